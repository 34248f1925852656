"""The compiled rows: ``flex`` (attention), ``inductor`` (rms_norm, rotary), their shared
``Compiled`` cache and the flex block-mask builder.

Compiling is slow (seconds per graph on CPU), so the tests that check compiled numerics use
few shapes, and the logic around the compile (keys, recompiles, layouts) is checked with a
counting backend that runs the traced graph eagerly.
"""

from __future__ import annotations

import functools
import itertools
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

from astrai import dispatch, ops
from astrai.backends import inductor as inductor_mod
from astrai.backends import rms_norm as rms_mod
from astrai.backends import rotary as rotary_mod
from astrai.backends.attention import flex as flex_mod
from astrai.backends.attention.block_mask import causal_block_mask
from astrai.backends.attention.dense import causal_keep
from astrai.backends.attention.flex import flex_attention, flex_available
from astrai.backends.attention.math import math_attention
from astrai.backends.inductor import Compiled, inductor_available
from astrai.backends.rms_norm import inductor_rms_norm, reference_rms_norm
from astrai.backends.rotary import inductor_rotary, reference_rotary, rotary_freqs
from astrai.dispatch import ExplicitSelectionError, Unavailable

TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 2e-2, torch.float64: 1e-10}
attention_context = functools.partial(ops.context, "attention")


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    torch.testing.assert_close(a.double(), b.double(), atol=tol, rtol=tol)


def qkv(dtype: torch.dtype, q_len: int, k_len: int, heads: int = 4, kv_heads: int = 2,
        d: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(q_len * 31 + k_len + kv_heads)
    return tuple(  # type: ignore[return-value]
        torch.randn(2, n, h, d, generator=g).to(dtype)
        for n, h in ((q_len, heads), (k_len, kv_heads), (k_len, kv_heads)))


# -- the block mask builder ----------------------------------------------------------


def dense_mask(q_len: int, k_len: int, window: int | None) -> torch.Tensor:
    """The element-level mask a block mask stands for, from its ``mask_mod``."""
    bm = causal_block_mask(q_len, k_len, "cpu", window)
    zero = torch.zeros((), dtype=torch.int64)
    return bm.mask_mod(zero, zero, torch.arange(q_len)[:, None],  # type: ignore[no-any-return]
                       torch.arange(k_len)[None, :])


class TestCausalBlockMask:
    @pytest.mark.parametrize("lens", [(5, 5), (3, 9), (9, 3), (1, 300), (300, 300)], ids=str)
    @pytest.mark.parametrize("window", [None, 1, 3, 130])
    def test_rule_is_bottom_right_causal_with_window(self, lens: tuple[int, int],
                                                     window: int | None) -> None:
        """The mask keeps exactly ``pos - window < j <= pos``, ``pos = i + k_len - q_len``."""
        q_len, k_len = lens
        i = torch.arange(q_len)[:, None] + (k_len - q_len)
        j = torch.arange(k_len)[None, :]
        want = (j <= i) & ((j > i - window) if window is not None else True)
        got = dense_mask(q_len, k_len, window)
        assert torch.equal(got, want)
        assert torch.equal(got, causal_keep(q_len, k_len, torch.device("cpu"), window))

    def test_window_skips_blocks(self) -> None:
        """A 128-wide window touches at most two 128-key blocks per query block; plain causal
        touches up to all eight."""
        def blocks(window: int | None) -> torch.Tensor:
            bm = causal_block_mask(1024, 1024, "cpu", window)
            return bm.kv_num_blocks + bm.full_kv_num_blocks  # type: ignore[no-any-return]

        assert int(blocks(128).max()) == 2
        assert int(blocks(None).max()) == 8

    def test_cached_per_shape_and_device(self) -> None:
        """The same shape, window and device give the same mask object (a str device too)."""
        a = causal_block_mask(7, 9, "cpu", 3)
        assert causal_block_mask(7, 9, torch.device("cpu"), 3) is a
        assert causal_block_mask(7, 9, "cpu") is not a
        assert causal_block_mask(9, 9, "cpu", 3) is not a

    @pytest.mark.filterwarnings("ignore::UserWarning")  # flex run uncompiled, on purpose
    def test_flex_with_a_window_matches_a_dense_mask(self) -> None:
        """flex_attention with the windowed block mask equals the reference with that mask."""
        from torch.nn.attention.flex_attention import flex_attention as flex

        q, k, v = qkv(torch.float32, 6, 11, kv_heads=4)
        bm = causal_block_mask(6, 11, "cpu", 4)
        out = flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=bm)
        want = math_attention(q, k, v, attn_mask=causal_keep(6, 11, q.device, 4))
        close(out.transpose(1, 2).flatten(-2), want, torch.float32)

    @pytest.mark.parametrize(("args", "message"), [
        ((4, 4, "cpu", 0), "window must be an int >= 1"),
        ((4, 4, "cpu", True), "window must be an int >= 1"),
        ((0, 4, "cpu"), "q_len and k_len >= 1"),
        ((4, 0, "cpu"), "q_len and k_len >= 1"),
    ])
    def test_error_bad_arguments(self, args: tuple[Any, ...], message: str) -> None:
        """A window below 1 (or a bool) and an empty side are ``ValueError``s."""
        with pytest.raises(ValueError, match=message):
            causal_block_mask(*args)


