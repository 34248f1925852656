"""A profile's ``chain_when``: where the implicit chain may try a row, without narrowing
what the row serves when selected by name (what a tuned profile's buckets need)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import astrai.dispatch as d
import astrai.ops as ops
from astrai.dispatch.explain import explain
from astrai.dispatch.lint import lint_view
from astrai.errors import ExplicitSelectionError, TableError
from tests.conftest import ctx

Write = Callable[[str, str], Path]

NARROW = """\
version: 1
profile: narrow
families:
  toy:
    chain_when:
      fast: has_cache
"""


@pytest.fixture
def narrow(toy: Path, write_yaml: Write) -> None:
    d.load_tables(write_yaml("narrow.yaml", NARROW))


@pytest.mark.usefixtures("narrow")
class TestChainWhen:
    def test_narrows_the_chain_only(self) -> None:
        with d.use_profile("narrow"):
            assert d.resolve("toy", ctx(3)).name == "ref"  # fast is kept off: no cache
            assert d.resolve("toy", ctx(3, has_cache=True)).name == "fast"
            got = d.resolve("toy", ctx(3), "fast")  # by name: its own when, ndim == 3
            assert (got.name, got.origin) == ("fast", "explicit")
            with d.op_backend(toy="fast"):
                assert d.resolve("toy", ctx(3)).name == "fast"
            with pytest.raises(ExplicitSelectionError, match="requires ndim == 3"):
                d.resolve("toy", ctx(2), "fast")  # what the row cannot serve, it never does
        assert d.resolve("toy", ctx(3)).name == "fast"  # without the profile

    def test_forcing_is_not_narrowed(self, write_yaml: Write) -> None:
        d.load_tables(write_yaml("force.yaml", NARROW.replace("narrow", "narrow-force")
                                 + "    force: fast\n"))
        with d.use_profile("narrow-force"):
            got = d.resolve("toy", ctx(3))
            assert (got.name, got.origin) == ("fast", "profile")

    def test_explain_says_why(self) -> None:
        with d.use_profile("narrow"):
            text = explain("toy", ctx(3)).splitlines()
        assert "  fast: reject (has_cache (call has has_cache=false))" in text
        assert "  note: profile narrow: the chain tries fast only where has_cache" in text
        with d.use_profile("narrow"):
            text = explain("toy", ctx(3, has_cache=True)).splitlines()
        assert "  fast: MATCH (ndim == 3 and has_cache)" in text

    def test_profiles_add_up(self, write_yaml: Write) -> None:
        d.load_tables(write_yaml("more.yaml", NARROW.replace("narrow", "more")
                                 .replace("has_cache", "has_mask")))
        with d.use_profile("narrow", "more"):
            assert d.resolve("toy", ctx(3, has_cache=True)).name == "ref"
            assert d.resolve("toy", ctx(3, has_cache=True, has_mask=True)).name == "fast"

    def test_lint_sees_the_narrowed_chain(self, write_yaml: Write) -> None:
        d.load_tables(write_yaml("never.yaml", NARROW.replace("narrow", "never")
                                 .replace("has_cache", "ndim == 2")))
        def fast(profiles: tuple[str, ...]) -> list[str]:
            report = lint_view(d.current().view("toy", profiles))
            return [f.kind for f in report.problems if f.row == "fast"]

        assert fast(("never",)) == ["unsatisfiable"]
        assert fast(()) == []


def test_an_unknown_row_is_a_located_error(toy: Path, write_yaml: Write) -> None:
    path = write_yaml("bad.yaml", NARROW.replace("fast:", "fats:"))
    with pytest.raises(TableError) as err:
        d.load_tables(path)
    assert str(err.value).startswith(f"{path}:6:7: chain_when: row 'fats' does not exist "
                                     f"(did you mean 'fast'?)")


def test_a_compared_size_keys_by_interval(write_yaml: Write) -> None:
    """A size compared only in a chain_when still keys calls by interval, not by value."""
    d.load_tables(write_yaml("big.yaml", """\
        version: 1
        profile: big
        families:
          rms_norm:
            chain_when:
              torch: tokens < 100
        """))
    before = d.stats().cache_misses
    with d.use_profile("big"):
        served = {d.resolve("rms_norm", ops.context("rms_norm", torch.randn(n, 8),
                                                    torch.ones(8))).name
                  for n in range(1, 250, 7)}  # below inductor_large (256 tokens)
        assert d.resolve("rms_norm", ops.context("rms_norm", torch.randn(5000, 8),
                                                 torch.ones(8))).name == "inductor_large"
    assert served == {"torch", "reference"}
    assert d.stats().cache_misses - before <= 4


def test_a_row_the_same_overlay_adds(toy: Path, write_yaml: Write) -> None:
    """chain_when, disable and force reach a row the same overlay adds."""
    base = ("version: 1\nprofile: {name}\nfamilies:\n  toy:\n    add:\n"
            "      - {{name: extra, impl: 'tests._impls:slow', when: ndim == 3}}\n")
    d.load_tables(
        write_yaml("a.yaml", base.format(name="added-narrow")
                   + "    chain_when: {extra: has_cache}\n"),
        write_yaml("b.yaml", base.format(name="added-off") + "    disable: [extra]\n"),
        write_yaml("c.yaml", base.format(name="added-force") + "    force: extra\n"))
    with d.use_profile("added-narrow"):
        assert d.resolve("toy", ctx(3)).name == "fast"
        assert d.resolve("toy", ctx(3, has_cache=True)).name == "extra"
    with d.use_profile("added-off"):
        assert d.resolve("toy", ctx(3)).name == "fast"
    with d.use_profile("added-force"):
        got = d.resolve("toy", ctx(3))
        assert (got.name, got.origin) == ("extra", "profile")


def test_lint_judges_a_forced_row_by_its_own_when(toy: Path, write_yaml: Write) -> None:
    """Forcing is not narrowed: lint's coverage under force + chain_when is that of the
    force alone."""
    force = "version: 1\nprofile: {name}\nfamilies:\n  toy:\n    force: fast\n"
    d.load_tables(write_yaml("ff.yaml", force.format(name="ff")
                             + "    chain_when: {fast: has_cache}\n"),
                  write_yaml("f.yaml", force.format(name="f")))
    with d.use_profile("ff"):
        assert d.resolve("toy", ctx(3)).name == "fast"
    both = lint_view(d.current().view("toy", ("ff",))).coverage
    assert both == lint_view(d.current().view("toy", ("f",))).coverage


def test_a_narrowed_row_is_probed_once(toy: Path, write_yaml: Write) -> None:
    from tests import _impls

    d.load_tables(write_yaml("probed.yaml", """\
        version: 1
        family: pr
        fallback: ref
        rows:
          - name: probed
            impl: tests._impls:fast
            available: tests._impls:counted_probe
          - name: ref
            impl: tests._impls:ref
        """), write_yaml("pn.yaml", """\
        version: 1
        profile: pn
        families:
          pr:
            chain_when: {probed: ndim == 3}
        """))
    with d.use_profile("pn"):
        assert d.resolve("pr", d.CallContext("pr", ndim=3)).name == "probed"
        assert d.resolve("pr", d.CallContext("pr", ndim=2), "probed").name == "probed"
        explain("pr", d.CallContext("pr", ndim=3))
    d.load_tables(write_yaml("other.yaml", NARROW.replace("narrow", "other")))
    with d.use_profile("pn"):
        assert d.resolve("pr", d.CallContext("pr", ndim=3)).name == "probed"
    assert _impls.PROBE["calls"] == 1


def test_a_profile_comparing_an_axis_the_new_table_lacks_is_stale(write_yaml: Write) -> None:
    rows = ("rows:\n  - name: windowed\n    impl: tests._impls:fast\n"
            "  - name: plain\n    impl: tests._impls:ref\n")
    head = "version: 1\nfamily: ax\nfallback: plain\n"
    d.load_tables(
        write_yaml("ax.yaml", head + "axes:\n  - {name: span, type: int, nullable: true}\n"
                   + rows),
        write_yaml("pw.yaml", "version: 1\nprofile: pw\nfamilies:\n  ax:\n"
                              "    chain_when: {windowed: span >= 64}\n"))
    with pytest.raises(TableError, match="loaded profile 'pw' compares axis 'span', which "
                                         "family 'ax' no longer declares"):
        d.load_tables(write_yaml("ax2.yaml", head + rows))



def test_on_the_fallback_row_ordered_first(toy: Path, write_yaml: Write) -> None:
    """A profile that orders the fallback first may keep the chain off it where a later
    row should win (tune does this when the fallback wins a bucket): that row then wins,
    and where nothing else matches the fallback still serves, as the last resort."""
    d.load_tables(write_yaml("fb.yaml", "version: 1\nprofile: fbfirst\nfamilies:\n  toy:\n"
                                        "    order: [ref]\n    chain_when: {ref: ndim != 3}\n"))
    with d.use_profile("fbfirst"):
        assert d.resolve("toy", ctx(2)).name == "ref"
        assert d.resolve("toy", ctx(3)).name == "fast"
        got = d.resolve("toy", ctx(3), "ref")
        assert (got.name, got.origin) == ("ref", "explicit")


def test_a_probe_runs_only_for_a_call_its_row_would_take(write_yaml: Write,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    """The chain asks a row's ``when`` before its availability: a call the row rejects
    never runs its probe (which may import a compiler); explain and ``list`` still show
    every row's availability."""
    from astrai.cli import main as cli
    from tests import _impls

    path = write_yaml("lazy.yaml", """\
        version: 1
        family: lazy
        fallback: ref
        rows:
          - name: big
            impl: tests._impls:fast
            when: ndim == 3
            available: tests._impls:counted_probe
          - name: ref
            impl: tests._impls:ref
        """)
    d.load_tables(path)
    _impls.PROBE["available"] = False
    x = torch.zeros(2, 2)
    assert ops.call("lazy", x) == "ref"  # ndim 2: big's when rejects it
    assert d.resolve("lazy", d.CallContext("lazy", ndim=2)).name == "ref"
    assert _impls.PROBE["calls"] == 0
    assert "big: SKIP unavailable (toggled off)" in explain("lazy", d.CallContext("lazy", ndim=2))
    assert _impls.PROBE["calls"] == 1
    assert cli(["list"]) == 0
    assert "toggled off" in capsys.readouterr().out
    assert d.resolve("lazy", d.CallContext("lazy", ndim=3)).name == "ref"  # big: unavailable
