"""The ``activation`` family: an elementwise activation (silu, gelu, gelu_tanh,
quick_gelu, relu).

Its declaration: the facade ``activation(x, act, backend=None)``, how a call is validated
and read into its axes (``dtype``, ``device_cuda``, ``ndim``, ``grad_enabled`` and the
table's ``act`` axis; lazily ``device``, ``sm`` and ``tokens`` - the rows of ``x``), the
common calls as data for the compiled hot path, and its model recognition
(``astrai.families.activation.model``).
"""

from __future__ import annotations

__all__ = ["ACTIVATION", "ACTIVATIONS", "ACTIVATION_READING", "ACTIVATION_READS",
           "ACTIVATION_SHAPE", "FAMILY", "activation", "describe_activation"]

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from astrai.backends.activation import ACTIVATIONS
from astrai.dispatch.facade import (
    DEVICE_OPS,
    FamilyCall,
    facade,
    leading_rows,
    read_device,
    read_sm,
    require_tensors,
)
from astrai.dispatch.reading import Case, Reading
from astrai.dispatch.torch_compile import compiling
from astrai.families import Family, declare

_grad = torch.is_grad_enabled

ACTIVATION_READS = ("dtype", "device_cuda", "ndim", "grad_enabled", "act")


def describe_activation(x: Tensor, act: str) -> tuple[Any, ...]:
    """``x`` a floating tensor of rank >= 1; ``act`` one of ``ACTIVATIONS``."""
    if (isinstance(x, Tensor) and len(x.shape) and x.dtype.is_floating_point
            and act in ACTIVATIONS):
        return (x.dtype, x.is_cuda, len(x.shape), _grad(), act)  # the common call
    require_tensors("activation", x=x)
    if not len(x.shape) or not x.dtype.is_floating_point:
        raise ValueError(f"activation expects a floating x of rank >= 1; got "
                         f"{tuple(x.shape)} {x.dtype}")
    raise ValueError(f"activation: unknown act {act!r}; activations: {', '.join(ACTIVATIONS)}")


#: ``tokens`` are the rows of ``x`` (every dimension but the last).
ACTIVATION_SHAPE: dict[str, Callable[..., Any]] = {
    "device": read_device, "sm": read_sm, "tokens": leading_rows(0, 1)}

#: ``activation(x, act)``: x a floating tensor of rank >= 1, act one of the activations
#: (the very string objects the family names: any other string takes the route).
ACTIVATION_READING = Reading(2, (
    Case((("tensor", 0), ("ndim_ge", 0, 1), ("floating", 0),
          ("any", *((("is", 1, i),) for i in range(len(ACTIVATIONS))))),
         (("dtype", 0), ("cuda", 0), ("ndim", 0), ("grad",), ("arg", 1)),
         {**DEVICE_OPS, "tokens": ("rows", 0, 1)}),
), consts=ACTIVATIONS)


def activation(x: torch.Tensor, act: str, backend: Any = None) -> torch.Tensor:
    """``act`` applied to ``x`` elementwise, through the ``activation`` table."""
    f = ACTIVATION
    if backend is None and not compiling() and f.lookup is not None:
        d = f.lookup(f.last, x, act)
        if d is not None:
            next(d.counter)
            return d.call(x, act)  # type: ignore[no-any-return]
    return f.route(backend, (x, act))(x, act)  # type: ignore[no-any-return]


ACTIVATION = facade(FamilyCall.of(activation, describe_activation, ACTIVATION_READS,
                                  ACTIVATION_SHAPE, positional=2, reading=ACTIVATION_READING))
FAMILY = declare(Family("activation", (ACTIVATION,),
                        model="astrai.families.activation.model:RECOGNITION"))
