"""Tests of the rotary rows (torch, complex, reference), rotary_freqs and tables/rotary.yaml."""

from __future__ import annotations

import functools
import importlib
import itertools
import math
from typing import Any

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from astrai import ops
from astrai.backends.native import native_rotary
from astrai.backends.rotary import inductor_rotary, reference_rotary, rotary_freqs, torch_rotary
from astrai.dispatch import ExplicitSelectionError, parse_spec, shipped_tables_dir
from astrai.ops import context as ops_context

rotary_context = functools.partial(ops_context, "rotary")

# float64 is limited by the float32 (cos, sin) table that rotary_freqs returns.
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 2e-2, torch.float64: 1e-6}
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
ROWS = yaml.safe_load((shipped_tables_dir() / "rotary.yaml").read_text())["rows"]


def load_impl(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


IMPLS = {row["name"]: load_impl(row["impl"]) for row in ROWS}
WHEN = {row["name"]: parse_spec(row["when"]) for row in ROWS}


def accepts(name: str, x: torch.Tensor, freqs: torch.Tensor) -> bool:
    """Whether the table's ``when`` gives row ``name`` this call (eligibility is the YAML)."""
    return WHEN[name].matches(rotary_context(x, freqs))


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    torch.testing.assert_close(a.double(), b.double(), atol=tol, rtol=tol)


def loop_rotary(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotate each adjacent pair of a [..., seq, heads, d] / [tokens, heads, d] x in float64."""
    out = x.double().clone()
    d = x.shape[-1]
    flat_x, flat_out = x.double().reshape(-1, d), out.view(-1, d)
    heads = x.shape[-2]
    pos = positions.reshape(-1).repeat_interleave(heads)
    for r in range(flat_x.shape[0]):
        for i in range(d // 2):
            angle = float(pos[r]) * theta ** (-2 * i / d)
            a, b = float(flat_x[r, 2 * i]), float(flat_x[r, 2 * i + 1])
            flat_out[r, 2 * i] = a * math.cos(angle) - b * math.sin(angle)
            flat_out[r, 2 * i + 1] = a * math.sin(angle) + b * math.cos(angle)
    return out


LAYOUTS = ("dense_batch", "dense_shared", "dense_3d_table", "packed")


def make_call(layout: str, dtype: torch.dtype, d: int = 8, seed: int = 0) -> tuple[Any, ...]:
    """(x, freqs_cis, positions broadcast like x's leading dims) for a layout."""
    g = torch.Generator().manual_seed(seed)
    if layout == "packed":
        pos = torch.tensor([0, 1, 2, 0, 1, 7, 3])
        x = torch.randn(7, 3, d, generator=g).to(dtype)
        return x, rotary_freqs(pos, d), pos
    x = torch.randn(2, 5, 3, d, generator=g).to(dtype)
    if layout == "dense_batch":
        pos = torch.tensor([[0, 1, 2, 3, 4], [6, 7, 8, 9, 10]])
        return x, rotary_freqs(pos, d), pos
    pos = torch.arange(5)
    table = rotary_freqs(pos, d)
    freqs = table if layout == "dense_3d_table" else table.unsqueeze(0)
    return x, freqs, pos.expand(2, 5)


class TestRotaryFreqs:
    def test_shape_and_values(self) -> None:
        """The table is [*positions, d/2, 2] of (cos, sin) with angle pos * theta^(-2i/d)."""
        table = rotary_freqs(torch.tensor([[0, 3]]), 8, theta=100.0)
        assert table.shape == (1, 2, 4, 2) and table.dtype == torch.float32
        assert torch.equal(table[0, 0], torch.tensor([[1.0, 0.0]] * 4))
        angles = 3 * 100.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
        torch.testing.assert_close(table[0, 1, :, 0].double(), angles.cos(), atol=1e-7, rtol=0)
        torch.testing.assert_close(table[0, 1, :, 1].double(), angles.sin(), atol=1e-7, rtol=0)

    def test_int_positions_mean_arange(self) -> None:
        """An int is a count of positions starting at 0."""
        assert torch.equal(rotary_freqs(6, 4), rotary_freqs(torch.arange(6), 4))

    def test_error_odd_head_dim(self) -> None:
        """An odd head_dim cannot form pairs."""
        with pytest.raises(ValueError, match="head_dim must be even"):
            rotary_freqs(4, 7)


class TestRotaryNumerics:
    @pytest.mark.parametrize("layout", LAYOUTS)
    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    def test_rows_agree_with_the_loop_and_each_other(self, layout: str, dtype: torch.dtype) -> None:
        """Every row that accepts the call matches a per-pair float64 loop and the others."""
        x, freqs, pos = make_call(layout, dtype)
        want = loop_rotary(x, pos)
        outs = {}
        for name, impl in IMPLS.items():
            if accepts(name, x, freqs):
                out = impl(x, freqs)
                assert out.shape == x.shape and out.dtype == dtype
                close(out, want, dtype)
                outs[name] = out
        assert {"torch", "reference"} <= outs.keys()
        assert ("complex" in outs) == (dtype in (torch.float32, torch.float64))
        for a, b in itertools.combinations(outs.values(), 2):
            close(a, b, dtype)

    @settings(max_examples=25, deadline=None)
    @given(
        m=st.integers(0, 64), n=st.integers(0, 64), shift=st.integers(0, 64),
        half=st.integers(1, 8), seed=st.integers(0, 2**16),
    )
    def test_scores_depend_only_on_relative_position(
        self, m: int, n: int, shift: int, half: int, seed: int
    ) -> None:
        """<rot(q, m), rot(k, n)> equals <rot(q, m+s), rot(k, n+s)> for every row."""
        g = torch.Generator().manual_seed(seed)
        d = 2 * half
        q, k = torch.randn(2, 1, 1, d, generator=g, dtype=torch.float64)
        pairs = rotary_freqs(torch.tensor([m]), d).double()
        for name, impl in IMPLS.items():
            if not accepts(name, q, pairs):  # rows of the half layout only
                continue

            def score(a: int, b: int, impl: Any = impl) -> float:
                fa = rotary_freqs(torch.tensor([a]), d).double()
                fb = rotary_freqs(torch.tensor([b]), d).double()
                return float((impl(q, fa) * impl(k, fb)).sum())
            assert math.isclose(score(m, n), score(m + shift, n + shift), abs_tol=1e-4)

    def test_rotation_keeps_pair_norms(self) -> None:
        """Each (2i, 2i+1) pair keeps its length: the pairs are adjacent elements."""
        x, freqs, _ = make_call("packed", torch.float64)

        def norms(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(*t.shape[:-1], -1, 2).square().sum(dim=-1)

        for name, impl in IMPLS.items():
            if accepts(name, x, freqs):
                torch.testing.assert_close(norms(impl(x, freqs)), norms(x))

    @pytest.mark.parametrize("row", list(IMPLS))
    def test_error_table_does_not_fit(self, row: str) -> None:
        """A freqs_cis of the wrong shape is a ValueError showing the expected shape, raised
        before any row runs."""
        x = torch.randn(2, 5, 3, 8)
        with pytest.raises(ValueError, match=r"expected \[2 or 1, 5, 4, 2\]"):
            ops.apply_rotary(x, rotary_freqs(torch.arange(4), 8).unsqueeze(0), backend=row)
        with pytest.raises(ValueError, match="does not fit"):
            ops.apply_rotary(x[0], rotary_freqs(torch.arange(4), 8), backend=row)
        with pytest.raises(ValueError, match="even head_dim"):
            ops.apply_rotary(torch.randn(4, 2, 7), torch.zeros(4, 3, 2), backend=row)

    def test_error_complex_row_refuses_half_types(self) -> None:
        """The complex row's ``when`` names the dtypes it takes instead of upcasting."""
        x, freqs, _ = make_call("packed", torch.float16)
        with pytest.raises(ExplicitSelectionError,
                           match=r"'complex'.*requires dtype in \{float32, float64\}"):
            ops.apply_rotary(x, freqs, backend="complex")


class TestTable:
    def test_table_names_the_module_objects(self) -> None:
        """The rows bind to this module's instances, in the documented order."""
        assert list(IMPLS) == ["native", "complex", "inductor_large", "torch", "inductor",
                               "reference"]
        assert IMPLS["native"] is native_rotary
        assert IMPLS["torch"] is torch_rotary and IMPLS["reference"] is reference_rotary
        assert IMPLS["inductor"] is IMPLS["inductor_large"] is inductor_rotary
        assert yaml.safe_load((shipped_tables_dir() / "rotary.yaml").read_text())[
            "fallback"
        ] == "reference"


def test_fast_check_agrees_with_full_check() -> None:
    """The facade's fast acceptance of a rotary call is exactly the full check's."""
    from astrai.backends.rotary import check_rotary_call
    from astrai.families.rotary import describe_rotary

    xs = [(2, 5, 3, 8), (1, 5, 3, 8), (5, 3, 8), (2, 5, 3, 7), (2, 5, 3, 0), (5, 8), (2, 5)]
    tables = [(2, 5, 4, 2), (1, 5, 4, 2), (3, 5, 4, 2), (5, 4, 2), (2, 4, 4, 2), (5, 4, 3),
              (4, 4, 2), (5, 3, 2), (1, 5, 3, 2), (5, 0, 2), (4, 2), ()]
    for xshape, tshape in itertools.product(xs, tables):
        for tdtype in (torch.float32, torch.int64):
            x, t = torch.zeros(xshape), torch.zeros(tshape, dtype=tdtype)
            try:
                check_rotary_call(x, t)
                full = True
            except ValueError:
                full = False
            try:
                describe_rotary(x, t)
                fast = True
            except ValueError:
                fast = False
            assert fast == full, (xshape, tshape, tdtype)
