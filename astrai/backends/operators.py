"""What the rows that stand in a compiled graph as operators of their own share: which
calls a row computes itself, why it hands the others back to torch, and the operator's
registration.

A row with a kernel torch cannot trace into (oneDNN's linear, astrai's native kernels, an
MoE row whose sizes depend on the data) is registered once as a torch operator
``astrai::<name>`` with a shape function; under ``torch.compile`` the row calls it and
inductor keeps it as an external kernel. Such a row computes a call itself only where no
autograd records (the operators have no backward), no CPU autocast is in force (it would
not cast them) and every tensor is of torch's own types (a subclass such as a ``DTensor``
computes otherwise).
"""

from __future__ import annotations

__all__ = ["PLAIN_TYPES", "handoff_reason", "plain_call", "registered_operator"]

from collections.abc import Callable
from typing import Any

import torch

#: The tensor types whose calls the rows compute themselves.
PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def plain_call(*tensors: torch.Tensor | None) -> bool:
    """Whether a call is one a row computes itself: no autograd recording, no CPU
    autocast, and every tensor given (``None`` aside) of torch's own types."""
    if torch.is_grad_enabled() or torch.is_autocast_enabled("cpu"):
        return False
    return all(t is None or type(t) in PLAIN_TYPES for t in tensors)


def handoff_reason(*tensors: torch.Tensor | None) -> str:
    """Why ``plain_call`` leaves a call to torch (``""`` where it does not)."""
    subclasses = sorted({type(t).__name__ for t in tensors
                         if t is not None and type(t) not in PLAIN_TYPES})
    if subclasses:
        return f"a tensor subclass ({', '.join(subclasses)})"
    if torch.is_autocast_enabled("cpu"):
        return "CPU autocast in force"
    if torch.is_grad_enabled():
        return "autograd recording"
    return ""


def registered_operator(name: str, compute: Callable[..., torch.Tensor],
                        shape: Callable[..., torch.Tensor]) -> Any:
    """The operator ``astrai::<name>`` computing ``compute`` (its schema read off
    ``compute``'s annotations) with the shape function ``shape``; registered with torch
    the first time (later calls return the registered one)."""
    namespace = torch.ops.astrai
    if hasattr(namespace, name):
        return getattr(namespace, name)
    op = torch.library.custom_op(f"astrai::{name}", compute, mutates_args=())
    op.register_fake(shape)
    return op