# -- Compiled ------------------------------------------------------------------------


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


class TestCompiled:
    def test_one_copy_per_key(self) -> None:
        """Each key compiles its own copy of the function once; the function itself stays
        uncompiled, so no key competes for another's recompile budget."""
        counter = torch._dynamo.testing.CompileCounter()
        c = Compiled(_double, dynamic=False, backend=counter)
        for i in range(12):  # more keys than torch._dynamo's recompile limit (8)
            torch.testing.assert_close(c(("len", i), torch.ones(i + 1)),
                                       torch.full((i + 1,), 3.0))
            c(("len", i), torch.ones(i + 1))
        assert counter.frame_count == 12
        assert c.keys() == [("len", i) for i in range(12)]

    def test_dynamic_lengths_share_a_graph(self) -> None:
        """With ``dynamic=True`` one key serves many lengths with one graph."""
        counter = torch._dynamo.testing.CompileCounter()
        c = Compiled(reference_rms_norm, dynamic=True, backend=counter)
        for n in range(2, 12):
            x = torch.randn(n, 8)
            torch.testing.assert_close(c("k", x, torch.ones(8), 1e-6),
                                       reference_rms_norm(x, torch.ones(8), 1e-6))
        assert counter.frame_count == 1

    def test_oldest_key_dropped_past_max_keys(self) -> None:
        """Past ``max_keys`` the key compiled first goes; it compiles again if it returns."""
        counter = torch._dynamo.testing.CompileCounter()
        c = Compiled(_double, dynamic=False, max_keys=3, backend=counter)
        for key in "abcd":
            c(key, torch.ones(2))
        assert c.keys() == ["b", "c", "d"]
        c("a", torch.ones(2))
        assert c.keys() == ["c", "d", "a"] and counter.frame_count == 5
        c.clear()
        assert c.keys() == []


# -- flex -------------------------------------------------------------------------


