"""The forms models compute, as features of their families: the rotary half layout
(transformers' ``apply_rotary_pos_emb``) and the RMS norm forms of ``LlamaRMSNorm`` (the
weight after the cast back) and Gemma (``1 + weight``).

The model code here is written out the way transformers writes it, so these tests hold
without transformers installed; ``tests/test_dispatch_model.py`` compares with the real
modules.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import astrai.dispatch as dispatch
from astrai import ops
from astrai.backends.rms_norm import inductor_rms_norm, reference_rms_norm, torch_rms_norm
from astrai.backends.rotary import (
    inductor_rotary,
    reference_rotary,
    reference_rotary_half,
    torch_rotary,
    torch_rotary_half,
)
from astrai.dispatch import CallContext, NoImplementationError, op_backend
from astrai.dispatch.axes import asked_features, call_key, context_fields, context_from_fields

HALF_TYPES = (torch.float32, torch.bfloat16, torch.float16)


# -- the model code, as transformers writes it -------------------------------------


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, unsqueeze_dim: int = 1
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def llama_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(dtype)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    out = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).type_as(x)


def qk_call(dtype: torch.dtype = torch.float32, batch: int = 2, heads: int = 4,
            kv_heads: int = 2, seq: int = 5, dim: int = 16, cos_batch: int | None = None,
            seed: int = 0) -> tuple[torch.Tensor, ...]:
    """transformers' layout: q [b, heads, s, d] (transposed from the projection), cos/sin
    [b or 1, s, d] from duplicated frequencies, in q's dtype."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, dim, generator=g).transpose(1, 2).to(dtype)
    k = torch.randn(batch, seq, kv_heads, dim, generator=g).transpose(1, 2).to(dtype)
    freqs = torch.randn(cos_batch or batch, seq, dim // 2, generator=g) * 3
    emb = torch.cat((freqs, freqs), dim=-1)
    return q, k, emb.cos().to(dtype), emb.sin().to(dtype)


# -- rotary, half layout ---------------------------------------------------------


class TestRotaryHalf:
    @pytest.mark.parametrize("dtype", HALF_TYPES)
    @pytest.mark.parametrize("shape", [dict(), dict(cos_batch=1), dict(batch=1, seq=1),
                                       dict(heads=8, kv_heads=8, seq=40, dim=64)])
    def test_rows_equal_transformers_bit_for_bit(self, dtype: torch.dtype,
                                                 shape: dict[str, Any]) -> None:
        q, k, cos, sin = qk_call(dtype, **shape)
        want = apply_rotary_pos_emb(q, k, cos, sin)
        for row in (torch_rotary_half, reference_rotary_half):
            got = row(q, k, cos, sin, 1)
            for a, b in zip(got, want, strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape
                assert torch.equal(a, b), row.__name__

    def test_large_calls_rotate_in_place_bit_for_bit(self) -> None:
        """Past the joined size, torch rotates q and k by halves in place: same bits."""
        q, k, cos, sin = qk_call(torch.bfloat16, heads=8, kv_heads=8, seq=600, dim=64)
        assert q.numel() + k.numel() > 1 << 15
        for a, b in zip(torch_rotary_half(q, k, cos, sin, 1),
                        apply_rotary_pos_emb(q, k, cos, sin), strict=True):
            assert torch.equal(a, b)

    def test_heads_at_another_dim(self) -> None:
        """unsqueeze_dim=2: q and k as [batch, seq, heads, head_dim]."""
        q, k, cos, sin = (t.transpose(1, 2) if t.dim() == 4 else t for t in qk_call())
        want = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
        got = ops.apply_rotary_half(q, k, cos, sin, 2)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert ops.context("rotary", q, k, cos, sin, 2).heads == 4

    def test_cos_in_float32_promotes_as_transformers(self) -> None:
        q, k, cos, sin = qk_call(torch.bfloat16)
        cos, sin = cos.float(), sin.float()
        want = apply_rotary_pos_emb(q, k, cos, sin)
        got = ops.apply_rotary_half(q, k, cos, sin)
        assert got[0].dtype == torch.float32
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_inductor_row_matches(self, dtype: torch.dtype) -> None:
        q, k, cos, sin = qk_call(dtype)
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        for a, b in zip(inductor_rotary(q, k, cos, sin, 1), apply_rotary_pos_emb(q, k, cos, sin),
                        strict=True):
            torch.testing.assert_close(a, b, atol=tol, rtol=tol)

    @pytest.mark.parametrize("row", ["torch", "reference", "inductor"])
    def test_gradients_equal_transformers(self, row: str) -> None:
        q, k, cos, sin = qk_call()
        q.requires_grad_(True)
        k.requires_grad_(True)
        grads = []
        for fn in (lambda: apply_rotary_pos_emb(q, k, cos, sin),
                   lambda: ops.apply_rotary_half(q, k, cos, sin, backend=row)):
            qo, ko = fn()
            (qo.square().sum() + (ko * 3).sum()).backward()
            grads.append((q.grad.clone(), k.grad.clone()))  # type: ignore[union-attr]
            q.grad = k.grad = None
        for a, b in zip(*grads, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)

    def test_facade_picks_a_row_declaring_the_layout(self) -> None:
        q, k, cos, sin = qk_call()
        ctx = ops.context("rotary", q, k, cos, sin)
        assert ctx.layout == "half" and ctx.tokens == 10 and ctx.heads == 4
        assert dispatch.resolve("rotary", ctx).name == "torch"
        assert "complex: reject (features: [layout]" in dispatch.explain("rotary", ctx)
        with op_backend(rotary="reference"):
            out = ops.apply_rotary_half(q, k, cos, sin)
        assert all(torch.equal(a, b) for a, b in zip(out, apply_rotary_pos_emb(q, k, cos, sin),
                                                      strict=True))
        assert dispatch.stats().served("rotary", "reference") == 1

    def test_error_strict_row_without_the_layout(self) -> None:
        q, k, cos, sin = qk_call()
        with pytest.raises(dispatch.ExplicitSelectionError, match="layout"):
            ops.apply_rotary_half(q, k, cos, sin, backend="complex")

    def test_pairs_layout_unchanged(self) -> None:
        x = torch.randn(2, 5, 4, 16)
        freqs = torch.randn(1, 5, 8, 2)
        ctx = ops.context("rotary", x, freqs)
        assert ctx.layout == "pairs" and asked_features(ctx) == frozenset()
        assert torch.equal(torch_rotary(x, freqs), ops.apply_rotary(x, freqs, backend="torch"))
        assert torch.equal(reference_rotary(x, freqs), ops.apply_rotary(x, freqs,
                                                                        backend="reference"))

    def test_generic_call_routes_by_arguments(self) -> None:
        """``ops.call("rotary", ...)`` with (q, k, cos, sin) is a half-layout call (as a
        recorded workload replays it)."""
        q, k, cos, sin = qk_call()
        got = ops.call("rotary", q, k, cos, sin, 1, backend="reference")
        assert all(torch.equal(a, b) for a, b in zip(got, apply_rotary_pos_emb(q, k, cos, sin),
                                                      strict=True))

    @pytest.mark.parametrize(("change", "match"), [
        (lambda q, k, c, s: (q, k[..., :8], c, s), "may differ only in their heads"),
        (lambda q, k, c, s: (q, k, c[..., :8], s[..., :8]), "the whole head_dim"),
        (lambda q, k, c, s: (q, k.double(), c, s), "one dtype"),
        (lambda q, k, c, s: (q, k, c[:, :3], s[:, :3]), "does not fit"),
        (lambda q, k, c, s: (q, k, c, s[:1]), "differ"),
        (lambda q, k, c, s: (q[0], k, c, s), "3 or 4 dimensions alike"),
        (lambda q, k, c, s: (q[..., :15], k[..., :15], c[..., :15], s[..., :15]), "even"),
    ])
    def test_error_malformed_call(self, change: Any, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            ops.apply_rotary_half(*change(*qk_call()))

    def test_error_unsqueeze_dim(self) -> None:
        q, k, cos, sin = qk_call()
        with pytest.raises(ValueError, match="names head_dim"):
            ops.apply_rotary_half(q, k, cos, sin, -1)
        with pytest.raises(TypeError, match="unsqueeze_dim must be an int"):
            ops.apply_rotary_half(q, k, cos, sin, 1.0)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"must be a torch\.Tensor"):
            ops.apply_rotary_half(q, None, cos, sin)  # type: ignore[arg-type]

    def test_a_users_table_without_the_layout_never_serves_it(self, tmp_path: Path) -> None:
        """A table written for pairs (no ``features: [layout]``) is never handed a half
        call: its rows would rotate the wrong elements."""
        path = tmp_path / "rotary.yaml"
        path.write_text("version: 1\nfamily: rotary\ndescription: pairs only\n"
                        "fallback: mine\nrows:\n  - name: mine\n"
                        "    impl: astrai.backends.rotary:torch_rotary\n")
        dispatch.load_tables(path)
        q, k, cos, sin = qk_call()
        with pytest.raises(NoImplementationError, match="the row declares none"):
            ops.apply_rotary_half(q, k, cos, sin)
        x, freqs = torch.randn(1, 5, 4, 16), torch.randn(1, 5, 8, 2)
        assert ops.apply_rotary(x, freqs).shape == x.shape


# -- RMS norm forms ------------------------------------------------------------


def norm_call(dtype: torch.dtype, weight_dtype: torch.dtype | None = None,
              shape: tuple[int, ...] = (2, 5, 32)) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(*shape, generator=g)
    x[0, 0] *= 1e-3  # a row whose mean square is near eps
    w = torch.randn(shape[-1], generator=g)
    return x.to(dtype), w.to(weight_dtype or dtype)


FORMS = {"llama": (llama_rms_norm, {"cast_before_weight": True}),
         "gemma": (gemma_rms_norm, {"weight_offset": 1.0})}
DTYPE_PAIRS = [(torch.float32, None), (torch.bfloat16, None), (torch.float16, None),
               (torch.bfloat16, torch.float32), (torch.float16, torch.float32)]


class TestRmsNormForms:
    @pytest.mark.parametrize("form", FORMS)
    @pytest.mark.parametrize(("dtype", "weight_dtype"), DTYPE_PAIRS)
    def test_reference_equals_the_model_bit_for_bit(self, form: str, dtype: torch.dtype,
                                                    weight_dtype: torch.dtype | None) -> None:
        model, features = FORMS[form]
        x, w = norm_call(dtype, weight_dtype)
        want = model(x, w, 1e-6)
        got = reference_rms_norm(x, w, 1e-6, **features)
        assert got.dtype == want.dtype and torch.equal(got, want)

    @pytest.mark.parametrize("form", FORMS)
    @pytest.mark.parametrize(("dtype", "weight_dtype"), DTYPE_PAIRS)
    @pytest.mark.parametrize("row", [torch_rms_norm, inductor_rms_norm])
    def test_fast_rows_equal_the_model_within_float32_rounding(
            self, form: str, dtype: torch.dtype, weight_dtype: torch.dtype | None,
            row: Any) -> None:
        """Computed in float32 like the model; after the cast back, a value on a rounding
        boundary may land one step of the low-precision dtype away."""
        model, features = FORMS[form]
        x, w = norm_call(dtype, weight_dtype)
        want = model(x, w, 1e-6)
        got = row(x, w, 1e-6, **features)
        assert got.dtype == want.dtype
        if want.dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        else:
            step = torch.finfo(want.dtype).eps * (w.float().abs().max() + 1) * 4
            assert ((got.float() - want.float()).abs() <= step * want.float().abs().clamp(
                min=1)).all()
            assert (got != want).float().mean() < 0.05  # only boundary cases

    def test_facade_features_reach_the_row(self) -> None:
        x, w = norm_call(torch.bfloat16)
        got = ops.rms_norm(x, w, 1e-6, cast_before_weight=True, backend="reference")
        assert torch.equal(got, llama_rms_norm(x, w, 1e-6))
        got = ops.rms_norm(x, w, 1e-6, weight_offset=1.0, backend="reference")
        assert torch.equal(got, gemma_rms_norm(x, w, 1e-6))
        ctx = ops.context("rms_norm", x, w, 1e-6, weight_offset=1.0, cast_before_weight=True)
        assert ctx.weight_offset and ctx.cast_before_weight
        assert asked_features(ctx) == {"weight_offset", "cast_before_weight"}

    def test_default_form_left_out(self) -> None:
        """An offset of 0 and the cast left off ask for nothing: the plain call."""
        x, w = norm_call(torch.float32)
        ctx = ops.context("rms_norm", x, w, 1e-6, weight_offset=0.0, cast_before_weight=False)
        assert asked_features(ctx) == frozenset()
        assert torch.equal(ops.rms_norm(x, w, 1e-6, weight_offset=0.0), ops.rms_norm(x, w, 1e-6))

    @pytest.mark.parametrize("row", ["torch", "reference", "inductor"])
    @pytest.mark.parametrize("form", FORMS)
    def test_gradients_equal_the_model(self, row: str, form: str) -> None:
        model, features = FORMS[form]
        x, w = norm_call(torch.float32)
        grads = []
        for run in (lambda x, w: model(x, w, 1e-6),
                    lambda x, w: ops.rms_norm(x, w, 1e-6, backend=row, **features)):
            xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
            (run(xg, wg) * torch.arange(32.0)).sum().backward()
            grads.append((xg.grad, wg.grad))
        for a, b in zip(*grads, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)

    @pytest.mark.parametrize(("features", "error", "match"), [
        ({"weight_offset": float("inf")}, ValueError, "finite"),
        ({"weight_offset": "1"}, TypeError, "must be a number"),
        ({"weight_offset": True}, TypeError, "must be a number"),
        ({"cast_before_weight": 1}, TypeError, "must be a bool"),
    ])
    def test_error_bad_feature(self, features: dict[str, Any], error: type[Exception],
                               match: str) -> None:
        x, w = norm_call(torch.float32)
        with pytest.raises(error, match=match):
            ops.rms_norm(x, w, 1e-6, **features)

    def test_a_users_table_without_the_forms_never_serves_them(self, tmp_path: Path) -> None:
        path = tmp_path / "rms_norm.yaml"
        path.write_text("version: 1\nfamily: rms_norm\ndescription: plain only\n"
                        "fallback: mine\nrows:\n  - name: mine\n"
                        "    impl: astrai.backends.rms_norm:torch_rms_norm\n")
        dispatch.load_tables(path)
        x, w = norm_call(torch.float32)
        with pytest.raises(NoImplementationError, match="weight_offset"):
            ops.rms_norm(x, w, 1e-6, weight_offset=1.0)
        assert ops.rms_norm(x, w, 1e-6).shape == x.shape


def test_feature_axes_parse_and_print() -> None:
    """The new axes read and write like the others (CLI, workloads, explain)."""
    ctx = context_from_fields("rotary", {"layout": "half", "dtype": "float32"})
    assert ctx.layout == "half" and "layout=half" in call_key(ctx)
    assert context_fields(CallContext("rotary"))["layout"] == "pairs"
    with pytest.raises(ValueError, match="pairs or half"):
        context_from_fields("rotary", {"layout": "diagonal"})
    assert dispatch.parse_spec("layout == half").matches(ctx)
