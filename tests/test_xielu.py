"""The xielu family: its rows, its facade's checks, and the xIELU activations
``dispatch_model`` recognises by what they compute (Apertus')."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from astrai import ops
from astrai.backends.inductor import inductor_available
from astrai.backends.xielu import inductor_xielu, reference_xielu, torch_xielu
from astrai.integrations.transformers import dispatch_model, restore_model, verify_model


def _want(x: torch.Tensor, alpha_p: float, alpha_n: float, beta: float, eps: float
          ) -> torch.Tensor:
    h = x.double()
    a_p = math.log1p(math.exp(alpha_p))
    a_n = beta + math.log1p(math.exp(alpha_n))
    return torch.where(h > 0, a_p * h * h + beta * h,
                       (torch.expm1(h.clamp(max=eps)) - h) * a_n + beta * h)


def _coefficients(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([0.4], dtype=dtype), torch.tensor([-0.7], dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_the_rows_compute_the_formula(dtype: torch.dtype) -> None:
    x = torch.linspace(-12, 6, 301, dtype=torch.float64).reshape(7, 43).to(dtype)
    a_p, a_n = _coefficients(dtype)
    want = _want(x, float(a_p), float(a_n), 0.5, -1e-6)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 3e-2)
    for row in (torch_xielu, reference_xielu, ops.xielu):
        got = row(x, a_p, a_n, 0.5, -1e-6)
        assert got.dtype == dtype and got.shape == x.shape
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    # far below 0 the negative branch is linear: (-1 - x) * a_n + beta * x
    a_n_wide = 0.5 + math.log1p(math.exp(float(a_n)))
    far = float(reference_xielu(torch.tensor([-1e4], dtype=dtype), a_p, a_n, 0.5, -1e-6))
    assert far == pytest.approx((1e4 - 1) * a_n_wide - 0.5e4, rel=1e-2)


def test_its_dtype_is_the_promotion_of_x_with_the_coefficients() -> None:
    """float32 coefficients on bfloat16 x give float32, as the module computes."""
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    a_p, a_n = _coefficients(torch.float32)
    for row in (torch_xielu, reference_xielu, ops.xielu):
        assert row(x, a_p, a_n, 0.5, -1e-6).dtype == torch.float32


@pytest.mark.parametrize("args, error, match", [
    ((torch.randn(2, 4), torch.randn(2), torch.randn(1)), ValueError, "alpha_p"),
    ((torch.randn(2, 4), torch.randn(1), torch.randn(1), 0.5, 1e-3), ValueError, "eps"),
    ((torch.arange(4), torch.randn(1), torch.randn(1)), ValueError, "floating"),
])
def test_a_malformed_call_is_refused(args: tuple[object, ...], error: type[Exception],
                                     match: str) -> None:
    with pytest.raises(error, match=match):
        ops.xielu(*args)


@pytest.mark.skipif(inductor_available() is not True, reason="inductor cannot build here")
def test_the_inductor_row_computes_the_formula() -> None:
    x = torch.randn(64, 256)
    a_p, a_n = _coefficients(torch.float32)
    torch.testing.assert_close(inductor_xielu(x, a_p, a_n, 0.5, -1e-6),
                               torch_xielu(x, a_p, a_n, 0.5, -1e-6), atol=1e-5, rtol=1e-5)
    assert ops.xielu(x, a_p, a_n, backend="inductor").shape == x.shape


class Trainable(nn.Module):
    """xIELU as a model might write it: coefficients as parameters, beta and eps held."""

    def __init__(self, beta: float = 0.5, eps: float = -1e-6) -> None:
        super().__init__()
        self.alpha_p = nn.Parameter(torch.tensor([0.3]))
        self.alpha_n = nn.Parameter(torch.tensor([-0.2]))
        self.beta, self.eps = beta, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a_p = F.softplus(self.alpha_p)
        a_n = self.beta + F.softplus(self.alpha_n)
        return torch.where(x > 0, a_p * x * x + self.beta * x,
                           (torch.expm1(torch.clamp(x, max=self.eps)) - x) * a_n + self.beta * x)


class Shifted(Trainable):
    """The same coefficients, another function (its positive branch shifted)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + (x > 0) * 0.25


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dispatch_model_routes_xielu_activations(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(16, 32), Trainable(beta=0.25, eps=-1e-5),
                          nn.Linear(32, 16)).to(dtype)
    model = copy.deepcopy(plain)
    report = dispatch_model(model, ["xielu"])
    assert report.paths("xielu") == ["1"]
    assert [r.detail for r in report.routed] == ["beta 0.25, eps -1e-05"]
    x = torch.randn(5, 16, dtype=dtype)
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x), atol=1e-5, rtol=1e-5)
    # its coefficients train through the row
    model(x).sum().backward()
    assert model[1].alpha_p.grad is not None and model[1].alpha_n.grad is not None
    assert verify_model(model, x)["xielu"] == 1
    assert restore_model(model) == 1


def test_a_module_of_those_coefficients_computing_otherwise_is_refused() -> None:
    report = dispatch_model(nn.Sequential(Shifted()), ["xielu"])
    (left,) = [n for n in report.not_routed if n.family == "xielu"]
    assert "computes something else than xIELU" in left.reason


def test_transformers_xielu_is_routed() -> None:
    activations = pytest.importorskip("transformers.activations")
    if not hasattr(activations, "XIELUActivation"):
        pytest.skip("this transformers has no XIELUActivation")
    plain = nn.Sequential(activations.XIELUActivation(dtype=torch.float32))
    model = copy.deepcopy(plain)
    report = dispatch_model(model, ["xielu"])
    assert report.paths("xielu") == ["0"]
    x = torch.randn(4, 64) * 4
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x), atol=1e-6, rtol=1e-6)
