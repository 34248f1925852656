"""The ``linear_cross_entropy`` family: a linear head's loss, ``cross_entropy(hidden @
weight.T + bias, labels)``, as one call - so that a row may never hold the whole logits.

Its declaration: the facade ``linear_cross_entropy(hidden, weight, labels, bias=None,
ignore_index=-100, reduction="mean", backend=None)`` (the computation:
``astrai.backends.linear_cross_entropy``), how a call is validated and read into its axes
(``dtype``, ``device_cuda``, ``grad_enabled`` and the table's ``reduction`` and
``vocab``; lazily ``device``, ``sm`` and ``tokens``, the rows of ``hidden``). A model's
head and loss reach it through the ``cross_entropy`` family's recognition of the loss;
the Python path serves it (no compiled hot-path reading).
"""

from __future__ import annotations

__all__ = ["FAMILY", "LINEAR_CROSS_ENTROPY", "LINEAR_CROSS_ENTROPY_READS",
           "describe_linear_cross_entropy", "linear_cross_entropy"]

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from astrai.dispatch.autocasting import Autocast, autocasting
from astrai.dispatch.facade import (
    FamilyCall,
    facade,
    read_device,
    read_sm,
    require_tensors,
    size_of,
)
from astrai.families import Family, declare
from astrai.families.cross_entropy import describe_labels

_grad = torch.is_grad_enabled

LINEAR_CROSS_ENTROPY_READS = ("dtype", "device_cuda", "grad_enabled", "reduction", "vocab")


def describe_linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor,
                                  bias: Tensor | None, ignore_index: int, reduction: str
                                  ) -> tuple[Any, ...]:
    """``hidden [N, H]`` floating; ``weight [V, H]`` and ``bias [V]`` (or ``None``) of its
    dtype; ``labels [N]`` integer; ``ignore_index`` an int; ``reduction`` mean, sum or
    none."""
    require_tensors("linear_cross_entropy", hidden=hidden, weight=weight, labels=labels)
    problems = []
    if hidden.dim() != 2 or not hidden.dtype.is_floating_point:
        problems.append(f"hidden must be a floating [tokens, features], got "
                        f"{tuple(hidden.shape)} {hidden.dtype}")
    h = hidden.shape[-1] if hidden.dim() else -1
    if weight.dim() != 2 or weight.shape[1] != h or not weight.shape[0] or (
            weight.dtype != hidden.dtype):
        problems.append(f"weight must be [vocab, {h}] of hidden's dtype {hidden.dtype}, got "
                        f"{tuple(weight.shape)} {weight.dtype}")
    if bias is not None and (not isinstance(bias, Tensor) or bias.dim() != 1
                             or bias.shape[0] != weight.shape[0] or bias.dtype != hidden.dtype):
        got = (f"{tuple(bias.shape)} {bias.dtype}" if isinstance(bias, Tensor)
               else type(bias).__name__)
        problems.append(f"bias must be None or [vocab] of hidden's dtype, got {got}")
    problems += describe_labels(labels,
                                hidden.shape[0] if hidden.dim() else -1, ignore_index,
                                reduction)
    if problems:
        raise ValueError("linear_cross_entropy: " + "; ".join(problems))
    return (hidden.dtype, hidden.is_cuda, _grad(), reduction, weight.shape[0])


#: ``tokens``: the rows of ``hidden``.
LINEAR_CROSS_ENTROPY_SHAPE: dict[str, Callable[..., Any]] = {
    "device": read_device, "sm": read_sm, "tokens": size_of(0, 0)}


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         bias: torch.Tensor | None = None, ignore_index: int = -100,
                         reduction: str = "mean", backend: Any = None) -> torch.Tensor:
    """The cross-entropy of ``hidden @ weight.T + bias`` against ``labels`` (float32),
    through the ``linear_cross_entropy`` table."""
    args = (hidden, weight, labels, bias, ignore_index, reduction)
    if autocasting():
        return LINEAR_CROSS_ENTROPY.autocasted(args, {"backend": backend})  # type: ignore[no-any-return]
    return LINEAR_CROSS_ENTROPY.route(backend, args)(*args)  # type: ignore[no-any-return]


LINEAR_CROSS_ENTROPY = facade(FamilyCall.of(
    linear_cross_entropy, describe_linear_cross_entropy, LINEAR_CROSS_ENTROPY_READS,
    LINEAR_CROSS_ENTROPY_SHAPE, positional=6,
    autocast=Autocast(("hidden", "weight", "bias"))))
FAMILY = declare(Family("linear_cross_entropy", (LINEAR_CROSS_ENTROPY,)))
