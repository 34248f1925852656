"""Decision tables and profiles as files (contract §5, §6): loading, errors, availability,
registry."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml

from astrai.dispatch import (
    CallContext,
    ImplRecord,
    Spec,
    TableError,
    current,
    explain,
    list_families,
    list_profiles,
    load_tables,
    refresh,
    register_env_alias,
    register_family,
    reload_tables,
    resolve,
    shipped_tables_dir,
    state,
    use_profile,
)
from astrai.dispatch.axes import EXPRESSION_AXES
from tests import _impls
from tests.conftest import TOY_TABLE, ctx

Write = Callable[[str, str], Path]

SHIPPED = ("activation", "attention", "gated_activation", "layer_norm", "linear", "rms_norm",
           "rotary")
ONE_ROW = """\
version: 1
family: {family}
fallback: ref
rows:
  - name: ref
    impl: tests._impls:ref
"""


def problems(err: pytest.ExceptionInfo[TableError]) -> list[str]:
    """The rendered problems of a load error."""
    return [str(p) for p in err.value.problems]


def load_error(write_yaml: Write, text: str, name: str = "bad.yaml") -> tuple[Path, list[str]]:
    """Write ``text``, load it, and return the path and the rendered problems."""
    path = write_yaml(name, text)
    with pytest.raises(TableError) as err:
        load_tables(path)
    assert str(err.value) == "\n".join(problems(err))
    return path, problems(err)


class TestShippedTablesDir:
    """``shipped_tables_dir``: where the packaged tables are."""

    def test_holds_the_shipped_families(self) -> None:
        """The directory holds one YAML file per shipped family, and the profiles."""
        root = shipped_tables_dir()
        stems = {p.stem for p in root.glob("*.yaml")}
        assert set(SHIPPED) <= stems
        assert {"reference"} <= {p.stem for p in (root / "profiles").glob("*.yaml")}


WHEN_ROW = {"name": "r", "impl": "tests._impls:ref"}


class TestFormatValidatesWhen:
    """The file format (the pydantic models) validates each row's ``when`` through the
    parser, with the vocabulary given in the validation context."""

    def test_error_syntax_error_is_carried(self) -> None:
        """A ``when`` that does not parse fails validation, carrying the ``SpecSyntaxError``."""
        from pydantic import ValidationError

        from astrai.dispatch.axes import CORE_VOCABULARY
        from astrai.dispatch.tables.format import RowModel
        from astrai.errors import SpecSyntaxError

        with pytest.raises(ValidationError) as info:
            RowModel.model_validate({**WHEN_ROW, "when": "dtype == bfloat61"},
                                    context={"vocabulary": CORE_VOCABULARY})
        (err,) = info.value.errors()
        assert err["loc"] == ("when",)
        assert isinstance(err["ctx"]["error"], SpecSyntaxError)
        assert err["ctx"]["error"].span == (9, 17)

    def test_vocabulary_comes_from_context(self) -> None:
        """An extra axis parses with the vocabulary that declares it; with no vocabulary
        (a profile's rows, checked when the profile is built) nothing is parsed."""
        from pydantic import ValidationError

        from astrai.dispatch.axes import CORE_VOCABULARY, Axis
        from astrai.dispatch.tables.format import RowModel

        row = {**WHEN_ROW, "when": "fused"}
        extra = CORE_VOCABULARY.with_extras({"fused": Axis("fused", "bool", (), core=False)})
        assert RowModel.model_validate(row, context={"vocabulary": extra}).when == "fused"
        assert RowModel.model_validate(row).when == "fused"
        with pytest.raises(ValidationError):
            RowModel.model_validate(row, context={"vocabulary": CORE_VOCABULARY})


class TestLoadTables:
    """``load_tables``: validate files, then add or replace families and profiles."""

    # -- what loads ---------------------------------------------------------------

    def test_shipped_tables_load(self) -> None:
        """Every shipped table file loads on its own and returns its family."""
        for name in SHIPPED:
            assert load_tables(shipped_tables_dir() / f"{name}.yaml") == [name]
        assert set(SHIPPED) <= set(load_tables(shipped_tables_dir()))
        assert {"reference"} <= set(list_profiles())

    def test_moving_a_row_up_changes_the_winner(self, write_yaml: Write) -> None:
        """Editing only the row order of a shipped table changes which row wins."""
        call = CallContext("rotary", dtype=torch.float32, ndim=4)
        before = resolve("rotary", call)
        data = yaml.safe_load((shipped_tables_dir() / "rotary.yaml").read_text())
        rows = data["rows"]
        second = next(r for r in rows[1:] if r["name"] == "torch")  # serves fp32 calls too
        data["rows"] = [second, *(r for r in rows if r is not second)]
        load_tables(write_yaml("rotary.yaml", yaml.safe_dump(data, sort_keys=False)))
        after = resolve("rotary", call)
        # the first row that takes an adjacent-pairs call (native's are the half layout's)
        assert before.name == next(r["name"] for r in rows if "layout == half" not in r["when"])
        assert (after.name, after.origin) == (second["name"], "chain")

    def test_returns_family_names(self, write_yaml: Write) -> None:
        """The return value names the families the given files defined (not profiles)."""
        a = write_yaml("a.yaml", ONE_ROW.format(family="fam_a"))
        b = write_yaml("b.yaml", ONE_ROW.format(family="fam_b"))
        p = write_yaml("p.yaml", "version: 1\nprofile: pa\nfamilies:\n  fam_a:\n    force: ref\n")
        assert sorted(load_tables(a, b, p)) == ["fam_a", "fam_b"]
        assert {"fam_a", "fam_b"} <= set(list_families())
        assert "pa" in list_profiles()

    def test_accepts_directories(self, write_yaml: Write, tmp_path: Path) -> None:
        """A directory is searched (recursively) for .yaml and .yml files."""
        write_yaml("dir/a.yaml", ONE_ROW.format(family="fam_a"))
        write_yaml("dir/nested/b.yml", ONE_ROW.format(family="fam_b"))
        write_yaml("dir/profiles/p.yaml",
                   "version: 1\nprofile: pb\nfamilies:\n  fam_b:\n    force: fallback\n")
        write_yaml("dir/notes.txt", "not a table")
        assert sorted(load_tables(tmp_path / "dir")) == ["fam_a", "fam_b"]
        assert "pb" in list_profiles()

    def test_replaces_a_family(self, toy: Path, write_yaml: Write) -> None:
        """Loading a file for a loaded family replaces its rows."""
        load_tables(write_yaml("other.yaml", TOY_TABLE.replace("ndim == 3", "ndim == 2")))
        assert resolve("toy", ctx(2)).name == "fast"

    def test_profile_files(self, toy: Path) -> None:
        """A file with top-level ``profile:`` is a profile usable by name."""
        assert {"toy-force", "toy-enable", "toy-disable"} <= set(list_profiles())
        with use_profile("toy-force"):
            assert resolve("toy", ctx(3)).name == "for_profile"

    def test_profile_with_its_family_in_one_call(self, write_yaml: Write) -> None:
        """A profile may name a family defined by another file of the same call."""
        table = write_yaml("fam.yaml", ONE_ROW.format(family="fam_c"))
        prof = write_yaml("prof.yaml",
                          "version: 1\nprofile: pc\nfamilies:\n  fam_c:\n    disable: [ref]\n")
        assert load_tables(prof, table) == ["fam_c"]

    def test_profile_add_row(self, toy: Path, write_yaml: Write) -> None:
        """A profile's ``add`` puts new rows first, bound like table rows."""
        load_tables(write_yaml("add.yaml", """\
            version: 1
            profile: toy-add
            families:
              toy:
                add:
                  - name: extra
                    impl: tests._impls:adhoc
                    when: ndim == 2
            """))
        with use_profile("toy-add"):
            res = resolve("toy", ctx(2))
        assert (res.name, res.obj, res.origin) == ("extra", _impls.adhoc, "chain")
        assert resolve("toy", ctx(2)).name == "ref"

    def test_profile_order_when_fallback(self, toy: Path, write_yaml: Write) -> None:
        """A profile can reorder rows, replace a row's ``when`` and set the fallback."""
        load_tables(write_yaml("mix.yaml", """\
            version: 1
            profile: toy-mix
            families:
              toy:
                order: [for_env]
                when:
                  for_env: ndim == 4
                fallback: for_context
            """))
        with use_profile("toy-mix"):
            three = resolve("toy", ctx(3))
            four = resolve("toy", ctx(4))
            none = resolve("toy", ctx(None), None)
        assert (three.name, four.name) == ("fast", "for_env")
        assert none.name == "ref"  # still first matching row in order
        with use_profile("toy-mix", "reference"):
            assert resolve("toy", ctx(3)).name == "for_context"

    # -- errors ---------------------------------------------------------------------

    def test_error_unknown_key(self, write_yaml: Write) -> None:
        """Unknown keys are reported at their position with the valid keys listed."""
        path, got = load_error(write_yaml, """\
            version: 1
            family: toy
            colour: blue
            fallback: ref
            rows:
              - name: ref
                impl: tests._impls:ref
                whne: always
            """)
        assert got == [
            f"{path}:3:1: unknown key 'colour'; expected one of: axes, context, define, "
            f"description, env_alias, fallback, family, rows, version",
            f"{path}:8:5: unknown key 'whne' (did you mean 'when'?); expected one of: "
            f"available, description, explicit_only, faithful, features, impl, name, requires, "
            f"when",
        ]

    def test_error_unknown_profile_key(self, toy: Path, write_yaml: Write) -> None:
        """Unknown keys in a profile's family overlay list the valid keys."""
        path, got = load_error(write_yaml, """\
            version: 1
            profile: p
            families:
              toy:
                forse: ref
            """)
        assert got == [
            f"{path}:5:5: unknown key 'forse' (did you mean 'force'?); expected one of: add, "
            f"chain_when, disable, enable, fallback, force, model_code, order, when"
        ]

    def test_error_duplicate_row_names(self, write_yaml: Write) -> None:
        """Two rows with one name are an error at the second one."""
        path, got = load_error(write_yaml, """\
            version: 1
            family: toy
            fallback: ref
            rows:
              - name: ref
                impl: tests._impls:ref
              - name: ref
                impl: tests._impls:fast
            """)
        assert got == [f"{path}:7:11: duplicate row name 'ref'"]

    def test_error_fallback_names_no_row(self, write_yaml: Write) -> None:
        """A fallback that names no row is an error listing the rows."""
        path, got = load_error(write_yaml, """\
            version: 1
            family: toy
            fallback: reff
            rows:
              - name: fast
                impl: tests._impls:fast
              - name: ref
                impl: tests._impls:ref
            """)
        assert got == [f"{path}:3:11: fallback 'reff' names no row (did you mean 'ref'?); "
                       f"rows: fast, ref"]

    @pytest.mark.parametrize(
        ("version", "message"),
        [
            ("0", "unknown table version 0; this astrai reads version 1"),
            ('"1"', "'version' must be an integer; this astrai reads version 1"),
            ("1.0", "'version' must be an integer; this astrai reads version 1"),
            ("true", "'version' must be an integer; this astrai reads version 1"),
        ],
    )
    def test_error_bad_version(self, write_yaml: Write, version: str, message: str) -> None:
        """A version this code does not know is an error at the version."""
        path, got = load_error(write_yaml, f"version: {version}\n" + ONE_ROW.split("\n", 1)[1]
                               .format(family="toy"))
        assert got == [f"{path}:1:10: {message}"]

    def test_error_missing_version(self, write_yaml: Write) -> None:
        """A file without a version says which version this astrai reads."""
        path, got = load_error(write_yaml, ONE_ROW.split("\n", 1)[1].format(family="toy"))
        assert got == [f"{path}:1:1: missing 'version' (this astrai reads version 1)"]

    def test_error_newer_version(self, write_yaml: Write) -> None:
        """A newer version says so and says which version is supported."""
        path, got = load_error(write_yaml, ONE_ROW.replace("version: 1", "version: 2")
                               .format(family="toy"))
        assert got == [f"{path}:1:10: table version 2 is newer than this astrai supports "
                       f"(version 1); upgrade astrai"]

    def test_error_newer_profile_version(self, write_yaml: Write) -> None:
        """A newer profile version names the kind of file."""
        path, got = load_error(write_yaml, "version: 3\nprofile: p\nfamilies: {}\n")
        assert got == [f"{path}:1:10: profile version 3 is newer than this astrai supports "
                       f"(version 1); upgrade astrai"]

    def test_error_bad_expression(self, write_yaml: Write) -> None:
        """A bad ``when`` is reported at the offending token with a caret under it."""
        path, got = load_error(write_yaml, """\
            version: 1
            family: toy
            fallback: ref
            rows:
              - name: ref
                impl: tests._impls:ref
                when: "ndim == 3 and head_dim == bfloat16"
            """)
        assert got == [
            f"{path}:7:38: expected an integer or none for 'head_dim', got 'bfloat16'\n"
            f"    ndim == 3 and head_dim == bfloat16\n"
            f"                              ^~~~~~~~"
        ]

    def test_error_bad_expression_did_you_mean(self, write_yaml: Write) -> None:
        """An unknown axis in a plain scalar suggests the close name."""
        path, got = load_error(write_yaml, """\
            version: 1
            family: toy
            fallback: ref
            rows:
              - name: ref
                impl: tests._impls:ref
                when: ndimm == 3
            """)
        assert got == [
            f"{path}:7:11: unknown axis 'ndimm' (did you mean 'ndim'?); expected one of: "
            f"{', '.join(sorted(EXPRESSION_AXES))}\n"
            f"    ndimm == 3\n"
            f"    ^~~~~"
        ]

    def test_error_missing_attribute(self, write_yaml: Write) -> None:
        """An ``impl`` attribute that does not exist is a load error with a suggestion."""
        path, got = load_error(write_yaml, ONE_ROW.replace("_impls:ref", "_impls:reff")
                               .format(family="toy"))
        assert got == [f"{path}:6:11: 'tests._impls' has no attribute 'reff' "
                       f"(did you mean 'ref'?)"]

    @pytest.mark.parametrize("impl", ["tests._impls.ref", "tests._impls:ref:x", "tests/_impls:ref",
                                      ":ref", "tests._impls:"])
    def test_error_bad_import_path(self, write_yaml: Write, impl: str) -> None:
        """A malformed ``module:attribute`` path is a load error at the ``impl`` value."""
        path, got = load_error(write_yaml, ONE_ROW.replace("tests._impls:ref", f"'{impl}'")
                               .format(family="toy"))
        assert len(got) == 1
        assert got[0].startswith(f"{path}:6:11: ")
        assert "impl" in got[0]

    def test_error_available_not_callable(self, write_yaml: Write) -> None:
        """An ``available`` path to something that is not callable is a load error."""
        path, got = load_error(write_yaml, ONE_ROW.format(family="toy")
                               + "    available: tests._impls:NOT_CALLABLE\n")
        assert got == [f"{path}:7:16: 'tests._impls:NOT_CALLABLE' is not callable"]

    def test_error_missing_own_module(self, write_yaml: Write) -> None:
        """A failing import of astrai's own code is a load error, not an unavailable row."""
        path, got = load_error(write_yaml, ONE_ROW.replace("tests._impls:ref",
                                                           "astrai.backends.nope:ref")
                               .format(family="toy"))
        assert got == [f"{path}:6:11: cannot import 'astrai.backends.nope': "
                       f"No module named 'astrai.backends.nope'"]

    def test_error_python_tag(self, write_yaml: Write) -> None:
        """A YAML tag that could build Python objects is refused at its position."""
        path, got = load_error(write_yaml, ONE_ROW.replace(
            "tests._impls:ref", "!!python/object/apply:os.system ['true']").format(family="toy"))
        assert got == [f"{path}:6:11: unsupported YAML tag "
                       f"'tag:yaml.org,2002:python/object/apply:os.system'"]

    def test_error_duplicate_yaml_key(self, write_yaml: Write) -> None:
        """A key given twice in one mapping is an error at the second one."""
        path, got = load_error(write_yaml, ONE_ROW.format(family="toy") + "fallback: ref\n")
        assert got == [f"{path}:7:1: duplicate key 'fallback'"]

    def test_error_invalid_yaml(self, write_yaml: Write) -> None:
        """Text that is not YAML is an error with the parser's position."""
        path, got = load_error(write_yaml, "version: 1\nfamily: [toy\n")
        assert len(got) == 1
        assert got[0].startswith(f"{path}:3:1: invalid YAML: ")

    def test_error_not_a_table(self, write_yaml: Write) -> None:
        """A YAML file that is neither a table nor a profile says what it expected."""
        path, got = load_error(write_yaml, "version: 1\nrows: []\n")
        assert got == [f"{path}:1:1: expected a mapping with 'version' and 'family:' (a table), "
                       f"'profile:' (a profile) or 'extends:' (a row overlay)"]

    def test_error_family_in_two_files(self, write_yaml: Write, tmp_path: Path) -> None:
        """One family defined twice within one source (a directory) is an error there."""
        first = write_yaml("dir/one.yaml", ONE_ROW.format(family="fam_a"))
        second = write_yaml("dir/two.yaml", ONE_ROW.format(family="fam_a"))
        with pytest.raises(TableError) as err:
            load_tables(tmp_path / "dir")
        assert problems(err) == [f"{second}:2:9: family 'fam_a' is also defined in {first}"]
        assert "fam_a" not in list_families()

    def test_later_source_replaces_family(self, write_yaml: Write) -> None:
        """Of two paths given to one load, the later one's family wins (later source wins)."""
        first = write_yaml("one.yaml", ONE_ROW.format(family="fam_a"))
        second = write_yaml("two.yaml", ONE_ROW.format(family="fam_a"))
        assert load_tables(first, second) == ["fam_a"]
        assert current().families["fam_a"].source == str(second)

    def test_error_missing_file(self, tmp_path: Path) -> None:
        """A path that does not exist is reported, not ignored."""
        missing = tmp_path / "nope.yaml"
        with pytest.raises(TableError) as err:
            load_tables(missing)
        assert problems(err) == [f"{missing}:1:1: no such file or directory"]

    def test_error_several_problems_all_reported(self, write_yaml: Write) -> None:
        """Every problem in a file is reported, in file order, not only the first."""
        path, got = load_error(write_yaml, """\
            version: 1
            family: toy
            fallback: reff
            rows:
              - name: fast
                impl: tests._impls:fast
                when: ndim == three
              - name: fast
                impl: tests._impls:fastt
              - name: ref
                impl: tests._impls:ref
                when: dtype == bfloat61 or training
            """)
        assert [g.split(": ", 1)[0] for g in got] == [
            f"{path}:3:11", f"{path}:7:19", f"{path}:8:11", f"{path}:9:11", f"{path}:12:20"
        ]
        assert "fallback 'reff' names no row" in got[0]
        assert "'three'" in got[1]
        assert "duplicate row name 'fast'" in got[2]
        assert "no attribute 'fastt'" in got[3]
        assert "unknown dtype 'bfloat61' (did you mean 'bfloat16'?)" in got[4]

    def test_error_structural_and_row_problems_together(self, write_yaml: Write) -> None:
        """A structural error does not hide the problems in the well-formed rows."""
        path, got = load_error(write_yaml, """\
            version: 1
            family: toy
            colour: blue
            fallback: ref
            rows:
              - name: ref
                impl: tests._impls:ref
                when: ndimm == 3
            """)
        assert [g.split(": ", 1)[0] for g in got] == [f"{path}:3:1", f"{path}:8:11"]

    def test_error_malformed_fallback_row_is_not_missing(self, write_yaml: Write) -> None:
        """A fallback row with an unknown key is reported for the key, not as missing."""
        path, got = load_error(write_yaml, """\
            version: 1
            family: toy
            fallback: ref
            rows:
              - name: fast
                impl: tests._impls:fast
              - name: ref
                impl: tests._impls:ref
                speed: 3
            """)
        assert got == [
            f"{path}:9:5: unknown key 'speed'; expected one of: available, description, "
            f"explicit_only, faithful, features, impl, name, requires, when"
        ]

    def test_error_structural_problem_keeps_declared_axes(self, write_yaml: Write) -> None:
        """Rows using a declared extra axis are not reported when another key is bad."""
        path, got = load_error(write_yaml, """\
            version: 1
            family: toy
            colour: blue
            axes:
              - name: causal
                type: bool
            fallback: ref
            rows:
              - name: ref
                impl: tests._impls:ref
                when: causal or not causal
            """)
        assert [g.split(": ", 1)[0] for g in got] == [f"{path}:3:1"]

    def test_error_bad_row_reports_all_its_problems(self, write_yaml: Write) -> None:
        """A row with an unknown key and a bad expression gets both problems reported."""
        path, got = load_error(write_yaml, """\
            version: 1
            family: toy
            fallback: ref
            rows:
              - name: ref
                impl: tests._impls:ref
                when: ndimm == 3
                speed: 3
            """)
        assert [g.split(": ", 1)[0] for g in got] == [f"{path}:7:11", f"{path}:8:5"]

    def test_error_profile_unknown_family(self, toy: Path, write_yaml: Write) -> None:
        """A profile naming an unknown family is an error with file and line."""
        path, got = load_error(write_yaml, """\
            version: 1
            profile: p
            families:
              toys:
                force: ref
            """)
        assert got == [
            f"{path}:4:3: unknown family 'toys' (did you mean 'toy'?); known families: "
            f"{', '.join(list_families())}, or '*'"
        ]

    def test_error_profile_unknown_row(self, toy: Path, write_yaml: Write) -> None:
        """A profile naming a row the family does not have is an error at that name."""
        path, got = load_error(write_yaml, """\
            version: 1
            profile: p
            families:
              toy:
                force: fsat
                disable: [ref, lowpp]
            """)
        rows = "fast, lowp, gone, ref, for_explicit, for_context, for_env, for_profile"
        assert got == [
            f"{path}:5:12: force: row 'fsat' does not exist in family 'toy' "
            f"(did you mean 'fast'?); rows: {rows}",
            f"{path}:6:20: disable: row 'lowpp' does not exist in family 'toy' "
            f"(did you mean 'lowp'?); rows: {rows}",
        ]

    def test_error_profile_bad_when(self, toy: Path, write_yaml: Write) -> None:
        """A profile's replacement ``when`` is type-checked like a table's."""
        path, got = load_error(write_yaml, """\
            version: 1
            profile: p
            families:
              toy:
                when:
                  fast: ndim == bfloat16
            """)
        assert len(got) == 1
        assert got[0].startswith(f"{path}:6:21: ")
        assert got[0].endswith("    ndim == bfloat16\n            ^~~~~~~~")

    def test_error_replacing_table_breaks_loaded_profile(self, toy: Path,
                                                         write_yaml: Write) -> None:
        """Dropping a row a loaded profile names is refused, and the old table stays."""
        before = current().families["toy"]
        smaller = TOY_TABLE.replace("  - name: for_profile\n    impl: tests._impls:for_profile\n",
                                    "")
        with pytest.raises(TableError) as err:
            load_tables(write_yaml("smaller.yaml", smaller))
        assert "profile 'toy-force'" in str(err.value)
        assert "'for_profile'" in str(err.value)
        assert current().families["toy"] is before

    # -- failed loads ------------------------------------------------------------------

    def test_failed_load_leaves_previous_tables(self, toy: Path, write_yaml: Write) -> None:
        """When any given file is bad, none of them is loaded and the old tables stay."""
        before = current()
        good = write_yaml("good.yaml", ONE_ROW.format(family="fam_good"))
        bad = write_yaml("bad.yaml", TOY_TABLE.replace("ndim == 3", "ndim == three"))
        with pytest.raises(TableError):
            load_tables(good, bad)
        assert current() is before
        assert "fam_good" not in list_families()
        assert resolve("toy", ctx(3)).name == "fast"

    # -- binding and availability ----------------------------------------------------------

    def test_missing_third_party_module(self, write_yaml: Write) -> None:
        """A missing package the row declares in ``requires`` makes it unavailable."""
        load_tables(write_yaml("tp.yaml", """\
            version: 1
            family: tp
            fallback: ref
            rows:
              - name: accel
                impl: astrai_test_missing_pkg.kernels:run
                requires: [astrai_test_missing_pkg]
              - name: probe_missing
                impl: tests._impls:fast
                available: astrai_test_missing_pkg:available
                requires: [astrai_test_missing_pkg]
              - name: needs_pkg
                impl: tests._impls:fast
                requires: [astrai_test_missing_pkg.sub]
              - name: ref
                impl: tests._impls:ref
            """))
        lines = explain("tp", CallContext("tp")).splitlines()
        reason = "astrai_test_missing_pkg is not installed (pip install astrai-test-missing-pkg)"
        assert lines[1:5] == [
            f"  accel: SKIP unavailable ({reason})",
            f"  probe_missing: SKIP unavailable ({reason})",
            f"  needs_pkg: SKIP unavailable ({reason})",
            "  ref: MATCH (always)  (fallback)",
        ]
        assert resolve("tp", CallContext("tp")).name == "ref"

    def test_error_undeclared_missing_module(self, write_yaml: Write) -> None:
        """A module that is missing but not declared in ``requires`` is a located load error."""
        path = write_yaml("tp.yaml", """\
            version: 1
            family: tp
            fallback: ref
            rows:
              - name: accel
                impl: astrai_test_missing_pkg.kernels:run
              - name: ref
                impl: tests._impls:ref
            """)
        with pytest.raises(TableError) as err:
            load_tables(path)
        assert problems(err) == [
            f"{path}:6:11: cannot import 'astrai_test_missing_pkg.kernels': No module named "
            f"'astrai_test_missing_pkg'; if 'astrai_test_missing_pkg' is an optional dependency, "
            f"declare it on the row: requires: [astrai_test_missing_pkg]"
        ]
        assert "tp" not in list_families()

    @pytest.mark.parametrize(
        ("probe", "reason"),
        [
            ("no_widget", "no widget on this machine"),
            ("probe_false", "probe_false() returned False"),
            ("probe_raises", "probe raised RuntimeError: driver exploded"),
        ],
    )
    def test_unavailable_reasons(self, write_yaml: Write, probe: str, reason: str) -> None:
        """A failing probe's reason (Unavailable, False, or an exception) reaches explain."""
        load_tables(write_yaml("pr.yaml", ONE_ROW.format(family="pr").replace(
            "rows:\n", f"rows:\n  - name: maybe\n    impl: tests._impls:fast\n"
                       f"    available: tests._impls:{probe}\n")))
        assert explain("pr", CallContext("pr")).splitlines()[1] == (
            f"  maybe: SKIP unavailable ({reason})"
        )

    def test_available_probe_cached(self, write_yaml: Write) -> None:
        """A probe runs once, however many calls, contexts and explains consult it."""
        load_tables(write_yaml("pc.yaml", ONE_ROW.format(family="pc").replace(
            "rows:\n", "rows:\n  - name: probed\n    impl: tests._impls:fast\n"
                       "    available: tests._impls:counted_probe\n")))
        for ndim in (1, 2, 3, 1, 2, 3):
            assert resolve("pc", CallContext("pc", ndim=ndim)).name == "probed"
            explain("pc", CallContext("pc", ndim=ndim))
        assert _impls.PROBE["calls"] == 1

    def test_available_probe_survives_unrelated_load(self, write_yaml: Write) -> None:
        """Loading another family does not re-run an already evaluated probe."""
        load_tables(write_yaml("pc.yaml", ONE_ROW.format(family="pc").replace(
            "rows:\n", "rows:\n  - name: probed\n    impl: tests._impls:fast\n"
                       "    available: tests._impls:counted_probe\n")))
        resolve("pc", CallContext("pc"))
        load_tables(write_yaml("other.yaml", ONE_ROW.format(family="other")))
        resolve("pc", CallContext("pc", ndim=5))
        assert _impls.PROBE["calls"] == 1


class TestRefresh:
    """``refresh``: re-evaluate availability probes."""

    def test_refresh_reprobes(self, write_yaml: Write) -> None:
        """After ``refresh()`` the probe runs again and its new answer is used."""
        load_tables(write_yaml("pc.yaml", ONE_ROW.format(family="pc").replace(
            "rows:\n", "rows:\n  - name: probed\n    impl: tests._impls:fast\n"
                       "    available: tests._impls:counted_probe\n")))
        assert resolve("pc", CallContext("pc")).name == "probed"
        _impls.PROBE["available"] = False
        assert resolve("pc", CallContext("pc", ndim=2)).name == "probed"
        refresh()
        assert resolve("pc", CallContext("pc")).name == "ref"
        assert explain("pc", CallContext("pc")).splitlines()[1] == (
            "  probed: SKIP unavailable (toggled off)"
        )
        assert _impls.PROBE["calls"] == 2

    def test_refresh_keeps_tables(self, toy: Path) -> None:
        """``refresh()`` changes no family or profile."""
        families, profiles = list_families(), list_profiles()
        refresh()
        assert (list_families(), list_profiles()) == (families, profiles)


class TestReloadTables:
    """``reload_tables`` and ``ASTR_TABLES``."""

    def test_astr_tables_path_list(self, write_yaml: Write, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
        """``ASTR_TABLES`` is an os.pathsep list of files and directories, read on reload."""
        one = write_yaml("one.yaml", ONE_ROW.format(family="fam_one"))
        write_yaml("more/two.yaml", ONE_ROW.format(family="fam_two"))
        monkeypatch.setenv("ASTR_TABLES", os.pathsep.join([str(one), str(tmp_path / "more")]))
        got = reload_tables()
        assert got == sorted(got)
        assert {"fam_one", "fam_two", *SHIPPED} <= set(got)
        assert got == list_families()

    def test_astr_tables_read_on_first_use(self, write_yaml: Write,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
        """The first use of the tables reads ``ASTR_TABLES`` too."""
        one = write_yaml("one.yaml", ONE_ROW.format(family="fam_one"))
        monkeypatch.setenv("ASTR_TABLES", str(one))
        monkeypatch.setattr(state, "snapshot", None)
        assert "fam_one" in list_families()

    def test_reload_drops_loaded_tables(self, toy: Path) -> None:
        """Families added with ``load_tables`` and not in ``ASTR_TABLES`` go away on reload."""
        assert "toy" in list_families()
        reload_tables()
        assert "toy" not in list_families()
        assert set(SHIPPED) <= set(list_families())

    def test_error_failed_reload_leaves_previous_tables(
        self, toy: Path, write_yaml: Write, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A reload that fails raises and leaves the tables in force."""
        before = current()
        bad = write_yaml("bad.yaml", "version: 1\nfamily: [\n")
        monkeypatch.setenv("ASTR_TABLES", str(bad))
        with pytest.raises(TableError) as err:
            reload_tables()
        assert str(err.value).startswith(f"{bad}:")
        assert current() is before
        assert "toy" in list_families()

    def test_reload_keeps_programmatic_families(self) -> None:
        """A family registered in Python survives a reload, its provider called again."""
        calls = []

        def provider() -> list[ImplRecord]:
            calls.append(1)
            return [ImplRecord("prog", "only", _impls.ref)]

        register_family("prog", provider, "only")
        reload_tables()
        assert resolve("prog", CallContext("prog")).name == "only"
        assert len(calls) == 2

    def test_reload_keeps_registered_alias(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """An alias registered in code for a shipped family survives a reload."""
        register_env_alias("rotary", "ASTR_TEST_ROTARY")
        reload_tables()
        monkeypatch.setenv("ASTR_TEST_ROTARY", "reference")
        res = resolve("rotary", CallContext("rotary", dtype=torch.float32, ndim=4))
        assert (res.name, res.origin) == ("reference", "env")

    def test_replaced_table_drops_its_alias(self, write_yaml: Write,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
        """Removing ``env_alias`` from a table and loading it again drops the alias."""
        load_tables(write_yaml("with.yaml", TOY_TABLE.replace(
            "fallback: ref", "env_alias: ASTR_TEST_TOY\nfallback: ref")))
        monkeypatch.setenv("ASTR_TEST_TOY", "for_env")
        assert resolve("toy", ctx(3)).origin == "env"
        load_tables(write_yaml("without.yaml", TOY_TABLE))
        assert (resolve("toy", ctx(3)).name, resolve("toy", ctx(3)).origin) == ("fast", "chain")


class TestRegisterFamily:
    """``register_family``: families defined in Python beside the YAML ones."""

    def test_priority_order(self) -> None:
        """Rows are tried by ascending priority (the seed's order), whatever the provider's."""
        register_family("prog", lambda: [
            ImplRecord("prog", "low", _impls.slow, priority=1),
            ImplRecord("prog", "high", _impls.fast, Spec.ndim(3), priority=5),
            ImplRecord("prog", "mid", _impls.medium, Spec.ndim(2), priority=3),
        ], "low")
        assert [r.name for r in current().families["prog"].rows] == ["low", "mid", "high"]
        assert resolve("prog", CallContext("prog", ndim=3)).name == "low"
        register_family("prog", lambda: [
            ImplRecord("prog", "low", _impls.slow, Spec.ndim(1), priority=1),
            ImplRecord("prog", "high", _impls.fast, Spec.ndim(3), priority=5),
            ImplRecord("prog", "mid", _impls.medium, Spec.ndim(2), priority=3),
        ], "low")
        assert resolve("prog", CallContext("prog", ndim=3)).name == "high"
        assert resolve("prog", CallContext("prog", ndim=2)).name == "mid"

    def test_fallback_by_record(self) -> None:
        """A fallback record not among the provider's rows stays outside the chain."""
        fallback = ImplRecord("prog", "ref", _impls.ref, priority=100)
        register_family("prog", [ImplRecord("prog", "fast", _impls.fast, Spec.ndim(3))],
                        fallback)
        assert [r.name for r in current().families["prog"].rows] == ["fast"]
        res = resolve("prog", CallContext("prog", ndim=2))
        assert (res.name, res.origin) == ("ref", "fallback")

    def test_fallback_by_callable(self) -> None:
        """The seed's form: a zero-argument callable that returns the fallback record."""
        fallback = ImplRecord("prog", "ref", _impls.ref)
        register_family("prog", [ImplRecord("prog", "fast", _impls.fast, Spec.ndim(3))],
                        lambda: fallback)
        res = resolve("prog", CallContext("prog", ndim=2))
        assert (res.name, res.origin, res.record.obj) == ("ref", "fallback", _impls.ref)
        assert resolve("prog", CallContext("prog", ndim=3)).name == "fast"

    def test_fallback_by_name(self) -> None:
        """A fallback given by name is one of the rows; the chain reaching it says chain."""
        register_family("prog", [ImplRecord("prog", "fast", _impls.fast, Spec.ndim(3)),
                                 ImplRecord("prog", "ref", _impls.ref)], "ref")
        lines = explain("prog", CallContext("prog", ndim=2)).splitlines()
        assert lines[1:] == [
            "  fast: reject (ndim == 3 (call has 2))",
            "  ref: MATCH (always)  (fallback)",
            "  table: register_family",
            "=> ref (origin=chain)",
        ]

    def test_error_fallback_callable_returns_other(self) -> None:
        """A fallback callable that returns no ImplRecord is a TypeError naming what it gave."""
        with pytest.raises(TypeError, match="the fallback callable returned 'ref'"):
            register_family("prog", [ImplRecord("prog", "ref", _impls.ref)], lambda: "ref")
        assert "prog" not in list_families()

    def test_unavailable_and_unfaithful_rows(self) -> None:
        """Programmatic rows honour ``available`` and ``faithful`` like YAML rows."""
        register_family("prog", [
            ImplRecord("prog", "gone", _impls.slow, available=_impls.no_widget, priority=3),
            ImplRecord("prog", "lowp", _impls.lowp, faithful=False, priority=2),
            ImplRecord("prog", "ref", _impls.ref, priority=1),
        ], "ref")
        assert resolve("prog", CallContext("prog")).name == "ref"
        assert resolve("prog", CallContext("prog"), "lowp").origin == "explicit"

    def test_replaces_family(self, toy: Path) -> None:
        """Registering an existing family's name replaces it."""
        register_family("toy", [ImplRecord("toy", "only", _impls.ref)], "only")
        assert resolve("toy", ctx(3)).name == "only"

    def test_error_fallback_not_a_row(self) -> None:
        """A fallback name that is none of the rows is a ValueError listing them."""
        with pytest.raises(ValueError) as err:
            register_family("prog", [ImplRecord("prog", "a", _impls.fast)], "b")
        assert str(err.value) == (
            "register_family('prog'): fallback 'b' is not one of the rows ['a']"
        )
        assert "prog" not in list_families()

    def test_error_duplicate_rows(self) -> None:
        """Two records with one name are refused."""
        with pytest.raises(ValueError):
            register_family("prog", [ImplRecord("prog", "a", _impls.fast),
                                     ImplRecord("prog", "a", _impls.ref)], "a")

    def test_error_not_records(self) -> None:
        """A provider that gives anything but ImplRecords is a TypeError."""
        with pytest.raises(TypeError):
            register_family("prog", [_impls.fast], "fast")  # type: ignore[list-item]


class TestRegisterEnvAlias:
    """``register_env_alias``: a legacy single-value variable for a family."""

    def test_alias_selects_row(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """The alias variable names the family's row, with origin 'env'."""
        register_family("prog", [ImplRecord("prog", "fast", _impls.fast, priority=1),
                                 ImplRecord("prog", "ref", _impls.ref)], "ref")
        register_env_alias("prog", "ASTR_TEST_PROG")
        monkeypatch.setenv("ASTR_TEST_PROG", "ref")
        res = resolve("prog", CallContext("prog"))
        assert (res.name, res.origin) == ("ref", "env")

    def test_error_unknown_family(self) -> None:
        """An alias for an unknown family is a KeyError naming it."""
        with pytest.raises(KeyError) as err:
            register_env_alias("nofamily", "ASTR_TEST_X")
        assert "Unknown family: 'nofamily'" in str(err.value)
