"""Shape and hardware axes: what each facade reads, and cut-point caching.

The lazy axes (``device``, ``sm``, ``batch``, ``q_len``, ``kv_len``, ``heads``,
``kv_heads``, ``tokens``, ``in_features``, ``out_features``) are read off a call only
when a loaded table compares them, and an int one enters the decision-cache key as the
interval between the tables' cut points: the number of decisions follows the tables,
not the number of distinct shapes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import astrai.ops
from astrai.backends.attention.math import math_attention
from astrai.dispatch import (
    CallContext,
    ImplRecord,
    Spec,
    explain,
    load_tables,
    parse_spec,
    register_family,
    resolve,
    stats,
    use_profile,
)
from astrai.dispatch.expr.analysis import comparisons
from astrai.dispatch.facade import FACADES, route
from astrai.dispatch.keying import key_plan
from astrai.dispatch.registry import current
from astrai.kv_cache import KVPool, decode_batch, prefill_batch


def _marker(value: float) -> Callable[..., torch.Tensor]:
    def row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Any = None,
            layer_id: int = 0, attn_mask: Any = None, is_causal: bool = False,
            fwd: str | None = None) -> torch.Tensor:
        return torch.full((*q.shape[:-2], q.shape[-2] * q.shape[-1]), value)

    return row


one_row = _marker(1.0)
mid_row = _marker(2.0)
long_row = _marker(3.0)
mha_row = _marker(4.0)


def _attention_table(tmp_path: Path, rows: str) -> None:
    (tmp_path / "attention.yaml").write_text(
        "version: 1\nfamily: attention\nfallback: math\nrows:\n" + rows +
        "  - name: math\n    impl: astrai.backends.attention.math:math_attention\n")
    load_tables(tmp_path)


LENGTH_ROWS = (
    "  - name: one\n    impl: tests.test_shape_axes:one_row\n    when: q_len == 1\n"
    "  - name: mid\n    impl: tests.test_shape_axes:mid_row\n    when: q_len < 1024\n"
    "  - name: long\n    impl: tests.test_shape_axes:long_row\n    when: q_len >= 1024\n"
)


def _served(q_len: int, *, kv_len: int | None = None, heads: int = 2,
            kv_heads: int = 2) -> float:
    q = torch.zeros(1, q_len, heads, 4)
    k = torch.zeros(1, q_len if kv_len is None else kv_len, kv_heads, 4)
    return float(astrai.ops.attention(q, k, k).flatten()[0])


class TestFacadesReadTheAxes:
    def test_attention_dense(self) -> None:
        q, k = torch.zeros(3, 5, 8, 16), torch.zeros(3, 7, 2, 16)
        ctx = astrai.ops.context("attention", q, k, k)
        assert (ctx.device, ctx.sm, ctx.batch, ctx.q_len, ctx.kv_len, ctx.heads,
                ctx.kv_heads) == ("cpu", None, 3, 5, 7, 8, 2)
        assert ctx.tokens is None and ctx.in_features is None

    def test_attention_paged_reads_the_longest_request(self) -> None:
        pool = KVPool(layers=1, slots=32, kv_heads=2, head_dim=8, max_requests=4,
                      max_context=12)
        batch = prefill_batch(pool, [3, 6])
        q, k = torch.zeros(9, 4, 8), torch.zeros(9, 2, 8)
        ctx = astrai.ops.context("attention", q, k, k, batch, fwd="prefill")
        assert (ctx.batch, ctx.q_len, ctx.kv_len, ctx.heads, ctx.kv_heads) == (2, 6, 6, 4, 2)
        astrai.ops.attention(q, k, k, batch, fwd="prefill")  # the prompts are now cached
        step = decode_batch(pool, batch.req_pool_indices)
        q1, k1 = torch.zeros(2, 4, 8), torch.zeros(2, 2, 8)
        ctx = astrai.ops.context("attention", q1, k1, k1, step, fwd="decode")
        assert (ctx.batch, ctx.q_len, ctx.kv_len) == (2, 1, 7)

    def test_rotary_rms_norm_linear(self) -> None:
        x = torch.zeros(2, 3, 4, 8)
        rot = astrai.ops.context("rotary", x, torch.zeros(3, 4, 2))
        assert (rot.device, rot.tokens, rot.heads, rot.q_len) == ("cpu", 6, 4, None)
        norm = astrai.ops.context("rms_norm", torch.zeros(2, 3, 8), torch.ones(8))
        assert (norm.tokens, norm.heads) == (6, None)
        lin = astrai.ops.context("linear", torch.zeros(5, 2, 8), torch.zeros(3, 8))
        assert (lin.tokens, lin.in_features, lin.out_features) == (10, 8, 3)

    def test_ops_call_reads_device(self, toy: Path) -> None:
        """A family without a facade: ``device`` and ``sm`` from the first tensor."""
        ctx = astrai.ops.context("toy", torch.zeros(2, 3))
        assert (ctx.device, ctx.sm, ctx.ndim) == ("cpu", None, 2)


class TestNothingReadUnlessCompared:
    def _counting(self, family: str) -> tuple[Callable[..., Any], dict[str, int]]:
        fc = FACADES[family].call
        calls = dict.fromkeys(fc.readers, 0)

        def counted(axis: str, read: Callable[..., Any]) -> Callable[..., Any]:
            def reader(*args: Any) -> Any:
                calls[axis] += 1
                return read(*args)

            return reader

        readers = {axis: counted(axis, read) for axis, read in fc.readers.items()}
        return route(dataclasses.replace(fc, readers=readers)), calls

    def test_shipped_tables_never_read_the_lazy_axes(self) -> None:
        pick, calls = self._counting("attention")
        q = torch.zeros(1, 4, 2, 8)
        for _ in range(3):
            pick(None, (q, q, q, None, 0, None, False, None, {}))
        # once each, to build the context of the first (missed) call
        assert calls == dict.fromkeys(FACADES["attention"].call.readers, 1)
        plans = [p for (fam, _), p in current().facade_keys.items() if fam == "attention"]
        # no keyer: the base values are the key, and so for the compiled hot path too
        assert plans and all(p[0] is None for p in plans)

    def test_a_table_comparing_one_reads_only_it_on_every_call(self, tmp_path: Path) -> None:
        _attention_table(tmp_path, LENGTH_ROWS)
        pick, calls = self._counting("attention")
        q = torch.zeros(1, 4, 2, 8)
        astrai.ops.attention(q, q, q)  # another route of the family, on the same snapshot
        for _ in range(3):
            pick(None, (q, q, q, None, 0, None, False, None, {}))
        # q_len for each call's key, read by this route's own reader; the decision was
        # taken by the other route's call, so no context is built here
        assert calls == {**dict.fromkeys(FACADES["attention"].call.readers, 0), "q_len": 3}
        q2 = torch.zeros(1, 2000, 2, 8)  # a length in another interval: a miss, a context
        pick(None, (q2, q2, q2, None, 0, None, False, None, {}))
        assert calls == {**dict.fromkeys(FACADES["attention"].call.readers, 1), "q_len": 5}


class TestCutPoints:
    def test_thousand_lengths_three_decisions(self, tmp_path: Path) -> None:
        _attention_table(tmp_path, LENGTH_ROWS)
        before = stats().cache_misses
        served = {n: _served(n) for n in range(1, 1101)}
        assert stats().cache_misses - before == 3
        assert served[1] == 1.0
        assert {served[n] for n in range(2, 1024)} == {2.0}
        assert {served[n] for n in range(1024, 1101)} == {3.0}

    def test_explain_shows_the_raw_length(self, tmp_path: Path) -> None:
        _attention_table(tmp_path, LENGTH_ROWS)
        q = torch.zeros(1, 700, 2, 4)
        text = explain("attention", astrai.ops.context("attention", q, q, q))
        assert "q_len=700 kv_len=700" in text
        assert "one: reject (q_len == 1 (call has 700))" in text
        assert text.endswith("=> mid (origin=chain)")

    def test_axes_compared_with_each_other(self, tmp_path: Path) -> None:
        """``heads == kv_heads`` keys on how the two order, not on their values."""
        _attention_table(tmp_path, "  - name: mha\n    impl: tests.test_shape_axes:mha_row\n"
                                   "    when: heads == kv_heads\n")
        before = stats().cache_misses
        for heads in (1, 2, 4, 8, 16):
            assert _served(3, heads=heads, kv_heads=heads) == 4.0
        for heads, kv_heads in ((2, 1), (4, 2), (8, 2), (16, 4)):
            q = torch.randn(1, 3, heads, 4)
            k = torch.randn(1, 3, kv_heads, 4)
            torch.testing.assert_close(astrai.ops.attention(q, k, k),
                                       astrai.ops.attention(q, k, k, backend="math"))
        # MHA and GQA through the chain, and the explicit math row (one decision for all)
        assert stats().cache_misses - before == 3

    def test_pair_with_a_base_axis(self, tmp_path: Path) -> None:
        """A lazy axis compared with a base one (``q_len <= head_dim``)."""
        _attention_table(tmp_path, "  - name: short\n    impl: tests.test_shape_axes:one_row\n"
                                   "    when: q_len <= head_dim\n")
        assert _served(4) == 1.0 and _served(3) == 1.0  # head_dim is 4
        assert _served(5) != 1.0

    def test_device_and_sm(self, tmp_path: Path) -> None:
        _attention_table(tmp_path, "  - name: hopper\n    impl: tests.test_shape_axes:long_row\n"
                                   "    when: sm >= 90\n"
                                   "  - name: cpu\n    impl: tests.test_shape_axes:one_row\n"
                                   "    when: device == cpu and sm == none\n")
        assert _served(3) == 1.0
        q = torch.zeros(1, 3, 2, 4)
        assert "hopper: reject (sm >= 90 (call has none))" in explain(
            "attention", astrai.ops.context("attention", q, q, q))

    def test_reload_recomputes_the_cut_points(self, tmp_path: Path) -> None:
        _attention_table(tmp_path, LENGTH_ROWS)
        assert _served(600) == 2.0
        other = tmp_path / "other"
        other.mkdir()
        _attention_table(other, "  - name: long\n    impl: tests.test_shape_axes:long_row\n"
                                "    when: q_len >= 512\n")
        assert _served(600) == 3.0
        assert key_plan(current(), "attention").found.points == {"q_len": (512,)}

    def test_profile_comparisons_count(self, tmp_path: Path) -> None:
        """A profile's condition adds its cut points: a profile that disables ``mid`` for
        long prompts keys on 512 too."""
        _attention_table(tmp_path, LENGTH_ROWS)
        prof = tmp_path / "profiles"
        prof.mkdir()
        (prof / "short.yaml").write_text(
            "version: 1\nprofile: short\nfamilies:\n  attention:\n    when:\n"
            "      mid: q_len < 512\n")
        load_tables(tmp_path / "attention.yaml", prof / "short.yaml")
        assert key_plan(current(), "attention").found.points == {"q_len": (1, 2, 512, 1024)}
        with use_profile("short"):
            assert _served(100) == 2.0
            assert _served(600) == 0.0  # mid is held to q_len < 512: the fallback serves
        assert _served(600) == 2.0

    def test_resolve_keys_on_intervals(self, tmp_path: Path) -> None:
        _attention_table(tmp_path, LENGTH_ROWS)
        before = stats().cache_misses
        for n in range(2, 300):
            ctx = CallContext("attention", dtype=torch.float32, ndim=4, head_dim=8, q_len=n)
            assert resolve("attention", ctx).name == "mid"
        assert stats().cache_misses - before == 1

    def test_opaque_spec_keys_on_raw_values(self) -> None:
        """A Python predicate may read any axis any way: no interval can stand for it, so
        each length is its own decision - and each is right."""
        seven = ImplRecord("attention", "seven", one_row,
                           Spec.of(lambda ctx: ctx.q_len == 7, "q_len is seven"), priority=0)
        math = ImplRecord("attention", "math", math_attention)
        register_family("attention", [seven, math], fallback="math")
        assert key_plan(current(), "attention").found.opaque
        before = stats().cache_misses
        assert [_served(n) == 1.0 for n in (6, 7, 8, 7)] == [False, True, False, True]
        assert stats().cache_misses - before == 3

    def test_comparisons(self) -> None:
        found = comparisons([parse_spec("q_len == 1 or q_len >= 1024"),
                             parse_spec("heads == kv_heads and device == cuda")])
        assert found.points == {"q_len": (1, 2, 1024)}
        assert found.pairs == {("heads", "kv_heads")}
        assert found.axes == {"q_len", "heads", "kv_heads", "device"}
        assert not found.opaque


@pytest.mark.parametrize("text, error", [
    ("q_len >= 0.5", "unknown character '.'"),
    ("q_len >= large", "expected an integer"),
    ("device == gpu", "expected one of: cpu, cuda, mps, xpu"),
    ("heads == dtype", "type"),
])
def test_values_are_type_checked(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_spec(text)


class TestShippedTablesUseTheAxes:
    """The shipped tables give the compiled rows the token counts they were measured to
    win (``tables/rms_norm.yaml``, ``tables/rotary.yaml``), and nothing else."""

    @pytest.mark.parametrize("family, dtype, small, large, points", [
        ("rms_norm", torch.float32, 255, 256, (2, 256)),
        ("rotary", torch.bfloat16, 63, 64, (64, 512)),
    ])
    def test_compiled_row_from_its_cut(self, family: str, dtype: torch.dtype, small: int,
                                       large: int, points: tuple[int, ...]) -> None:
        from astrai.backends.inductor import inductor_available

        if inductor_available() is not True:
            pytest.skip("inductor cannot compile on this machine")
        ndim = 2 if family == "rms_norm" else 3
        below = resolve(family, CallContext(family, dtype=dtype, ndim=ndim, tokens=small))
        above = resolve(family, CallContext(family, dtype=dtype, ndim=ndim, tokens=large))
        assert below.name != "inductor_large"
        assert (above.name, above.origin) == ("inductor_large", "chain")
        assert key_plan(current(), family).found.points["tokens"] == points
