"""The ``native`` rows (``astrai.backends.native``): RMS norm and the half-layout rotary in
one pass of C++, from astrai's native extension.

The extension is built once per session (about 15 s; conftest's ``built``) with the
machine's C++ compiler; without one the tests that need it skip, saying so. What holds
without it - the rows are unavailable with the reason, the chain passes them by, a direct
call still computes the right result - is tested in a process where the extension is off.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch

import astrai.dispatch as dispatch
from astrai import ops
from astrai.backends import native as rows
from astrai.backends.rms_norm import reference_rms_norm
from astrai.backends.rotary import reference_rotary_half
from astrai.dispatch import Unavailable
from tests.conftest import python_child
from tests.test_model_forms import qk_call

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
FORMS = [dict(), dict(weight_offset=1.0), dict(cast_before_weight=True),
         dict(weight_offset=1.0, cast_before_weight=True),
         dict(weight_offset=0.1, cast_before_weight=True)]  # an offset W cannot hold exactly


def _rms_call(shape: tuple[int, ...], dtype: torch.dtype, weight_dtype: torch.dtype,
              seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 3
    if x.numel():
        x.view(-1, shape[-1])[0] *= 1e-3  # a row whose mean square is near eps
    w = torch.randn(shape[-1], generator=g, dtype=torch.float64)
    return x.to(dtype), w.to(weight_dtype)


def _equal_pairs(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)


class TestRmsNormKernel:
    @pytest.mark.parametrize(("dtype", "weight_dtype"), list(itertools.product(DTYPES, DTYPES)),
                             ids=str)
    @pytest.mark.parametrize("form", FORMS, ids=str)
    def test_equals_the_reference(self, kernels: ModuleType, dtype: torch.dtype,
                                  weight_dtype: torch.dtype, form: dict[str, Any]) -> None:
        """Every form and mix of dtypes: the reference's dtype and shape, its values up to
        the order of the sum of squares (which a low-precision result rarely shows)."""
        for shape in [(1, 1, 512), (3, 7, 40), (5,), (4, 13)]:
            x, w = _rms_call(shape, dtype, weight_dtype)
            want = reference_rms_norm(x, w, 1e-5, **form)
            got = kernels.rms_norm_kernel(x, w, 1e-5, form.get("weight_offset", 0.0),
                                          form.get("cast_before_weight", False))
            assert got.dtype == want.dtype and got.shape == want.shape
            if dtype in (torch.float32, torch.float64):  # x's dtype is the computation's
                tol = 1e-6 if dtype == torch.float32 else 1e-13
                torch.testing.assert_close(got, want, atol=tol, rtol=tol)
            else:  # one step of the dtypes rounded to, on a rounding boundary
                step = max(torch.finfo(dtype).eps, torch.finfo(want.dtype).eps) * 2
                gap = (got.double() - want.double()).abs()
                assert (gap <= step * want.double().abs().clamp(min=1)).all()
                assert (got != want).double().mean() < 0.02

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("form", FORMS[:3], ids=str)
    def test_views_that_overlap_broadcast_or_are_empty(self, kernels: ModuleType,
                                                       dtype: torch.dtype,
                                                       form: dict[str, Any]) -> None:
        """x and the weight as views whose elements overlap (unfold, as_strided), repeat
        (expand: zero strides) or are none: the reference's values, and the same on every
        call."""
        g = torch.Generator().manual_seed(3)
        base = torch.randn(96, generator=g).to(dtype)
        xs = [torch.randn(3, 20, generator=g).to(dtype).unfold(1, 8, 2),  # [3, 7, 8]
              base.as_strided((2, 5, 8), (1, 1, 1)),
              base.as_strided((4, 8), (0, 1)),
              base[:8].expand(3, 2, 8),
              base[:1].expand(5, 8),
              torch.zeros(0, 8, dtype=dtype), torch.zeros(2, 0, 8, dtype=dtype)]
        weights = [base[10:18], base[:1].expand(8), base.as_strided((8,), (0,)) + 0.5,
                   torch.randn(16, generator=g).to(dtype)[::2]]
        offset, cast = form.get("weight_offset", 0.0), form.get("cast_before_weight", False)
        for x, w in itertools.product(xs, weights):
            want = reference_rms_norm(x, w, 1e-5, **form)
            got = kernels.rms_norm_kernel(x, w, 1e-5, offset, cast)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got, kernels.rms_norm_kernel(x, w, 1e-5, offset, cast))
            tol = {torch.float64: 1e-13, torch.float32: 1e-6}.get(dtype, 2e-2)
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("form", [FORMS[0], FORMS[2]], ids=str)
    def test_threads_give_the_same_bits(self, kernels: ModuleType, dtype: torch.dtype,
                                        form: dict[str, Any]) -> None:
        """Rows split among threads: each row is computed whole by one thread, so any
        number of threads gives the single-threaded result bit for bit."""
        x, w = _rms_call((2, 150, 1000), dtype, torch.bfloat16)
        offset, cast = form.get("weight_offset", 0.0), form.get("cast_before_weight", False)
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = kernels.rms_norm_kernel(x, w, 1e-6, offset, cast)
            for n in (2, 3):
                torch.set_num_threads(n)
                assert torch.equal(kernels.rms_norm_kernel(x, w, 1e-6, offset, cast), one)
        finally:
            torch.set_num_threads(threads)

    def test_any_layout_of_x(self, kernels: ModuleType) -> None:
        x = torch.randn(4, 40, 6).transpose(1, 2)  # not contiguous
        w = torch.randn(40)
        torch.testing.assert_close(rows.native_rms_norm(x, w, 1e-6, cast_before_weight=True),
                                   reference_rms_norm(x, w, 1e-6, cast_before_weight=True),
                                   atol=1e-6, rtol=1e-6)

    def test_a_wide_row_sums_as_accurately_as_torch(self, kernels: ModuleType) -> None:
        x, w = _rms_call((1, 1 << 18), torch.float32, torch.float32)
        exact = reference_rms_norm(x.double(), w.double(), 1e-6)
        for got in (rows.native_rms_norm(x, w, 1e-6), reference_rms_norm(x, w, 1e-6)):
            assert ((got.double() - exact).abs() / exact.abs().clamp(min=1e-3)).max() < 5e-7

    def test_empty_and_zero_rows(self, kernels: ModuleType) -> None:
        assert rows.native_rms_norm(torch.zeros(0, 8), torch.ones(8)).shape == (0, 8)
        out = rows.native_rms_norm(torch.zeros(2, 8), torch.ones(8), 1e-6)
        assert torch.equal(out, torch.zeros(2, 8))

    def test_calls_the_kernel_does_not_serve_are_torchs(self, kernels: ModuleType) -> None:
        """Tensors that need gradients: the kernel declines and the row computes with
        torch's operations, so gradients flow and equal the reference's."""
        x, w = _rms_call((3, 16), torch.float32, torch.float32)
        assert kernels.rms_norm_kernel(x.requires_grad_(True), w, 1e-6, 0.0, True) is None
        xs, ws = x.detach().clone().requires_grad_(True), w.clone().requires_grad_(True)
        rows.native_rms_norm(x, w, 1e-6, cast_before_weight=True).square().sum().backward()
        reference_rms_norm(xs, ws, 1e-6, cast_before_weight=True).square().sum().backward()
        assert x.grad is not None and xs.grad is not None
        torch.testing.assert_close(x.grad, xs.grad, atol=1e-5, rtol=1e-5)
        with torch.no_grad():  # no autograd in force: the kernel serves it
            assert kernels.rms_norm_kernel(x, w, 1e-6, 0.0, True) is not None
        ints = torch.ones(2, 8, dtype=torch.int32)
        assert kernels.rms_norm_kernel(ints, torch.ones(8), 1e-6, 0.0, False) is None

    @pytest.mark.parametrize(("args", "error", "match"), [
        ((torch.randn(2, 8), torch.randn(4), 1e-6, 0.0, False), ValueError, r"\[x.shape\[-1\]\]"),
        ((torch.randn(2, 8), torch.randn(2, 8), 1e-6, 0.0, False), ValueError, "weight"),
        (("x", torch.randn(8), 1e-6, 0.0, False), TypeError, "x must be a tensor"),
        ((torch.randn(8), torch.randn(8), "eps", 0.0, False), TypeError, "real number"),
        ((torch.randn(8), torch.randn(8)), TypeError, "rms_norm_kernel"),
    ])
    def test_error_malformed_call(self, kernels: ModuleType, args: tuple[Any, ...],
                                  error: type[Exception], match: str) -> None:
        with pytest.raises(error, match=match):
            kernels.rms_norm_kernel(*args)


class TestRotaryHalfKernel:
    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("shape", [dict(), dict(cos_batch=1), dict(batch=1, seq=1),
                                       dict(heads=8, kv_heads=8, seq=40, dim=64)], ids=str)
    def test_equals_the_reference_bit_for_bit(self, kernels: ModuleType, dtype: torch.dtype,
                                              shape: dict[str, Any]) -> None:
        q, k, cos, sin = qk_call(dtype, **shape)
        _equal_pairs(rows.native_rotary_half(q, k, cos, sin, 1),
                     reference_rotary_half(q, k, cos, sin, 1))

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    def test_views_that_overlap_or_broadcast(self, kernels: ModuleType,
                                             dtype: torch.dtype) -> None:
        """q and k whose last dimension has stride 1 but whose elements overlap (unfold,
        as_strided) or repeat (expand) - views for which empty_like gives a layout other
        than x's: the reference's bits, the same on every call, through the kernel and
        through the facade's chain."""
        g = torch.Generator().manual_seed(5)
        base = torch.randn(64, generator=g).to(dtype)
        q = torch.randn(1, 2, 12, generator=g).to(dtype).unfold(2, 8, 1)  # [1, 2, 5, 8]
        cos = torch.randn(1, 5, 8, generator=g).to(dtype)
        sin = torch.randn(1, 5, 8, generator=g).to(dtype)
        ks = [base.as_strided((1, 2, 5, 8), (1, 1, 1, 1)),
              base.as_strided((1, 3, 5, 8), (0, 0, 1, 1)),
              base[:40].view(1, 1, 5, 8).expand(1, 4, 5, 8),
              base[:8].expand(1, 2, 5, 8),
              base.as_strided((1, 5, 2, 8), (0, 1, 1, 1)).transpose(1, 2)]
        for k in ks:
            want = reference_rotary_half(q, k, cos, sin, 1)
            got = kernels.rotary_half_kernel(q, k, cos, sin, 1)
            _equal_pairs(got, want)
            _equal_pairs(kernels.rotary_half_kernel(q, k, cos, sin, 1), got)
            _equal_pairs(rows.native_rotary_half(k, q, cos, sin, 1),
                         reference_rotary_half(k, q, cos, sin, 1))
        if dtype in (torch.float32, torch.float64):  # the table's region of the row
            with torch.no_grad():
                dispatch.reset_stats()
                _equal_pairs(ops.apply_rotary_half(q, ks[0], cos, sin),
                             reference_rotary_half(q, ks[0], cos, sin, 1))
                assert dispatch.stats().by_row()["rotary"] == {"native": {"chain": 1}}

    def test_the_reported_overlapping_call(self, kernels: ModuleType) -> None:
        torch.manual_seed(0)
        q = torch.randn(1, 2, 12).unfold(2, 8, 1)
        k = torch.randn(64).as_strided((1, 2, 5, 8), (1, 1, 1, 1))
        cos, sin = torch.randn(1, 5, 8), torch.randn(1, 5, 8)
        with torch.no_grad():
            dispatch.reset_stats()
            _equal_pairs(ops.apply_rotary_half(q, k, cos, sin),
                         reference_rotary_half(q, k, cos, sin, 1))
            assert dispatch.stats().by_row()["rotary"] == {"native": {"chain": 1}}

    def test_empty_calls(self, kernels: ModuleType) -> None:
        for seq, heads in ((0, 4), (3, 0)):
            q, k = torch.randn(2, heads, seq, 8), torch.randn(2, 2, seq, 8)
            cos, sin = torch.randn(2, seq, 8), torch.randn(2, seq, 8)
            _equal_pairs(kernels.rotary_half_kernel(q, k, cos, sin, 1),
                         reference_rotary_half(q, k, cos, sin, 1))

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    def test_threads_give_the_same_bits(self, kernels: ModuleType, dtype: torch.dtype) -> None:
        q, k, cos, sin = qk_call(dtype, batch=2, heads=8, kv_heads=2, seq=300, dim=64)
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = kernels.rotary_half_kernel(q, k, cos, sin, 1)
            for n in (2, 3):
                torch.set_num_threads(n)
                _equal_pairs(kernels.rotary_half_kernel(q, k, cos, sin, 1), one)
            _equal_pairs(one, reference_rotary_half(q, k, cos, sin, 1))
        finally:
            torch.set_num_threads(threads)

    def test_heads_at_another_dim_and_three_dims(self, kernels: ModuleType) -> None:
        q, k, cos, sin = qk_call(torch.bfloat16)
        qt, kt = q.transpose(1, 2), k.transpose(1, 2)  # [b, s, h, d]: unsqueeze_dim 2
        _equal_pairs(rows.native_rotary_half(qt, kt, cos, sin, 2),
                     reference_rotary_half(qt, kt, cos, sin, 2))
        _equal_pairs(rows.native_rotary_half(q[0], k[0], cos[0], sin[0], 0),
                     reference_rotary_half(q[0], k[0], cos[0], sin[0], 0))

    def test_strided_head_dim(self, kernels: ModuleType) -> None:
        """A last dimension read with a stride is copied first; the values are the same."""
        q, k, cos, sin = qk_call(torch.float32, dim=32)
        q, k = q[..., ::2], k[..., ::2]
        cos, sin = cos[..., ::2].contiguous(), sin[..., ::2].contiguous()
        _equal_pairs(rows.native_rotary_half(q, k, cos, sin, 1),
                     reference_rotary_half(q, k, cos, sin, 1))

    def test_cos_and_sin_of_any_layout(self, kernels: ModuleType) -> None:
        """cos and sin read through strides of their own (a slice of a wider table, a
        transposed view) give the same bits."""
        q, k, cos, sin = qk_call(torch.float32, dim=16)
        wide_cos, wide_sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
        cos_view, sin_view = wide_cos[..., 16:], wide_sin.transpose(0, 1).contiguous()
        sin_view = sin_view.transpose(0, 1)[..., :16]
        assert cos_view.stride(-1) == 1 and not cos_view.is_contiguous()
        assert sin_view.stride() != cos_view.stride()
        _equal_pairs(rows.native_rotary_half(q, k, cos_view, sin_view, 1),
                     reference_rotary_half(q, k, cos, sin, 1))
        by_column = cos.transpose(1, 2).contiguous().transpose(1, 2)  # last stride not 1
        assert by_column.stride(-1) != 1
        _equal_pairs(rows.native_rotary_half(q, k, by_column, sin, 1),
                     reference_rotary_half(q, k, cos, sin, 1))

    def test_calls_the_kernel_does_not_serve_are_torchs(self, kernels: ModuleType) -> None:
        """Mixed dtypes (cos in float32 with bfloat16 q) and tensors that need gradients are
        computed with torch's operations: transformers' promotion, and gradients."""
        q, k, cos, sin = qk_call(torch.bfloat16)
        assert kernels.rotary_half_kernel(q, k, cos.float(), sin.float(), 1) is None
        _equal_pairs(rows.native_rotary_half(q, k, cos.float(), sin.float(), 1),
                     reference_rotary_half(q, k, cos.float(), sin.float(), 1))
        q, k, cos, sin = qk_call(torch.float32)
        q.requires_grad_(True)
        assert kernels.rotary_half_kernel(q, k, cos, sin, 1) is None
        qo, _ = rows.native_rotary_half(q, k, cos, sin, 1)
        qo.sum().backward()
        assert q.grad is not None

    @pytest.mark.parametrize(("change", "error", "match"), [
        (lambda q, k, c, s: (q, k, c[..., :8], s[..., :8], 1), ValueError, "d even"),
        (lambda q, k, c, s: (q, k, c, s, 7), ValueError, "d even"),
        (lambda q, k, c, s: (q, k, c, s, 3), ValueError, "unsqueeze_dim"),
        (lambda q, k, c, s: (q, k, c, s, -1), ValueError, "unsqueeze_dim"),
        (lambda q, k, c, s: (q, k[:, :, :1], c, s, 1), ValueError, "size"),
        (lambda q, k, c, s: (q, k, c, s[:, :1], 1), ValueError, "d even"),
        (lambda q, k, c, s: (q, None, c, s, 1), TypeError, "k must be a tensor"),
        (lambda q, k, c, s: (q, k, c, s), TypeError, "rotary_half_kernel"),
    ])
    def test_error_malformed_call(self, kernels: ModuleType, change: Callable[..., Any],
                                  error: type[Exception], match: str) -> None:
        q, k, cos, sin = qk_call(torch.float32)
        with pytest.raises(error, match=match):
            kernels.rotary_half_kernel(*change(q, k, cos, sin))


