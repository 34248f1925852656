"""The ``gated_activation`` family: ``act(gate) * up`` (SwiGLU, GeGLU) as one call.

Its declaration: the facade ``gated_activation(gate, up, act, backend=None)``, how a call
is validated and read into its axes (``dtype``, ``device_cuda``, ``ndim``,
``grad_enabled`` and the table's ``act`` axis; lazily ``device``, ``sm`` and ``tokens`` -
the rows of ``gate``), the common calls as data for the compiled hot path, and its model
recognition (``astrai.families.gated_activation.model``: the gated MLPs of Llama-style
models and Phi-3's fused projection).
"""

from __future__ import annotations

__all__ = ["FAMILY", "GATED", "GATED_READING", "GATED_READS", "GATED_SHAPE",
           "describe_gated_activation", "gated_activation"]

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

GATED_READS = ("dtype", "device_cuda", "ndim", "grad_enabled", "act")


def describe_gated_activation(gate: Tensor, up: Tensor, act: str) -> tuple[Any, ...]:
    """``gate`` and ``up`` floating tensors of one shape (rank >= 1) and dtype; ``act``
    one of the activations."""
    if isinstance(gate, Tensor) and isinstance(up, Tensor):  # the common call
        shape, dtype = gate.shape, gate.dtype
        if (shape and shape == up.shape and up.dtype is dtype and dtype.is_floating_point
                and act in ACTIVATIONS):
            return (dtype, gate.is_cuda, len(shape), _grad(), act)
    require_tensors("gated_activation", gate=gate, up=up)
    if not len(gate.shape) or gate.shape != up.shape or gate.dtype != up.dtype or (
            not gate.dtype.is_floating_point):
        raise ValueError(f"gated_activation expects floating gate and up of one shape and "
                         f"dtype (rank >= 1); got gate {tuple(gate.shape)} {gate.dtype}, up "
                         f"{tuple(up.shape)} {up.dtype}")
    raise ValueError(f"gated_activation: unknown act {act!r}; activations: "
                     f"{', '.join(ACTIVATIONS)}")


#: ``tokens`` are the rows of ``gate`` (every dimension but the last).
GATED_SHAPE: dict[str, Callable[..., Any]] = {
    "device": read_device, "sm": read_sm, "tokens": leading_rows(0, 1)}

#: ``gated_activation(gate, up, act)``: gate and up floating, of one shape and dtype, rank
#: >= 1; act one of the activations (the very string objects the family names).
GATED_READING = Reading(3, (
    Case((("tensor", 0), ("tensor", 1), ("ndim_ge", 0, 1), ("floating", 0),
          ("shape_eq", 1, 0), ("dtype_eq", 1, 0),
          ("any", *((("is", 2, i),) for i in range(len(ACTIVATIONS))))),
         (("dtype", 0), ("cuda", 0), ("ndim", 0), ("grad",), ("arg", 2)),
         {**DEVICE_OPS, "tokens": ("rows", 0, 1)}),
), consts=ACTIVATIONS)


def gated_activation(gate: torch.Tensor, up: torch.Tensor, act: str,
                     backend: Any = None) -> torch.Tensor:
    """``act(gate) * up`` through the ``gated_activation`` table."""
    f = GATED
    if backend is None and not compiling() and f.lookup is not None:
        d = f.lookup(f.last, gate, up, act)
        if d is not None:
            next(d.counter)
            return d.call(gate, up, act)  # type: ignore[no-any-return]
    return f.route(backend, (gate, up, act))(gate, up, act)  # type: ignore[no-any-return]


GATED = facade(FamilyCall.of(gated_activation, describe_gated_activation, GATED_READS,
                             GATED_SHAPE, positional=3, reading=GATED_READING))
FAMILY = declare(Family("gated_activation", (GATED,),
                        model="astrai.families.gated_activation.model:RECOGNITION"))
