"""Input validation of the built-in families: run once per call, before any row.

A row's ``when`` decides *which* implementation may serve a well-formed call; these
checks make sure the call *is* well-formed, so no row is ever handed shapes that
disagree (a row might otherwise broadcast them into a wrong result). Each raises
``ValueError`` (or ``TypeError`` for a non-tensor) naming the shapes; the common,
well-formed case costs a handful of integer comparisons.
"""

from __future__ import annotations

__all__ = ["check_attention", "check_linear", "check_rms_norm", "check_rotary"]

from typing import Any

import torch

from astrai.backends.attention._dense import PAGED_MODES, check_dense
from astrai.backends.attention._paged import check_paged
from astrai.backends.rotary import check_rotary_call


def _tensors(family: str, **tensors: Any) -> None:
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{family}: {name} must be a torch.Tensor, got {type(t).__name__}")


def _attention_slow(q: Any, k: Any, v: Any, kv_cache: Any, layer_id: int, attn_mask: Any,
                    fwd: str | None) -> None:
    _tensors("attention", q=q, k=k, v=v)
    if attn_mask is not None:
        _tensors("attention", attn_mask=attn_mask)
    if kv_cache is None:
        check_dense(q, k, v, attn_mask)
    else:
        check_paged(q, k, v, kv_cache, layer_id, fwd, attn_mask)
    if q.shape[-1] < 1 or k.shape[-2] < 1:
        raise ValueError(f"attention needs head_dim >= 1 and at least one k/v head; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}")
    if v.shape[-1] < 1:
        raise ValueError(f"attention needs v's head_dim >= 1; got v {tuple(v.shape)}")


def check_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Any,
                    layer_id: int, attn_mask: torch.Tensor | None, fwd: str | None) -> None:
    """Dense ``[batch, seq, heads, head_dim]`` q/k/v that agree (GQA allowed), or a
    packed ``[tokens, heads, head_dim]`` call that fits its paged batch."""
    if fwd is not None and fwd not in PAGED_MODES:
        raise ValueError(f"fwd must be one of None, 'prefill', 'decode'; got {fwd!r}")
    if kv_cache is None and attn_mask is None:
        try:  # the common dense call: unpacking and integer comparisons only
            b, _, h, d = q.shape
            kb, kn, kh, kd = k.shape
            vb, vn, vh, vd = v.shape
        except (ValueError, AttributeError):
            pass  # not 4-d, or not tensors: the full check says which
        else:
            if (b == kb == vb and kn == vn and kh == vh and d == kd and d > 0 < kh and vd > 0
                    and not h % kh and q.dtype == k.dtype == v.dtype):
                return
    _attention_slow(q, k, v, kv_cache, layer_id, attn_mask, fwd)


def check_rotary(x: torch.Tensor, freqs_cis: torch.Tensor) -> None:
    """``x`` 3-d or 4-d with an even head_dim, and a ``(cos, sin)`` table that fits it."""
    _tensors("rotary", x=x, freqs_cis=freqs_cis)
    check_rotary_call(x, freqs_cis)


def check_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """``weight`` is ``[x.shape[-1]]``; ``eps`` is a non-negative number."""
    _tensors("rms_norm", x=x, weight=weight)
    if x.dim() < 1 or tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"rms_norm expects x [..., features] and weight [features]; got x "
                         f"{tuple(x.shape)}, weight {tuple(weight.shape)}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"rms_norm eps must be a number >= 0, got {eps!r}")


def check_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """``x [..., in]``, ``weight [out, in]``, ``bias [out]`` or ``None``, one dtype."""
    _tensors("linear", x=x, weight=weight)
    if x.dim() < 1 or weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"linear expects x [..., in_features] and weight [out_features, "
                         f"in_features]; got x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    if bias is not None:
        _tensors("linear", bias=bias)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"linear bias must have shape ({weight.shape[0]},) to match "
                             f"weight {tuple(weight.shape)}; got {tuple(bias.shape)}")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"linear expects x, weight and bias of one dtype; got x {x.dtype}, "
                         f"weight {weight.dtype}"
                         + ("" if bias is None else f", bias {bias.dtype}"))
