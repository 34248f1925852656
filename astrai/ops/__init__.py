"""The op facades: every call is described, resolved against its table, counted and run.

``backend=`` is the explicit selection of SPEC §3 (a row name or an
implementation object): strict, it raises rather than fall back.
"""

from __future__ import annotations

__all__ = ["apply_rotary", "attention", "linear", "rms_norm"]

from typing import Any

import torch

from astrai.dispatch.resolution import resolve
from astrai.dispatch.stats import count
from astrai.ops._contexts import (
    attention_context,
    linear_context,
    rms_norm_context,
    rotary_context,
)

_FWD_MODES = (None, "prefill", "decode")


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: Any = None,
    layer_id: int = 0,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    fwd: str | None = None,
    backend: Any = None,
) -> torch.Tensor:
    """Scaled dot-product attention through the ``attention`` table.

    Dense ``[batch, seq, heads, head_dim]`` (training / no cache), or packed
    ``[tokens, heads, head_dim]`` with a paged ``kv_cache`` for ``fwd="prefill"`` /
    ``"decode"``. K/V may have fewer heads (GQA). Returns ``[..., heads*head_dim]``.
    """
    if fwd not in _FWD_MODES:
        raise ValueError(f"fwd must be one of None, 'prefill', 'decode'; got {fwd!r}")
    ctx = attention_context(q, k, v, kv_cache, layer_id, attn_mask, is_causal, fwd)
    res = resolve("attention", ctx, backend)
    count("attention", res.record.name, res.origin)
    return res.record.obj(  # type: ignore[no-any-return]
        q, k, v, kv_cache=kv_cache, layer_id=layer_id, attn_mask=attn_mask,
        is_causal=is_causal, fwd=fwd,
    )


def apply_rotary(x: torch.Tensor, freqs_cis: torch.Tensor, backend: Any = None) -> torch.Tensor:
    """Rotate adjacent pairs ``(2i, 2i+1)`` of ``x`` by ``freqs_cis`` (cos, sin) per pair."""
    ctx = rotary_context(x, freqs_cis)
    res = resolve("rotary", ctx, backend)
    count("rotary", res.record.name, res.origin)
    return res.record.obj(x, freqs_cis)  # type: ignore[no-any-return]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
             backend: Any = None) -> torch.Tensor:
    """RMS normalisation over the last dimension, scaled by ``weight``."""
    ctx = rms_norm_context(x, weight, eps)
    res = resolve("rms_norm", ctx, backend)
    count("rms_norm", res.record.name, res.origin)
    return res.record.obj(x, weight, eps)  # type: ignore[no-any-return]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           backend: Any = None) -> torch.Tensor:
    """``x @ weight.T + bias`` through the ``linear`` table."""
    ctx = linear_context(x, weight, bias)
    res = resolve("linear", ctx, backend)
    count("linear", res.record.name, res.origin)
    return res.record.obj(x, weight, bias)  # type: ignore[no-any-return]
