"""Tests of the rms_norm rows (torch, reference) and linear rows (fp8, bf16, torch)."""

from __future__ import annotations

import functools
import importlib
from typing import Any

import pytest
import torch
import yaml

from astrai import ops
from astrai.backends import linear as linear_mod
from astrai.backends.linear import bf16_linear, fp8_available, fp8_linear, torch_linear
from astrai.backends.rms_norm import (
    reference_rms_norm,
    torch_rms_norm,
    torch_rms_norm_available,
)
from astrai.dispatch import Unavailable, shipped_tables_dir
from astrai.ops import context as ops_context

linear_context = functools.partial(ops_context, "linear")
rms_norm_context = functools.partial(ops_context, "rms_norm")

TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 2e-2, torch.float64: 1e-10}
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def table(family: str) -> dict[str, Any]:
    return yaml.safe_load((shipped_tables_dir() / f"{family}.yaml").read_text())  # type: ignore[no-any-return]


def load_impl(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def faithful(family: str) -> dict[str, Any]:
    """Faithful rows available here, name -> impl."""
    out = {}
    for row in table(family)["rows"]:
        probe = row.get("available")
        if row.get("faithful", True) and (probe is None or load_impl(probe)()):
            out[row["name"]] = load_impl(row["impl"])
    return out


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    torch.testing.assert_close(a.double(), b.double(), atol=tol, rtol=tol)


SHAPES = [(7,), (3, 16), (2, 5, 16), (2, 3, 4, 8)]


class TestRmsNorm:
    @pytest.mark.parametrize("shape", SHAPES, ids=str)
    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    def test_rows_agree_with_float64_formula(
        self, shape: tuple[int, ...], dtype: torch.dtype
    ) -> None:
        """Each row equals x / sqrt(mean(x^2) + eps) * w (float64) and the other rows."""
        g = torch.Generator().manual_seed(len(shape))
        x = (torch.randn(shape, generator=g) * 3).to(dtype)
        w = torch.rand(shape[-1], generator=g).to(dtype) + 0.5
        xd = x.double()
        want = xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + 1e-5) * w.double()
        rows = faithful("rms_norm")
        outs = [impl(x, w, 1e-5) for impl in rows.values()]
        assert {"torch", "reference"} <= rows.keys()
        for out in outs:
            assert out.shape == x.shape and out.dtype == dtype
            close(out, want, dtype)
        for other in outs[1:]:
            close(outs[0], other, dtype)

    def test_weight_of_another_dtype(self) -> None:
        """A float32 weight with a bfloat16 x gives a bfloat16 result from both rows."""
        x, w = torch.randn(3, 8, dtype=torch.bfloat16), torch.rand(8)
        a, b = torch_rms_norm(x, w), reference_rms_norm(x, w)
        assert a.dtype == b.dtype == torch.bfloat16
        close(a, b, torch.bfloat16)

    @pytest.mark.parametrize("row", ["torch", "reference"])
    def test_error_weight_shape(self, row: str) -> None:
        """A weight that does not match x's last dimension is a ValueError before any row runs."""
        with pytest.raises(ValueError, match=r"got x \(2, 8\), weight \(4,\)"):
            ops.rms_norm(torch.randn(2, 8), torch.ones(4), backend=row)

    def test_probe_of_torch_row(self) -> None:
        """F.rms_norm exists in this torch, so the torch row is available."""
        assert torch_rms_norm_available() is True


