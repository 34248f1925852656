"""SDPA pinned to one kernel: ``sdpa_flash``, ``sdpa_efficient``, ``sdpa_cudnn``, ``sdpa_math``.

Each available row is checked against the ``math`` reference row on every call of a grid
that its table ``when`` accepts. The adaptations the CUDA kernels need (no mask, no GQA,
aligned head_dim, at least two keys, no empty calls) are checked on CPU through SDPA's math
kernel, with spies showing what the kernel was handed. On CPU, the CUDA-only rows are
unavailable with their reason, which ``explain`` shows. GPU numerics run under the ``gpu``
marker.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from typing import Any

import pytest
import torch

from astrai import dispatch, ops
from astrai.backends.attention import pinned
from astrai.backends.attention.math import math_attention
from astrai.backends.attention.pinned import (
    PinnedSdpa,
    Takes,
    sdpa_cudnn,
    sdpa_cudnn_available,
    sdpa_efficient,
    sdpa_efficient_available,
    sdpa_flash,
    sdpa_flash_available,
    sdpa_math,
)
from astrai.dispatch import ExplicitSelectionError, Unavailable
from astrai.kv_cache import KVPool, decode_batch, prefill_batch

TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 2e-2, torch.float64: 1e-10}
PINNED = ("sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math")
attention_context = functools.partial(ops.context, "attention")


def rows() -> dict[str, Any]:
    """The pinned rows of the loaded attention table, by name."""
    table = dispatch.current().family("attention")
    return {r.name: r for r in table.rows if r.name in PINNED}


def usable() -> list[str]:
    """The pinned rows available on this machine (the probe decides)."""
    state = dispatch.current()
    return [n for n, r in rows().items() if state.availability(r)[0]]


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    torch.testing.assert_close(a.double(), b.double(), atol=tol, rtol=tol)


def dense(dtype: torch.dtype, q_len: int, k_len: int, heads: int = 4, kv_heads: int = 2,
          d: int = 16, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(q_len * 101 + k_len * 7 + kv_heads + d)
    return tuple(  # type: ignore[return-value]
        torch.randn(2, n, h, d, generator=g).to(dtype).to(device)
        for n, h in ((q_len, heads), (k_len, kv_heads), (k_len, kv_heads)))


def mask(kind: str, q_len: int, k_len: int, dtype: torch.dtype,
         device: str = "cpu") -> torch.Tensor | None:
    if kind == "none":
        return None
    g = torch.Generator().manual_seed(q_len + 13 * k_len)
    keep = torch.rand(2, 1, q_len, k_len, generator=g) > 0.3
    keep[..., 0] = True
    if kind == "bool":
        return keep.to(device)
    return torch.where(keep, torch.randn(2, 1, q_len, k_len, generator=g),
                       float("-inf")).to(dtype).to(device)


# -- numerics on this machine --------------------------------------------------------


GRID = list(itertools.product(
    (torch.float32, torch.bfloat16, torch.float64),
    (4, 1),  # kv_heads under 4 query heads: MHA and GQA
    (False, True),  # is_causal
    ((6, 6), (3, 9), (9, 3), (1, 12)),  # (q_len, k_len): square, chunk, more queries, decode
    ("none", "bool", "additive"),
))


class TestDenseNumerics:
    @pytest.mark.parametrize(("dtype", "kv_heads", "causal", "lens", "kind"), GRID,
                             ids=lambda v: str(v).replace("torch.", ""))
    def test_rows_match_the_reference(self, dtype: torch.dtype, kv_heads: int, causal: bool,
                                      lens: tuple[int, int], kind: str) -> None:
        """Every available pinned row whose ``when`` takes the call equals ``math``."""
        q, k, v = dense(dtype, *lens, kv_heads=kv_heads)
        m = mask(kind, *lens, dtype)
        call = {"attn_mask": m, "is_causal": causal}
        want = math_attention(q, k, v, **call)
        ran = []
        for name in usable():
            if rows()[name].spec.matches(attention_context(q, k, v, **call)):
                out = rows()[name].obj(q, k, v, **call)
                assert out.shape == want.shape and out.dtype == dtype, name
                close(out, want, dtype)
                ran.append(name)
        assert "sdpa_math" in ran  # runs everywhere, so it always takes these calls

    @pytest.mark.parametrize("d", [64, 128])
    def test_model_head_dims(self, d: int) -> None:
        """Causal GQA prefill and decode at the head dims models use, bf16."""
        for q_len, k_len in ((32, 32), (1, 40)):
            q, k, v = dense(torch.bfloat16, q_len, k_len, heads=8, kv_heads=2, d=d)
            want = math_attention(q, k, v, is_causal=True)
            for name in usable():
                close(rows()[name].obj(q, k, v, is_causal=True), want, torch.bfloat16)


def packed(dtype: torch.dtype, tokens: int, seed: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed q/k/v for a paged call: 4 query heads, 2 kv heads, head_dim 8."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(tokens, h, 8, generator=g).to(dtype)  # type: ignore[return-value]
                 for h in (4, 2, 2))


class TestPagedNumerics:
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
    def test_prefill_then_decode(self, dtype: torch.dtype) -> None:
        """The rows that take the paged path give ``math``'s prefill and decode outputs."""
        impls = [(n, rows()[n].obj) for n in usable()] + [("math", math_attention)]
        outs: dict[str, torch.Tensor] = {}
        for name, impl in impls:
            pool = KVPool(1, 64, 2, 8, 4, 16, dtype=dtype)
            batch = prefill_batch(pool, [3, 6, 1])
            q, k, v = packed(dtype, batch.num_tokens, seed=3)
            if name != "math" and not rows()[name].spec.matches(
                    attention_context(q, k, v, kv_cache=batch, fwd="prefill")):
                continue
            first = impl(q, k, v, kv_cache=batch, fwd="prefill")
            step = decode_batch(pool, batch.req_pool_indices)
            q, k, v = packed(dtype, step.num_tokens, seed=4)
            outs[name] = torch.cat([first, impl(q, k, v, kv_cache=step, fwd="decode")])
        assert {"sdpa_math", "math"} <= outs.keys()
        for out in outs.values():
            close(out, outs["math"], dtype)


