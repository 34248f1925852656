"""RMS norm: rows ``torch`` (``torch.rms_norm``), ``inductor`` and ``reference`` (float32).

``rms_norm(x, weight, eps) = x / sqrt(mean(x**2, -1) + eps) * weight`` over the
last dimension; ``weight`` is ``[x.shape[-1]]``, or ``None`` for no scaling (Llama 4's
QK norm: normalised in float32, cast back once). The output has ``x``'s shape and
dtype. Rows are plain functions: the table's ``when`` decides which calls they
serve, and the facade (``astrai.ops.rms_norm``) validates shapes before any row
runs, so a row does neither.

The forms models define (``astrai.ops.rms_norm``'s features; a row serves them only
when its table row declares them):

- ``weight_offset=c``: the weight is applied as ``c + weight``, added in float32
  (Gemma's ``(1 + weight)``, with ``c = 1``);
- ``cast_before_weight=True``: normalised in float32, cast back to ``x``'s dtype, then
  multiplied by the weight in torch's type promotion, so the output's dtype is that of
  ``weight * x`` (``LlamaRMSNorm``: ``weight * normed.to(input_dtype)``).

The reference writes each form out op for op as the models do, so it equals their
forward bit for bit; ``torch`` and ``inductor`` equal it within float32 rounding.

``inductor`` is ``reference_rms_norm`` compiled by ``torch.compile`` with dynamic
shapes, on its first call per (dtype, weight dtype, device, rank of x, form): token counts
and feature sizes share one graph. Every rounding of the reference is written into the
compiled function as a cast, so that its results have the reference's types and roundings
(inductor would keep a half-type intermediate in float32); ``eps`` and the offset reach it
as Python floats. Inside a user's ``torch.compile`` it is the reference math, which the
user's compile compiles with the rest of the graph.
"""

from __future__ import annotations

__all__ = [
    "inductor_rms_norm",
    "reference_rms_norm",
    "torch_rms_norm",
    "torch_rms_norm_available",
]

import functools

import torch
import torch.nn.functional as F

from astrai.backends.inductor import Compiled
from astrai.dispatch.tables.model import Unavailable
from astrai.dispatch.torch_compile import compiling


def torch_rms_norm_available() -> bool | Unavailable:
    """``True`` when this torch has ``torch.nn.functional.rms_norm`` (torch >= 2.4)."""
    if hasattr(F, "rms_norm"):
        return True
    return Unavailable(
        f"torch.nn.functional.rms_norm needs torch >= 2.4; this is torch {torch.__version__}"
    )


_FULL = (torch.float32, torch.float64)


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, *,
                   weight_offset: float = 0.0,
                   cast_before_weight: bool = False) -> torch.Tensor:
    """PyTorch's fused RMS norm; a weight of another dtype is cast to ``x``'s.

    The model forms (see the module docstring) normalise in float32 with the fused
    kernel too: without the weight for ``cast_before_weight`` (the weight multiplies
    after the cast), with ``weight_offset + weight`` as its weight for the offset form.
    """
    if weight is None:  # no scaling (the facade allows no form then)
        return torch.rms_norm(x, (x.shape[-1],), None, eps)
    if weight_offset or cast_before_weight:
        if (not weight_offset and weight.dtype is x.dtype and x.dtype in _FULL):
            # LlamaRMSNorm's form where both of its casts are no-ops: one kernel
            return torch.rms_norm(x, weight.shape, weight, eps)
        return _torch_model_form(x, weight, eps, weight_offset, cast_before_weight)
    if weight.dtype is not x.dtype:
        weight = weight.to(x.dtype)
    # torch.rms_norm is what F.rms_norm calls, minus its __torch_function__ check;
    # weight.shape == (x.shape[-1],) was checked by the facade.
    return torch.rms_norm(x, weight.shape, weight, eps)


