"""The ``layer_norm`` family: layer normalisation over the last dimension.

Its declaration: the facade ``layer_norm(x, weight=None, bias=None, eps=1e-5,
backend=None)``, how a call is validated and read into its axes (``dtype``,
``device_cuda``, ``ndim``, ``grad_enabled``; lazily ``device``, ``sm`` and ``tokens`` -
the rows normalised), the common calls as data for the compiled hot path, and its model
recognition (``astrai.families.layer_norm.model``). ``weight`` and ``bias`` are each
``[features]`` or ``None``, of ``x``'s dtype, or float32 with a float16/bfloat16 ``x``.
"""

from __future__ import annotations

__all__ = ["FAMILY", "LAYER_NORM", "LAYER_NORM_READING", "LAYER_NORM_READS",
           "LAYER_NORM_SHAPE", "describe_layer_norm", "layer_norm"]

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from astrai.dispatch.facade import (
    DEVICE_OPS,
    FamilyCall,
    facade,
    leading_rows,
    read_device,
    read_sm,
    require_tensors,
)
from astrai.dispatch.reading import Case, Op, Reading
from astrai.dispatch.torch_compile import compiling
from astrai.families import Family, declare

_grad = torch.is_grad_enabled
_HALF = (torch.float16, torch.bfloat16)

LAYER_NORM_READS = ("dtype", "device_cuda", "ndim", "grad_enabled")


def _fits(x: Tensor, p: Any) -> bool:
    """``p`` is ``None``, or ``[features]`` of x's dtype (float32 with a half-type x)."""
    return p is None or (isinstance(p, Tensor) and len(p.shape) == 1
                         and p.shape[0] == x.shape[-1]
                         and (p.dtype is x.dtype or (p.dtype is torch.float32
                              and x.dtype in _HALF)))


def _same(x: Tensor, p: Any) -> bool:
    """``p`` is ``None``, or ``[features]`` of x's dtype."""
    return p is None or (isinstance(p, Tensor) and len(p.shape) == 1
                         and p.shape[0] == x.shape[-1] and p.dtype is x.dtype)


def describe_layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None,
                        eps: float) -> tuple[Any, ...]:
    """``x [..., f]`` floating; ``weight`` and ``bias`` ``[f]`` or ``None``; ``eps`` a
    number >= 0."""
    if (isinstance(x, Tensor) and len(x.shape) and x.dtype.is_floating_point
            and _same(x, weight) and _same(x, bias) and eps.__class__ is float and eps >= 0):
        return (x.dtype, x.is_cuda, len(x.shape), _grad())  # the common call
    require_tensors("layer_norm", x=x)
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None:
            require_tensors("layer_norm", **{name: p})
    if not len(x.shape) or not x.dtype.is_floating_point:
        raise ValueError(f"layer_norm expects a floating x [..., features]; got x "
                         f"{tuple(x.shape)} {x.dtype}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and not _fits(x, p):
            raise ValueError(f"layer_norm expects {name} [features] = [{x.shape[-1]}] of x's "
                             f"dtype ({x.dtype}), or float32 with a float16/bfloat16 x; got "
                             f"{name} {tuple(p.shape)} {p.dtype}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"layer_norm eps must be a number >= 0, got {eps!r}")
    return (x.dtype, x.is_cuda, len(x.shape), _grad())


#: ``tokens`` are the rows normalised.
LAYER_NORM_SHAPE: dict[str, Callable[..., Any]] = {
    "device": read_device, "sm": read_sm, "tokens": leading_rows(0, 1)}


def _param(i: int) -> Op:
    """Argument ``i`` is ``None``, or ``[features]`` of x's dtype."""
    return ("any", (("is", i, 0),),
            (("tensor", i), ("ndim", i, 1), ("size_eq", i, 0, 0, -1), ("dtype_eq", i, 0)))


#: ``layer_norm(x, weight, bias, eps)``: x [..., f] floating, weight and bias [f] of x's
#: dtype or None, eps an exact float >= 0 (float32 parameters of a half-type x take the
#: route).
LAYER_NORM_READING = Reading(4, (
    Case((("tensor", 0), ("ndim_ge", 0, 1), ("floating", 0), _param(1), _param(2),
          ("float_ge0", 3)),
         (("dtype", 0), ("cuda", 0), ("ndim", 0), ("grad",)),
         {**DEVICE_OPS, "tokens": ("rows", 0, 1)}),
))


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5,
               backend: Any = None) -> torch.Tensor:
    """Layer normalisation over the last dimension, then ``* weight + bias`` (each
    optional), through the ``layer_norm`` table."""
    f = LAYER_NORM
    if backend is None and not compiling() and f.lookup is not None:
        d = f.lookup(f.last, x, weight, bias, eps)
        if d is not None:
            next(d.counter)
            return d.call(x, weight, bias, eps)  # type: ignore[no-any-return]
    return f.route(backend, (x, weight, bias, eps))(x, weight, bias, eps)  # type: ignore[no-any-return]


LAYER_NORM = facade(FamilyCall.of(layer_norm, describe_layer_norm, LAYER_NORM_READS,
                                  LAYER_NORM_SHAPE, positional=4, reading=LAYER_NORM_READING))
FAMILY = declare(Family("layer_norm", (LAYER_NORM,),
                        model="astrai.families.layer_norm.model:RECOGNITION"))
