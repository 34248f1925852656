"""``rms_norm`` without a weight (Llama 4's QK norm, ``L2Norm``): every row normalises
without scaling, the facade refuses a form without a weight, the compiled path reads the
call, and ``dispatch_model`` recognises a weightless RMS norm by what it computes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import astrai.dispatch as d
from astrai import ops
from astrai.backends.inductor import inductor_available
from astrai.backends.rms_norm import inductor_rms_norm, reference_rms_norm, torch_rms_norm
from astrai.integrations.transformers import dispatch_model, restore_model, verify_model


def _want(x: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.double()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_every_row_normalises_without_scaling(dtype: torch.dtype) -> None:
    x = torch.randn(3, 5, 64, dtype=dtype)
    tol = {torch.float64: 1e-12, torch.float32: 1e-6}.get(dtype, 1e-2)
    rows = [reference_rms_norm, torch_rms_norm]
    if inductor_available() is True:
        rows.append(inductor_rms_norm)
    for row in rows:
        got = row(x, None, 1e-6)
        assert got.dtype == dtype
        torch.testing.assert_close(got, _want(x, 1e-6), atol=tol, rtol=tol)
    with torch.no_grad():
        for backend in [r.name for r in d.current().family("rms_norm").rows
                        if r.name in ("reference", "torch", "native", "inductor")
                        and d.current().availability(r)[0] is True]:
            got = ops.rms_norm(x, None, 1e-6, backend=backend)
            torch.testing.assert_close(got, _want(x, 1e-6), atol=tol, rtol=tol)


def test_a_form_needs_a_weight() -> None:
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="without a weight takes no weight_offset"):
        ops.rms_norm(x, None, 1e-6, weight_offset=1.0)
    with pytest.raises(ValueError, match="without a weight takes no cast_before_weight"):
        ops.rms_norm(x, None, 1e-6, cast_before_weight=True)
    with pytest.raises(ValueError, match="eps must be a number >= 0"):
        ops.rms_norm(x, None, -1.0)
    with pytest.raises(ValueError, match=r"expects x \[..., features\]"):
        ops.rms_norm(torch.tensor(1.0), None, 1e-6)


def test_the_native_row_hands_a_weightless_call_to_torch_and_says_so() -> None:
    """Its kernel scales by a weight: a weightless call it is chosen for runs on torch's
    operations, counted as handed."""
    native = next(r for r in d.current().family("rms_norm").rows if r.name == "native")
    if d.current().availability(native)[0] is not True:
        pytest.skip("the native extension is not loaded here")
    d.reset_stats()
    with torch.no_grad():
        x = torch.randn(1, 64)
        torch.testing.assert_close(ops.rms_norm(x, None, 1e-6, backend="native"),
                                   _want(x, 1e-6))
    assert d.stats().handed_off("rms_norm", "native") == 1


def test_the_compiled_path_reads_a_weightless_call(hot: object) -> None:
    from astrai.dispatch.facade import FACADES

    facade = FACADES["rms_norm"]
    x = torch.randn(2, 64)
    ops.rms_norm(x, None, 1e-6)
    decided = hot.lookup(facade.last, x, None, 1e-6, False, False)  # type: ignore[attr-defined]
    assert decided is not None
    assert decided.call is facade.plain(None, (x, None, 1e-6, {}))
    assert hot.lookup(facade.last, x, None, -1.0, False, False) is None  # type: ignore[attr-defined]


class Llama4TextL2Norm(nn.Module):
    def __init__(self, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x.float()).type_as(x)


class ScaledL2Norm(Llama4TextL2Norm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


class UnusedBufferRMSNorm(Llama4TextL2Norm):
    """Falcon-Mamba's: holds a buffer of ones its forward never reads."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.weight = nn.Buffer(torch.ones(hidden), persistent=False)


class BufferWeightRMSNorm(UnusedBufferRMSNorm):
    """Scales by its buffer: a weight astrai would not read."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.weight


def test_torchs_rms_norm_without_affine_of_its_own_size_is_served() -> None:
    plain = nn.Sequential(nn.RMSNorm(32, eps=1e-5, elementwise_affine=False))
    model = copy.deepcopy(plain)
    report = dispatch_model(model)
    assert report.paths("rms_norm") == ["0"] and not report.not_routed
    x = torch.randn(2, 3, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x), atol=1e-6, rtol=1e-6)
    assert verify_model(model, x)["rms_norm"] == 1


def test_a_buffer_the_norm_never_reads_leaves_it_weightless() -> None:
    plain = nn.Sequential(UnusedBufferRMSNorm(), BufferWeightRMSNorm())
    with torch.no_grad():
        plain[1].weight.normal_()
    model = copy.deepcopy(plain)
    report = dispatch_model(model)
    assert report.paths("rms_norm") == ["0"]
    assert [(n.family, n.path) for n in report.not_routed] == [("rms_norm", "1")]
    x = torch.randn(2, 3, 64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x), atol=1e-6, rtol=1e-6)
    assert verify_model(model, x)["rms_norm"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dispatch_model_routes_a_weightless_rms_norm(dtype: torch.dtype) -> None:
    plain = nn.Sequential(Llama4TextL2Norm(), ScaledL2Norm())
    model = copy.deepcopy(plain)
    report = dispatch_model(model)
    assert report.paths("rms_norm") == ["0"]
    assert [r.detail for r in report.routed] == ["no weight, eps from .eps"]
    assert [(n.family, n.path) for n in report.not_routed] == [("rms_norm", "1")]
    x = torch.randn(2, 3, 64, dtype=dtype)
    with torch.no_grad():
        assert torch.equal(model[0](x), plain[0](x)) or dtype != torch.float32
        torch.testing.assert_close(model(x), plain(x), atol=1e-2, rtol=1e-2)
    assert verify_model(model, x)["rms_norm"] == 1
    restore_model(model)
