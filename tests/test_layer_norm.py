"""The layer_norm family: its rows, its facade's validation, and the layer norms
``dispatch_model`` recognises by what they compute (nn.LayerNorm with and without its
parameters, OLMo's weightless float32 norm, Cohere's norm without a bias)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import astrai.dispatch as d
from astrai import ops
from astrai.backends.layer_norm import reference_layer_norm, torch_layer_norm
from astrai.integrations.transformers import dispatch_model, restore_model, verify_model

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {torch.float64: {"atol": 1e-12, "rtol": 1e-12},
            torch.float32: {"atol": 1e-5, "rtol": 1e-5}}.get(dtype, {"atol": 2e-2, "rtol": 2e-2})


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("params", ["both", "weight", "none"])
def test_the_rows_compute_torchs_layer_norm(dtype: torch.dtype, params: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 64, generator=g).to(dtype)
    w = torch.randn(64, generator=g).to(dtype) if params != "none" else None
    b = torch.randn(64, generator=g).to(dtype) if params == "both" else None
    want = F.layer_norm(x, (64,), w, b, 1e-5)
    for row in (reference_layer_norm, torch_layer_norm):
        got = row(x, w, b, 1e-5)
        assert got.dtype == dtype and got.shape == x.shape
        torch.testing.assert_close(got, want, **_tol(dtype))
    torch.testing.assert_close(ops.layer_norm(x, w, b, 1e-5), want, **_tol(dtype))
    torch.testing.assert_close(ops.layer_norm(x, w, b, 1e-5, backend="reference"), want,
                               **_tol(dtype))


def test_half_type_x_takes_float32_parameters() -> None:
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    w, b = torch.randn(32), torch.randn(32)
    out = ops.layer_norm(x, w, b)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, F.layer_norm(x, (32,), w, b, 1e-5))


@pytest.mark.parametrize("args, error, match", [
    ((torch.randn(2, 8), torch.randn(7), None, 1e-5), ValueError,
     r"layer_norm: weight.shape\[0\] must equal f = x.shape\[-1\] = 8, got 7"),
    ((torch.randn(2, 8), torch.randn(8, dtype=torch.bfloat16), None, 1e-5), ValueError,
     r"weight must have x's dtype \(torch.float32\), or float32 with a float16 or bfloat16 "
     r"x, got torch.bfloat16"),
    ((torch.randn(2, 8), None, torch.randn(2, 8), 1e-5), ValueError,
     r"layer_norm: bias must be \[f\] \(1 dimension\)"),
    ((torch.randn(2, 8), None, None, -1.0), ValueError,
     "layer_norm: eps must be a float >= 0, got -1.0"),
    ((torch.randn(2, 8), None, None, True), TypeError,
     "layer_norm: eps must be a float >= 0, got True"),
    ((torch.tensor(1.0), None, None, 1e-5), ValueError,
     r"layer_norm: x must be \[\.\.\., f\] \(at least 1 dimension\)"),
    ((torch.ones(2, 8, dtype=torch.int64), None, None, 1e-5), ValueError,
     "layer_norm: x must be floating point, got torch.int64"),
    (([1.0], None, None, 1e-5), TypeError, "x must be a torch.Tensor"),
    ((torch.randn(2, 8), "w", None, 1e-5), TypeError, "weight must be a torch.Tensor"),
])
def test_a_malformed_call_is_refused_before_any_row(args: tuple[Any, ...],
                                                     error: type[Exception],
                                                     match: str) -> None:
    with pytest.raises(error, match=match):
        ops.layer_norm(*args)


def test_the_table_gives_every_float_call_to_torch() -> None:
    for dtype in DTYPES:
        for tokens in (1, 4096):
            ctx = d.CallContext("layer_norm", dtype=dtype, ndim=2, tokens=tokens)
            assert d.resolve("layer_norm", ctx).name == "torch"
    ctx = ops.context("layer_norm", torch.randn(3, 2, 8), None, None, 1e-5)
    assert (ctx.tokens, ctx.ndim) == (6, 3)


# -- in a model --------------------------------------------------------------------


class OlmoLayerNorm(nn.Module):
    """OLMo's: no parameters, float32, an epsilon written into the forward."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.normalized_shape = (hidden,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.to(torch.float32), self.normalized_shape, None, None,
                            eps=1e-5).to(x.dtype)


class CohereLayerNorm(nn.Module):
    """Cohere's: a weight, no bias, the statistics and the weight in float32."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden))
        self.variance_epsilon = 1e-5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        mean = h.mean(-1, keepdim=True)
        var = (h - mean).pow(2).mean(-1, keepdim=True)
        h = (h - mean) * torch.rsqrt(var + self.variance_epsilon)
        return (self.weight.to(torch.float32) * h).to(x.dtype)


class LayerNorm1P(nn.LayerNorm):
    """Nemotron's: scales by 1 + weight (its weight starts at zero)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class ShiftedLayerNorm(nn.LayerNorm):
    """Named a layer norm, computes something else."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 1.0


class T5LayerNorm(nn.Module):
    """An RMS norm by what it is, a layer norm by its name: not the layer_norm family's."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.variance_epsilon)).to(x.dtype)


class Model(nn.Module):
    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.full = nn.LayerNorm(hidden)
        self.no_bias = nn.LayerNorm(hidden, bias=False)
        self.plain = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.olmo, self.cohere = OlmoLayerNorm(hidden), CohereLayerNorm(hidden)
        self.shifted, self.t5 = ShiftedLayerNorm(hidden), T5LayerNorm(hidden)
        self.one_p = LayerNorm1P(hidden)
        self.group = nn.GroupNorm(4, hidden)
        for m in (self.full, self.no_bias, self.one_p):
            with torch.no_grad():
                for p in m.parameters():
                    p.normal_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in (self.full, self.no_bias, self.plain, self.olmo, self.cohere, self.shifted,
                  self.t5, self.one_p):
            x = m(x)
        return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dispatch_model_routes_the_layer_norms_by_what_they_compute(dtype: torch.dtype
                                                                     ) -> None:
    torch.manual_seed(0)
    plain = Model().to(dtype)
    model = copy.deepcopy(plain)
    x = torch.randn(2, 3, 32, dtype=dtype)
    report = dispatch_model(model)
    assert sorted(report.paths("layer_norm")) == ["cohere", "full", "no_bias", "olmo",
                                                  "one_p", "plain"]
    assert report.paths("rms_norm") == ["t5"]
    details = {r.path: r.detail for r in report.routed}
    assert details["olmo"] == "no weight, eps 1e-05 (fixed)"
    assert details["plain"] == "no weight, eps from .eps"
    assert details["one_p"] == "1 + weight and bias, eps from .eps"
    reasons = {(n.family, n.path): n.reason for n in report.not_routed}
    assert "for no epsilon" in reasons[("layer_norm", "shifted")]
    assert "no astrai family claims" in reasons[("norm", "group")]
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x), atol=1e-5, rtol=1e-5)
    assert verify_model(model, x)["layer_norm"] == 6
    assert restore_model(model) == 7
    assert torch.equal(model(x), plain(x))


def test_a_layer_norm_over_more_than_the_last_dim_is_refused() -> None:
    model = nn.Sequential(nn.LayerNorm((4, 8)))
    report = dispatch_model(model)
    assert [n.reason for n in report.not_routed if n.family == "layer_norm"] == [
        "it normalises over (4, 8), more than the last dimension"]
