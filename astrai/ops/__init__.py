"""The op facades: every call is described, resolved against its table, counted and run.

Under ``torch.compile`` the decision is taken once at trace time and baked into
the graph (see ``astrai.dispatch.compiled``); compiled calls are not counted.

``backend=`` is the explicit selection of SPEC §3 (a row name or an
implementation object): strict, it raises rather than fall back.
"""

from __future__ import annotations

__all__ = ["apply_rotary", "attention", "linear", "rms_norm"]

from typing import Any

import torch

from astrai.dispatch import compiled
from astrai.dispatch.compiled import IMPLS, decision_name
from astrai.dispatch.resolution import decide
from astrai.ops._contexts import (
    attention_context,
    linear_context,
    rms_norm_context,
    rotary_context,
)

_FWD_MODES = (None, "prefill", "decode")
_NO_EXTRA = ()
_grad = torch.is_grad_enabled
_compiling = torch.compiler.is_compiling


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
    # The signature is read straight off the tensors; it equals CallContext.signature().
    sig = ("attention", fwd, q.dtype, q.is_cuda, q.dim(), q.shape[-1], kv_cache is not None,
           attn_mask is not None, _grad(), _NO_EXTRA)
    if _compiling():
        obj = IMPLS[decision_name("attention", sig, backend, compiled.KEY)]
    else:
        d = decide("attention", sig, backend, attention_context,
                   (q, k, v, kv_cache, layer_id, attn_mask, is_causal, fwd))
        next(d.counter)
        obj = d.obj
    return obj(  # type: ignore[no-any-return]
        q, k, v, kv_cache=kv_cache, layer_id=layer_id, attn_mask=attn_mask,
        is_causal=is_causal, fwd=fwd,
    )


def apply_rotary(x: torch.Tensor, freqs_cis: torch.Tensor, backend: Any = None) -> torch.Tensor:
    """Rotate adjacent pairs ``(2i, 2i+1)`` of ``x`` by ``freqs_cis`` (cos, sin) per pair."""
    sig = ("rotary", None, x.dtype, x.is_cuda, x.dim(), x.shape[-1], False, False, _grad(),
           _NO_EXTRA)
    if _compiling():
        return IMPLS[decision_name("rotary", sig, backend, compiled.KEY)](  # type: ignore[no-any-return]
            x, freqs_cis)
    d = decide("rotary", sig, backend, rotary_context, (x, freqs_cis))
    next(d.counter)
    return d.obj(x, freqs_cis)  # type: ignore[no-any-return]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
             backend: Any = None) -> torch.Tensor:
    """RMS normalisation over the last dimension, scaled by ``weight``."""
    sig = ("rms_norm", None, x.dtype, x.is_cuda, x.dim(), None, False, False, _grad(),
           _NO_EXTRA)
    if _compiling():
        return IMPLS[decision_name("rms_norm", sig, backend, compiled.KEY)](  # type: ignore[no-any-return]
            x, weight, eps)
    d = decide("rms_norm", sig, backend, rms_norm_context, (x, weight, eps))
    next(d.counter)
    return d.obj(x, weight, eps)  # type: ignore[no-any-return]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           backend: Any = None) -> torch.Tensor:
    """``x @ weight.T + bias`` through the ``linear`` table."""
    sig = ("linear", None, x.dtype, x.is_cuda, x.dim(), None, False, False, _grad(), _NO_EXTRA)
    if _compiling():
        return IMPLS[decision_name("linear", sig, backend, compiled.KEY)](  # type: ignore[no-any-return]
            x, weight, bias)
    d = decide("linear", sig, backend, linear_context, (x, weight, bias))
    next(d.counter)
    return d.obj(x, weight, bias)  # type: ignore[no-any-return]
