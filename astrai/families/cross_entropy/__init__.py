"""The ``cross_entropy`` family: the loss of logits against labels.

Its declaration: the facade ``cross_entropy(logits, labels, ignore_index=-100,
reduction="mean", backend=None)`` (the computation: ``astrai.backends.cross_entropy``),
how a call is validated and read into its axes (``dtype``, ``device_cuda``,
``grad_enabled`` and the table's ``reduction`` and ``vocab``; lazily ``device``, ``sm``
and ``tokens``, the rows of ``logits``), and its model recognition
(``astrai.families.cross_entropy.model``: a causal or masked LM's ``loss_function``, its
head and loss fused through the ``linear_cross_entropy`` family in training). A loss is
one call per step: the Python path serves it (no compiled hot-path reading).
"""

from __future__ import annotations

__all__ = ["CROSS_ENTROPY", "CROSS_ENTROPY_READS", "FAMILY", "REDUCTIONS",
           "cross_entropy", "describe_cross_entropy", "describe_labels"]

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

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

#: How the tokens' losses are reduced.
REDUCTIONS = ("mean", "sum", "none")

CROSS_ENTROPY_READS = ("dtype", "device_cuda", "grad_enabled", "reduction", "vocab")


def describe_labels(labels: Tensor, tokens: int, ignore_index: int,
                    reduction: str) -> list[str]:
    """What is wrong with ``labels``, ``ignore_index`` and ``reduction`` (nothing: [])."""
    problems = []
    if (labels.dim() != 1 or labels.shape[0] != tokens or labels.dtype.is_floating_point
            or labels.dtype.is_complex or labels.dtype is torch.bool):
        problems.append(f"labels must be an integer [{tokens}] (one per token), got "
                        f"{tuple(labels.shape)} {labels.dtype}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        problems.append(f"ignore_index must be an int, got {ignore_index!r}")
    if reduction not in REDUCTIONS:
        problems.append(f"reduction must be one of {', '.join(REDUCTIONS)}, got "
                        f"{reduction!r}")
    return problems


def describe_cross_entropy(logits: Tensor, labels: Tensor, ignore_index: int,
                           reduction: str) -> tuple[Any, ...]:
    """``logits [N, V]`` floating; ``labels [N]`` integer; ``ignore_index`` an int;
    ``reduction`` mean, sum or none."""
    require_tensors("cross_entropy", logits=logits, labels=labels)
    problems = []
    if logits.dim() != 2 or not logits.dtype.is_floating_point or not logits.shape[-1]:
        problems.append(f"logits must be a floating [tokens, vocab], got "
                        f"{tuple(logits.shape)} {logits.dtype}")
    problems += describe_labels(labels, logits.shape[0] if logits.dim() else -1,
                                ignore_index, reduction)
    if problems:
        raise ValueError("cross_entropy: " + "; ".join(problems))
    return (logits.dtype, logits.is_cuda, _grad(), reduction, logits.shape[1])


#: ``tokens``: the rows of ``logits``.
CROSS_ENTROPY_SHAPE: dict[str, Callable[..., Any]] = {
    "device": read_device, "sm": read_sm, "tokens": size_of(0, 0)}


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                  reduction: str = "mean", backend: Any = None) -> torch.Tensor:
    """The cross-entropy of ``logits`` against ``labels`` (float32; float64 for float64
    logits), through the ``cross_entropy`` table."""
    args = (logits, labels, ignore_index, reduction)
    return CROSS_ENTROPY.route(backend, args)(*args)  # type: ignore[no-any-return]


CROSS_ENTROPY = facade(FamilyCall.of(cross_entropy, describe_cross_entropy,
                                     CROSS_ENTROPY_READS, CROSS_ENTROPY_SHAPE, positional=4))
FAMILY = declare(Family("cross_entropy", (CROSS_ENTROPY,),
                        model="astrai.families.cross_entropy.model:RECOGNITION"))