# -- the adaptations a CUDA kernel needs, checked on CPU -----------------------------

#: SDPA's math kernel, handed each call as CUDA flash / cuDNN would need it.
MASKLESS = PinnedSdpa("maskless", "MATH",
                      cpu=Takes(masks=False, gqa=False, align=8, min_keys=2, empty=False),
                      cuda=None)
STRICT = PinnedSdpa("strict", "MATH",
                    cpu=Takes(gqa=False, align=8, min_keys=2, empty=False), cuda=None)


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """What the kernel is handed, per call: shapes, mask shape, causal flag, scale."""
    seen: list[dict[str, Any]] = []
    real = pinned.sdpa_core

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor | None,
            causal: bool, scale: float | None = None) -> torch.Tensor:
        seen.append({"q": tuple(q.shape), "k": tuple(k.shape), "v": tuple(v.shape),
                     "mask": None if m is None else tuple(m.shape), "causal": causal,
                     "scale": scale})
        return real(q, k, v, m, causal, scale)

    monkeypatch.setattr(pinned, "sdpa_core", spy)
    return seen


class TestAdaptations:
    @pytest.mark.parametrize("lens", [(5, 5), (3, 9), (9, 3), (1, 12)], ids=str)
    def test_gqa_and_head_dim_are_adapted(self, lens: tuple[int, int],
                                          kernel_calls: list[dict[str, Any]]) -> None:
        """Without GQA or with an unaligned head_dim (12), the kernel gets repeated heads and
        dims padded to 16 (scale 1/sqrt(12)); the output equals math's."""
        q, k, v = dense(torch.float32, *lens, heads=4, kv_heads=2, d=12)
        close(STRICT(q, k, v, is_causal=True), math_attention(q, k, v, is_causal=True),
              torch.float32)
        got = kernel_calls[-1]
        assert got["k"] == (2, 4, lens[1], 16) and got["q"][-1] == 16
        assert got["scale"] == pytest.approx(12 ** -0.5)

    @pytest.mark.filterwarnings("ignore::UserWarning")  # CausalBias: no fused kernel on CPU
    @pytest.mark.parametrize("lens", [(3, 9), (9, 3), (1, 12)], ids=str)
    def test_maskless_kernel_gets_lower_right_causal(
            self, lens: tuple[int, int], kernel_calls: list[dict[str, Any]]) -> None:
        """A kernel without masks serves a non-square causal call through the lower-right
        ``CausalBias``, never through a mask of astrai's own (the core is not called)."""
        q, k, v = dense(torch.bfloat16, *lens, heads=4, kv_heads=1)
        close(MASKLESS(q, k, v, is_causal=True), math_attention(q, k, v, is_causal=True),
              torch.bfloat16)
        assert kernel_calls == []

    def test_square_causal_uses_the_kernels_flag(
            self, kernel_calls: list[dict[str, Any]]) -> None:
        """A square causal call reaches a maskless kernel with SDPA's own causal flag."""
        q, k, v = dense(torch.float32, 6, 6)
        close(MASKLESS(q, k, v, is_causal=True), math_attention(q, k, v, is_causal=True),
              torch.float32)
        assert kernel_calls[-1]["mask"] is None and kernel_calls[-1]["causal"] is True

    @pytest.mark.parametrize("kind", ["none", "bool", "additive"])
    @pytest.mark.parametrize("causal", [False, True])
    def test_one_key_is_padded_with_a_hidden_key(
            self, kind: str, causal: bool, kernel_calls: list[dict[str, Any]]) -> None:
        """With one key, the kernel gets two (the second masked out); same output."""
        q, k, v = dense(torch.float32, 1, 1)
        m = mask(kind, 1, 1, torch.float32)
        close(STRICT(q, k, v, attn_mask=m, is_causal=causal),
              math_attention(q, k, v, attn_mask=m, is_causal=causal), torch.float32)
        got = kernel_calls[-1]
        assert got["k"][2] == 2 and got["mask"] is not None and got["mask"][-1] == 2
        assert got["causal"] is False

    @pytest.mark.parametrize("lens", [(0, 5), (4, 0), (0, 0)], ids=str)
    def test_empty_calls_skip_the_kernel(self, lens: tuple[int, int],
                                         kernel_calls: list[dict[str, Any]]) -> None:
        """No queries or no keys: the defined result (zeros) without calling the kernel."""
        q, k, v = dense(torch.float32, *lens)
        for row in (STRICT, MASKLESS):
            out = row(q, k, v, is_causal=True)
            assert out.shape == (2, lens[0], 64) and not out.any()
        assert kernel_calls == []

    def test_paged_path_is_adapted(self, kernel_calls: list[dict[str, Any]]) -> None:
        """The paged path goes through the adapted kernel too (GQA repeated, dims padded)."""
        outs = []
        for impl in (STRICT, math_attention):
            pool = KVPool(1, 32, 1, 12, 4, 8)
            batch = prefill_batch(pool, [2, 5])
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(7, h, 12, generator=g) for h in (3, 1, 1))
            outs.append(impl(q, k, v, kv_cache=batch, fwd="prefill"))
        close(outs[0], outs[1], torch.float32)
        assert kernel_calls[-1]["k"][1] == 3 and kernel_calls[-1]["k"][-1] == 16