class TestWhatOnlyTorchSees:
    """Tensors and states in which torch's own operations must run - a trace, a mode, a
    transform, a tangent, a subclass: the kernels decline them, so the rows compute what
    the reference computes, seen by whoever watches torch's operations."""

    def test_an_export_records_the_operations(self, kernels: ModuleType) -> None:
        """``torch.export`` (non-strict: the row itself runs, on the tracer's tensors)
        records torch's operations, so the program computes the reference for inputs it
        never saw."""

        class Norm(torch.nn.Module):
            def __init__(self, weight: torch.Tensor) -> None:
                super().__init__()
                self.register_buffer("weight", weight)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return rows.native_rms_norm(x, self.weight, 1e-6)

        w = torch.randn(8)
        with torch.no_grad():
            program = torch.export.export(Norm(w), (torch.randn(2, 8),), strict=False)
            ops_seen = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
            assert ops_seen and all(op.startswith("aten.") for op in ops_seen), ops_seen
            other = torch.randn(2, 8)
            torch.testing.assert_close(program.module()(other),
                                       reference_rms_norm(other, w, 1e-6))

    def test_fake_tensors_and_dispatch_modes(self, kernels: ModuleType) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.utils._python_dispatch import TorchDispatchMode

        seen: list[str] = []

        class Watch(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                                   kwargs: Any = None) -> Any:
                seen.append(str(func))
                return func(*args, **(kwargs or {}))

        q, k, cos, sin = qk_call(torch.float32)
        with torch.no_grad():
            with Watch():
                rows.native_rotary_half(q, k, cos, sin, 1)
            assert any("mul" in op for op in seen)
            with FakeTensorMode() as mode:
                fq, fk, fc, fs = (mode.from_tensor(t) for t in (q, k, cos, sin))
                out = rows.native_rotary_half(fq, fk, fc, fs, 1)
                assert out[0].shape == q.shape
                fx, fw = mode.from_tensor(torch.randn(2, 8)), mode.from_tensor(torch.ones(8))
                assert rows.native_rms_norm(fx, fw).shape == (2, 8)

    def test_vmap_forward_ad_and_subclasses(self, kernels: ModuleType) -> None:
        import torch.autograd.forward_ad as fwad

        x, w = _rms_call((3, 4, 16), torch.float32, torch.float32)
        with torch.no_grad():
            mapped = torch.func.vmap(lambda r: rows.native_rms_norm(r, w, 1e-6))(x)
            torch.testing.assert_close(mapped, reference_rms_norm(x, w, 1e-6))
            with fwad.dual_level():
                dual = fwad.make_dual(x, torch.ones_like(x))
                tangent = fwad.unpack_dual(rows.native_rms_norm(dual, w, 1e-6)).tangent
                assert tangent is not None

            class Marked(torch.Tensor):
                pass

            out = rows.native_rms_norm(x.as_subclass(Marked), w, 1e-6)
            assert type(out) is Marked

    def test_a_call_handed_to_torch_is_counted_as_such(self, kernels: ModuleType) -> None:
        """The row serves (and is counted) either way; a call its kernel declines is also
        counted as handed to torch's operations, and the stats table says so."""
        from astrai import dispatch

        class Marked(torch.Tensor):
            pass

        x, w = _rms_call((4, 16), torch.float32, torch.float32)
        dispatch.reset_stats()
        with torch.no_grad():
            rows.native_rms_norm(x, w, 1e-6)
            rows.native_rms_norm(x.as_subclass(Marked), w, 1e-6)
            rows.native_rotary_half(*qk_call(torch.float32), 1)
            q, k, cos, sin = qk_call(torch.float32)
            rows.native_rotary_half(q.as_subclass(Marked), k, cos, sin, 1)
        got = dispatch.stats()
        assert got.handed == {("rms_norm", "native", "torch's operations"): 1,
                              ("rotary", "native", "torch's operations"): 1}
        assert got.handed_off("rms_norm") == got.handed_off("rotary", "native") == 1
        assert "rms_norm     native                  1  of them handed to torch's operations" \
            in got.table()
        said = dispatch.explain("rms_norm", dispatch.CallContext("rms_norm"))
        assert ("note: of the calls row native was chosen for, 1 ran on torch's operations "
                "(its kernel declined them; stats().handed)") in said
        assert dispatch.stats(reset=True).handed and not dispatch.stats().handed
        assert "ran on torch's operations" not in dispatch.explain(
            "rms_norm", dispatch.CallContext("rms_norm"))

    def test_a_nested_tensor_is_an_error_not_a_crash(self) -> None:
        code = """
import torch
from astrai.backends import native
assert native._kernels() is not None
q, c = torch.randn(1, 4, 3, 8), torch.randn(1, 3, 8)
nt = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(4, 8)])
with torch.no_grad():
    for args in ((q, q, nt, c), (q, q, c, nt), (nt, q, c, c)):
        try:
            native.native_rotary_half(*args, 1)
        except Exception as e:
            print(type(e).__name__)
        else:
            print("served")
"""
        done = python_child({"ASTR_NATIVE": "on"}, code)
        assert done.returncode == 0, done.stderr[-2000:]
        assert len(done.stdout.split()) == 3


