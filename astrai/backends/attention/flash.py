"""``flash``: attention through the flash-attn package (CUDA, fp16/bf16, head_dim <= 256).

Dense calls use ``flash_attn_func`` on the ``[batch, seq, heads, head_dim]``
tensors as they are (flash-attn reads that layout and does GQA natively). The
paged path writes the new K/V into the pool, gathers every request's context
back to back and runs ``flash_attn_varlen_func`` with ``qo_indptr`` /
``kv_indptr`` as the cumulative lengths; flash-attn's causal mask is aligned to
the bottom-right corner, which is exactly the per-request rule of ``_paged``.

Features: ``scale`` (``softmax_scale``), ``softcap`` (flash-attn >= 2.6, applied
to the scaled logits as Gemma 2 does), ``dropout_p`` (not together with
``softcap``: flash-attn refuses that pair; the table's ``when`` says so) and a
sliding ``window`` (``window_size``), on both paths.

flash-attn is imported lazily, on first use; ``flash_available`` says why the
row cannot run where the package or a suitable GPU is missing. The row is a plain
function: which calls it serves (CUDA, fp16/bf16, head_dim <= 256, no mask) is
``tables/attention.yaml``'s ``when`` alone, and the facade validates the call first.
"""

from __future__ import annotations

__all__ = ["flash_attention", "flash_available", "flash_options"]

import importlib
import importlib.util
from types import ModuleType
from typing import Any

import torch

from astrai.backends.attention.dense import merge_heads
from astrai.backends.attention.paged import packed_kv, store_kv
from astrai.dispatch.tables.model import Unavailable
from astrai.kv_cache import PagedBatch

_MIN_CAPABILITY = (8, 0)  # flash-attn 2 runs on Ampere and newer.

_module: ModuleType | None = None


def flash_available() -> bool | Unavailable:
    """``True`` when flash-attn is installed and a GPU it supports is present."""
    if not torch.cuda.is_available():  # the machine first: installing cannot help here
        return Unavailable("no CUDA device (flash-attn runs on CUDA GPUs only)")
    if importlib.util.find_spec("flash_attn") is None:
        return Unavailable("flash_attn is not installed (pip install flash-attn)")
    capability = torch.cuda.get_device_capability()
    if capability < _MIN_CAPABILITY:
        name = torch.cuda.get_device_name()
        return Unavailable(
            f"flash-attn needs compute capability >= 8.0 (Ampere); {name} has "
            f"{capability[0]}.{capability[1]}"
        )
    try:
        importlib.import_module("flash_attn")
    except Exception as exc:  # a broken build must not take the process down
        return Unavailable(f"flash_attn failed to import: {type(exc).__name__}: {exc}")
    return True


def _flash() -> ModuleType:
    """The imported ``flash_attn`` module; ``RuntimeError`` with the reason if unusable."""
    global _module
    if _module is None:
        ok = flash_available()
        if not ok:
            raise RuntimeError(f"the flash attention row cannot run: {ok}")
        _module = importlib.import_module("flash_attn")
    return _module


def flash_attention(
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
) -> torch.Tensor:
    """Attention output ``[..., heads * head_dim]`` in ``q``'s dtype (mask-free calls)."""
    fa = _module or _flash()
    options = flash_options(scale, softcap, dropout_p, window)
    if kv_cache is None:
        return merge_heads(fa.flash_attn_func(q, k, v, causal=is_causal, **options))
    batch: PagedBatch = kv_cache
    store_kv(batch, layer_id, k, v)
    k_ctx, v_ctx = packed_kv(batch, layer_id)
    out = fa.flash_attn_varlen_func(
        q,
        k_ctx.to(q.dtype),
        v_ctx.to(q.dtype),
        cu_seqlens_q=batch.qo_indptr.to(torch.int32),
        cu_seqlens_k=batch.kv_indptr.to(torch.int32),
        max_seqlen_q=batch.max_extend_len,
        max_seqlen_k=batch.max_seq_len,
        causal=True,
        **options,
    )
    return merge_heads(out)


def flash_options(scale: float | None, softcap: float | None, dropout_p: float,
                  window: int | None) -> dict[str, Any]:
    """flash-attn's keywords for the features a call asks for (none when it asks none,
    so a flash-attn too old for one of them still serves the others).

    ``window`` keys back, the query's own position included, is flash-attn's
    ``window_size=(window - 1, 0)``: its window is bottom-right aligned like ours.
    """
    options: dict[str, Any] = {}
    if scale is not None:
        options["softmax_scale"] = scale
    if softcap:
        options["softcap"] = softcap
    if dropout_p:
        options["dropout_p"] = dropout_p
    if window is not None:
        options["window_size"] = (window - 1, 0)
    return options
