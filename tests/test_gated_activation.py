"""The gated_activation family: act(gate) * up as one call (its rows, its facade's
validation, its table's regions), and the gated MLPs ``dispatch_model`` recognises by
what they compute (three projections, or Phi-3's fused gate_up), their activation covered."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import astrai.dispatch as d
from astrai import ops
from astrai.backends.activation import ACTIVATIONS, torch_activation
from astrai.backends.gated_activation import (
    inductor_gated_activation,
    reference_gated_activation,
    torch_gated_activation,
)
from astrai.backends.inductor import inductor_available
from astrai.integrations.transformers import dispatch_model, restore_model, verify_model


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_the_rows_compute_act_gate_times_up(act: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    gate, up = (torch.randn(3, 40, generator=g, dtype=torch.float64) * 4 for _ in range(2))
    want = torch_activation(gate, act) * up
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 5e-2)
    for row in (torch_gated_activation, reference_gated_activation):
        got = row(gate.to(dtype), up.to(dtype), act)
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    got = ops.gated_activation(gate.to(dtype), up.to(dtype), act)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.skipif(inductor_available() is not True, reason="inductor cannot compile here")
def test_the_fused_row_is_the_reference() -> None:
    gate, up = torch.randn(70, 64), torch.randn(70, 64)
    torch.testing.assert_close(inductor_gated_activation(gate, up, "silu"),
                               reference_gated_activation(gate, up, "silu"))


@pytest.mark.parametrize("args, error, match", [
    ((torch.randn(2, 8), torch.randn(2, 7), "silu"), ValueError,
     r"gated_activation: up must have gate's shape \(2, 8\), got \(2, 7\)"),
    ((torch.randn(2, 8), torch.randn(2, 8, dtype=torch.float64), "silu"), ValueError,
     r"gated_activation: up must have gate's dtype \(torch.float32\), got torch.float64"),
    ((torch.randn(2, 8), torch.randn(2, 8), "swish"), ValueError, "unknown act 'swish'"),
    ((torch.randn(2, 8), [0.0], "silu"), TypeError, "up must be a torch.Tensor"),
])
def test_a_malformed_call_is_refused(args: tuple[Any, ...], error: type[Exception],
                                     match: str) -> None:
    with pytest.raises(error, match=match):
        ops.gated_activation(*args)


def test_the_table_gives_the_fused_row_its_measured_region() -> None:
    def row(tokens: int, dtype: torch.dtype) -> str:
        ctx = ops.context("gated_activation", torch.zeros(tokens, 8, dtype=dtype),
                          torch.zeros(tokens, 8, dtype=dtype), "silu")
        return d.resolve("gated_activation", ctx).name

    fused = "inductor_large" if inductor_available() is True else "torch"
    for dtype in (torch.float32, torch.bfloat16):
        assert row(1, dtype) == row(255, dtype) == "torch"
        assert row(256, dtype) == row(4096, dtype) == fused


# -- in a model --------------------------------------------------------------------


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int = 16, inner: int = 24, act: str = "silu") -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.act_fn = nn.SiLU() if act == "silu" else nn.GELU(approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class SwappedMLP(LlamaMLP):
    """The activation on the layer named ``up``: roles are found by computing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_proj(x) * self.act_fn(self.up_proj(x)))


class Phi3MLP(nn.Module):
    def __init__(self, hidden: int = 16, inner: int = 24) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.activation_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * self.activation_fn(gate))


