"""``math``: the reference attention, written out in float32.

``softmax(q @ k^T * scale + mask) @ v`` with the softmax spelled out
(subtract the row maximum, exponentiate, normalise), GQA by repeating key/value
heads, and the paged path handled one request at a time. It runs anywhere and
is the fallback every other row is checked against. Conventions (causal
alignment, masks, GQA, empty rows) are those of ``_dense``; the paged path is
described in ``_paged``.

Because it materialises the softmax, this row can also hand the attention
probabilities back: ``MathAttention.with_weights`` returns ``(output, weights)``
for a dense call, ``weights`` being ``[batch, heads, q_len, k_len]`` (one per
*query* head under GQA) in ``q``'s dtype - the softmax taken in float32 and cast,
as transformers' eager attention does. A row object with a ``with_weights``
method of this signature is what ``output_attentions=True`` needs (see
``astrai.integrations.transformers``); the other rows have none.
"""

from __future__ import annotations

__all__ = ["WEIGHTS_METHOD", "MathAttention", "math_attention"]

import math
from typing import Any

import torch

from astrai.backends.attention.dense import causal_keep, merge_heads
from astrai.backends.attention.paged import context_kv, store_kv
from astrai.kv_cache import PagedBatch

#: The method through which a row returns the attention probabilities with its output.
WEIGHTS_METHOD = "with_weights"


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 attention of ``q`` ``[B, Sq, H, D]`` over ``k``/``v`` ``[B, Sk, Hkv, D]``.

    Returns ``(output [B, Sq, H, Dv], weights [B, H, Sq, Sk])`` in float32
    (float64 for float64 input); ``weights`` are the softmax probabilities, zero
    on a row that may see no key.
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

    scores = torch.matmul(q32, k32.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.to(compute)
    if is_causal:
        scores = scores.masked_fill(~causal_keep(q_len, k_len, q.device), float("-inf"))

    # A row that may see no key at all gets zero weights, hence a zero output.
    empty = torch.isneginf(scores).all(dim=-1, keepdim=True)
    scores = scores.masked_fill(empty, 0.0)
    weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.masked_fill(empty, 0.0)
    return torch.matmul(weights, v32).transpose(1, 2), weights


class MathAttention:
    """Reference attention: dense ``[batch, seq, heads, head_dim]`` or paged packed tokens.

    An instance rather than a function only to carry ``with_weights``; which calls
    it serves is the table's ``when`` alone, and the facade validates them first.
    """

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: Any = None,
        layer_id: int = 0,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        fwd: str | None = None,
    ) -> torch.Tensor:
        """Attention output ``[..., heads * head_dim]`` in ``q``'s dtype."""
        if kv_cache is None:
            return merge_heads(_attend(q, k, v, attn_mask, is_causal)[0]).to(q.dtype)

        batch: PagedBatch = kv_cache
        store_kv(batch, layer_id, k, v)
        outputs = []
        start = 0
        for i, n in enumerate(batch.extend_lens_host):
            k_ctx, v_ctx = context_kv(batch, layer_id, i)
            q_i = q[start : start + n].unsqueeze(0)
            out, _ = _attend(q_i, k_ctx.unsqueeze(0), v_ctx.unsqueeze(0), None, is_causal=True)
            outputs.append(out[0])
            start += n
        return merge_heads(torch.cat(outputs, dim=0)).to(q.dtype)

    def with_weights(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: Any = None,
        layer_id: int = 0,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        fwd: str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(output, weights)`` of a dense call: the same output as calling the row.

        ``output`` is ``[batch, q_len, heads * head_dim]`` and ``weights`` the
        softmax probabilities ``[batch, heads, q_len, k_len]`` (per query head under
        GQA; zero on a query row that may see no key), both in ``q``'s dtype.
        The arguments are the facade's, validated as the facade does
        (``astrai.backends.attention.dense.check_dense``) by the caller; a paged call
        (``kv_cache``) has no single weight matrix and is a ``ValueError``.
        """
        if kv_cache is not None:
            raise ValueError(
                "math: attention weights are returned for dense [batch, seq, heads, head_dim] "
                "calls only, not for the paged (kv_cache) path"
            )
        out, weights = _attend(q, k, v, attn_mask, is_causal)
        return merge_heads(out).to(q.dtype), weights.to(q.dtype)

    def __repr__(self) -> str:
        return "MathAttention()"


#: The ``math`` row of ``tables/attention.yaml``.
math_attention = MathAttention()