# -- availability, explain, selection --------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answers")
class TestOnCpu:
    def test_cuda_only_rows_say_why(self) -> None:
        """efficient and cuDNN are unavailable without CUDA, with the reason."""
        eff, cudnn = sdpa_efficient_available(), sdpa_cudnn_available()
        assert isinstance(eff, Unavailable) and eff.reason == (
            "no CUDA device: SDPA's memory-efficient kernel runs on CUDA GPUs only")
        assert isinstance(cudnn, Unavailable) and cudnn.reason == (
            "no CUDA device: SDPA's cuDNN kernel runs on CUDA GPUs only")

    def test_flash_runs_on_cpu(self) -> None:
        """SDPA's flash kernel has a CPU implementation: the row is available here."""
        assert sdpa_flash_available() is True

    def test_explain_shows_the_reasons(self) -> None:
        """``explain`` of a CPU call shows both reasons and the explicit-only rows."""
        q, k, v = dense(torch.float32, 4, 4)
        text = dispatch.explain("attention", attention_context(q, k, v))
        assert ("  sdpa_efficient: SKIP unavailable (no CUDA device: SDPA's memory-efficient "
                "kernel runs on CUDA GPUs only)") in text
        assert ("  sdpa_cudnn: SKIP unavailable (no CUDA device: SDPA's cuDNN kernel runs on "
                "CUDA GPUs only)") in text
        assert "  sdpa_flash: SKIP explicit-only (selected by name or a profile)" in text
        assert "  sdpa_math: SKIP explicit-only (selected by name or a profile)" in text
        assert text.splitlines()[-1] == "=> torch_native (origin=chain)"

    def test_error_selecting_a_cuda_only_row(self) -> None:
        """Asking for one by name is an ``ExplicitSelectionError`` with the reason."""
        q, k, v = dense(torch.float32, 4, 4)
        with pytest.raises(ExplicitSelectionError, match="no CUDA device: SDPA's cuDNN"):
            ops.attention(q, k, v, backend="sdpa_cudnn")

    def test_error_calling_a_cuda_only_row_on_cpu_tensors(self) -> None:
        """Called directly with CPU tensors, a CUDA-only row raises instead of running."""
        q, k, v = dense(torch.float16, 4, 4)
        for row in (sdpa_efficient, sdpa_cudnn):
            with pytest.raises(RuntimeError, match="kernel does not run on cpu tensors"):
                row(q, k, v)

    def test_selected_by_name_through_the_facade(self) -> None:
        """``backend="sdpa_math"`` / ``"sdpa_flash"`` serve through the facade."""
        q, k, v = dense(torch.float32, 5, 7)
        want = math_attention(q, k, v, is_causal=True)
        for name in ("sdpa_math", "sdpa_flash"):
            close(ops.attention(q, k, v, is_causal=True, backend=name), want, torch.float32)


