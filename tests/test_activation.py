"""The activation family: its rows, its facade's validation, and the activation modules
``dispatch_model`` recognises by what they compute."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import astrai.dispatch as d
from astrai import ops
from astrai.backends.activation import ACTIVATIONS, reference_activation, torch_activation
from astrai.families.activation.model import activation_of
from astrai.integrations.transformers import dispatch_model, restore_model, verify_model

FORMULAS = {
    "silu": lambda x: x * torch.sigmoid(x),
    "gelu": lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2))),
    "gelu_tanh": lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi)
                                                      * (x + 0.044715 * x ** 3))),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": lambda x: torch.clamp_min(x, 0),
    "relu2": lambda x: torch.clamp_min(x, 0) ** 2,
}


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_the_rows_compute_the_formula(act: str, dtype: torch.dtype) -> None:
    x = torch.linspace(-12, 12, 301, dtype=torch.float64).reshape(1, 301)
    want = FORMULAS[act](x)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 2e-2)
    for row in (reference_activation, torch_activation):
        got = row(x.to(dtype), act)
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    got = ops.activation(x.to(dtype), act)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("args, error, match", [
    ((torch.randn(3), "swish"), ValueError, "unknown act 'swish'; activations: silu"),
    ((torch.ones(3, dtype=torch.int64), "relu"), ValueError,
     r"activation: x must be floating point, got torch.int64"),
    ((torch.tensor(1.0), "relu"), ValueError,
     r"activation: x must be \[\.\.\., f\] \(at least 1 dimension\); got x \(\)"),
    (([1.0], "relu"), TypeError, "x must be a torch.Tensor"),
])
def test_a_malformed_call_is_refused(args: tuple[Any, ...], error: type[Exception],
                                     match: str) -> None:
    with pytest.raises(error, match=match):
        ops.activation(*args)


def test_the_act_axis_is_the_tables() -> None:
    ctx = ops.context("activation", torch.randn(4, 2, 8), "gelu_tanh")
    assert ctx.extra == {"act": "gelu_tanh"} and ctx.tokens == 8
    assert d.resolve("activation", ctx).name == "torch"
    assert "act=gelu_tanh" in d.explain("activation", ctx)


class MishActivation(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.tanh(F.softplus(x))


class ClippedGELUActivation(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.clamp(F.gelu(x), -10, 10)


class SiLUActivation(nn.Module):
    """Written out op by op in the input's dtype, as models write it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(x)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
        self.acts = nn.ModuleList([nn.SiLU(), nn.GELU(), nn.GELU(approximate="tanh"),
                                   nn.ReLU(), SiLUActivation()])
        self.odd = nn.ModuleList([MishActivation(), ClippedGELUActivation()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        for act in self.acts:
            h = act(h)
        return self.down(h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dispatch_model_routes_activations_by_what_they_compute(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    plain = MLP().to(dtype)
    model = copy.deepcopy(plain)
    report = dispatch_model(model)
    details = {r.path: r.detail for r in report.routed if r.family == "activation"}
    assert details == {"acts.0": "silu", "acts.1": "gelu", "acts.2": "gelu_tanh",
                       "acts.3": "relu", "acts.4": "silu"}
    reasons = {n.path: n.reason for n in report.not_routed if n.family == "activation"}
    assert "computes none of the activations" in reasons["odd.0"]
    assert "computes none of the activations" in reasons["odd.1"]  # clipped at 10
    x = torch.randn(2, 3, 16, dtype=dtype)
    with torch.no_grad():
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(model(x), plain(x), atol=tol, rtol=tol)
    assert verify_model(model, x)["activation"] == 5
    restore_model(model)
    assert torch.equal(model(x), plain(x))


def test_transformers_act2fn() -> None:
    activations = pytest.importorskip("transformers.activations")
    want = {"silu": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh",
            "gelu_pytorch_tanh": "gelu_tanh", "quick_gelu": "quick_gelu", "relu": "relu"}
    if "relu2" in activations.ACT2FN:
        want["relu2"] = "relu2"
    for name, act in want.items():
        assert activation_of(activations.ACT2FN[name]) == act, name
    assert activation_of(activations.ACT2FN["mish"]).startswith("refused: ")
