"""The ``linear`` family: ``x @ weight.T + bias``.

Its declaration: the facade ``linear(x, weight, bias=None, backend=None)``, how a call is
validated and read into its axes (``dtype``, ``device_cuda``, ``ndim``, ``grad_enabled``;
lazily ``device``, ``sm``, ``tokens`` - the rows of ``x`` -, ``in_features`` and
``out_features``), the common calls as data for the compiled hot path, and its model
recognition (``astrai.families.linear.model``).
"""

from __future__ import annotations

__all__ = ["FAMILY", "LINEAR", "LINEAR_READING", "LINEAR_READS", "LINEAR_SHAPE",
           "describe_linear", "linear"]

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from astrai.dispatch.autocasting import Autocast, autocasting
from astrai.dispatch.facade import (
    DEVICE_OPS,
    FamilyCall,
    facade,
    leading_rows,
    read_device,
    read_sm,
    require_tensors,
    size_of,
)
from astrai.dispatch.reading import Case, Op, Reading
from astrai.dispatch.torch_compile import compiling
from astrai.families import Family, declare

_grad = torch.is_grad_enabled

LINEAR_READS = ("dtype", "device_cuda", "ndim", "grad_enabled")


def describe_linear(x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> tuple[Any, ...]:
    """``x [..., in]``, ``weight [out, in]``, ``bias [out]`` or ``None``, one dtype."""
    if bias is None and isinstance(x, Tensor) and isinstance(weight, Tensor):
        shape, ws = x.shape, weight.shape
        dtype = x.dtype
        if len(ws) == 2 and shape and ws[1] == shape[-1] and weight.dtype == dtype:
            return (dtype, x.is_cuda, len(shape), _grad())  # the common call
    require_tensors("linear", x=x, weight=weight)
    if len(x.shape) < 1 or len(weight.shape) != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"linear expects x [..., in_features] and weight [out_features, "
                         f"in_features]; got x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    if bias is not None:
        require_tensors("linear", bias=bias)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"linear bias must have shape ({weight.shape[0]},) to match "
                             f"weight {tuple(weight.shape)}; got {tuple(bias.shape)}")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"linear expects x, weight and bias of one dtype; got x {x.dtype}, "
                         f"weight {weight.dtype}"
                         + ("" if bias is None else f", bias {bias.dtype}"))
    return (x.dtype, x.is_cuda, len(x.shape), _grad())


#: Linear: ``tokens`` are the rows of ``x``; the features are ``weight``'s.
LINEAR_SHAPE: dict[str, Callable[..., Any]] = {
    "device": read_device, "sm": read_sm, "tokens": leading_rows(0, 1),
    "in_features": size_of(1, 1), "out_features": size_of(1, 0)}

#: ``linear(x, weight, bias)``: x [..., in], weight [out, in], bias [out] or None, one dtype.
_LINEAR_SHAPE: tuple[Op, ...] = (("tensor", 0), ("tensor", 1), ("ndim", 1, 2), ("ndim_ge", 0, 1),
                                 ("size_eq", 1, 1, 0, -1), ("dtype_eq", 1, 0))
_LINEAR_BASE: tuple[Op, ...] = (("dtype", 0), ("cuda", 0), ("ndim", 0), ("grad",))
_LINEAR_LAZY: dict[str, Op] = {**DEVICE_OPS, "tokens": ("rows", 0, 1),
                               "in_features": ("size", 1, 1), "out_features": ("size", 1, 0)}
LINEAR_READING = Reading(3, (
    Case((("is", 2, 0), *_LINEAR_SHAPE), _LINEAR_BASE, _LINEAR_LAZY),
    Case((*_LINEAR_SHAPE, ("tensor", 2), ("ndim", 2, 1), ("size_eq", 2, 0, 1, 0),
          ("dtype_eq", 2, 0)), _LINEAR_BASE, _LINEAR_LAZY),
))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           backend: Any = None) -> torch.Tensor:
    """``x @ weight.T + bias`` through the ``linear`` table."""
    f = LINEAR
    if backend is None and not compiling() and f.lookup is not None:
        d = f.lookup(f.last, x, weight, bias)
        if d is not None:
            next(d.counter)
            return d.call(x, weight, bias)  # type: ignore[no-any-return]
    if autocasting():
        return f.autocasted((x, weight, bias), {"backend": backend})  # type: ignore[no-any-return]
    return f.route(backend, (x, weight, bias))(x, weight, bias)  # type: ignore[no-any-return]


LINEAR = facade(FamilyCall.of(linear, describe_linear, LINEAR_READS, LINEAR_SHAPE,
                              positional=3, reading=LINEAR_READING,
                              autocast=Autocast(("x", "weight", "bias"))))
FAMILY = declare(Family("linear", (LINEAR,), model="astrai.families.linear.model:RECOGNITION"))
