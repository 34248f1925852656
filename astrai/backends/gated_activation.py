"""Gated activations: rows ``torch``, ``inductor`` (one fused pass) and ``reference``.

``gated_activation(gate, up, act) = act(gate) * up`` elementwise (SwiGLU with ``silu``,
GeGLU with ``gelu`` / ``gelu_tanh``), ``gate`` and ``up`` of one shape and dtype; the
output has theirs. ``torch`` computes it as the models do, ``act(gate)`` then the product,
each rounded to the inputs' dtype (two passes over memory); ``reference`` writes it in
float32 (float64 for float64) and casts once; ``inductor`` is the reference compiled by
``torch.compile`` (one fused pass, dynamic shapes, compiled on its first call per dtype,
device, rank and activation), which rounds as the reference does.
"""

from __future__ import annotations

__all__ = ["inductor_gated_activation", "reference_gated_activation",
           "torch_gated_activation"]

import torch

from astrai.backends.activation import reference_activation, torch_activation
from astrai.backends.inductor import Compiled
from astrai.dispatch.torch_compile import compiling


def torch_gated_activation(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """``act(gate) * up`` with torch's kernels, in the inputs' dtype (the models' order)."""
    return torch_activation(gate, act) * up


def _reference(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    wide = torch.float64 if gate.dtype == torch.float64 else torch.float32
    return (reference_activation(gate.to(wide), act) * up.to(wide)).to(gate.dtype)


def reference_gated_activation(gate: torch.Tensor, up: torch.Tensor, act: str
                               ) -> torch.Tensor:
    """``act(gate) * up`` written out in float32 (float64 for float64), cast once."""
    return _reference(gate, up, act)


_compiled = Compiled(_reference, dynamic=True)


def inductor_gated_activation(gate: torch.Tensor, up: torch.Tensor, act: str
                              ) -> torch.Tensor:
    """The reference compiled by inductor into one pass (compiled lazily, per dtype,
    device, rank and activation); inside a user's ``torch.compile``, the reference."""
    if compiling():
        return _reference(gate, up, act)
    key = (gate.dtype, gate.device, gate.dim(), act)
    return _compiled(key, gate, up, act)  # type: ignore[no-any-return]
