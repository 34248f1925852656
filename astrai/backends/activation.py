"""Activations: rows ``torch`` (torch's own functions) and ``reference`` (the formulas).

``activation(x, act)`` applies one of ``ACTIVATIONS`` elementwise; the output has ``x``'s
shape and dtype:

- ``silu``: ``x * sigmoid(x)`` (SwiGLU's activation);
- ``gelu``: ``x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2))``;
- ``gelu_tanh``: ``0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))`` (GPT-2's "new" GELU,
  Gemma's ``gelu_pytorch_tanh``);
- ``quick_gelu``: ``x * sigmoid(1.702 x)`` (CLIP's);
- ``relu``: ``max(x, 0)``;
- ``relu2``: ``max(x, 0)^2`` (squared ReLU: Nemotron, Persimmon, Arcee, BitNet).

The reference writes each formula in float32 (float64 for float64 ``x``) and casts once;
the torch row calls torch's kernels, which compute half types in float32 too.
"""

from __future__ import annotations

__all__ = ["ACTIVATIONS", "reference_activation", "torch_activation"]

import math

import torch
import torch.nn.functional as F

#: The activations the family computes, by the name its ``act`` axis gives them.
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "quick_gelu", "relu", "relu2")
_TANH_SCALE = math.sqrt(2.0 / math.pi)


def reference_activation(x: torch.Tensor, act: str) -> torch.Tensor:
    """``act`` written out in float32 (float64 for float64 ``x``), cast once."""
    h = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    if act == "silu":
        out = h * torch.sigmoid(h)
    elif act == "gelu":
        out = 0.5 * h * (1.0 + torch.erf(h * (1.0 / math.sqrt(2.0))))
    elif act == "gelu_tanh":
        out = 0.5 * h * (1.0 + torch.tanh(_TANH_SCALE * (h + 0.044715 * h * h * h)))
    elif act == "quick_gelu":
        out = h * torch.sigmoid(1.702 * h)
    elif act == "relu":
        out = torch.clamp_min(h, 0.0)
    elif act == "relu2":
        out = torch.square(torch.clamp_min(h, 0.0))
    else:
        raise ValueError(f"unknown activation {act!r}; activations: {', '.join(ACTIVATIONS)}")
    return out.to(x.dtype)


def torch_activation(x: torch.Tensor, act: str) -> torch.Tensor:
    """torch's own function for ``act``."""
    if act == "silu":
        return F.silu(x)
    if act == "gelu":
        return F.gelu(x)
    if act == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if act == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    if act == "relu":
        return F.relu(x)
    if act == "relu2":
        return torch.square(F.relu(x))
    raise ValueError(f"unknown activation {act!r}; activations: {', '.join(ACTIVATIONS)}")
