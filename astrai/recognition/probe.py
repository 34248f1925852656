"""What recognising a module by what it computes takes: a copy of the module to run its
class's ``forward`` on, with tensors of the caller's choosing (``probe_copy``) or holding
random weights (``random_copy``), and how far what it computed is from a reference
(``gap``).

A family tells a module by running the module's own code on small random CPU inputs and
comparing with what the family computes; the copy keeps the module itself untouched
(its parameters, buffers, children and attributes stay its own, whatever device or
dtype they live on), and has no hooks of its own.
"""

from __future__ import annotations

__all__ = ["gap", "probe_copy", "random_copy"]

import copy
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


def probe_copy(module: nn.Module, *, parameters: Mapping[str, torch.Tensor | None] | None = None,
               buffers: Mapping[str, torch.Tensor | None] | None = None,
               modules: Mapping[str, nn.Module | None] | None = None,
               attributes: Mapping[str, Any] | None = None) -> nn.Module:
    """A shallow copy of ``module`` with dicts of its own - parameters, buffers, children,
    attributes - in which the given entries stand instead of the module's (a tensor given
    for a parameter becomes a parameter without gradient), and no hooks."""
    probe = copy.copy(module)
    probe.__dict__ = dict(module.__dict__)
    probe._parameters = dict(module._parameters)
    probe._buffers = dict(module._buffers)
    probe._modules = dict(module._modules)
    for hooks in ("_forward_hooks", "_forward_pre_hooks"):
        setattr(probe, hooks, type(getattr(module, hooks))())
    for name, value in (parameters or {}).items():
        probe._parameters[name] = (value if value is None or isinstance(value, nn.Parameter)
                                   else nn.Parameter(value, requires_grad=False))
    probe._buffers.update(buffers or {})
    probe._modules.update(modules or {})
    probe.__dict__.update(attributes or {})
    return probe


def gap(got: Any, want: torch.Tensor) -> float:
    """How far ``got`` is from ``want``, relative to ``want``'s scale: the largest absolute
    difference over one plus the largest magnitude, in float32; infinite where ``got``
    is not a tensor of ``want``'s shape (or where either holds a NaN)."""
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return math.inf
    a, b = got.detach().float(), want.detach().float()
    value = float((a - b).abs().max()) / (1.0 + float(b.abs().max())) if b.numel() else 0.0
    return math.inf if math.isnan(value) else value


def random_copy(module: nn.Module, generator: torch.Generator, scale: float = 0.3
                ) -> nn.Module:
    """A float32 copy of ``module`` (children too) on the CPU in eval mode, whatever
    device or dtype the module lives on: its parameters random (normal, times ``scale``,
    drawn from ``generator``), its buffers the module's own values (a buffer on the meta
    device, which holds none, stays unset)."""
    probe = copy.deepcopy(module)
    probe.to_empty(device="cpu")
    probe.float().eval()
    with torch.no_grad():
        for p in probe.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * scale)
        for mine, theirs in zip(probe.buffers(), module.buffers(), strict=True):
            if not theirs.is_meta:
                mine.copy_(theirs.detach())
    return probe

