"""The ``moe_experts`` family: a stack of gated-MLP experts applied to the tokens a
router sent them, summed with the router's weights.

Its declaration: the facade ``moe_experts(hidden, top_k_index, top_k_weights, gate_up,
down, act, weights_on="output", backend=None)`` (the computation:
``astrai.backends.moe_experts``), how a call is validated and read into its axes
(``dtype``, ``device_cuda``, ``grad_enabled`` and the table's ``act``, ``weights_on``,
``experts``, ``top_k`` and ``align`` - the largest power of two, up to 64, dividing the
weights' addresses and strides in bytes, an address unread while traced; lazily
``device``, ``sm`` and ``tokens``, the rows of ``hidden``), and its model recognition
(``astrai.families.moe_experts.model``: the 3-d expert stacks of Mixtral, Qwen2-MoE,
Qwen3-MoE, DeepSeek-V3 and Llama 4). An expert call costs a matmul per expert, so the
family keeps no compiled hot-path reading: the Python path serves it.
"""

from __future__ import annotations

__all__ = ["EXPERTS", "EXPERTS_READS", "EXPERTS_SHAPE", "FAMILY", "WEIGHTS_ON",
           "describe_moe_experts", "moe_experts"]

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from astrai.backends.activation import ACTIVATIONS
from astrai.backends.operators import PLAIN_TYPES
from astrai.dispatch.facade import (
    FamilyCall,
    facade,
    read_device,
    read_sm,
    require_tensors,
    size_of,
)
from astrai.families import Family, declare

_grad = torch.is_grad_enabled
#: Whether the call is traced by ``torch.compile`` or ``torch.export``.
_tracing = torch.compiler.is_compiling

#: Where the router's weights apply: to each expert's output (Mixtral, Qwen, DeepSeek)
#: or to its input (Llama 4).
WEIGHTS_ON = ("output", "input")

EXPERTS_READS = ("dtype", "device_cuda", "grad_enabled", "act", "weights_on", "experts",
                 "top_k", "align")


def describe_moe_experts(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                         gate_up: Tensor, down: Tensor, act: str, weights_on: str
                         ) -> tuple[Any, ...]:
    """``hidden [T, H]`` floating; ``top_k_index [T, K]`` integer; ``top_k_weights
    [T, K]`` floating; ``gate_up [E, 2I, H]`` and ``down [E, H, I]`` of ``hidden``'s
    dtype; ``act`` one of the activations; ``weights_on`` ``output`` or ``input``."""
    require_tensors("moe_experts", hidden=hidden, top_k_index=top_k_index,
                    top_k_weights=top_k_weights, gate_up=gate_up, down=down)
    problems = []
    if hidden.dim() != 2 or not hidden.dtype.is_floating_point:
        problems.append(f"hidden must be a floating [tokens, hidden], got "
                        f"{tuple(hidden.shape)} {hidden.dtype}")
    t = hidden.shape[0] if hidden.dim() else -1
    if (top_k_index.dim() != 2 or top_k_index.shape[0] != t or top_k_index.dtype.is_floating_point
            or top_k_index.dtype.is_complex or top_k_index.dtype is torch.bool):
        problems.append(f"top_k_index must be an integer [tokens, top_k] with hidden's "
                        f"{t} tokens, got {tuple(top_k_index.shape)} {top_k_index.dtype}")
    if (top_k_weights.shape != top_k_index.shape
            or not top_k_weights.dtype.is_floating_point):
        problems.append(f"top_k_weights must be floating, of top_k_index's shape "
                        f"{tuple(top_k_index.shape)}, got {tuple(top_k_weights.shape)} "
                        f"{top_k_weights.dtype}")
    h = hidden.shape[-1] if hidden.dim() else -1
    if (gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0]
            or gate_up.shape[2] != h or down.shape[1] != h
            or gate_up.shape[1] != 2 * down.shape[2]):
        problems.append(f"gate_up must be [experts, 2 * intermediate, {h}] and down "
                        f"[experts, {h}, intermediate], got {tuple(gate_up.shape)} and "
                        f"{tuple(down.shape)}")
    if gate_up.dtype != hidden.dtype or down.dtype != hidden.dtype:
        problems.append(f"gate_up and down must have hidden's dtype {hidden.dtype}, got "
                        f"{gate_up.dtype} and {down.dtype}")
    if act not in ACTIVATIONS:
        problems.append(f"unknown act {act!r}; activations: {', '.join(ACTIVATIONS)}")
    if weights_on not in WEIGHTS_ON:
        problems.append(f"weights_on must be one of {', '.join(WEIGHTS_ON)}, got "
                        f"{weights_on!r}")
    if problems:
        raise ValueError("moe_experts: " + "; ".join(problems))
    return (hidden.dtype, hidden.is_cuda, _grad(), act, weights_on, gate_up.shape[0],
            top_k_index.shape[1], _align(gate_up, down))


def _align(*weights: Tensor) -> int:
    """The largest power of two up to 64 dividing every weight's address and strides
    (but a unit one) in bytes (grouped matmul kernels need 16). Traced (``torch.compile``,
    ``torch.export``), or for a tensor subclass, the address cannot be read: it counts
    as aligned to its element size alone, which every tensor's address is."""
    best = 64
    addressed = not _tracing()
    for w in weights:
        size = w.element_size()
        if addressed and type(w) in PLAIN_TYPES:
            address = w.data_ptr()
        else:
            address = size
        for v in (address, *(s * size for s in w.stride() if s != 1)):
            while best > 1 and v % best:
                best //= 2
    return best


#: ``tokens``: the rows of ``hidden``.
EXPERTS_SHAPE: dict[str, Callable[..., Any]] = {
    "device": read_device, "sm": read_sm, "tokens": size_of(0, 0)}


def moe_experts(hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                act: str, weights_on: str = "output", backend: Any = None) -> torch.Tensor:
    """The experts ``top_k_index`` names, applied to ``hidden`` and summed with
    ``top_k_weights``, through the ``moe_experts`` table."""
    args = (hidden, top_k_index, top_k_weights, gate_up, down, act, weights_on)
    return EXPERTS.route(backend, args)(*args)  # type: ignore[no-any-return]


EXPERTS = facade(FamilyCall.of(moe_experts, describe_moe_experts, EXPERTS_READS,
                               EXPERTS_SHAPE, positional=7))
FAMILY = declare(Family("moe_experts", (EXPERTS,),
                        model="astrai.families.moe_experts.model:RECOGNITION"))
