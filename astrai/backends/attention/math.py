"""``math``: the reference attention, written out in float32.

``softmax(q @ k^T * scale + mask) @ v`` with the softmax spelled out
(subtract the row maximum, exponentiate, normalise), GQA by repeating key/value
heads, and the paged path handled one request at a time. It runs anywhere and
is the fallback every other row is checked against. Conventions (causal
alignment, masks, GQA, empty rows, the sliding window) are those of ``dense``;
the paged path is described in ``paged``.

It honours every attention feature a call may ask for, in this order (Gemma 2's
and gpt-oss's, as transformers' eager attention computes them):

1. ``scale`` replaces ``head_dim ** -0.5``;
2. ``softcap``: the scaled logits become ``softcap * tanh(logits / softcap)``;
3. the mask, the causal rule and its sliding ``window`` (``-inf`` where forbidden);
4. ``sinks`` (``[heads]``): head ``h``'s sink logit joins each of its rows'
   softmax denominators as one more column, which is then dropped, so a row's
   probabilities sum to less than one;
5. ``dropout_p``: dropout on the probabilities (zeroed with probability ``p``,
   the rest scaled by ``1 / (1 - p)``); the returned weights are those after it.

With ``return_weights=True`` (dense calls only: a paged batch has no single weight
matrix) the row returns ``(output, weights)``, ``weights`` being the probabilities
``[batch, heads, q_len, k_len]`` (one per *query* head under GQA) in ``q``'s
dtype: the softmax taken in float32 and cast, as transformers' eager attention does.
"""

from __future__ import annotations

__all__ = ["math_attention"]

import math
from typing import Any

import torch
import torch.nn.functional as F

from astrai.backends.attention.dense import causal_keep, merge_heads
from astrai.backends.attention.paged import context_kv, store_kv
from astrai.kv_cache import PagedBatch


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    dropout_p: float = 0.0,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 attention of ``q`` ``[B, Sq, H, D]`` over ``k``/``v`` ``[B, Sk, Hkv, D]``.

    Returns ``(output [B, Sq, H, Dv], weights [B, H, Sq, Sk])`` in float32
    (float64 for float64 input); ``weights`` are the softmax probabilities, zero
    on a row that may see no key. The features are the module docstring's.
    """
    heads, kv_heads = q.shape[2], k.shape[2]
    compute = torch.promote_types(q.dtype, torch.float32)
    q32 = q.to(compute).transpose(1, 2)  # [B, H, Sq, D]
    k32 = k.to(compute).transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
    v32 = v.to(compute).transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
    q_len, k_len = q32.shape[2], k32.shape[2]
    if k_len == 0:  # no key at all: every query sees nothing, hence a zero output
        weights = q32.new_zeros(*q32.shape[:3], 0)
        return torch.matmul(weights, v32).transpose(1, 2), weights

    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q32, k32.transpose(-1, -2)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.to(compute)
    if is_causal:
        keep = causal_keep(q_len, k_len, q.device, window)
        scores = scores.masked_fill(~keep, float("-inf"))

    # A row that may see no key at all gets zero weights, hence a zero output.
    empty = torch.isneginf(scores).all(dim=-1, keepdim=True)
    scores = scores.masked_fill(empty, 0.0)
    top = scores.amax(dim=-1, keepdim=True)
    if sinks is None:
        weights = torch.exp(scores - top)
        weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        sink = sinks.to(compute).view(1, heads, 1, 1)
        top = torch.maximum(top, sink)
        weights = torch.exp(scores - top)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + torch.exp(sink - top))
    weights = weights.masked_fill(empty, 0.0)
    if dropout_p:
        weights = F.dropout(weights, p=dropout_p, training=True)
    return torch.matmul(weights, v32).transpose(1, 2), weights


def math_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: Any = None,
    layer_id: int = 0,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    fwd: str | None = None,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    dropout_p: float = 0.0,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    return_weights: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention output ``[..., heads * head_dim]`` in ``q``'s dtype; with
    ``return_weights=True`` (dense calls), ``(output, weights)``.

    Which calls it serves is the table's ``when`` alone, and the facade validates
    them first (a paged call asking for weights is a ``ValueError`` here, for a
    direct caller: the table never sends one).
    """
    features: dict[str, Any] = {"scale": scale, "softcap": softcap, "dropout_p": dropout_p,
                                "window": window, "sinks": sinks}
    if kv_cache is None:
        out, weights = _attend(q, k, v, attn_mask, is_causal, **features)
        if return_weights:
            return merge_heads(out).to(q.dtype), weights.to(q.dtype)
        return merge_heads(out).to(q.dtype)
    if return_weights:
        raise ValueError("math: attention weights are returned for dense [batch, seq, heads, "
                         "head_dim] calls only, not for the paged (kv_cache) path")

    batch: PagedBatch = kv_cache
    store_kv(batch, layer_id, k, v)
    outputs = []
    start = 0
    for i, n in enumerate(batch.extend_lens_host):
        k_ctx, v_ctx = context_kv(batch, layer_id, i)
        q_i = q[start : start + n].unsqueeze(0)
        out, _ = _attend(q_i, k_ctx.unsqueeze(0), v_ctx.unsqueeze(0), None, True, **features)
        outputs.append(out[0])
        start += n
    return merge_heads(torch.cat(outputs, dim=0)).to(q.dtype)
