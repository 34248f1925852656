"""The depthwise_conv1d family: its rows, its facade's checks, and the one-group-per-channel
``nn.Conv1d`` modules ``dispatch_model`` recognises by what they compute."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import astrai.dispatch as d
from astrai import ops
from astrai.backends.depthwise_conv1d import (
    reference_depthwise_conv1d,
    torch_depthwise_conv1d,
)
from astrai.families.depthwise_conv1d import depthwise_conv1d
from astrai.integrations.transformers import dispatch_model, restore_model, verify_model


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("padding", [0, 1, 3])
@pytest.mark.parametrize("bias", [True, False])
def test_the_rows_compute_the_convolution(dtype: torch.dtype, padding: int, bias: bool
                                          ) -> None:
    g = torch.Generator().manual_seed(padding)
    x = torch.randn(2, 6, 9, generator=g, dtype=torch.float64)
    w = torch.randn(6, 1, 4, generator=g, dtype=torch.float64)
    b = torch.randn(6, generator=g, dtype=torch.float64) if bias else None
    want = F.conv1d(x, w, b, padding=padding, groups=6)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 5e-2)
    cast = [t if t is None else t.to(dtype) for t in (x, w, b)]
    for row in (reference_depthwise_conv1d, torch_depthwise_conv1d, depthwise_conv1d):
        got = row(cast[0], cast[1], cast[2], padding)
        assert got.dtype == dtype and got.shape == (2, 6, 9 + 2 * padding - 3)
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_the_facade_takes_the_family_signature_and_counts_the_call() -> None:
    d.reset_stats()
    out = ops.depthwise_conv1d(torch.randn(1, 4, 5), torch.randn(4, 1, 2), padding=1)
    assert out.shape == (1, 4, 6)
    assert d.stats().served("depthwise_conv1d") == 1


@pytest.mark.parametrize("args, error, match", [
    ((torch.randn(1, 4, 5), torch.randn(4, 2, 3)), ValueError, r"weight.shape\[1\] must be 1"),
    ((torch.randn(1, 4, 5), torch.randn(3, 1, 3)), ValueError,
     r"weight.shape\[0\] must equal c = x.shape\[1\] = 4"),
    ((torch.randn(4, 5), torch.randn(4, 1, 3)), ValueError, r"x must be \[b, c, t\]"),
    ((torch.randn(1, 4, 5), torch.randn(4, 1, 3), torch.randn(5)), ValueError,
     r"bias.shape\[0\] must equal c"),
    ((torch.randn(1, 4, 5), torch.randn(4, 1, 3), None, -1), ValueError,
     r"padding must be an int >= 0, got -1"),
    ((torch.randn(1, 4, 5), torch.randn(4, 1, 3, dtype=torch.float64)), ValueError,
     r"weight must have x's dtype"),
    ((torch.ones(1, 4, 5, dtype=torch.int64), torch.ones(4, 1, 3, dtype=torch.int64)),
     ValueError, r"x must be floating point"),
])
def test_a_malformed_call_is_refused(args: tuple[Any, ...], error: type[Exception],
                                     match: str) -> None:
    with pytest.raises(error, match=match):
        depthwise_conv1d(*args)


class Mixer(nn.Module):
    """A Mamba-style causal convolution (padding taps - 1, the first steps kept), beside
    convolutions the family does not serve."""

    def __init__(self, channels: int = 8, taps: int = 4) -> None:
        super().__init__()
        self.conv1d = nn.Conv1d(channels, channels, taps, groups=channels, padding=taps - 1)
        self.no_bias = nn.Conv1d(channels, channels, 3, groups=channels, padding=1, bias=False)
        self.strided = nn.Conv1d(channels, channels, 3, groups=channels, stride=2)
        self.mixing = nn.Conv1d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps = x.shape[-1]
        h = self.conv1d(x)[..., :steps]
        h = self.mixing(self.no_bias(h))
        return torch.cat((h, self.strided(h)), -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dispatch_model_routes_depthwise_convolutions(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    plain = Mixer().to(dtype)
    model = copy.deepcopy(plain)
    report = dispatch_model(model)
    assert sorted(report.paths("depthwise_conv1d")) == ["conv1d", "no_bias"]
    details = {r.path: r.detail for r in report.routed}
    assert details["conv1d"] == "4 taps, padding 3"
    reasons = {(n.family, n.path): n.reason for n in report.not_routed}
    assert "stride 2" in reasons[("depthwise_conv1d", "strided")]
    assert "a convolution" in reasons[("convolution", "mixing")]
    x = torch.randn(2, 8, 7, dtype=dtype)
    with torch.no_grad():
        assert torch.equal(model(x), plain(x))  # the torch row is the module's own op
    assert verify_model(model, x)["depthwise_conv1d"] == 2
    assert restore_model(model) == 2
    assert torch.equal(model(x), plain(x))


def test_a_conv_computing_something_else_is_refused() -> None:
    class Doubled(nn.Conv1d):
        def forward(self, input: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(input)

    report = dispatch_model(nn.Sequential(Doubled(4, 4, 3, groups=4)))
    (refused,) = [n for n in report.not_routed if n.family == "depthwise_conv1d"]
    assert "computes something else" in refused.reason