class TestProbeReasons:
    """The probes' answers for GPUs this machine does not have (torch.cuda patched)."""

    @pytest.fixture
    def gpu(self, monkeypatch: pytest.MonkeyPatch) -> Any:
        def fake(capability: tuple[int, int], cudnn: int | None = 91000) -> None:
            monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
            monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
            monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
            monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available",
                                lambda: True)
            monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: cudnn is not None)
            monkeypatch.setattr(torch.backends.cudnn, "version", lambda: cudnn)
        return fake

    def test_old_gpu(self, gpu: Any) -> None:
        """A compute capability 7.5 GPU: each CUDA kernel's range, and the GPU, are named."""
        gpu((7, 5))
        for probe, kernel in ((sdpa_flash_available, "flash"),
                              (sdpa_efficient_available, "memory-efficient (bfloat16)"),
                              (sdpa_cudnn_available, "cuDNN")):
            got = probe()
            assert isinstance(got, Unavailable)
            assert got.reason == (f"SDPA's {kernel} kernel needs compute capability 8.0 to "
                                  "12.1; Tesla T4 has 7.5")

    def test_supported_gpu(self, gpu: Any) -> None:
        """An sm90 GPU with cuDNN 9.1: every pinned row is available."""
        gpu((9, 0))
        assert sdpa_flash_available() is True
        assert sdpa_efficient_available() is True
        assert sdpa_cudnn_available() is True

    def test_old_cudnn(self, gpu: Any) -> None:
        """cuDNN 8.9 is too old for SDPA's cuDNN kernel; none at all is said too."""
        gpu((9, 0), cudnn=8906)
        got = sdpa_cudnn_available()
        assert isinstance(got, Unavailable) and got.reason == (
            "SDPA's cuDNN kernel needs cuDNN >= 9.0; this is 8906")
        gpu((9, 0), cudnn=None)
        assert str(sdpa_cudnn_available()) == "this torch build has no cuDNN"


# -- SDPA's process-wide flags -------------------------------------------------------


def _enabled() -> tuple[bool, ...]:
    b = torch.backends.cuda
    return (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled(),
            b.cudnn_sdp_enabled())


