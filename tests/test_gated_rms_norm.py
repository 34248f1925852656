"""The gated_rms_norm family: its rows, its facade's checks, and the gated RMS norms of
state-space and gated-delta-net mixers ``dispatch_model`` recognises by what they compute
(gate after the norm, Qwen3-Next's; before it, in groups, Mamba-2's)."""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import astrai.dispatch as d
from astrai import ops
from astrai.backends.gated_rms_norm import (
    reference_gated_rms_norm,
    torch_gated_rms_norm,
    transformers_gated_rms_norm,
)
from astrai.integrations.transformers import dispatch_model, restore_model, verify_model


def _want(x: torch.Tensor, w: torch.Tensor, gate: torch.Tensor | None, eps: float,
          gate_first: bool) -> torch.Tensor:
    h = x.double()
    g = None if gate is None else F.silu(gate.double())
    if gate_first and g is not None:
        h = h * g
    h = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    return h * g if (g is not None and not gate_first) else h


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("gate_first", [False, True])
@pytest.mark.parametrize("gated", [True, False])
def test_the_rows_compute_the_formula(dtype: torch.dtype, gate_first: bool,
                                      gated: bool) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 2, 4, 16, generator=g, dtype=torch.float64)
    w = torch.randn(4, 16, generator=g, dtype=torch.float64)
    gate = torch.randn(3, 2, 4, 16, generator=g, dtype=torch.float64) if gated else None
    want = _want(x, w, gate, 1e-6, gate_first)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 2e-2)
    args = (x.to(dtype), w.to(dtype), None if gate is None else gate.to(dtype), 1e-6,
            gate_first)
    rows = [reference_gated_rms_norm, torch_gated_rms_norm, ops.gated_rms_norm]
    if dtype != torch.float64:  # the models' order computes in float32 whatever x
        rows.append(transformers_gated_rms_norm)
    for row in rows:
        got = row(*args)
        assert got.dtype == dtype and got.shape == x.shape
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("args, error, match", [
    ((torch.randn(2, 1, 8), torch.randn(1, 4)), ValueError, r"weight.shape\[1\] must equal s"),
    ((torch.randn(2, 1, 8), torch.randn(1, 8), torch.randn(2, 1, 4)), ValueError, "gate"),
    ((torch.randn(2, 1, 8), torch.randn(1, 8, dtype=torch.float64)), ValueError,
     "weight must have x's dtype"),
    ((torch.randn(2, 1, 8), torch.randn(1, 8), None, -1.0), ValueError,
     "eps must be a float >= 0"),
    ((torch.randn(8), torch.randn(1, 8)), ValueError, r"x must be \[\.\.\., g, s\]"),
])
def test_a_malformed_call_is_refused(args: tuple[Any, ...], error: type[Exception],
                                     match: str) -> None:
    with pytest.raises(error, match=match):
        ops.gated_rms_norm(*args)


class NormThenGate(nn.Module):
    """Qwen3-Next's RMSNormGated: normalised in float32, weighted in x's dtype, gated."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.to(torch.float32))).to(dtype)


class GateThenNormRMSNormGated(nn.Module):
    """Mamba-2's: gated, then normalised in groups of group_size."""

    def __init__(self, size: int, group_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon, self.group_size = eps, group_size

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None
                ) -> torch.Tensor:
        dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        if gate is not None:
            h = h * F.silu(gate.to(torch.float32))
        *lead, last = h.shape
        grouped = h.view(*lead, last // self.group_size, self.group_size)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True)
                                        + self.variance_epsilon)
        return self.weight * grouped.view(*lead, last).to(dtype)


class SigmoidGatedRMSNorm(NormThenGate):
    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True)
                                        + self.variance_epsilon)
        return self.weight * h * torch.sigmoid(gate)


class Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.after = type("Qwen3NextRMSNormGated", (NormThenGate,), {})(16)
        self.before = GateThenNormRMSNormGated(32, 8)
        self.sigmoid = type("KimiRMSNormGated", (SigmoidGatedRMSNorm,), {})(16)
        with torch.no_grad():
            for p in self.parameters():
                p.normal_()

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        a = self.after(x[..., :16], z[..., :16])
        b = self.before(x, z)
        c = self.before(x)
        return torch.cat((a, self.sigmoid(a, z[..., 16:]), b, c), -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dispatch_model_routes_gated_rms_norms_by_what_they_compute(dtype: torch.dtype
                                                                    ) -> None:
    torch.manual_seed(0)
    plain = Mixer().to(dtype)
    model = copy.deepcopy(plain)
    report = dispatch_model(model)
    assert sorted(report.paths("gated_rms_norm")) == ["after", "before"]
    details = {r.path: r.detail for r in report.routed}
    assert details["after"] == "gate after the norm, eps from .variance_epsilon"
    assert details["before"] == ("gate before the norm, eps from .variance_epsilon, "
                                 "groups of 8")
    reasons = {(n.family, n.path): n.reason for n in report.not_routed}
    assert "matches neither gated RMS norm form" in reasons[("gated_rms_norm", "sigmoid")]
    x, z = torch.randn(2, 3, 32, dtype=dtype), torch.randn(2, 3, 32, dtype=dtype)
    with torch.no_grad():  # the transformers row rounds as the modules do
        assert torch.equal(model(x, z), plain(x, z))
    assert verify_model(model, x, z)["gated_rms_norm"] == 3  # before: with and without a gate
    assert restore_model(model) == 2
    assert torch.equal(model(x, z), plain(x, z))


def test_a_norm_that_needs_its_gate_called_without_one_fails_as_it_does_unrouted() -> None:
    plain = type("Qwen3NextRMSNormGated", (NormThenGate,), {})(16)
    norm = copy.deepcopy(plain)
    assert dispatch_model(nn.Sequential(norm)).paths("gated_rms_norm") == ["0"]
    x = torch.randn(2, 16)
    with pytest.raises(AttributeError):
        plain(x, None)  # type: ignore[arg-type]
    d.reset_stats()
    with pytest.raises(AttributeError):  # its own forward, as unrouted
        norm(x, None)  # type: ignore[arg-type]
    assert d.stats().served("gated_rms_norm", origin="model") == 1


def test_a_call_the_facade_cannot_take_runs_the_modules_own_forward(
        caplog: pytest.LogCaptureFixture) -> None:
    norm = GateThenNormRMSNormGated(16, 16)
    plain = copy.deepcopy(norm)
    dispatch_model(nn.Sequential(norm))
    x = torch.randn(2, 16, dtype=torch.bfloat16)  # a float32 weight beside bf16 input
    d.reset_stats()
    with caplog.at_level(logging.WARNING, logger="astrai"):
        got = norm(x, x)
    assert torch.equal(got, plain(x, x)) and got.dtype == torch.float32  # as the module
    assert d.stats().served("gated_rms_norm", origin="model") == 1
    assert any("runs its own forward" in r.getMessage() for r in caplog.records)