class TestTables:
    def test_chain_serves_inference_calls_with_native(self, kernels: ModuleType) -> None:
        x, w = _rms_call((1, 1, 64), torch.float32, torch.float32)
        q, k, cos, sin = qk_call(torch.float32, batch=1, seq=1)
        dispatch.reset_stats()
        with torch.no_grad():
            ops.rms_norm(x, w, 1e-6)
            ops.apply_rotary_half(q, k, cos, sin)
        by_row = dispatch.stats().by_row()
        assert by_row["rms_norm"] == by_row["rotary"] == {"native": {"chain": 1}}
        ctx = ops.context("rms_norm", x, w, 1e-6)
        assert dispatch.resolve("rms_norm", ctx).name == "torch"  # autograd on: not native
        assert "native: reject (not grad_enabled" in dispatch.explain("rms_norm", ctx)

    def test_the_regions_of_the_table(self, kernels: ModuleType) -> None:
        """float32 and float64 at any token count (the kernel splits rows among threads);
        bfloat16 below 256 (the compiled row's from there); float16 one token."""
        def row(tokens: int, dtype: torch.dtype) -> str:
            ctx = dispatch.CallContext("rms_norm", dtype=dtype, ndim=2, tokens=tokens,
                                       grad_enabled=False)
            return dispatch.resolve("rms_norm", ctx).name

        for tokens in (1, 4095, 4096, 1 << 20):
            assert row(tokens, torch.float32) == row(tokens, torch.float64) == "native"
        assert row(255, torch.bfloat16) == "native"
        assert row(256, torch.bfloat16) in ("inductor_large", "torch")
        assert row(1, torch.float16) == "native" and row(2, torch.float16) != "native"

    def test_pairs_layout_never_reaches_the_row(self, kernels: ModuleType) -> None:
        x = torch.randn(1, 1, 4, 16)
        freqs = torch.randn(1, 1, 8, 2)
        ctx = ops.context("rotary", x, freqs)
        with torch.no_grad():
            assert dispatch.resolve("rotary", ctx).name != "native"
        with pytest.raises(dispatch.ExplicitSelectionError, match="layout"):
            ops.apply_rotary(x, freqs, backend="native")

    def test_compiled_model_has_no_graph_break(self, kernels: ModuleType) -> None:
        """Inside torch.compile the rows trace torch's operations: no graph break."""
        x, w = _rms_call((2, 3, 32), torch.float32, torch.float32)
        q, k, cos, sin = qk_call(torch.float32)

        def step(x: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, ...]:
            qo, ko = rows.native_rotary_half(q, k, cos, sin, 1)
            return rows.native_rms_norm(x, w, 1e-6, cast_before_weight=True), qo, ko

        with torch.no_grad():
            eager = step(x, q)
            compiled = torch.compile(step, fullgraph=True, backend="eager")(x, q)
        for a, b in zip(eager, compiled, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_without_the_extension_the_rows_are_unavailable_with_the_reason() -> None:
    """ASTR_NATIVE=off: the rows say why, the chain passes them by, and a direct call
    still computes the reference's result with torch's operations."""
    code = """
import torch, astrai.dispatch as d
from astrai import ops
from astrai.backends import native
from astrai.backends.rms_norm import reference_rms_norm
print(native.native_available())
x, w = torch.randn(1, 8), torch.randn(8)
with torch.no_grad():
    ctx = ops.context("rms_norm", x, w, 1e-6)
    print(d.resolve("rms_norm", ctx).name)
    print(d.explain("rms_norm", ctx).splitlines()[1])
    print(torch.allclose(native.native_rms_norm(x, w, 1e-6), reference_rms_norm(x, w, 1e-6)))
"""
    done = python_child({"ASTR_NATIVE": "off"}, code)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "astrai's native extension is not loaded: ASTR_NATIVE=off"
    assert lines[1] == "torch"
    assert lines[2].strip().startswith("native: SKIP unavailable (astrai's native extension is not "
                               "loaded: ASTR_NATIVE=off)")
    assert lines[3] == "True"


def test_available_reports_the_extension(kernels: ModuleType) -> None:
    assert rows.native_available() is True
    assert not isinstance(rows.native_available(), Unavailable)