class TestFlags:
    def test_one_kernel_enabled_during_the_call(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Inside a call only the row's kernel is enabled; afterwards every one is again."""
        seen: list[tuple[bool, ...]] = []
        real = pinned.sdpa_attention

        def spy(*args: Any) -> torch.Tensor:
            seen.append(_enabled())
            return real(*args)

        monkeypatch.setattr(pinned, "sdpa_attention", spy)
        before = _enabled()
        q, k, v = dense(torch.float32, 3, 3)
        sdpa_math(q, k, v)
        sdpa_flash(q, k, v)
        assert seen == [(False, False, True, False), (True, False, False, False)]
        assert _enabled() == before == (True, True, True, True)

    def test_threads_do_not_undo_each_others_flags(
            self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Two threads pinning different kernels, each pausing while its kernel is pinned (so
        the other runs meanwhile): each call sees its own kernel alone, before and after the
        pause, and the flags end as they began (without the rows' lock, both threads see the
        other's kernel and the flags stay pinned to one kernel afterwards)."""
        seen: dict[str, set[tuple[bool, ...]]] = {"math": set(), "flash": set()}
        real = pinned.sdpa_attention

        def spy(q: torch.Tensor, *args: Any) -> torch.Tensor:
            mine = seen[threading.current_thread().name]
            mine.add(_enabled())
            time.sleep(0.0005)  # hands the GIL to the other thread
            mine.add(_enabled())
            return real(q, *args)

        monkeypatch.setattr(pinned, "sdpa_attention", spy)
        q, k, v = dense(torch.float32, 2, 2, d=8)
        errors: list[BaseException] = []

        def run(row: PinnedSdpa) -> None:
            try:
                for _ in range(40):
                    row(q, k, v)
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(row,), name=name)
                   for name, row in (("math", sdpa_math), ("flash", sdpa_flash))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert seen == {"math": {(False, False, True, False)},
                        "flash": {(True, False, False, False)}}
        assert _enabled() == (True, True, True, True)


class TestUnderCompile:
    def test_fullgraph_with_a_pinned_row(self) -> None:
        """A facade call selecting ``sdpa_math`` compiles without a graph break and gives the
        eager output; the flags are untouched afterwards."""
        import torch._dynamo

        def block(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            return ops.attention(q, k, k, is_causal=True, backend="sdpa_math") * 2

        q, k, _ = dense(torch.float32, 4, 4)
        torch._dynamo.reset()
        info = torch._dynamo.explain(block)(q, k)
        assert info.graph_break_count == 0
        compiled = torch.compile(block, backend="eager", fullgraph=True)
        torch.testing.assert_close(compiled(q, k), block(q, k))
        assert _enabled() == (True, True, True, True)
        torch._dynamo.reset()


# -- on a GPU ------------------------------------------------------------------------


@pytest.mark.gpu
class TestOnGpu:
    @pytest.mark.parametrize("name", ["sdpa_flash", "sdpa_efficient", "sdpa_cudnn",
                                      "sdpa_math"])
    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
    def test_dense_grid_matches_math(self, name: str, dtype: torch.dtype) -> None:
        """On CUDA, every call of a small grid the row's ``when`` takes equals ``math``."""
        row = rows()[name]
        ok, why = dispatch.current().availability(row)
        if not ok:
            pytest.skip(f"{name} unavailable: {why}")
        ran = 0
        for kv_heads, causal, lens, kind, d in itertools.product(
                (8, 2), (False, True), ((64, 64), (1, 70), (17, 130), (130, 17), (5, 1)),
                ("none", "bool", "additive"), (64, 128, 80, 256)):
            q, k, v = dense(dtype, *lens, heads=8, kv_heads=kv_heads, d=d, device="cuda")
            m = mask(kind, *lens, dtype, device="cuda")
            call = {"attn_mask": m, "is_causal": causal}
            if not row.spec.matches(attention_context(q, k, v, **call)):
                continue
            close(row.obj(q, k, v, **call), math_attention(q, k, v, **call), dtype)
            ran += 1
        if dtype != torch.float32 or name in ("sdpa_efficient", "sdpa_math"):
            assert ran > 0

    def test_efficient_paged_matches_math(self) -> None:
        """The memory-efficient kernel serves the paged path (it takes masks)."""
        ok, why = dispatch.current().availability(rows()["sdpa_efficient"])
        if not ok:
            pytest.skip(f"sdpa_efficient unavailable: {why}")
        outs = []
        for impl in (sdpa_efficient, math_attention):
            pool = KVPool(1, 64, 2, 64, 4, 16, dtype=torch.float16, device="cuda")
            batch = prefill_batch(pool, [3, 9])
            g = torch.Generator().manual_seed(1)
            q, k, v = (torch.randn(12, h, 64, generator=g).half().cuda() for h in (8, 2, 2))
            outs.append(impl(q, k, v, kv_cache=batch, fwd="prefill"))
        close(outs[0], outs[1], torch.float16)