class TestLinear:
    @pytest.mark.parametrize("shape", [(16,), (3, 16), (2, 5, 16)], ids=str)
    @pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    def test_faithful_rows_match_float64(
        self, shape: tuple[int, ...], bias: bool, dtype: torch.dtype
    ) -> None:
        """The faithful rows equal x @ W.T + b computed in float64."""
        g = torch.Generator().manual_seed(3)
        x = torch.randn(shape, generator=g).to(dtype)
        w = (torch.randn(12, 16, generator=g) / 4).to(dtype)
        b = torch.randn(12, generator=g).to(dtype) if bias else None
        want = x.double() @ w.double().T + (0 if b is None else b.double())
        # every faithful row, available here or not (one whose CPU or extension is missing
        # computes the call with F.linear)
        rows = {r["name"]: load_impl(r["impl"]) for r in table("linear")["rows"]
                if r.get("faithful", True)}
        assert list(rows) == ["native", "onednn", "transposed", "transposed_one", "torch"]
        for impl in rows.values():
            with torch.no_grad():  # the copy rows: their product (with autograd, F.linear)
                out = impl(x, w, b)
            assert out.shape == (*shape[:-1], 12) and out.dtype == dtype
            # Half-precision accumulations round; scale the tolerance by sqrt(in_features).
            tol = TOL[dtype] * 4
            torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
    def test_bf16_row_computes_in_bfloat16(self, dtype: torch.dtype) -> None:
        """bf16 equals the bfloat16 product cast back: close to exact, but not exact."""
        g = torch.Generator().manual_seed(4)
        x, w, b = torch.randn(4, 32, generator=g), torch.randn(8, 32, generator=g), torch.randn(8)
        x, w, b = x.to(dtype), w.to(dtype), b.to(dtype)
        out = bf16_linear(x, w, b)
        assert out.dtype == dtype
        exact = torch_linear(x, w, b)
        assert not torch.equal(out, exact)
        torch.testing.assert_close(out, exact, atol=0.25, rtol=2e-2)
        bf = torch.nn.functional.linear(x.bfloat16(), w.bfloat16(), b.bfloat16()).to(dtype)
        torch.testing.assert_close(out, bf, atol=0, rtol=0)

    @pytest.mark.parametrize("row", ["torch", "bf16"])
    def test_error_shapes(self, row: str) -> None:
        """Mismatched in_features or bias shape is a ValueError naming both shapes, before any
        row runs."""
        with pytest.raises(ValueError, match=r"got x \(2, 5\), weight \(3, 4\)"):
            ops.linear(torch.randn(2, 5), torch.randn(3, 4), backend=row)
        with pytest.raises(ValueError, match=r"bias must have shape \(3,\)"):
            ops.linear(torch.randn(2, 4), torch.randn(3, 4), torch.randn(4), backend=row)

    def test_non_faithful_rows_are_marked(self) -> None:
        """fp8 and bf16 are faithful: false; the others are faithful, torch the
        fallback."""
        data = table("linear")
        flags = {r["name"]: r.get("faithful", True) for r in data["rows"]}
        assert flags == {"fp8": False, "bf16": False, "native": True, "onednn": True,
                         "transposed": True, "transposed_one": True, "torch": True}
        assert data["fallback"] == "torch"


class TestFp8:
    def test_quantize_round_trip_within_e4m3_precision(self) -> None:
        """Per-tensor scaling maps the tensor's max to 448 and loses at most ~6% per element."""
        t = torch.randn(16, 32) * 5
        q, scale = linear_mod._quantize(t)
        assert q.dtype == torch.float8_e4m3fn
        assert float(q.float().abs().max()) == 448.0
        torch.testing.assert_close(q.float() * scale, t, atol=float(scale) * 2, rtol=0.07)

    def test_padding_keeps_the_product(self) -> None:
        """Zero padding to multiples of 16 leaves the top-left product unchanged."""
        x, w = torch.randn(3, 20), torch.randn(5, 20)
        xp, wp = linear_mod._pad_to(x, 16, 32), linear_mod._pad_to(w, 16, 32)
        assert xp.shape == (16, 32) and wp.shape == (16, 32)
        torch.testing.assert_close((xp @ wp.T)[:3, :5], x @ w.T)

    @pytest.mark.skipif(bool(fp8_available()), reason="fp8 matmul is usable here")
    def test_probe_says_why_unavailable(self) -> None:
        """Without a compute-capability-8.9 GPU the probe is an Unavailable with the reason."""
        result = fp8_available()
        assert isinstance(result, Unavailable) and not result
        assert "CUDA" in result.reason or "compute capability" in result.reason

    @pytest.mark.skipif(bool(fp8_available()), reason="fp8 matmul is usable here")
    def test_error_direct_call_raises_runtime_error(self) -> None:
        """Calling the unavailable fp8 row raises RuntimeError instead of computing."""
        with pytest.raises(RuntimeError, match="fp8 linear row cannot run"):
            fp8_linear(torch.randn(2, 16), torch.randn(4, 16))

    @pytest.mark.gpu
    @pytest.mark.skipif(not fp8_available(), reason="needs a GPU with compute capability >= 8.9")
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
    def test_fp8_close_to_torch_on_gpu(self, dtype: torch.dtype) -> None:
        """On an fp8 GPU the result is within e4m3 error of F.linear, for ragged shapes."""
        x = torch.randn(2, 5, 40, device="cuda", dtype=dtype)
        w = torch.randn(24, 40, device="cuda", dtype=dtype) / 6
        b = torch.randn(24, device="cuda", dtype=dtype)
        out, want = fp8_linear(x, w, b), torch_linear(x, w, b)
        assert out.shape == want.shape and out.dtype == dtype
        rel = (out.float() - want.float()).norm() / want.float().norm()
        assert float(rel) < 0.08
