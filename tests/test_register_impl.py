"""``register_impl`` / ``unregister_impl``: a package joins a row to an
existing family in Python, placed where it asks, kept across reloads, and the seed's
contract (priority, faithful, availability) holds for it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import astrai.dispatch as d
import astrai.ops as ops
from astrai.backends.rms_norm import reference_rms_norm
from astrai.dispatch.tables.model import Unavailable, table_revision


def doubled(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return reference_rms_norm(x, weight, eps) * 2


def _rows() -> list[str]:
    return d.current().family("rms_norm").row_names()


def _served(x: torch.Tensor | None = None) -> str:
    x = torch.randn(2, 8) if x is None else x
    return d.resolve("rms_norm", ops.context("rms_norm", x, torch.ones(8))).name


def _row(name: str, **kw: object) -> d.ImplRecord:
    return d.ImplRecord("rms_norm", name, doubled, **kw)  # type: ignore[arg-type]


class TestPlacement:
    def test_without_an_anchor_it_is_tried_first_like_a_plugin_row(self) -> None:
        """One rule for every joined row without an anchor: before the family's first
        faithful row, in the order joined (its priority does not move it; the seed's
        default 100 used to put it last, where the chain never tried it)."""
        first_faithful = next(r.name for r in d.current().family("rms_norm").rows
                              if r.faithful)
        d.register_impl(_row("early", priority=0))
        d.register_impl(_row("late"))
        rows = _rows()
        assert rows.index("early") + 1 == rows.index("late") == rows.index(first_faithful) - 1
        assert _served() == "early"

    def test_before_and_after(self) -> None:
        d.register_impl(_row("first"), before=d.current().family("rms_norm").rows[0].name)
        d.register_impl(_row("second"), after="torch")
        rows = _rows()
        assert rows[0] == "first"
        assert rows[rows.index("torch") + 1] == "second"
        assert _served() == "first"
        torch.testing.assert_close(ops.rms_norm(torch.ones(2, 8), torch.ones(8)),
                                   torch.full((2, 8), 2.0))

    def test_registering_a_name_again_replaces_it(self) -> None:
        d.register_impl(_row("mine"), before="torch")
        d.register_impl(_row("mine"), after="torch")
        rows = _rows()
        assert rows.count("mine") == 1 and rows.index("mine") == rows.index("torch") + 1


class TestLifetime:
    def test_survives_reload_and_a_replaced_table(self, write_yaml: Callable[[str, str], Path]
                                                  ) -> None:
        d.register_impl(_row("mine"), before="torch")
        d.reload_tables()
        assert "mine" in _rows()
        d.load_tables(write_yaml("rms_norm.yaml", """\
            version: 1
            family: rms_norm
            fallback: torch
            rows:
              - name: torch
                impl: astrai.backends.rms_norm:reference_rms_norm
            """))
        assert _rows() == ["mine", "torch"]

    def test_decisions_follow_at_once(self) -> None:
        x = torch.randn(2, 8)
        assert _served(x) == "torch"  # cached now
        d.register_impl(_row("mine", priority=-1))
        assert _served(x) == "mine"
        d.unregister_impl("rms_norm", "mine")
        assert _served(x) == "torch" and "mine" not in _rows()

    def test_revision_tells_the_tables_apart(self) -> None:
        before = table_revision(d.current().family("rms_norm"))
        d.register_impl(_row("mine"))
        joined = table_revision(d.current().family("rms_norm"))
        assert joined != before and joined.startswith(before + "+joined-")
        d.unregister_impl("rms_norm", "mine")
        assert table_revision(d.current().family("rms_norm")) == before


class TestSeedContract:
    def test_unfaithful_row_is_explicit_only(self) -> None:
        d.register_impl(_row("lossy", priority=-1, faithful=False))
        assert _served() == "torch"
        x = torch.ones(2, 8)
        torch.testing.assert_close(ops.rms_norm(x, torch.ones(8), backend="lossy"),
                                   torch.full((2, 8), 2.0))

    def test_unavailable_row_is_skipped_with_its_reason(self) -> None:
        d.register_impl(_row("gone", priority=-1,
                             available=lambda: Unavailable("needs a widget")))
        assert _served() == "torch"
        text = d.explain("rms_norm", ops.context("rms_norm", torch.randn(2, 8), torch.ones(8)))
        assert "gone: SKIP unavailable (needs a widget)" in text

    def test_source_names_the_caller(self) -> None:
        d.register_impl(_row("mine"))
        assert d.current().family("rms_norm").row("mine").source == (  # type: ignore[union-attr]
            f"register_impl ({__name__})")


@pytest.mark.parametrize("call, error", [
    (lambda: d.register_impl(_row("torch")), "already has a row 'torch'"),
    (lambda: d.register_impl(_row("x"), before="trch"), "did you mean 'torch'"),
    (lambda: d.register_impl(_row("x"), before="torch", after="torch"), "not both"),
    (lambda: d.unregister_impl("rms_norm", "torch"), "was not joined by register_impl"),
    (lambda: d.register_impl(d.ImplRecord("nofam", "x", doubled)), "known families"),
])
def test_errors(call: Callable[[], None], error: str) -> None:
    rows = _rows()
    with pytest.raises((ValueError, KeyError), match=error):
        call()
    assert _rows() == rows  # nothing changed


def test_a_profile_may_name_a_joined_row(write_yaml: Callable[[str, str], Path]) -> None:
    """Profiles are checked against the family with its joined rows in place."""
    d.register_impl(_row("lossy", faithful=False))
    d.load_tables(write_yaml("profiles/lossy.yaml",
                             "version: 1\nprofile: lossy\nfamilies:\n  rms_norm:\n"
                             "    enable: [lossy]\n    order: [lossy]\n"))
    assert _served() == "torch"
    with d.use_profile("lossy"):
        assert _served() == "lossy"
