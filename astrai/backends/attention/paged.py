"""Shared code of the paged path: validating a call, writing new K/V, gathering contexts.

The paged path takes packed ``q`` ``[tokens, heads, head_dim]`` and ``k``/``v``
``[tokens, kv_heads, head_dim]`` (the batch's new tokens) with a
``PagedBatch`` as ``kv_cache``. Every row first writes the new K/V into the pool
at ``out_cache_loc`` for ``layer_id``, then attends, per request, causally over
that request's whole context read back from the pool: new token ``j`` of a
request with ``prefix`` cached positions sees positions ``<= prefix + j``
(``is_causal`` is not consulted: the paged path is always causal), and with a
sliding ``window`` only those ``> prefix + j - window``. The cache
keeps no autograd history, so gradients reach ``q`` but not ``k``/``v`` here.
"""

from __future__ import annotations

__all__ = [
    "check_paged",
    "context_kv",
    "packed_kv",
    "padded_keep",
    "padded_kv",
    "store_kv",
    "token_coords",
]

from typing import Any

import torch

from astrai.backends.attention.dense import PAGED_MODES
from astrai.kv_cache import PagedBatch


def check_paged(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: Any,
    layer_id: int,
    fwd: str | None,
    attn_mask: torch.Tensor | None,
) -> PagedBatch:
    """Validate a paged call; returns the batch or raises ``TypeError``/``ValueError``."""
    if not isinstance(kv_cache, PagedBatch):
        raise TypeError(
            f"kv_cache must be an astrai.kv_cache.PagedBatch, got {type(kv_cache).__name__}"
        )
    if fwd not in PAGED_MODES:
        raise ValueError(f"the paged path needs fwd in {list(PAGED_MODES)}, got {fwd!r}")
    if attn_mask is not None:
        raise ValueError("the paged path takes no attn_mask (it is causal per request)")
    pool = kv_cache.pool
    if not 0 <= layer_id < pool.layers:
        raise ValueError(f"layer_id {layer_id} is out of range [0, {pool.layers})")
    tokens = kv_cache.num_tokens
    for name, t, heads in (("q", q, None), ("k", k, pool.kv_heads), ("v", v, pool.kv_heads)):
        if t.dim() != 3 or t.shape[0] != tokens or t.shape[2] != pool.head_dim or (
            heads is not None and t.shape[1] != heads
        ):
            want = f"[{tokens}, {heads or 'heads'}, {pool.head_dim}]"
            raise ValueError(
                f"paged attention expects {name} as {want} (tokens, heads, head_dim of the "
                f"batch and pool); got shape {tuple(t.shape)}"
            )
    if q.shape[1] % pool.kv_heads:
        raise ValueError(f"q has {q.shape[1]} heads, not a multiple of the pool's "
                         f"{pool.kv_heads} kv_heads (GQA)")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if fwd == "decode" and kv_cache.max_extend_len != 1:
        raise ValueError(
            "fwd='decode' takes one new token per request; this batch has "
            f"{list(kv_cache.extend_lens_host)} (use fwd='prefill')"
        )
    return kv_cache


def store_kv(batch: PagedBatch, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write the new tokens' K/V into the pool at ``out_cache_loc`` for ``layer_id``."""
    batch.pool.write(layer_id, batch.out_cache_loc, k, v)


def context_kv(
    batch: PagedBatch, layer_id: int, i: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V ``[seq_len_i, kv_heads, head_dim]`` of request ``i``, read through ``req_to_token``."""
    pool = batch.pool
    slots = pool.req_to_token[batch.req_pool_indices[i], : batch.seq_lens_host[i]].long()
    return pool.k_buffer[layer_id, slots], pool.v_buffer[layer_id, slots]


def packed_kv(batch: PagedBatch, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every request's context K/V packed back to back (``kv_indptr`` delimits them)."""
    pool = batch.pool
    return pool.k_buffer[layer_id, batch.kv_indices], pool.v_buffer[layer_id, batch.kv_indices]


def padded_kv(batch: PagedBatch, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V ``[batch, max_seq_len, kv_heads, head_dim]``; positions past a context are junk.

    Rows of ``req_to_token`` past a request's length hold stale but valid slot
    indices, so the gather is safe; ``padded_keep`` masks those positions out.
    """
    pool = batch.pool
    slots = pool.req_to_token[batch.req_pool_indices, : batch.max_seq_len].long()
    return pool.k_buffer[layer_id, slots], pool.v_buffer[layer_id, slots]


def token_coords(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """For each new token: its request index and its offset among that request's new tokens."""
    device = batch.qo_indptr.device
    owner = torch.repeat_interleave(
        torch.arange(batch.batch_size, device=device),
        batch.extend_lens,
        output_size=batch.num_tokens,
    )
    offset = torch.arange(batch.num_tokens, device=device) - batch.qo_indptr[owner]
    return owner, offset


def padded_keep(batch: PagedBatch, q_len: int, window: int | None = None) -> torch.Tensor:
    """Bool ``[batch, 1, q_len, max_seq_len]``: padded query ``j`` may see key ``p``.

    Key ``p`` is visible when it lies in the request's context and
    ``p <= prefix_len + j`` (and, with a sliding ``window``, ``p > prefix_len + j -
    window``).
    """
    device = batch.seq_lens.device
    keys = torch.arange(batch.max_seq_len, device=device).view(1, 1, -1)
    queries = torch.arange(q_len, device=device).view(1, -1, 1)
    last = batch.prefix_lens.view(-1, 1, 1) + queries
    seq = batch.seq_lens.view(-1, 1, 1)
    keep = (keys < seq) & (keys <= last)
    if window is not None:
        keep &= keys > last - window
    return keep.unsqueeze(1)
