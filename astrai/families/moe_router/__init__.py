"""The ``moe_router`` family: each token's top-k experts and their weights, from its
router logits.

Its declaration: the facade ``moe_router(logits, top_k, scoring="softmax",
normalize=False, bias=None, groups=1, top_groups=1, scale=1.0, backend=None)`` (the
computation: ``astrai.backends.moe_router``), how a call is validated and read into its
axes (``dtype``, ``device_cuda``, ``grad_enabled``, the table's ``scoring`` and
``top_k``; lazily ``device``, ``sm`` and ``tokens``, the rows of ``logits``), and its
model recognition (``astrai.families.moe_router.model``: the top-k routers of Mixtral,
Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 and Llama 4). The Python path serves it (no compiled
hot-path reading).
"""

from __future__ import annotations

__all__ = ["FAMILY", "ROUTER", "ROUTER_READS", "ROUTER_SHAPE", "SCORINGS",
           "describe_moe_router", "moe_router"]

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from astrai.dispatch.facade import (
    FamilyCall,
    facade,
    number,
    read_device,
    read_sm,
    require_tensors,
    size_of,
)
from astrai.families import Family, declare

_grad = torch.is_grad_enabled

#: How logits become scores: ``softmax`` over the experts, or ``sigmoid`` of each.
SCORINGS = ("softmax", "sigmoid")

ROUTER_READS = ("dtype", "device_cuda", "grad_enabled", "scoring", "top_k")


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def describe_moe_router(logits: Tensor, top_k: int, scoring: str, normalize: bool,
                        bias: Tensor | None, groups: int, top_groups: int, scale: float
                        ) -> tuple[Any, ...]:
    """``logits [T, E]`` floating; ``1 <= top_k <= E``; ``scoring`` softmax or sigmoid;
    ``normalize`` a bool; ``bias`` ``[E]`` or ``None`` (sigmoid scoring only);
    ``groups`` dividing ``E`` with ``top_groups <= groups`` and ``top_k`` experts in
    them; ``scale`` a number."""
    require_tensors("moe_router", logits=logits)
    problems = []
    if logits.dim() != 2 or not logits.dtype.is_floating_point:
        problems.append(f"logits must be a floating [tokens, experts], got "
                        f"{tuple(logits.shape)} {logits.dtype}")
    e = logits.shape[-1] if logits.dim() else 0
    if not _count(top_k) or top_k > e:
        problems.append(f"top_k must be an int in 1..{e} (the experts), got {top_k!r}")
    if scoring not in SCORINGS:
        problems.append(f"scoring must be one of {', '.join(SCORINGS)}, got {scoring!r}")
    if not isinstance(normalize, bool):
        problems.append(f"normalize must be a bool, got {normalize!r}")
    if bias is not None and (not isinstance(bias, Tensor) or bias.shape != (e,)
                             or not bias.dtype.is_floating_point or scoring != "sigmoid"):
        got = (f"{tuple(bias.shape)} {bias.dtype}" if isinstance(bias, Tensor)
               else type(bias).__name__)
        problems.append(f"bias must be None or a floating [{e}] with sigmoid scoring, got "
                        f"{got} with {scoring} scoring")
    if (not _count(groups) or not _count(top_groups) or top_groups > groups
            or (e and e % groups) or (groups > 1 and (e // groups < 2
                                                     or top_groups * (e // groups) < top_k))):
        problems.append(f"groups must divide the {e} experts (at least 2 in each), with "
                        f"1 <= top_groups <= groups holding top_k experts; got groups "
                        f"{groups!r}, top_groups {top_groups!r}")
    try:
        number("moe_router", "scale", scale)
    except TypeError as exc:
        problems.append(str(exc).removeprefix("moe_router: "))
    if problems:
        raise ValueError("moe_router: " + "; ".join(problems))
    return (logits.dtype, logits.is_cuda, _grad(), scoring, top_k)


#: ``tokens``: the rows of ``logits``.
ROUTER_SHAPE: dict[str, Callable[..., Any]] = {
    "device": read_device, "sm": read_sm, "tokens": size_of(0, 0)}


def moe_router(logits: torch.Tensor, top_k: int, scoring: str = "softmax",
               normalize: bool = False, bias: torch.Tensor | None = None, groups: int = 1,
               top_groups: int = 1, scale: float = 1.0, backend: Any = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, indices)``, float32 and int64 ``[T, top_k]``: each token's chosen
    experts, through the ``moe_router`` table."""
    args = (logits, top_k, scoring, normalize, bias, groups, top_groups, scale)
    return ROUTER.route(backend, args)(*args)  # type: ignore[no-any-return]


ROUTER = facade(FamilyCall.of(moe_router, describe_moe_router, ROUTER_READS, ROUTER_SHAPE,
                              positional=8))
FAMILY = declare(Family("moe_router", (ROUTER,),
                        model="astrai.families.moe_router.model:RECOGNITION"))