def _torch_model_form(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                      cast_before_weight: bool) -> torch.Tensor:
    dtype = x.dtype
    if cast_before_weight:
        scale = weight + offset if offset else weight
        if dtype in _FULL and scale.dtype is dtype:  # both casts are no-ops: one kernel
            return torch.rms_norm(x, scale.shape, scale, eps)
        compute = torch.promote_types(dtype, torch.float32)
        return scale * torch.rms_norm(x.to(compute), weight.shape, None, eps).to(dtype)
    compute = torch.promote_types(dtype, torch.float32)
    scale = weight.to(compute) + offset
    return torch.rms_norm(x.to(compute), scale.shape, scale, eps).to(x.dtype)


def reference_rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, *,
    weight_offset: float = 0.0,
    cast_before_weight: bool = False,
) -> torch.Tensor:
    """The fallback: mean of squares, ``rsqrt`` and weight, all in float32 (or float64);
    the model forms written out as the models write them."""
    return _reference(x, weight, eps, weight_offset, cast_before_weight)


def _reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float,
               cast_before_weight: bool) -> torch.Tensor:
    compute = torch.promote_types(x.dtype, torch.float32)
    xw = x.to(compute)
    normed = xw * torch.rsqrt(xw.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:  # no scaling: one cast back
        return normed.to(x.dtype)
    if cast_before_weight:  # LlamaRMSNorm: weight * normed.to(input dtype)
        return (weight + offset if offset else weight) * normed.to(x.dtype)
    # Gemma's (1 + weight) in float32 when offset, then one cast back
    return (normed * (weight.to(compute) + offset if offset else weight.to(compute))).to(x.dtype)


def _compiled_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                        offset: float, cast_before_weight: bool) -> torch.Tensor:
    """``_reference`` as inductor compiles it: the same operations, with the one rounding
    inductor would otherwise leave out written as a cast. Inductor keeps an intermediate
    result of a half type in float32 unless a cast rounds it, while eager mode rounds
    LlamaRMSNorm's ``weight + offset`` to the weight's dtype before the product: here it is
    computed in the weight's opmath type and cast, as eager mode computes it. ``offset``
    must already be rounded to the weight's dtype (as eager mode takes a Python scalar
    added to a tensor: ``_offset_as``)."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xw = x.to(compute)
    normed = xw * torch.rsqrt(xw.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return normed.to(x.dtype)
    if cast_before_weight:
        scale = weight
        if offset:
            scale = (weight.to(torch.promote_types(weight.dtype, torch.float32))
                     + offset).to(weight.dtype)
        return scale * normed.to(x.dtype)
    return (normed * (weight.to(compute) + offset if offset else weight.to(compute))).to(x.dtype)


@functools.lru_cache(maxsize=64)
def _offset_as(offset: float, dtype: torch.dtype) -> float:
    """``offset`` rounded to ``dtype``, as ``tensor + offset`` takes the scalar."""
    return float(torch.tensor(offset, dtype=torch.float64).to(dtype).item())


# The casts of the model forms round as in eager mode (the reference's bits).
_compiled = Compiled(_compiled_reference, dynamic=True,
                     options={"emulate_precision_casts": True})


def inductor_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, *,
                      weight_offset: float = 0.0,
                      cast_before_weight: bool = False) -> torch.Tensor:
    """``reference_rms_norm`` compiled by inductor (dynamic shapes, compiled lazily), with
    the reference's types and roundings."""
    if compiling():
        return _reference(x, weight, eps, weight_offset, cast_before_weight)
    # Python numbers from here: a NumPy scalar would reach the compiled function as a
    # tensor, which torch.compile's guards do not hold under torch.inference_mode.
    eps, offset, cast = float(eps), float(weight_offset), bool(cast_before_weight)
    if cast and offset and weight is not None:
        offset = _offset_as(offset, weight.dtype)
    # Keyed by rank and form too: a copy per key keeps each graph's guards to one kind
    # of input.
    key = (x.dtype, None if weight is None else weight.dtype, x.device, x.dim(), offset, cast)
    return _compiled(key, x, weight, eps, offset, cast)  # type: ignore[no-any-return]
