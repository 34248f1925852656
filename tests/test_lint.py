"""Tests for table lint (contract §10): shadowed and unsatisfiable rows, and the coverage matrix."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import pytest

from astrai.dispatch import lint
from astrai.dispatch.axes import CORE_VOCABULARY, Axis
from astrai.dispatch.expr.spec import Spec, parse_spec
from astrai.dispatch.lint import LintFinding, LintReport, lint_all, lint_family, lint_view
from astrai.dispatch.registry import current
from astrai.dispatch.tables.model import FamilyTable, ImplRecord, View

QUANT = Axis("quant", "enum", ("int8", "fp8"), nullable=True, core=False)
SPAN = Axis("span", "int", nullable=True, core=False)
EXTRAS: Mapping[str, Axis] = MappingProxyType({"quant": QUANT, "span": SPAN})

Row = tuple[str, str | Spec] | tuple[str, str | Spec, dict[str, Any]]


def make_view(*rows: Row, fallback: str = "", axes: Mapping[str, Axis] = EXTRAS,
              **view_kw: Any) -> View:
    """A ``View`` of a family ``fam`` whose rows are ``(name, when[, record options])``."""
    vocabulary = CORE_VOCABULARY.with_extras(axes)
    records = []
    for name, when, *opts in rows:
        spec = parse_spec(when, vocabulary) if isinstance(when, str) else when
        records.append(ImplRecord("fam", name, object(), spec, **(opts[0] if opts else {})))
    table = FamilyTable("fam", tuple(records), fallback or records[-1].name, axes=axes)
    return View(table, table.rows, table.fallback_record, **view_kw)


def kinds(report: LintReport) -> dict[str, str]:
    """Row name -> kind of finding, for compact assertions."""
    return {p.row: p.kind for p in report.problems}


def winner(report: LintReport, **cells: str) -> str:
    """The winner of the single coverage region that contains the given axis values."""
    found = [w for region, w in report.coverage
             if all(region[a] == "*" or v in region[a].split(",") for a, v in cells.items())]
    assert len(found) == 1, (cells, report.coverage)
    return found[0]


class TestLintView:
    def test_shadowed_by_earlier_always_row(self) -> None:
        """A row after an ``always`` row is reported as shadowed by it."""
        report = lint_view(make_view(("a", "always"), ("b", "dtype == float16"),
                                     ("ref", "always")))
        assert report.problems == [LintFinding(
            "shadowed", "b", "row 'b' is shadowed by 'a' (every call it accepts is taken "
            "earlier)", ("a",))]

    def test_a_row_shadowed_only_by_probed_rows_is_a_backup(self) -> None:
        """A row whose calls are all taken by rows with an availability probe wins where
        they are unavailable: a note; one shadowed by any unprobed row is a finding."""
        def probe() -> bool:
            return True

        report = lint_view(make_view(("fast", "dtype == float32", {"available": probe}),
                                     ("backup", "dtype == float32"), ("ref", "always")))
        assert report.problems == []
        assert "row 'backup' wins only where 'fast' is unavailable (each has an " \
               "availability probe)" in report.notes
        report = lint_view(make_view(("fast", "dtype == float32", {"available": probe}),
                                     ("any", "dtype in {float16, float32}"),
                                     ("backup", "dtype == float32"), ("ref", "always")))
        assert kinds(report) == {"backup": "shadowed"}

    def test_shadowed_by_union_of_two_rows(self) -> None:
        """A row covered by two earlier rows together names both of them, in order."""
        report = lint_view(make_view(("f16", "dtype == float16"), ("bf16", "dtype == bfloat16"),
                                     ("both", "dtype in {float16, bfloat16}"), ("ref", "always")))
        assert kinds(report) == {"both": "shadowed"}
        assert report.problems[0].by == ("f16", "bf16")

    def test_partial_overlap_is_not_shadowed(self) -> None:
        """A row that keeps at least one call of its own is not reported."""
        report = lint_view(make_view(("f16", "dtype == float16"),
                                     ("half_or_f32", "dtype in {float16, float32}"),
                                     ("ref", "always")))
        assert report.ok

    @pytest.mark.parametrize("when", ["ndim == 3 and ndim == 4", "has_cache and not has_cache",
                                      "ndim < 3 and ndim > 5", "never",
                                      "inference and fwd == none"])
    def test_unsatisfiable_row(self, when: str) -> None:
        """A row whose condition accepts no call is unsatisfiable, with its condition shown."""
        report = lint_view(make_view(("x", when), ("ref", "always")))
        assert report.problems == [LintFinding("unsatisfiable", "x",
                                               f"row 'x' is unsatisfiable: {when}")]

    def test_int_boundary_le_then_lt_is_shadowed(self) -> None:
        """``head_dim < 128`` after ``head_dim <= 128`` can never win."""
        report = lint_view(make_view(("le", "head_dim <= 128"), ("lt", "head_dim < 128"),
                                     ("ref", "always")))
        assert kinds(report) == {"lt": "shadowed"}

    def test_int_boundary_lt_then_le_is_not_shadowed(self) -> None:
        """``head_dim <= 128`` after ``head_dim < 128`` still wins at exactly 128."""
        report = lint_view(make_view(("lt", "head_dim < 128"), ("le", "head_dim <= 128"),
                                     ("ref", "always")))
        assert report.ok
        assert winner(report, head_dim="128") == "le"
        assert winner(report, head_dim="<128") == "lt"

    def test_int_gaps_between_mentioned_values(self) -> None:
        """Values strictly between two mentioned ints are a class of their own."""
        report = lint_view(make_view(("a", "ndim >= 2 and ndim <= 5 and ndim != 3"),
                                     ("b", "ndim > 1 and ndim < 6"), ("ref", "always")))
        assert report.ok
        assert winner(report, ndim="3") == "b"
        assert winner(report, ndim="4") == "a"

    def test_non_faithful_row_is_explicit_only(self) -> None:
        """A non-faithful row nobody enables is explicit-only: a note, never a shadow."""
        report = lint_view(make_view(("fp8", "always", {"faithful": False}), ("a", "always"),
                                     ("late", "dtype == float16", {"faithful": False}),
                                     ("ref", "always")))
        assert report.ok
        assert "row 'fp8' is explicit-only (not faithful; no profile enables it)" in report.notes
        assert winner(report) == "a"

    def test_enabled_non_faithful_row_shadows(self) -> None:
        """A non-faithful row enabled by a profile takes part in the chain and can shadow."""
        report = lint_view(make_view(("fp8", "always", {"faithful": False}), ("a", "ndim == 2"),
                                     ("ref", "always"), enabled={"fp8": "fast"}))
        assert kinds(report) == {"a": "shadowed"}
        assert report.problems[0].by == ("fp8",)

    def test_profile_disabled_row_does_not_shadow(self) -> None:
        """A row disabled by a profile is skipped, so the rows after it can still win."""
        report = lint_view(make_view(("a", "always"), ("b", "dtype == float16"),
                                     ("ref", "always"), disabled={"a": "slow"}))
        assert report.ok
        assert "row 'a' is disabled by profile slow" in report.notes
        assert winner(report, dtype="float16") == "b"

    def test_extra_axes_are_analysed(self) -> None:
        """A family's extra axes are enumerated like core ones (enum with none, int classes)."""
        report = lint_view(make_view(("q", "quant == int8 and span > 64"),
                                     ("q2", "quant in {int8} and span >= 65"),
                                     ("any", "quant != none"), ("ref", "always")))
        assert kinds(report) == {"q2": "shadowed"}
        assert report.axes == ("quant", "span")
        assert winner(report, quant="int8", span="65") == "q"
        assert winner(report, quant="int8", span=">65") == "q"
        assert winner(report, quant="fp8", span="64") == "any"
        assert winner(report, quant="none", span="none") == "ref"

    def test_coverage_matrix_winners(self) -> None:
        """Each region of the coverage matrix names the row the chain picks there."""
        report = lint_view(make_view(("fast", "dtype == bfloat16 and has_cache"),
                                     ("mid", "dtype in {float16, bfloat16}"),
                                     ("ref", "training")))
        assert report.axes == ("fwd", "dtype", "has_cache")
        assert winner(report, fwd="decode", dtype="bfloat16", has_cache="true") == "fast"
        assert winner(report, fwd="decode", dtype="bfloat16", has_cache="false") == "mid"
        assert winner(report, fwd="none", dtype="float16", has_cache="true") == "mid"
        # No row takes it, and the fallback (training only) rejects it too: the call raises.
        assert winner(report, fwd="prefill", dtype="other", has_cache="true") == lint.NO_ROW
        assert winner(report, fwd="none", dtype="other", has_cache="true") == "ref"
        assert winner(report, fwd="none", dtype="other", has_cache="false") == "ref"

    def test_coverage_regions_are_compact(self) -> None:
        """An axis on which the winner does not depend collapses to ``*``."""
        report = lint_view(make_view(("a", "dtype == float16 or has_mask"), ("ref", "always")))
        assert report.coverage == [({"dtype": "float16", "has_mask": "false"}, "a"),
                                   ({"dtype": "*", "has_mask": "true"}, "a"),
                                   ({"dtype": "other", "has_mask": "false"}, "ref")]

    def test_fallback_is_exempt_from_shadowed(self) -> None:
        """A fallback that never wins is a note, not a problem."""
        report = lint_view(make_view(("a", "always"), ("ref", "always")))
        assert report.ok
        assert "fallback row 'ref' never wins: every call is taken earlier by 'a'" in report.notes

    def test_fallback_with_never_is_a_note(self) -> None:
        """A fallback whose condition matches nothing is a note, not a finding; a call no
        other row takes then has no row (it raises, as the fallback's ``when`` rules it
        out)."""
        report = lint_view(make_view(("a", "ndim == 4"), ("ref", "never")))
        assert report.ok
        assert any("raises NoImplementationError" in n for n in report.notes)
        assert winner(report, ndim="<4") == lint.NO_ROW

    def test_fallback_in_the_middle_shadows_later_rows(self) -> None:
        """Rows after a fallback that accepts every call are shadowed by it."""
        report = lint_view(make_view(("ref", "always"), ("b", "ndim == 3"), fallback="ref"))
        assert kinds(report) == {"b": "shadowed"}

    def test_opaque_row_is_not_analysable(self) -> None:
        """A Python predicate may match anything: it never shadows and is noted, not flagged."""
        opaque = Spec.of(lambda ctx: ctx.ndim == 3, "is packed")
        report = lint_view(make_view(("py", opaque), ("b", "ndim == 3"), ("ref", "always")))
        assert report.ok
        assert any("row 'py' is not analysable" in n and "is packed" in n for n in report.notes)
        assert winner(report, ndim="3") == "maybe py, else b"

    def test_opaque_row_after_always_is_shadowed(self) -> None:
        """Even an opaque row is shadowed when an earlier row accepts every call."""
        opaque = Spec.of(lambda ctx: True, "custom") & parse_spec("ndim == 3")
        report = lint_view(make_view(("a", "always"), ("py", opaque), ("ref", "always")))
        assert kinds(report) == {"py": "shadowed"}

    def test_forced_row_is_a_note(self) -> None:
        """Rows that lose only to a profile's forced row are notes, not problems."""
        report = lint_view(make_view(("a", "dtype == float16"), ("ref", "always"),
                                     forced=("ref", "reference"), profiles=("reference",)))
        assert report.ok
        assert "row 'a' never wins while profile reference forces 'ref'" in report.notes
        assert winner(report, dtype="float16") == "ref"

    def test_too_many_combinations_are_sampled(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Above the cap a deterministic sample is analysed, and the report says so."""
        monkeypatch.setattr(lint, "MAX_COMBINATIONS", 5)
        report = lint_view(make_view(("a", "dtype in {float16, bfloat16} and has_cache"),
                                     ("ref", "always")))
        assert any("too many combinations (6); analysed a sample of 5" in n
                   for n in report.notes)


class TestLintReport:
    def test_render(self) -> None:
        """``render`` prints problems prefixed by the family, then the coverage table."""
        report = lint_view(make_view(("a", "dtype == float16"), ("b", "ndim == 3 and ndim == 4"),
                                     ("c", "dtype in {float16}"), ("ref", "always")))
        assert report.render() == "\n".join([
            "fam: row 'b' is unsatisfiable: ndim == 3 and ndim == 4",
            "fam: row 'c' is shadowed by 'a' (every call it accepts is taken earlier)",
            "fam: coverage (every row assumed available; '(here: x)' where the winner is not "
            "available on this machine and x serves):",
            "  dtype    ndim  winner",
            "  float16  *     a",
            "  other    *     ref",
        ])

    def test_render_ok_without_coverage(self) -> None:
        """A clean report renders one ok line when the coverage table is left out."""
        report = lint_view(make_view(("a", "ndim == 3"), ("ref", "always")))
        assert report.ok
        assert report.render(coverage=False) == "fam: ok: no shadowed or unsatisfiable rows"


class TestLintFamily:
    def test_matches_lint_view_of_the_loaded_family(self) -> None:
        """``lint_family`` lints the registry's view of the family."""
        family = sorted(current().families)[0]
        state = current()
        assert lint_family(family).render() == lint_view(state.view(family, ()), state).render()

    def test_reference_profile_forces_the_fallback(self) -> None:
        """Under the shipped reference profile every family is clean: forcing is intended."""
        report = lint_family("attention", ("reference",))
        assert report.ok
        assert report.profiles == ("reference",)

    def test_unknown_family(self) -> None:
        """An unknown family is a ``KeyError``."""
        with pytest.raises(KeyError, match="no_such_family"):
            lint_family("no_such_family")

    def test_unknown_profile(self) -> None:
        """An unknown profile is a ``ValueError`` listing the known ones."""
        with pytest.raises(ValueError, match=r"unknown profile 'nope'; profiles: .*reference"):
            lint_family("attention", ("nope",))


class TestLintAll:
    def test_one_report_per_family(self) -> None:
        """``lint_all`` reports every loaded family, sorted by name."""
        reports = lint_all()
        assert [r.family for r in reports] == sorted(current().families)
        assert all(r.coverage for r in reports)

    def test_unknown_profile(self) -> None:
        """An unknown profile is a ``ValueError``."""
        with pytest.raises(ValueError, match="nope"):
            lint_all(("nope",))


class TestAxisComparisons:
    """``head_dim == ndim``-style comparisons of two axes."""

    def test_equal_then_unequal_are_both_reachable(self) -> None:
        """Rows split on whether two axes are equal: neither is shadowed or unsatisfiable,
        even with a constant in play."""
        report = lint_view(make_view(("eq", "head_dim == ndim and head_dim >= 64"),
                                     ("ne", "head_dim != ndim"), ("ref", "always")))
        assert report.ok, report.problems

    def test_contradiction_is_unsatisfiable(self) -> None:
        report = lint_view(make_view(("x", "head_dim < ndim and ndim < head_dim"),
                                     ("ref", "always")))
        assert kinds(report) == {"x": "unsatisfiable"}

    def test_equal_after_less_or_equal_is_shadowed(self) -> None:
        """(Two unknown values are equal, so ``<=`` needs the ``none`` case to cover ``==``.)"""
        report = lint_view(make_view(("le", "head_dim <= ndim or head_dim == none"),
                                     ("eq", "head_dim == ndim"), ("ref", "always")))
        assert kinds(report) == {"eq": "shadowed"}


class TestShapeAxes:
    """Lint over the shape and hardware axes: each interval between the
    constants a length is compared with is analysed, so a row that loses every interval
    is flagged and one that wins a single interval is not."""

    def test_shadowed_for_every_interval(self) -> None:
        report = lint_view(make_view(("short", "q_len < 128"), ("long", "q_len >= 128"),
                                     ("huge", "q_len > 4096 and device == cuda"),
                                     ("ref", "always")))
        assert kinds(report) == {"huge": "shadowed"}
        assert report.problems[0].by == ("long",)

    def test_one_interval_left_is_not_shadowed(self) -> None:
        report = lint_view(make_view(("short", "q_len < 128"), ("long", "q_len > 128"),
                                     ("edge", "q_len in {128, 129}"), ("ref", "always")))
        assert kinds(report) == {}
        assert winner(report, q_len="128") == "edge"

    def test_pair_of_axes(self) -> None:
        """``heads == kv_heads`` and ``heads != kv_heads`` cover every call between them."""
        report = lint_view(make_view(("mha", "heads == kv_heads"), ("gqa", "heads != kv_heads"),
                                     ("any", "sm >= 80"), ("ref", "always")))
        assert kinds(report) == {"any": "shadowed"}

    def test_device_and_sm(self) -> None:
        report = lint_view(make_view(("hopper", "device == cuda and sm >= 90"),
                                     ("cuda", "device == cuda"),
                                     ("cuda90", "device == cuda and sm >= 90 and q_len >= 1"),
                                     ("ref", "always")))
        assert kinds(report) == {"cuda90": "shadowed"}


class TestFeatures:
    """Feature requests are one dimension of the domain (none, each declared feature,
    each row's declared set), not the product of six axes."""

    def test_a_row_winning_only_feature_calls_is_not_shadowed(self) -> None:
        report = lint_view(make_view(("fast", "always"),
                                     ("capped", "always", {"features": frozenset({"softcap"})}),
                                     ("ref", "always", {"features": frozenset({"softcap",
                                                                               "scale"})})))
        assert kinds(report) == {}
        assert winner(report, features="softcap") == "capped"
        assert winner(report, features="none") == "fast"
        assert winner(report, features="scale") == "ref"

    def test_shadowed_among_feature_rows(self) -> None:
        report = lint_view(make_view(("capped", "always", {"features": frozenset({"softcap"})}),
                                     ("capped2", "dtype == float16",
                                      {"features": frozenset({"softcap"})}),
                                     ("ref", "always", {"features": frozenset({"softcap"})})))
        assert kinds(report) == {"capped2": "shadowed"}

    def test_shipped_attention_is_analysed_whole(self) -> None:
        report = lint_family("attention")
        assert not any("sample" in note for note in report.notes)
        assert report.ok


@pytest.mark.parametrize("profiles", [(), ("reference",), ("low-precision",)])
def test_coverage_names_what_explain_picks(profiles: tuple[str, ...]) -> None:
    """Every cell of every shipped family's coverage matrix (under each shipped profile)
    names the row ``resolve`` and ``explain`` pick for a call of that region on this
    machine, or ``no row`` exactly where they raise ``NoImplementationError``."""
    import astrai.dispatch as dispatch
    from astrai.dispatch.explain import explain
    from astrai.errors import NoImplementationError

    checked = 0
    with dispatch.use_profile(*profiles):
        for report in lint_all(profiles):
            assert len(report.examples) == len(report.coverage)
            for (cells, label), ctx in zip(report.coverage, report.examples, strict=True):
                assert ctx.family == report.family
                here = label.split(" (here: ")[-1].rstrip(")") if "(here: " in label else label
                said = explain(report.family, ctx)
                try:
                    got = dispatch.resolve(report.family, ctx).name
                except NoImplementationError:
                    got = lint.NO_ROW
                    assert f"no {report.family} row can serve this call" in said
                else:
                    assert f"=> {got} (origin=" in said.splitlines()[-1]
                assert got == here, (report.family, cells, label)
                checked += 1
    assert checked >= 10  # every family has a few regions


def test_no_row_where_the_fallback_rejects() -> None:
    """A region no row accepts, the fallback included, says ``no row`` (the call raises),
    not the fallback's name."""
    report = lint_view(make_view(("fast", "ndim == 4"), ("reference", "ndim >= 3")))
    assert winner(report, ndim="4") == "fast"
    assert winner(report, ndim="3") == "reference"
    assert winner(report, ndim="<3") == lint.NO_ROW