@pytest.fixture
def counted_flex(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The flex row with its graphs counted and run eagerly instead of by inductor."""
    counter = torch._dynamo.testing.CompileCounter()
    monkeypatch.setattr(flex_mod, "_compiled", Compiled(flex_mod._call, dynamic=False,
                                                        backend=counter))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield counter


FLEX_GRID = [
    *itertools.product(
        (torch.float32,),
        (4, 1),  # kv_heads under 4 query heads: MHA, MQA
        (False, True),
        ((3, 9), (9, 3)),  # a chunk over a longer context; more queries than keys
    ),
    (torch.float32, 2, True, (6, 6)),
    (torch.float32, 2, True, (1, 12)),  # decode
    (torch.bfloat16, 2, True, (3, 9)),
    (torch.float16, 4, False, (6, 6)),
]


class TestFlexLogic:
    @pytest.mark.parametrize(("dtype", "kv_heads", "causal", "lens"), FLEX_GRID,
                             ids=lambda v: str(v).replace("torch.", ""))
    def test_matches_the_reference(self, dtype: torch.dtype, kv_heads: int, causal: bool,
                                   lens: tuple[int, int], counted_flex: Any) -> None:
        """Layout, GQA and the bottom-right causal rule: flex's graph equals ``math``."""
        q, k, v = qkv(dtype, *lens, kv_heads=kv_heads)
        with torch.no_grad():
            out = flex_attention(q, k, v, is_causal=causal)
            assert out.shape == (2, lens[0], 64) and out.dtype == dtype
            close(out, math_attention(q, k, v, is_causal=causal), dtype)

    def test_compiled_once_per_shape(self, counted_flex: Any) -> None:
        """Each new shape or causality compiles once; repeats reuse it."""
        with torch.no_grad():
            for _ in range(3):
                for lens, causal in (((4, 4), True), ((4, 4), False), ((2, 7), True)):
                    flex_attention(*qkv(torch.float32, *lens), is_causal=causal)
        assert counted_flex.frame_count == 3

    @pytest.mark.parametrize("lens", [(0, 5), (4, 0)], ids=str)
    def test_empty_calls_compile_nothing(self, lens: tuple[int, int],
                                         counted_flex: Any) -> None:
        """No queries or no keys: zeros of the right shape, and no compile."""
        out = flex_attention(*qkv(torch.float32, *lens), is_causal=True)
        assert out.shape == (2, lens[0], 64) and not out.any()
        assert counted_flex.frame_count == 0

    def test_error_mask_or_cache(self) -> None:
        """A mask or a paged cache is refused, never ignored."""
        q, k, v = qkv(torch.float32, 3, 3)
        with pytest.raises(ValueError, match="without attn_mask"):
            flex_attention(q, k, v, attn_mask=torch.ones(3, 3, dtype=torch.bool))
        with pytest.raises(ValueError, match="without attn_mask"):
            flex_attention(q, k, v, kv_cache=object())


class TestFlexCompiled:
    """The real thing: flex compiled by inductor (two shapes: each compiles for seconds)."""

    @pytest.mark.parametrize(("dtype", "kv_heads", "lens"), [
        (torch.float32, 2, (3, 9)),  # GQA, a chunk over a longer context
        (torch.bfloat16, 1, (9, 3)),  # MQA, queries that see no key (zeros)
    ], ids=str)
    def test_matches_the_reference(self, dtype: torch.dtype, kv_heads: int,
                                   lens: tuple[int, int]) -> None:
        """Compiled causal flex equals ``math``; a repeat of the shape adds no compiled
        function."""
        q, k, v = qkv(dtype, *lens, kv_heads=kv_heads)
        with torch.no_grad():
            out = flex_attention(q, k, v, is_causal=True)
            keys = flex_mod._compiled.keys()
            close(out, math_attention(q, k, v, is_causal=True), dtype)
            flex_attention(q, k, v, is_causal=True)
        assert flex_mod._compiled.keys() == keys

    def test_selected_by_name(self) -> None:
        """``backend="flex"`` serves inference calls; grad mode and masks are refused by
        the row's ``when`` (flex has no CPU backward)."""
        q, k, v = qkv(torch.float32, 3, 9, kv_heads=2)  # the shape compiled above
        with torch.no_grad():
            close(ops.attention(q, k, v, is_causal=True, backend="flex"),
                  math_attention(q, k, v, is_causal=True), torch.float32)
            with pytest.raises(ExplicitSelectionError, match="has_mask"):
                ops.attention(q, k, v, attn_mask=torch.ones(3, 9, dtype=torch.bool),
                              backend="flex")
        if not torch.cuda.is_available():
            with pytest.raises(ExplicitSelectionError, match="grad_enabled"):
                ops.attention(q, k, v, is_causal=True, backend="flex")

    def test_inside_a_users_compile(self) -> None:
        """Traced by a user's ``torch.compile``, the row is plain flex_attention: no graph
        break, no compiled function of its own, the eager result."""
        def block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return ops.attention(q, k, v, is_causal=True, backend="flex") + 1

        q, k, v = qkv(torch.float32, 5, 5, kv_heads=4)
        with torch.no_grad():
            want = block(q, k, v)
            keys = flex_mod._compiled.keys()
            torch._dynamo.reset()
            with warnings.catch_warnings():  # fullgraph=True: a graph break would raise
                warnings.simplefilter("ignore", UserWarning)
                got = torch.compile(block, backend="eager", fullgraph=True)(q, k, v)
            torch._dynamo.reset()
        close(got, want, torch.float32)
        assert flex_mod._compiled.keys() == keys


# -- the inductor rows ---------------------------------------------------------------

#: Shapes (ranks) the generic rms_norm test compiles too, and one decode row (fp32 only).
RMS_CALLS = [*itertools.product(((7,), (3, 16), (2, 5, 16)),
                                (torch.float32, torch.bfloat16, torch.float64)),
             ((1, 16), torch.float32)]
#: The dtypes the generic row tests compile too (their graphs are shared in one run).
DTYPES = (torch.float32, torch.bfloat16, torch.float64)
MIXED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
RMS_FORMS = [dict(weight_offset=0.1, cast_before_weight=True), dict(cast_before_weight=True),
             dict(weight_offset=1.0)]


class TestInductorRmsNorm:
    @pytest.mark.parametrize(("shape", "dtype"), RMS_CALLS, ids=str)
    def test_matches_the_reference(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """The compiled row equals the reference row (shape and dtype kept)."""
        g = torch.Generator().manual_seed(len(shape))
        x = (torch.randn(shape, generator=g) * 3).to(dtype)
        w = torch.rand(shape[-1], generator=g).to(dtype) + 0.5
        out = inductor_rms_norm(x, w, 1e-5)
        assert out.shape == x.shape and out.dtype == dtype
        close(out, reference_rms_norm(x, w, 1e-5), dtype)

    def test_lengths_and_ranks_share_a_graph(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Token counts share one graph per dtype, device and rank."""
        counter = torch._dynamo.testing.CompileCounter()
        monkeypatch.setattr(rms_mod, "_compiled", Compiled(rms_mod._reference, dynamic=True,
                                                           backend=counter))
        w = torch.rand(16) + 0.5
        for n in (2, 3, 9, 40):
            for x in (torch.randn(n, 16), torch.randn(2, n, 16), torch.randn(n, 2, 3, 16)):
                close(inductor_rms_norm(x, w), reference_rms_norm(x, w), torch.float32)
        assert counter.frame_count == 3
        cpu = torch.device("cpu")
        assert rms_mod._compiled.keys() == [(torch.float32, torch.float32, cpu, n, 0.0, False)
                                             for n in (2, 3, 4)]

    def test_gradients_match_the_reference(self) -> None:
        """Training through the compiled row: the input and weight gradients equal the
        reference row's."""
        grads = []
        for row in (inductor_rms_norm, reference_rms_norm):
            g = torch.Generator().manual_seed(7)
            x = torch.randn(5, 16, generator=g).requires_grad_()
            w = (torch.rand(16, generator=g) + 0.5).requires_grad_()
            row(x, w, 1e-5).square().sum().backward()
            grads.append((x.grad, w.grad))
        for a, b in zip(*grads, strict=True):
            close(a, b, torch.float32)  # type: ignore[arg-type]

    def test_selected_by_name(self) -> None:
        """``backend="inductor"`` serves through the facade."""
        x, w = torch.randn(3, 16), torch.rand(16)
        close(ops.rms_norm(x, w, backend="inductor"), reference_rms_norm(x, w), torch.float32)

    @pytest.mark.parametrize(("dtype", "weight_dtype"),
                             list(itertools.product(MIXED_DTYPES, MIXED_DTYPES)), ids=str)
    def test_model_forms_round_as_the_reference(self, dtype: torch.dtype,
                                                weight_dtype: torch.dtype) -> None:
        """Each form with an x and a weight of any dtypes: the reference's dtype, and its
        values up to the order of the sum of squares - float32 rounding for a float32 x;
        for a half-type x (whose normed value the cast form rounds to x's dtype) one
        rounding step, on few elements. LlamaRMSNorm's ``weight + offset`` is rounded to
        the weight's dtype before the product, as eager mode rounds it."""
        g = torch.Generator().manual_seed(11)
        x = (torch.randn(7, 64, generator=g) * 3).to(dtype)
        w = torch.randn(64, generator=g).to(weight_dtype)
        for form in RMS_FORMS:
            want = reference_rms_norm(x, w, 1e-5, **form)
            got = inductor_rms_norm(x, w, 1e-5, **form)
            assert got.dtype == want.dtype and got.shape == want.shape, form
            if dtype == torch.float32:
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=str(form))
                continue
            step = max(torch.finfo(dtype).eps, torch.finfo(want.dtype).eps) * 2
            gap = (got.double() - want.double()).abs()
            assert (gap <= step * want.double().abs().clamp(min=1)).all(), form
            assert (got != want).double().mean() < 0.02, form

    def test_numpy_scalars_under_inference_mode(self) -> None:
        """eps and weight_offset given as NumPy scalars, under torch.inference_mode: the
        compiled row takes their values (a NumPy scalar would reach the graph as a tensor,
        whose guards fail there)."""
        np = pytest.importorskip("numpy")
        x, w = torch.randn(4, 24), torch.rand(24) + 0.5
        with torch.inference_mode():
            for eps in (np.float64(1e-6), np.float32(1e-5)):
                want = reference_rms_norm(x, w, float(eps))
                close(inductor_rms_norm(x, w, eps), want, torch.float32)
            # the facade takes a float64 (a float subclass) and refuses other NumPy types
            close(ops.rms_norm(x, w, np.float64(1e-6), backend="inductor"),
                  reference_rms_norm(x, w, 1e-6), torch.float32)
            close(inductor_rms_norm(x, w, np.float64(1e-6), weight_offset=np.float64(1.0),
                                    cast_before_weight=np.bool_(True)),
                  reference_rms_norm(x, w, 1e-6, weight_offset=1.0, cast_before_weight=True),
                  torch.float32)


ROTARY_CALLS = {
    "dense": lambda dtype: (torch.randn(2, 5, 3, 8).to(dtype),
                            rotary_freqs(torch.arange(5)[None], 8)),
    "dense-shared": lambda dtype: (torch.randn(2, 5, 3, 8).to(dtype), rotary_freqs(5, 8)),
    "packed": lambda dtype: (torch.randn(7, 3, 8).to(dtype), rotary_freqs(torch.arange(7), 8)),
}


class TestInductorRotary:
    @pytest.mark.parametrize("layout", list(ROTARY_CALLS))
    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    def test_matches_the_reference(self, layout: str, dtype: torch.dtype) -> None:
        """Every layout, compiled, equals the reference row."""
        x, freqs = ROTARY_CALLS[layout](dtype)
        out = inductor_rotary(x, freqs)
        assert out.shape == x.shape and out.dtype == dtype
        close(out, reference_rotary(x, freqs), dtype)

    def test_numpy_unsqueeze_dim_under_inference_mode(self) -> None:
        """The half layout's unsqueeze_dim given as a NumPy integer, under
        torch.inference_mode: the compiled row takes its value."""
        np = pytest.importorskip("numpy")
        q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
        cos, sin = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
        with torch.inference_mode():
            got = inductor_rotary(q, k, cos, sin, np.int64(1))
        for a, b in zip(got, reference_rotary(q, k, cos, sin, 1), strict=True):
            close(a, b, torch.float32)

    def test_lengths_and_tables_do_not_recompile(self,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
        """Once dense calls (tables per batch row, shared, 3-d) and packed calls have
        compiled, new batch sizes and lengths reuse the graphs."""
        counter = torch._dynamo.testing.CompileCounter()
        monkeypatch.setattr(rotary_mod, "_compiled", Compiled(rotary_mod._reference_pairs,
                                                              dynamic=True, backend=counter))

        def dense(batch: int, seq: int) -> None:
            x = torch.randn(batch, seq, 3, 8)
            positions = torch.arange(seq)[None] + torch.arange(batch)[:, None]
            for freqs in (rotary_freqs(positions, 8), rotary_freqs(torch.arange(seq)[None], 8),
                          rotary_freqs(seq, 8)):
                close(inductor_rotary(x, freqs), reference_rotary(x, freqs), torch.float32)

        def packed(tokens: int) -> None:
            x, freqs = torch.randn(tokens, 3, 8), rotary_freqs(torch.arange(tokens), 8)
            close(inductor_rotary(x, freqs), reference_rotary(x, freqs), torch.float32)

        dense(3, 5)
        dense(4, 7)
        packed(9)
        packed(6)
        warm = counter.frame_count
        assert warm <= 4
        for batch, seq in itertools.product((3, 5, 6), (4, 9, 12)):
            dense(batch, seq)
        for tokens in (7, 13, 40):
            packed(tokens)
        assert counter.frame_count == warm


class TestInsideAUsersCompile:
    def test_facades_compile_fullgraph(self) -> None:
        """A user's ``torch.compile(fullgraph=True, dynamic=True)`` of a block calling both
        inductor rows by name: no graph break, the eager output at two lengths, and the rows
        compile nothing of their own (they run the reference math inside the graph)."""
        w = torch.rand(16) + 0.5
        freqs = rotary_freqs(torch.arange(12)[None], 8)

        def block(x: torch.Tensor) -> torch.Tensor:
            seq = x.shape[1]
            h = ops.rms_norm(x, w, backend="inductor")
            h = ops.apply_rotary(h.view(1, seq, 2, 8), freqs[:, :seq], backend="inductor")
            return h.flatten(-2) * 2

        keys = (rms_mod._compiled.keys(), rotary_mod._compiled.keys())
        torch._dynamo.reset()
        compiled = torch.compile(block, fullgraph=True, dynamic=True)  # a break would raise
        for seq in (6, 11):
            x = torch.randn(1, seq, 16)
            close(compiled(x), block(x), torch.float32)
        torch._dynamo.reset()
        assert (rms_mod._compiled.keys(), rotary_mod._compiled.keys()) == keys


# -- availability ----------------------------------------------------------------------


class TestAvailability:
    def test_toolchain_present_here(self) -> None:
        """This machine has a C++ compiler: the compiled rows are available."""
        assert inductor_available() is True
        assert flex_available() is True

    def test_no_compiler(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Without a working C++ compiler the probe names what it tried."""
        monkeypatch.setattr(inductor_mod, "_cxx_candidates", lambda: ["no-such-cxx-4711"])
        got = inductor_available()
        assert isinstance(got, Unavailable) and got.reason == (
            "no C++ compiler for inductor's CPU code (tried: no-such-cxx-4711); install g++ "
            "or set CXX")
        assert str(flex_available()) == got.reason

    def test_cuda_without_triton(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A CUDA device without triton: inductor cannot compile the CUDA calls."""
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(inductor_mod.importlib.util, "find_spec", lambda name: None)
        got = inductor_available()
        assert isinstance(got, Unavailable) and "triton is not installed" in got.reason

    def test_explain_shows_explicit_only(self) -> None:
        """The compiled rows are explicit-only: explain says so, the chain goes on."""
        x, w = torch.randn(3, 16), torch.ones(16)
        text = dispatch.explain("rms_norm", ops.context("rms_norm", x, w))
        assert "  inductor: SKIP explicit-only (selected by name or a profile)" in text
        assert text.splitlines()[-1] == "=> torch (origin=chain)"
        q, k, v = qkv(torch.float32, 3, 3)
        with torch.no_grad():
            text = dispatch.explain("attention", attention_context(q, k, v))
        assert "  flex: SKIP explicit-only (selected by name or a profile)" in text


# -- on a GPU ------------------------------------------------------------------------


@pytest.mark.gpu
class TestOnGpu:
    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
    def test_flex_matches_math(self, dtype: torch.dtype) -> None:
        """On CUDA, compiled flex equals ``math`` for causal GQA calls (square and a chunk)."""
        ok = flex_available()
        if not ok:
            pytest.skip(f"flex unavailable: {ok}")
        for lens in ((64, 64), (16, 200)):
            q, k, v = (t.cuda() for t in qkv(dtype, *lens, heads=8, kv_heads=2, d=64))
            close(flex_attention(q, k, v, is_causal=True),
                  math_attention(q, k, v, is_causal=True), dtype)

    def test_inductor_rows_match_the_reference(self) -> None:
        """On CUDA, the compiled rms_norm and rotary rows equal their reference rows."""
        ok = inductor_available()
        if not ok:
            pytest.skip(f"inductor unavailable: {ok}")
        x, w = torch.randn(33, 256, device="cuda").bfloat16(), torch.rand(256, device="cuda")
        close(inductor_rms_norm(x, w), reference_rms_norm(x, w), torch.bfloat16)
        xr = torch.randn(2, 9, 4, 64, device="cuda").bfloat16()
        freqs = rotary_freqs(torch.arange(9)[None], 64).cuda()
        close(inductor_rotary(xr, freqs), reference_rotary(xr, freqs), torch.bfloat16)
