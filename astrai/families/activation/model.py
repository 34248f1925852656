"""Activations in a model: which modules compute one, told by what they compute, and the
forward that sends their calls to ``ops.activation``.

A module without children or parameters that is torch's ``SiLU``, ``GELU`` or ``ReLU``,
or whose class is named after an activation (``...GELU...``, ``...SiLU...``,
``...Swish...``, ``...ReLU...``, ``...Activation...``: transformers' ``ACT2FN`` classes),
is run on random inputs (float32 over [-24, 24], then bfloat16) and compared with each
activation the family computes. It is served as the one it matches, within float32
tolerance in float32 and a few roundings in bfloat16; an activation of another kind
(Mish, a clipped or "fast" GELU approximation, a squared ReLU) is a reason.
"""

from __future__ import annotations

__all__ = ["RECOGNITION", "activation_child", "activation_of", "child_activation",
           "is_activation_kind"]

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from astrai.backends.activation import ACTIVATIONS, reference_activation
from astrai.families.activation import activation
from astrai.families.recognition import Installed, ModelRecognition

_ACT_NAME = re.compile(r"gelu|silu|swish|relu|activation", re.IGNORECASE)
_TORCH_ACTS = (nn.SiLU, nn.GELU, nn.ReLU)
_FP32_TOL = 1e-5
_BF16_TOL = 2.0 ** -6  # a few roundings of bfloat16 (models write formulas op by op)


def is_activation_kind(module: nn.Module) -> bool:
    """Whether ``module`` may compute an activation: torch's, or a class named after one,
    holding no children and no parameters."""
    if module._modules or any(p is not None for p in module._parameters.values()):
        return False
    return isinstance(module, _TORCH_ACTS) or bool(_ACT_NAME.search(type(module).__name__))


def activation_child(module: nn.Module) -> str | None:
    """The name of ``module``'s one direct child that may compute an activation (``None``:
    none, or more than one)."""
    acts = [n for n, c in module._modules.items() if c is not None and is_activation_kind(c)]
    return acts[0] if len(acts) == 1 else None


def child_activation(module: nn.Module) -> tuple[str, str]:
    """``(name, act)`` of ``module``'s activation child: ``act`` what it computes, or
    ``"refused: "`` and why it cannot be served."""
    name = activation_child(module)
    assert name is not None
    child = module._modules[name]
    assert child is not None
    return name, activation_of(child)


def _gap(module: nn.Module, act: str, x: torch.Tensor) -> float | str:
    try:
        with torch.no_grad():
            got = module(x)
    except Exception as exc:
        return f"called on a {x.dtype} tensor it raised {type(exc).__name__}"
    if not isinstance(got, torch.Tensor) or got.shape != x.shape or got.dtype != x.dtype:
        return "it does not return a tensor of its input's shape and dtype"
    want = reference_activation(x, act)
    return float(((got.float() - want.float()).abs() / (want.float().abs() + 1.0)).max())


def activation_of(module: nn.Module) -> str:
    """The activation ``module`` computes (one of ``ACTIVATIONS``), or ``"refused: "`` and
    why it cannot be served."""
    g = torch.Generator().manual_seed(5)
    x = torch.rand(2, 3, 64, generator=g) * 48.0 - 24.0  # past a clip at 10 (gelu_10)
    gaps: dict[str, float] = {}
    for act in ACTIVATIONS:
        gap = _gap(module, act, x)
        if isinstance(gap, str):
            return f"refused: {gap}"
        gaps[act] = gap
    act = min(gaps, key=gaps.__getitem__)
    if not gaps[act] <= _FP32_TOL:
        return (f"refused: it computes none of the activations astrai serves "
                f"({', '.join(ACTIVATIONS)}; the closest, {act}, differs by {gaps[act]:.2g})")
    half = _gap(module, act, x.to(torch.bfloat16))
    if isinstance(half, float) and not half <= _BF16_TOL:
        return f"refused: in bfloat16 it differs from {act} by {half:.2g}"
    return act


def _activation_forward(act: str) -> Callable[..., Any]:
    def activation_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
        return activation(input, act)

    return activation_forward


def _route(module: nn.Module) -> Installed | str:
    act = activation_of(module)
    if act.startswith("refused: "):
        return act.removeprefix("refused: ")
    return Installed(_activation_forward(act), act, act)


#: Activations: whole (parameterless) modules.
RECOGNITION = ModelRecognition(claims=is_activation_kind, module=_route)
