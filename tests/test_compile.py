"""The facades under ``torch.compile``: no graph breaks, eager numerics, guarded decisions.

While tracing, each facade takes its decision once and bakes it into the graph; the
graph is guarded on ``astrai.dispatch.state.compile_key`` (table epoch + scope), so a
changed override, a table load or a ``refresh()`` recompiles.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from torch import nn

import astrai.ops
from astrai.backends.rotary import rotary_freqs
from astrai.dispatch import load_tables, op_backend, refresh, state
from astrai.dispatch.scopes import EMPTY_SCOPE

#: An ``rms_norm`` table whose first row is ``_marked_rms_norm`` (output: all 3.0).
MARKED_TABLE = """\
version: 1
family: rms_norm
fallback: reference
rows:
  - name: marked
    impl: tests.test_compile:_marked_rms_norm
  - name: reference
    impl: astrai.backends.rms_norm:reference_rms_norm
"""


def _marked_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """A recognisable ``rms_norm`` row: returns 3.0 everywhere."""
    return torch.full_like(x, 3.0)


def _sevens(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """A recognisable ad hoc ``rms_norm`` object: returns 7.0 everywhere."""
    return torch.full_like(x, 7.0)


@pytest.fixture(autouse=True)
def _reset_dynamo() -> Iterator[None]:
    """Start and end every test with Dynamo's caches empty."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Block(nn.Module):
    """A tiny attention block: projections, rotary, causal attention, norm, output."""

    freqs: torch.Tensor

    def __init__(self, dim: int = 32, heads: int = 4, seq: int = 8) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        gen = torch.Generator().manual_seed(0)
        self.wq = nn.Parameter(torch.randn(dim, dim, generator=gen) / dim**0.5)
        self.wk = nn.Parameter(torch.randn(dim, dim, generator=gen) / dim**0.5)
        self.wv = nn.Parameter(torch.randn(dim, dim, generator=gen) / dim**0.5)
        self.wo = nn.Parameter(torch.randn(dim, dim, generator=gen) / dim**0.5)
        self.norm = nn.Parameter(torch.ones(dim))
        self.register_buffer("freqs", rotary_freqs(torch.arange(seq)[None], self.head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        shape = (b, s, self.heads, self.head_dim)
        h = astrai.ops.rms_norm(x, self.norm)
        q = astrai.ops.linear(h, self.wq).reshape(shape)
        k = astrai.ops.linear(h, self.wk).reshape(shape)
        v = astrai.ops.linear(h, self.wv).reshape(shape)
        q = astrai.ops.apply_rotary(q, self.freqs)
        k = astrai.ops.apply_rotary(k, self.freqs)
        a = astrai.ops.attention(q, k, v, is_causal=True)
        return x + astrai.ops.linear(a, self.wo)


def _input() -> torch.Tensor:
    return torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))


class TestFullGraph:
    """The four facades compile as one graph and match eager."""

    def test_no_graph_breaks(self) -> None:
        """``torch._dynamo.explain`` finds one graph and zero breaks."""
        model = Block()
        with torch.no_grad():
            info = torch._dynamo.explain(model)(_input())
        assert info.graph_break_count == 0, info.break_reasons
        assert info.graph_count == 1

    @pytest.mark.parametrize("grad", [False, True])
    def test_eager_backend_matches(self, grad: bool) -> None:
        """``fullgraph=True`` with the eager backend gives the eager output."""
        model = Block()
        x = _input()
        with torch.set_grad_enabled(grad):
            want = model(x)
            got = torch.compile(model, backend="eager", fullgraph=True)(x)
        torch.testing.assert_close(got, want)

    def test_inductor_matches(self) -> None:
        """The default (inductor) backend gives the eager output, within a minute."""
        model = Block()
        x = _input()
        start = time.monotonic()
        with torch.no_grad():
            want = model(x)
            try:
                got = torch.compile(model, fullgraph=True)(x)
            except Exception as exc:  # pragma: no cover - no C++ toolchain
                if "compiler" in str(exc).lower() or "cpp" in str(exc).lower():
                    pytest.skip(f"inductor unavailable here: {exc}")
                raise
        assert time.monotonic() - start < 60
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _counted(
    fn: Callable[..., Any],
) -> tuple[Callable[..., Any], torch._dynamo.testing.CompileCounter]:
    counter = torch._dynamo.testing.CompileCounter()
    return torch.compile(fn, backend=counter, fullgraph=True), counter


def _norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return astrai.ops.rms_norm(x, w) * 2


