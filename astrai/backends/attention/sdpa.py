"""``torch_native``: attention through ``torch.nn.functional.scaled_dot_product_attention``.

Dense calls go straight to SDPA (GQA via ``enable_gqa`` where this torch has
it, else by repeating key/value heads). The paged path gathers every request's
context into one padded ``[batch, max_seq_len, ...]`` tensor and runs a single
SDPA call with a mask that encodes both the ragged lengths and the per-request
causal rule; decode steps skip the query padding entirely.

The row is a plain function: ``tables/attention.yaml``'s ``when`` decides which
calls it serves, and the facade (``astrai.ops.attention``) validates the call
before any row runs; called directly, it relies on SDPA's own shape checks.

``sdpa_dense`` and ``sdpa_paged`` are the row's two paths with the SDPA call itself
(``core``, on ``[batch, heads, seq, head_dim]`` tensors) passed in: the rows pinned to
one SDPA backend (``astrai.backends.attention.pinned``) reuse them with a core that
adapts a call to what their kernel takes.
"""

from __future__ import annotations

__all__ = ["Core", "sdpa_attention", "sdpa_core", "sdpa_dense", "sdpa_heads_first", "sdpa_paged"]

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from astrai.backends.attention.dense import (
    merge_heads,
    merge_masks,
    repeat_kv_heads,
    takes_heads_first,
)
from astrai.backends.attention.paged import padded_keep, padded_kv, store_kv, token_coords
from astrai.kv_cache import PagedBatch

#: ``enable_gqa`` arrived in torch 2.5.
_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)
_SDPA = F.scaled_dot_product_attention

#: An SDPA call on ``[B, H, S, D]`` tensors: ``core(q, k, v, mask, causal)``, where
#: ``causal`` is SDPA's own (top-left) flag, set only for square calls without a mask.
Core = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, bool],
                torch.Tensor]


def sdpa_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """SDPA on ``[B, H, S, D]`` tensors, with GQA when k/v have fewer heads."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads == kv_heads:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              dropout_p=dropout_p, scale=scale)
    if _HAS_GQA:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, dropout_p=dropout_p, scale=scale,
            enable_gqa=True,
        )
    k, v = repeat_kv_heads(k, v, heads)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                          dropout_p=dropout_p, scale=scale)


@takes_heads_first
def sdpa_attention(
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
    dropout_p: float = 0.0,
    window: int | None = None,
    heads_first: bool = False,
) -> torch.Tensor:
    """Attention output ``[..., heads * head_dim]`` in ``q``'s dtype, via PyTorch's SDPA
    (``scale`` and ``dropout_p`` are SDPA's own; a ``window`` becomes part of the mask).
    A heads-first call (``heads_first=True``: q/k/v ``[batch, heads, seq, head_dim]``,
    SDPA's own layout) goes to SDPA untouched and returns ``[batch, seq, heads,
    head_dim]``."""
    core: Core = sdpa_core
    if scale is not None or dropout_p:
        core = functools.partial(sdpa_core, scale=scale, dropout_p=dropout_p)
    if heads_first:
        return sdpa_heads_first(q, k, v, attn_mask, is_causal, core, window=window)
    if kv_cache is not None:
        return sdpa_paged(q, k, v, kv_cache, layer_id, core, window=window)
    return sdpa_dense(q, k, v, attn_mask, is_causal, core, window=window)


def sdpa_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    core: Core = sdpa_core,
    *,
    window: int | None = None,
) -> torch.Tensor:
    """A dense call through ``core``: the causal rule (and ``window``) and the mask merged
    into one mask (SDPA's own causal flag where the call is square and has no mask)."""
    out = sdpa_heads_first(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                           attn_mask, is_causal, core, window=window)
    return merge_heads(out)


def sdpa_heads_first(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    core: Core = sdpa_core,
    *,
    window: int | None = None,
) -> torch.Tensor:
    """A dense call given heads-first (q/k/v ``[batch, heads, seq, head_dim]``) through
    ``core``, with no copy or transpose on the way in: ``[batch, seq, heads, head_dim]``
    out, a view of what SDPA returns."""
    q_len, k_len = q.shape[2], k.shape[2]
    if attn_mask is None and window is None and (not is_causal or q_len == k_len):
        # SDPA's own causal flag is top-left aligned, which equals ours when square.
        if core is sdpa_core and _HAS_GQA:  # the hot path: SDPA itself
            if q.shape[1] != k.shape[1]:
                out = _SDPA(q, k, v, is_causal=is_causal, enable_gqa=True)
            elif is_causal:
                out = _SDPA(q, k, v, is_causal=True)
            else:
                out = _SDPA(q, k, v)
            return out.transpose(1, 2)
        return core(q, k, v, None, is_causal).transpose(1, 2)
    mask = merge_masks(attn_mask, is_causal, q_len, k_len, q.dtype, q.device, window)
    return core(q, k, v, mask, False).transpose(1, 2)


def sdpa_paged(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: PagedBatch,
    layer_id: int,
    core: Core = sdpa_core,
    *,
    window: int | None = None,
) -> torch.Tensor:
    """The paged path through ``core``: one padded call whose mask encodes every
    request's context length and causal rule (and ``window``)."""
    store_kv(batch, layer_id, k, v)
    k_pad, v_pad = padded_kv(batch, layer_id)  # [B, L, Hkv, D]
    k_pad = k_pad.to(q.dtype).transpose(1, 2)
    v_pad = v_pad.to(q.dtype).transpose(1, 2)
    q_len = batch.max_extend_len
    if q_len == 1:
        # Decode (or a prefill of one token each): token i is request i's only query.
        q_pad = q.unsqueeze(1)
    else:
        owner, offset = token_coords(batch)
        q_pad = q.new_zeros(batch.batch_size, q_len, *q.shape[1:])
        q_pad = q_pad.index_put((owner, offset), q)
    out = core(q_pad.transpose(1, 2), k_pad, v_pad, padded_keep(batch, q_len, window), False)
    out = out.transpose(1, 2)  # [B, q_len, H, D]
    if q_len == 1:
        return merge_heads(out[:, 0])
    return merge_heads(out[owner, offset])