class SumMLP(LlamaMLP):
    """Shaped like a gated MLP, computes a sum."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) + self.up_proj(x))


class PlainMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(16, 64), nn.Linear(64, 16), nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlps = nn.ModuleList([LlamaMLP(), LlamaMLP(act="gelu_tanh"), SwappedMLP(),
                                   Phi3MLP(), SumMLP(), PlainMLP()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for mlp in self.mlps:
            x = x + mlp(x)
        return x


def test_dispatch_model_routes_gated_mlps_by_what_they_compute() -> None:
    torch.manual_seed(0)
    plain = Model()
    model = copy.deepcopy(plain)
    report = dispatch_model(model)
    details = {r.path: r.detail for r in report.routed if r.family == "gated_activation"}
    assert details == {
        "mlps.0": "down_proj(silu(gate_proj(x)) * up_proj(x))",
        "mlps.1": "down_proj(gelu_tanh(gate_proj(x)) * up_proj(x))",
        "mlps.2": "down_proj(silu(up_proj(x)) * gate_proj(x))",
        "mlps.3": "down_proj(silu(gate) * up), gate, up = gate_up_proj(x).chunk(2)"}
    refused = {n.path: n.reason for n in report.not_routed if n.family == "gated_activation"}
    assert list(refused) == ["mlps.4"] and "computes none of its forms" in refused["mlps.4"]
    # the covered activations are not routed on their own; the others are
    acts = sorted(r.path for r in report.routed if r.family == "activation")
    assert acts == ["mlps.4.act_fn", "mlps.5.act"]
    assert len(report.paths("linear")) == 3 * 4 + 2 + 2
    x = torch.randn(2, 3, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x), atol=1e-5, rtol=1e-5)
    served = verify_model(model, x)
    assert served["gated_activation"] == 4 and served["activation"] == 2
    again = dispatch_model(model)
    assert again.changed == 0 and again.counts() == report.counts()
    restore_model(model)
    assert not [m for m in model.modules() if "forward" in m.__dict__]
    assert torch.equal(model(x), plain(x))


def test_an_mlp_whose_activation_astrai_does_not_compute_is_refused() -> None:
    mlp = LlamaMLP()

    class MishActivation(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.mish(x)

    mlp.act_fn = MishActivation()
    report = dispatch_model(nn.Sequential(mlp))
    reasons = [n.reason for n in report.not_routed if n.family == "gated_activation"]
    assert len(reasons) == 1 and reasons[0].startswith("its activation act_fn: ")


def test_an_activation_routed_before_is_covered_when_its_mlp_is_routed() -> None:
    """Routing the activation alone, then everything: the MLP's route covers the activation,
    which gets its own forward back (it is no longer called), and verify_model holds."""
    torch.manual_seed(0)
    plain = nn.Sequential(LlamaMLP())
    model = copy.deepcopy(plain)
    assert dispatch_model(model, ["activation"]).paths("activation") == ["0.act_fn"]
    report = dispatch_model(model)
    assert report.paths("gated_activation") == ["0"] and report.paths("activation") == []
    assert "forward" not in model[0].act_fn.__dict__
    x = torch.randn(2, 16)
    assert verify_model(model, x)["gated_activation"] == 1
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x), atol=1e-6, rtol=1e-6)


class SubNormedMLP(LlamaMLP):
    """BitNet's form: an RMS norm on the gated product before ``down``."""

    def __init__(self) -> None:
        super().__init__()
        self.ffn_sub_norm = nn.RMSNorm(24, eps=1e-6)
        with torch.no_grad():
            self.ffn_sub_norm.weight.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ffn_sub_norm(self.act_fn(self.gate_proj(x))
                                                * self.up_proj(x)))


class PostNormedMLP(LlamaMLP):
    """A child applied elsewhere (after ``down``): not the sub-norm form."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(super().forward(x))


class DroppingMLP(LlamaMLP):
    """A dropout, whose place no call out of training can tell."""

    def __init__(self) -> None:
        super().__init__()
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(super().forward(x))


class SubDroppedMLP(LlamaMLP):
    """A dropout on the gated product before ``down``."""

    def __init__(self) -> None:
        super().__init__()
        self.dropout = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.dropout(self.act_fn(self.gate_proj(x)) * self.up_proj(x)))


def test_a_child_applied_to_the_gated_product_is_served_on_its_own() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(SubNormedMLP(), PostNormedMLP(), DroppingMLP(),
                          SubDroppedMLP()).eval()
    model = copy.deepcopy(plain)
    report = dispatch_model(model)
    details = {r.path: r.detail for r in report.routed if r.family == "gated_activation"}
    assert details == {"0": "down_proj(ffn_sub_norm(silu(gate_proj(x)) * up_proj(x)))",
                       "3": "down_proj(dropout(silu(gate_proj(x)) * up_proj(x)))"}
    assert "0.ffn_sub_norm" in report.paths("rms_norm")
    refused = {n.path: n.reason for n in report.not_routed if n.family == "gated_activation"}
    assert "computes none of its forms" in refused["1"]
    assert refused["2"] == ("it holds a dropout (dropout) it does not apply to the gated "
                            "product alone")
    x = torch.randn(2, 3, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x), atol=1e-5, rtol=1e-5)
    served = verify_model(model, x)
    assert served["gated_activation"] == 2 and served["rms_norm"] == 1
    # training: both drop the same entries where the seed is the same
    plain.train()
    model.train()
    outs = []
    for m in (plain, model):
        torch.manual_seed(3)
        with torch.no_grad():
            outs.append(m(x))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


class ShapedLikeFusedHead(nn.Module):
    """Layers shaped as a fused gated MLP would be (``dense`` 16 -> 16, ``decoder``
    8 -> 16) by coincidence; its forward takes 8 features: no gated MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.dense, self.decoder, self.act = nn.Linear(16, 16), nn.Linear(8, 16), nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(self.act(self.decoder(x)))


def test_layers_shaped_like_a_gated_mlp_by_coincidence_are_served_on_their_own() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(ShapedLikeFusedHead())
    model = copy.deepcopy(plain)
    report = dispatch_model(model)
    assert not [n for n in report.not_routed if n.family == "gated_activation"]
    assert report.paths("gated_activation") == []
    assert report.paths("activation") == ["0.act"]
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x), atol=1e-5, rtol=1e-5)