class TestGuards:
    """A changed decision input recompiles instead of reusing a stale graph."""

    def test_override_recompiles(self) -> None:
        """Entering ``op_backend(rms_norm="reference")`` recompiles; later cycles reuse."""
        fn, counter = _counted(_norm)
        x, w = torch.randn(3, 8), torch.ones(8)
        want = _norm(x, w)
        torch.testing.assert_close(fn(x, w), want)
        fn(x, w)
        assert counter.frame_count == 1
        with op_backend(rms_norm="reference"):
            torch.testing.assert_close(fn(x, w), want)
            assert counter.frame_count == 2
            fn(x, w)
            assert counter.frame_count == 2
        torch.testing.assert_close(fn(x, w), want)
        settled = counter.frame_count
        for _ in range(3):  # once every scope has been seen, nothing recompiles
            with op_backend(rms_norm="reference"):
                fn(x, w)
            fn(x, w)
        assert counter.frame_count == settled

    def test_leaving_scope_reuses_first_graph(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """After leaving the scope the graph compiled before it is reused (no recompile)."""
        # The state of a fresh process, before any scope was ever entered or left.
        fresh = EMPTY_SCOPE.compile_key
        monkeypatch.setattr(state, "compile_key", (state.compile_key[0], fresh))
        fn, counter = _counted(_norm)
        x, w = torch.randn(3, 8), torch.ones(8)
        fn(x, w)
        with op_backend(rms_norm="reference"):
            fn(x, w)
        assert counter.frame_count == 2
        fn(x, w)
        assert counter.frame_count == 2

    def test_override_object_takes_effect(self) -> None:
        """An ad hoc object in ``op_backend`` is what the recompiled graph calls."""
        fn, counter = _counted(_norm)
        x, w = torch.randn(3, 8), torch.ones(8)
        fn(x, w)
        with op_backend(rms_norm=_sevens):
            assert torch.equal(fn(x, w), torch.full_like(x, 14.0))
        assert counter.frame_count == 2
        torch.testing.assert_close(fn(x, w), _norm(x, w))

    def test_load_tables_recompiles(self, write_yaml: Callable[[str, str], Path]) -> None:
        """Loading a table whose new first row is ``marked`` recompiles and calls it."""
        fn, counter = _counted(_norm)
        x, w = torch.randn(3, 8), torch.ones(8)
        torch.testing.assert_close(fn(x, w), _norm(x, w))
        load_tables(write_yaml("rms_norm.yaml", MARKED_TABLE))
        assert torch.equal(fn(x, w), torch.full_like(x, 6.0))
        assert counter.frame_count == 2

    def test_refresh_recompiles(self) -> None:
        """``refresh()`` (a new epoch) recompiles on the next call."""
        fn, counter = _counted(_norm)
        x, w = torch.randn(3, 8), torch.ones(8)
        fn(x, w)
        fn(x, w)
        assert counter.frame_count == 1
        refresh()
        torch.testing.assert_close(fn(x, w), _norm(x, w))
        assert counter.frame_count == 2
        fn(x, w)
        assert counter.frame_count == 2


def test_ops_call_compiles_fullgraph() -> None:
    """``ops.call`` on a user family compiles with fullgraph=True (no graph break), picks the
    table's row, and a scope recompiles to the scope's row."""
    from astrai.dispatch import ImplRecord, Spec, register_family

    register_family("toy_compiled", [
        ImplRecord("toy_compiled", "a", lambda x: x + 1, Spec.always()),
        ImplRecord("toy_compiled", "b", lambda x: x + 2, Spec.always()),
    ], "b")

    @torch.compile(backend="eager", fullgraph=True)
    def call(x: torch.Tensor) -> torch.Tensor:
        return astrai.ops.call("toy_compiled", x)  # type: ignore[no-any-return]

    zero = torch.zeros(1)
    assert call(zero).item() == 1.0
    with op_backend(toy_compiled="b"):
        assert call(zero).item() == 2.0
    assert call(zero).item() == 1.0


def test_two_probed_objects_recompile() -> None:
    """Two objects with their own ``supports_call``, one scope each: each is used (the
    compile guard tells them apart)."""

    class Const:
        def __init__(self, value: float) -> None:
            self.value = value

        def supports_call(self, *args: Any, **kwargs: Any) -> bool:
            return True

        def __call__(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
            return torch.full_like(x, self.value)

    fn, _ = _counted(_norm)
    x, w = torch.randn(3, 8), torch.ones(8)
    one, two = Const(1.0), Const(2.0)
    for _ in range(2):
        with op_backend(rms_norm=one):
            assert fn(x, w).unique().item() == 2.0
        with op_backend(rms_norm=two):
            assert fn(x, w).unique().item() == 4.0


class TestDynamicShapes:
    """``fullgraph=True, dynamic=True``: a decision on a symbolic length is taken for its
    interval between the tables' cut points, so lengths share a graph."""

    def test_attention_twenty_lengths(self) -> None:
        def block(q: torch.Tensor) -> torch.Tensor:
            return astrai.ops.attention(q, q, q, is_causal=True)

        counter = torch._dynamo.testing.CompileCounter()
        fn = torch.compile(block, backend=counter, fullgraph=True, dynamic=True)
        for length in range(3, 23):
            q = torch.randn(1, length, 2, 8)
            torch.testing.assert_close(fn(q), block(q))
        assert counter.frame_count == 1

    def test_every_facade_compiles_dynamic(self) -> None:
        freqs = rotary_freqs(16, 8)

        def block(x: torch.Tensor, w: torch.Tensor, lin: torch.Tensor) -> torch.Tensor:
            seq = x.shape[1]
            h = astrai.ops.rms_norm(x, w)
            h = astrai.ops.apply_rotary(h.view(1, seq, 2, 8), freqs[:seq]).flatten(-2)
            return astrai.ops.linear(h, lin)

        counter = torch._dynamo.testing.CompileCounter()
        fn = torch.compile(block, backend=counter, fullgraph=True, dynamic=True)
        w, lin = torch.ones(16), torch.randn(4, 16)
        for seq in (5, 7, 11, 13):  # between the tables' cut points (linear's: 4 tokens)
            x = torch.randn(1, seq, 16)
            torch.testing.assert_close(fn(x, w, lin), block(x, w, lin))
        assert counter.frame_count == 1

    def test_cut_point_picks_the_row_of_each_interval(self, tmp_path: Path) -> None:
        """A table that switches rows at head_dim 8: under dynamic shapes each side of the
        cut gets its own row and graph, never the other side's."""
        (tmp_path / "attn.yaml").write_text(
            "version: 1\nfamily: attention\nfallback: math\nrows:\n"
            "  - name: small\n    impl: tests.test_compile:_attention_sevens\n"
            "    when: head_dim <= 8\n"
            "  - name: math\n    impl: astrai.backends.attention.math:math_attention\n")
        load_tables(tmp_path)

        def block(q: torch.Tensor) -> torch.Tensor:
            return astrai.ops.attention(q, q, q)

        counter = torch._dynamo.testing.CompileCounter()
        fn = torch.compile(block, backend=counter, fullgraph=True, dynamic=True)
        for d in (4, 6, 8):
            assert torch.equal(fn(torch.randn(1, 3, 2, d)), torch.full((1, 3, 2 * d), 7.0))
        assert counter.frame_count == 1  # one graph for the whole interval
        for d in (12, 16, 32):
            q = torch.randn(1, 3, 2, d)
            torch.testing.assert_close(fn(q), block(q))
        # The other side of the cut: the math row's graph (whose own code may specialise).
        assert 2 <= counter.frame_count <= 3


def _attention_sevens(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Any = None,
                      layer_id: int = 0, attn_mask: Any = None, is_causal: bool = False,
                      fwd: str | None = None) -> torch.Tensor:
    return torch.full((*q.shape[:-2], q.shape[-2] * q.shape[-1]), 7.0)


def test_cut_points() -> None:
    """Each constant an int axis is compared with gives it two points; a Python spec gives
    none at all."""
    from astrai.dispatch import Spec, parse_spec
    from astrai.dispatch.expr.analysis import cut_points

    specs = [parse_spec("head_dim <= 256 and ndim == 4"), parse_spec("head_dim in {64, 128}"),
             parse_spec("dtype == float16 and has_cache")]
    assert cut_points(specs) == {"head_dim": (64, 65, 128, 129, 257), "ndim": (4, 5)}
    assert cut_points([parse_spec("head_dim < 8 or head_dim > 32")]) == {"head_dim": (8, 33)}
    assert cut_points([*specs, Spec.of(lambda ctx: True, "python")]) is None


class TestShapeAxesCompiled:
    """A table comparing ``q_len`` (a lazy axis): under ``dynamic=True`` and
    ``mark_dynamic`` a graph serves a whole interval, and no table comparing it costs
    nothing at all."""

    def _table(self, tmp_path: Path, when: str) -> None:
        (tmp_path / "attn.yaml").write_text(
            "version: 1\nfamily: attention\nfallback: math\nrows:\n"
            "  - name: short\n    impl: tests.test_compile:_attention_sevens\n"
            f"    when: {when}\n"
            "  - name: math\n    impl: astrai.backends.attention.math:math_attention\n")
        load_tables(tmp_path)

    def test_twenty_lengths_one_graph_per_interval(self, tmp_path: Path) -> None:
        self._table(tmp_path, "q_len < 12")

        def block(q: torch.Tensor) -> torch.Tensor:
            return astrai.ops.attention(q, q, q)

        counter = torch._dynamo.testing.CompileCounter()
        fn = torch.compile(block, backend=counter, fullgraph=True, dynamic=True)
        for length in range(3, 12):  # from 3: a length equal to the head count is duck-sized
            assert torch.equal(fn(torch.randn(1, length, 2, 4)), torch.full((1, length, 8), 7.0))
        assert counter.frame_count == 1
        for length in range(12, 23):
            q = torch.randn(1, length, 2, 4)
            torch.testing.assert_close(fn(q), block(q))
        assert counter.frame_count == 2

    def test_mark_dynamic(self, tmp_path: Path) -> None:
        self._table(tmp_path, "q_len < 12")

        def block(q: torch.Tensor) -> torch.Tensor:
            return astrai.ops.attention(q, q, q)

        counter = torch._dynamo.testing.CompileCounter()
        fn = torch.compile(block, backend=counter, fullgraph=True)
        for length in range(3, 12):
            q = torch.randn(1, length, 2, 4)
            torch._dynamo.mark_dynamic(q, 1)
            assert torch.equal(fn(q), torch.full((1, length, 8), 7.0))
        assert counter.frame_count == 1

    def test_axes_compared_with_each_other(self, tmp_path: Path) -> None:
        """``heads == kv_heads``: guarded on how the two order, so MHA and GQA calls get
        one graph each, whatever the lengths."""
        self._table(tmp_path, "heads == kv_heads")

        def block(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            return astrai.ops.attention(q, k, k)

        counter = torch._dynamo.testing.CompileCounter()
        fn = torch.compile(block, backend=counter, fullgraph=True, dynamic=True)
        for length in (3, 5, 9):
            q = torch.randn(1, length, 4, 4)
            assert torch.equal(fn(q, q), torch.full((1, length, 16), 7.0))
            k = torch.randn(1, length, 2, 4)
            torch.testing.assert_close(fn(q, k), block(q, k))
        assert counter.frame_count == 2


@pytest.mark.parametrize("row", ["torch", "native"])
def test_traced_rotary_is_elementwise_for_inductor_to_fuse(row: str) -> None:
    """Traced, the half-layout rotary rows are the reference's pure elementwise formula
    (eager's in-place writes into slices would keep inductor from fusing it), with the
    same result."""
    import operator

    from astrai import native

    if row == "native" and not native.status().loaded:
        pytest.skip(f"the native row is unavailable here: {native.status().reason}")
    seen: list[Any] = []

    def backend(gm: torch.fx.GraphModule, example: Any) -> Any:
        seen.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 128, 8, 64, generator=g).transpose(1, 2)  # large: eager goes in place
    k = torch.randn(1, 128, 4, 64, generator=g).transpose(1, 2)
    cos, sin = torch.randn(1, 128, 64, generator=g), torch.randn(1, 128, 64, generator=g)

    def rotate(q: torch.Tensor, k: torch.Tensor) -> Any:
        return astrai.ops.apply_rotary_half(q, k, cos, sin, backend=row)

    with torch.no_grad():
        got = torch.compile(rotate, backend=backend, fullgraph=True)(q, k)
        want = rotate(q, k)
    assert seen and not {operator.setitem, operator.iadd, operator.isub} & set(seen)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_size_the_data_decides_is_unknown_to_the_tables() -> None:
    """The rows a mask picks (an expert's tokens, as transformers 4's MoE loops take
    them) have a size no guard can be made on: the tables see the length as unknown - no
    spec comparing it holds, so the row taken is one that serves any length - and the
    function compiles as one graph, to the eager result."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(9, 16, generator=g), torch.randn(8, 16, generator=g)
    picked = torch.tensor([1, 0, 1, 1, 0, 1, 1, 1, 0], dtype=torch.bool)

    def expert(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        rows = x[mask.nonzero().squeeze(1)]
        return astrai.ops.linear(rows, w)

    counter = torch._dynamo.testing.CompileCounter()
    with torch.no_grad():
        got = torch.compile(expert, backend=counter, fullgraph=True)(x, picked)
        want = expert(x, picked)
    torch._dynamo.reset()
    assert counter.frame_count == 1
    torch.testing.assert_close(got, want)

    # torch.export's default traces outside dynamo: the same call, decided the same way
    class Expert(nn.Module):
        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return expert(x, mask)

    program = torch.export.export(Expert(), (x, picked))
    torch.testing.assert_close(program.module()(x, picked), want)
