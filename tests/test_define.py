"""A table's definitions (``define:``): named sub-expressions its rows use as atoms.

Built by ``astrai.dispatch.expr.definitions.define`` (type-checked, no recursion, names of
their own), parsed as named specs, loaded from table files with every problem located,
usable in profiles for their family, named by ``explain``, encoded in the precompiled
tables, and checked by lint.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from astrai import cli
from astrai.dispatch import (
    CallContext,
    TableError,
    current,
    explain,
    load_tables,
    resolve,
    shipped_tables_dir,
    use_profile,
)
from astrai.dispatch.axes import (
    CORE_VOCABULARY,
    EXPRESSION_AXES,
    PREDICATES,
    Axis,
    Vocabulary,
)
from astrai.dispatch.expr import definitions
from astrai.dispatch.expr.definitions import (
    MAX_DEFINITION_DEPTH,
    MAX_DEFINITION_SIZE,
    Defined,
    define,
)
from astrai.dispatch.expr.spec import Spec, parse_spec
from astrai.dispatch.lint import lint_family
from astrai.dispatch.tables import artifact, load
from astrai.errors import SpecSyntaxError

Write = Callable[[str, str], Path]

ATTENTION_LIKE = {
    "dense": "not has_cache and ndim == 4",
    "paged": "has_cache and ndim == 3 and fwd in {prefill, decode}",
}
CYCLE_HINT = "a definition may use other definitions but never itself, directly or through others"
CORE_NAMES = ", ".join(sorted([*EXPRESSION_AXES, *PREDICATES]))


def built(texts: dict[str, str], vocabulary: Vocabulary = CORE_VOCABULARY) -> Vocabulary:
    """The vocabulary with ``texts`` defined, which must have no problem."""
    got = define(texts, vocabulary)
    assert got.problems == ()
    return got.vocabulary


def rendered(got: Defined) -> dict[str, str]:
    """Each problem of ``got`` as the user reads it."""
    return {name: p.render() if isinstance(p, SpecSyntaxError) else p
            for name, p in got.problems}


def load_problems(path: Path) -> list[str]:
    """The rendered problems of loading ``path``, which must fail."""
    with pytest.raises(TableError) as err:
        load_tables(path)
    return [str(p) for p in err.value.problems]


def test_public_names_import() -> None:
    """Every name in the module's ``__all__`` exists."""
    assert all(hasattr(definitions, name) for name in definitions.__all__)


class TestDefine:
    """``define``: a table's definitions built against a vocabulary, every problem kept."""

    def test_builds_named_specs(self) -> None:
        """Each definition becomes a named spec that stands for its expression."""
        dense = built(ATTENTION_LIKE).definitions["dense"]
        assert (dense.kind, dense.description) == ("named", "dense")
        assert [p.description for p in dense.parts] == ["not has_cache and ndim == 4"]
        assert dense.matches(CallContext("f", ndim=4))
        assert not dense.matches(CallContext("f", ndim=3))

    def test_rows_use_definitions_as_atoms(self) -> None:
        """An expression over the built vocabulary uses definitions like predicates."""
        spec = parse_spec("dense and dtype == float32 or paged", built(ATTENTION_LIKE))
        assert spec.description == "dense and dtype == float32 or paged"
        assert spec.matches(CallContext("f", ndim=4, dtype=torch.float32))
        assert spec.matches(CallContext("f", ndim=3, has_cache=True, fwd="decode"))
        assert not spec.matches(CallContext("f", ndim=4, dtype=torch.float16))

    def test_definitions_use_each_other_in_any_order(self) -> None:
        """A definition may use one defined before or after it."""
        vocabulary = built({"fast": "dense and dtype == float16", "dense": "ndim == 4"})
        fast = vocabulary.definitions["fast"]
        assert fast.parts[0].parts[0] is vocabulary.definitions["dense"]
        assert fast.matches(CallContext("f", ndim=4, dtype=torch.float16))
        assert not fast.matches(CallContext("f", ndim=3, dtype=torch.float16))

    def test_family_axes_and_predicates(self) -> None:
        """A definition may use the family's extra axes and the built-in predicates."""
        span = Axis("span", "int", nullable=True, core=False)
        vocabulary = built({"long": "span > 4096 and mask_free"},
                           CORE_VOCABULARY.with_extras({"span": span}))
        assert vocabulary.definitions["long"].matches(CallContext("f", extra={"span": 8192}))
        got = define({"long": "span > 4096"}, CORE_VOCABULARY)
        assert rendered(got)["long"].startswith("unknown axis 'span'")

    def test_error_type(self) -> None:
        """A definition is type-checked like a ``when``: the error is placed in its text."""
        got = define({"wide": "head_dim == bfloat16", "ok": "ndim == 4"}, CORE_VOCABULARY)
        assert rendered(got) == {"wide": (
            "expected an integer or none for 'head_dim', got 'bfloat16'\n"
            "    head_dim == bfloat16\n"
            "                ^~~~~~~~")}
        assert got.vocabulary.definitions["ok"].description == "ok"

    def test_error_direct_cycle(self) -> None:
        """A definition that uses itself is refused at the use, naming the cycle."""
        got = define({"loop": "ndim == 4 or not loop"}, CORE_VOCABULARY)
        assert rendered(got) == {"loop": (
            f"definition cycle: loop -> loop; {CYCLE_HINT}\n"
            f"    ndim == 4 or not loop\n"
            f"                     ^~~~")}

    def test_error_indirect_cycle(self) -> None:
        """A cycle through others is reported once, where it closes, naming every step."""
        got = define({"a": "b and ndim == 4", "b": "has_cache or c", "c": "not a",
                      "d": "a or b"}, CORE_VOCABULARY)
        assert rendered(got) == {"c": (
            f"definition cycle: a -> b -> c -> a; {CYCLE_HINT}\n"
            f"    not a\n"
            f"        ^")}
        assert set(got.vocabulary.definitions) == {"a", "b", "c", "d"}

    def test_error_two_cycles(self) -> None:
        """Two separate cycles are both reported; a definition outside them is built."""
        got = define({"a": "b", "b": "a", "c": "c", "ok": "has_cache"}, CORE_VOCABULARY)
        assert {n: m.split(";")[0] for n, m in rendered(got).items()} == {
            "b": "definition cycle: a -> b -> a", "c": "definition cycle: c -> c"}
        assert got.vocabulary.definitions["ok"].parts[0].description == "has_cache"

    @pytest.mark.parametrize(("name", "what"), [
        ("ndim", "is already an axis"),
        ("span", "is already an axis"),
        ("mask_free", "is already a built-in predicate"),
        ("and", "is a keyword of the grammar"),
        ("none", "is a keyword of the grammar"),
    ])
    def test_error_name_clash(self, name: str, what: str) -> None:
        """A name that is an axis (core or the family's), a predicate or a keyword is
        refused, and left out of the vocabulary."""
        span = Axis("span", "int", nullable=True, core=False)
        got = define({name: "has_cache"}, CORE_VOCABULARY.with_extras({"span": span}))
        assert rendered(got) == {
            name: f"definition name {name!r} {what}; a definition needs a name of its own"}
        assert name not in got.vocabulary.definitions

    def test_error_not_a_name(self) -> None:
        """A name the grammar cannot read as one word is refused."""
        got = define({"two words": "has_cache"}, CORE_VOCABULARY)
        assert rendered(got) == {"two words": (
            "definition name 'two words' is not a name an expression can use: a letter or '_' "
            "first, then letters, digits or '_'")}

    def test_error_too_deep(self) -> None:
        """A chain of deeply nested definitions is refused past ``MAX_DEFINITION_DEPTH``."""
        nots = "not " * 60
        got = define({"d0": f"{nots}has_cache", "d1": f"{nots}d0", "d2": f"{nots}d1"},
                     CORE_VOCABULARY)
        (name, message), = rendered(got).items()
        assert name == "d2"
        assert message.startswith(f"definition 'd2' is nested too deeply: 184 levels through "
                                  f"the definitions it uses (at most {MAX_DEFINITION_DEPTH})\n")

    def test_error_too_large(self) -> None:
        """Definitions that double each other are refused past ``MAX_DEFINITION_SIZE``."""
        texts = {"d0": "has_cache"} | {f"d{i}": f"d{i - 1} and not d{i - 1}" for i in range(1, 20)}
        got = define(texts, CORE_VOCABULARY)
        assert next(iter(rendered(got).values())).startswith(
            f"definition 'd11' is too large: it stands for 10237 clauses through the "
            f"definitions it uses (at most {MAX_DEFINITION_SIZE})")

    def test_failed_definition_stands_for_always(self) -> None:
        """A definition with a problem is still a name, so its uses raise no second error."""
        got = define({"bad": "ndim == four"}, CORE_VOCABULARY)
        assert parse_spec("bad and has_cache", got.vocabulary).description == "bad and has_cache"


class TestParseWithDefinitions:
    """``parse_spec`` with a vocabulary that holds definitions."""

    def test_error_unknown_name_suggests_definitions(self) -> None:
        """An unknown name lists the definitions apart and suggests a close one."""
        with pytest.raises(SpecSyntaxError) as err:
            parse_spec("densse and ndim == 4", built(ATTENTION_LIKE))
        assert str(err.value) == (
            f"unknown axis, predicate or definition 'densse' (did you mean 'dense'?); expected "
            f"one of: {CORE_NAMES}; or a definition: dense, paged\n"
            f"    densse and ndim == 4\n"
            f"    ^~~~~~")

    def test_error_definition_with_comparison(self) -> None:
        """A definition stands alone, like a predicate."""
        with pytest.raises(SpecSyntaxError) as err:
            parse_spec("dense == true", built(ATTENTION_LIKE))
        assert str(err.value) == (
            "'dense' is a definition and takes no comparison, got '=='\n"
            "    dense == true\n"
            "          ^~")

    def test_cached_per_definitions(self) -> None:
        """One text in two vocabularies that define a name differently gives two specs."""
        four = parse_spec("dense", built({"dense": "ndim == 4"}))
        five = parse_spec("dense", built({"dense": "ndim == 5"}))
        assert four != five
        assert four.matches(CallContext("f", ndim=4))
        assert five.matches(CallContext("f", ndim=5)) and not five.matches(CallContext("f", ndim=4))


class TestNamedSpec:
    """``Spec.named``: a definition's spec, printed by name and evaluated as what it names."""

    def test_round_trips_through_text_and_encoding(self) -> None:
        """The description parses back (with the definitions) and the encoding decodes to
        an equal spec, with no parser needed for the definition."""
        vocabulary = built(ATTENTION_LIKE)
        spec = parse_spec("dense and dtype == float32 or paged and mask_free", vocabulary)
        assert parse_spec(spec.description, vocabulary) == spec
        plain = spec.encode()
        assert plain[1][0][1][0] == ["pred", "dense", [
            "and", [["not", ["axis", "has_cache"]], ["cmp", "ndim", "==", 4]]]]
        decoded = Spec.decode(json.loads(json.dumps(plain)))
        assert decoded == spec and decoded.description == spec.description

    def test_equal_only_with_same_meaning(self) -> None:
        """Two definitions of one name are different specs."""
        four = Spec.named("dense", Spec.ndim(4))
        assert four == Spec.named("dense", Spec.ndim(4))
        assert hash(four) == hash(Spec.named("dense", Spec.ndim(4)))
        assert four != Spec.named("dense", Spec.ndim(5))

    @pytest.mark.parametrize(("texts", "when", "call", "reason"), [
        (ATTENTION_LIKE, "dense and dtype == float32", {"ndim": 3, "dtype": torch.float32},
         "dense (ndim == 4 fails; call has ndim=3)"),
        (ATTENTION_LIKE, "dense", {"ndim": 4, "has_cache": True},
         "dense (not has_cache fails; call has has_cache=true)"),
        ({"four": "ndim == 4"}, "four", {"ndim": 3}, "four (call has ndim=3)"),
        ({"fast": "dense and dtype == float16", "dense": "ndim == 4 and not has_mask"}, "fast",
         {"ndim": 4, "has_mask": True, "dtype": torch.float16},
         "fast (dense (not has_mask fails; call has has_mask=true))"),
        ({"paged": "has_cache and mask_free"}, "paged", {"has_cache": True, "has_mask": True},
         "paged (mask_free (call has has_mask=true))"),
        ({"nothing": "never and has_cache"}, "nothing", {}, "nothing (never fails)"),
    ])
    def test_failure_names_the_clause_inside(self, texts: dict[str, str], when: str,
                                             call: dict[str, object], reason: str) -> None:
        """``failure`` names the definition and the clause inside it that failed first."""
        spec = parse_spec(when, built(texts))
        assert spec.failure(CallContext("f", **call)) == reason  # type: ignore[arg-type]

    def test_builtin_predicate_reason_unchanged(self) -> None:
        """A built-in predicate still reads ``name (call has ...)``."""
        assert Spec.mask_free().failure(CallContext("f", has_mask=True)) == (
            "mask_free (call has has_mask=true)")


TABLE = """\
    version: 1
    family: deffam
    define:
      dense: "not has_cache and ndim == 4"
      paged: has_cache and ndim == 3 and fwd in {prefill, decode}
    fallback: ref
    rows:
      - name: fast
        impl: tests._impls:fast
        when: dense and dtype == float32
      - name: ref
        impl: tests._impls:ref
        when: dense or paged
    """


class TestTableFiles:
    """``load_tables`` with ``define:``: rows use definitions; every problem is located."""

    def test_rows_use_definitions(self, write_yaml: Write) -> None:
        """Rows resolve through their definitions, and the table keeps them."""
        load_tables(write_yaml("t.yaml", TABLE))
        table = current().families["deffam"]
        assert [r.spec.description for r in table.rows] == [
            "dense and dtype == float32", "dense or paged"]
        assert list(table.definitions) == ["dense", "paged"]
        call = CallContext("deffam", dtype=torch.float32, ndim=4)
        assert resolve("deffam", call).name == "fast"
        assert resolve("deffam", call.evolve(ndim=3, has_cache=True, fwd="decode")).name == "ref"

    def test_explain_names_the_failing_clause(self, write_yaml: Write) -> None:
        """``explain`` names the clause inside a definition that rejected the call."""
        path = write_yaml("t.yaml", TABLE)
        load_tables(path)
        call = CallContext("deffam", dtype=torch.float32, ndim=3, has_cache=True, fwd="decode")
        assert explain("deffam", call).splitlines() == [
            "[deffam] fwd=decode dtype=float32 device_cuda=false ndim=3 head_dim=none "
            "has_cache=true has_mask=false grad_enabled=true",
            "  fast: reject (dense (not has_cache fails; call has has_cache=true))",
            "  ref: MATCH (dense or paged)  (fallback)",
            f"  table: {path} (load_tables)",
            "=> ref (origin=chain)",
        ]
        assert explain("deffam", call.evolve(has_cache=False)).splitlines()[1] == (
            "  fast: reject (dense (ndim == 4 fails; call has ndim=3))")

    def test_error_every_problem_located(self, write_yaml: Write) -> None:
        """Bad definitions are reported at their position (the column inside the text,
        quoted or not) with the file's other problems, in file order."""
        path = write_yaml("bad.yaml", """\
            version: 1
            family: deffam
            define:
              a: "b and ndim == 4"
              b: has_cache or a
              ndim: has_cache
              bad: "head_dim == bfloat16"
              dense: not has_cache and ndim == 4
            fallback: ref
            rows:
              - name: ref
                impl: tests._impls:ref
                when: densse or bad
            """)
        assert load_problems(path) == [
            f"{path}:5:19: definition cycle: a -> b -> a; {CYCLE_HINT}\n"
            f"    has_cache or a\n"
            f"                 ^",
            f"{path}:6:3: definition name 'ndim' is already an axis; a definition needs a name "
            f"of its own",
            f"{path}:7:21: expected an integer or none for 'head_dim', got 'bfloat16'\n"
            f"    head_dim == bfloat16\n"
            f"                ^~~~~~~~",
            f"{path}:13:11: unknown axis, predicate or definition 'densse' (did you mean "
            f"'dense'?); expected one of: {CORE_NAMES}; or a definition: a, b, bad, dense\n"
            f"    densse or bad\n"
            f"    ^~~~~~",
        ]

    def test_error_structural_problem_keeps_definitions(self, write_yaml: Write) -> None:
        """With another key wrong, the definitions are still checked, and rows that use the
        good ones are not reported."""
        path = write_yaml("bad.yaml", """\
            version: 1
            family: deffam
            colour: blue
            define:
              dense: not has_cache and ndim == 4
              loop: not loop
            fallback: ref
            rows:
              - name: ref
                impl: tests._impls:ref
                when: dense or loop
            """)
        assert [p.split("\n")[0] for p in load_problems(path)] == [
            f"{path}:3:1: unknown key 'colour'; expected one of: axes, context, define, "
            f"description, env_alias, fallback, family, rows, version",
            f"{path}:6:13: definition cycle: loop -> loop; {CYCLE_HINT}",
        ]

    @pytest.mark.parametrize(("entry", "message"), [
        ("my-def: has_cache", "4:3: define.my-def: 'my-def' is not a definition name (letters, "
                              "digits and '_', starting with a letter or '_')"),
        ("empty: ''", "4:10: define.empty: String should have at least 1 character"),
    ])
    def test_error_malformed_entry(self, write_yaml: Write, entry: str, message: str) -> None:
        """A malformed name or an empty expression is a format error at its place, once."""
        path = write_yaml("bad.yaml", TABLE.replace("    define:\n",
                                                    f"    define:\n      {entry}\n"))
        assert load_problems(path) == [f"{path}:{message}"]

    def test_schema_documents_define(self) -> None:
        """The table schema describes ``define`` and its names."""
        from astrai.dispatch.tables.format import json_schemas

        define_schema = json_schemas()["table.schema.json"]["properties"]["define"]
        assert "named sub-expressions" in define_schema["description"]
        assert list(define_schema["patternProperties"]) == ["^[A-Za-z_][A-Za-z0-9_]*$"]

    def test_explain_table_shows_definitions(self, write_yaml: Write,
                                             capsys: pytest.CaptureFixture[str]) -> None:
        """``explain FAMILY`` (no call) lists the definitions, in text and JSON."""
        load_tables(write_yaml("t.yaml", TABLE))
        assert cli.main(["explain", "deffam"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[2:4] == ["  define dense: not has_cache and ndim == 4",
                              "  define paged: has_cache and ndim == 3 and fwd in {prefill, "
                              "decode}"]
        assert cli.main(["explain", "deffam", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["definitions"] == {
            "dense": "not has_cache and ndim == 4",
            "paged": "has_cache and ndim == 3 and fwd in {prefill, decode}"}


PROFILE = """\
    version: 1
    profile: pdef
    families:
      deffam:
        when:
          ref: paged or dense and dtype == float16
        add:
          - name: extra
            impl: tests._impls:slow
            when: paged and not dense
    """


class TestProfiles:
    """A profile's overlay for a family may use that family's definitions."""

    def test_overlay_uses_family_definitions(self, write_yaml: Write) -> None:
        """``when`` and ``add`` rows of a family's overlay parse with its definitions."""
        load_tables(write_yaml("t.yaml", TABLE), write_yaml("p.yaml", PROFILE))
        paged = CallContext("deffam", ndim=3, has_cache=True, fwd="prefill")
        with use_profile("pdef"):
            assert resolve("deffam", paged).name == "extra"
            lines = explain("deffam", CallContext("deffam", ndim=4, dtype=torch.float16))
        assert "  extra: reject (paged (has_cache fails; call has has_cache=false))" in lines
        assert "  ref: MATCH (paged or dense and dtype == float16)  (fallback)" in lines

    def test_error_star_overlay_has_no_definitions(self, write_yaml: Write) -> None:
        """A ``"*"`` overlay applies to every family, so it may use only the core names."""
        table = write_yaml("t.yaml", TABLE)
        profile = write_yaml("p.yaml", """\
            version: 1
            profile: pstar
            families:
              "*":
                when:
                  ref: dense
            """)
        with pytest.raises(TableError) as err:
            load_tables(table, profile)
        assert [str(p) for p in err.value.problems] == [
            f"{profile}:6:12: unknown axis or predicate 'dense'; expected one of: {CORE_NAMES}\n"
            f"    dense\n"
            f"    ^~~~~"]

    def test_error_replaced_table_drops_definition(self, write_yaml: Write) -> None:
        """Replacing the table with one that lacks a definition a loaded profile uses is
        refused, naming the profile; the previous table stays in force."""
        profile = write_yaml("p.yaml", PROFILE)
        load_tables(write_yaml("t.yaml", TABLE), profile)
        renamed = write_yaml("t2.yaml", TABLE.replace("      paged:", "      paged2:")
                             .replace("dense or paged", "dense or paged2"))
        with pytest.raises(TableError) as err:
            load_tables(renamed)
        assert [str(p) for p in err.value.problems] == [
            f"{profile}:1:1: loaded profile 'pdef' uses definition 'paged' of family 'deffam', "
            f"which no longer exists"]
        assert list(current().families["deffam"].definitions) == ["dense", "paged"]

    def test_error_replaced_table_redefines_definition(self, write_yaml: Write) -> None:
        """A replacing table that gives a definition a loaded profile uses another meaning is
        refused too: the profile would keep the old one."""
        profile = write_yaml("p.yaml", PROFILE)
        load_tables(write_yaml("t.yaml", TABLE), profile)
        with pytest.raises(TableError) as err:
            load_tables(write_yaml("t2.yaml", TABLE.replace("ndim == 4", "ndim == 5")))
        assert [str(p) for p in err.value.problems] == [
            f"{profile}:1:1: loaded profile 'pdef' uses definition 'dense' of family 'deffam', "
            f"which the new table defines differently; load the profile again with it"]
        load_tables(write_yaml("t3.yaml", TABLE.replace("ndim == 4", "ndim == 5")), profile)
        with use_profile("pdef"):  # loaded together: the profile takes the new meaning
            got = resolve("deffam", CallContext("deffam", ndim=5, dtype=torch.float16))
        assert (got.name, got.origin) == ("ref", "chain")


class TestShippedAttention:
    """The shipped attention table uses ``dense`` and ``paged``, on the fast path too."""

    def test_rows_use_dense_and_paged(self) -> None:
        """Its rows print the definitions by name."""
        table = current().families["attention"]
        assert list(table.definitions) == ["dense", "paged"]
        assert all("dense" in r.spec.description for r in table.rows)
        assert "dense or paged" in table.row("torch_native").spec.description

    def test_precompiled_definitions_equal_full_path(self) -> None:
        """The artifact holds the definitions encoded; the fast path builds the same ones
        as the full path, without parsing."""
        path = shipped_tables_dir() / "attention.yaml"
        entry = artifact.lookup(path.read_bytes())
        assert entry is not None
        assert entry.whens[("define", "dense")][:2] == ["pred", "dense"]
        fast = load.parse_file(path)
        full = load.parse_text(path.read_text(encoding="utf-8"), str(path))
        assert fast.located is None and fast.table is not None and full.table is not None
        assert dict(fast.table.definitions) == dict(full.table.definitions)
        assert [r.spec for r in fast.table.rows] == [r.spec for r in full.table.rows]

    def test_explain_paged_call_names_clause(self) -> None:
        """A 3-d call without a cache: the sdpa row's reason lists the call's values."""
        call = CallContext("attention", dtype=torch.float32, ndim=3)
        lines = explain("attention", call).splitlines()
        assert lines[2] == ("  torch_native: reject (dense or paged and mask_free (call has "
                            "fwd=none, has_cache=false, has_mask=false, ndim=3))")


class TestLint:
    """``lint`` with definitions: analysed through them; an unused one is a warning."""

    def test_warns_unused_definition(self, write_yaml: Write) -> None:
        """A definition no row uses (directly or through another) is a warning, not a
        problem; one used only by an unused definition is unused too."""
        load_tables(write_yaml("t.yaml", TABLE.replace(
            "    fallback:", "      spare: paged and dtype == float16\n"
                             "      extra: spare or ndim == 2\n    fallback:")))
        report = lint_family("deffam")
        assert report.warnings == ["definition 'spare' is not used by any row",
                                   "definition 'extra' is not used by any row"]
        assert report.ok
        assert "deffam: warning: definition 'spare' is not used by any row" in report.render()

    def test_used_definitions_no_warning(self, write_yaml: Write) -> None:
        """Definitions used by rows, directly or through another, raise no warning."""
        load_tables(write_yaml("t.yaml", TABLE.replace("when: dense or paged",
                                                       "when: either")
                               .replace("    fallback:", "      either: dense or paged\n"
                                                        "    fallback:")))
        assert lint_family("deffam").warnings == []
        assert lint_family("attention").warnings == []

    def test_profile_row_uses_definition(self, write_yaml: Write) -> None:
        """A definition only a profile's row uses is used under that profile."""
        load_tables(write_yaml("t.yaml", TABLE.replace("when: dense or paged", "when: dense")),
                    write_yaml("p.yaml", PROFILE))
        assert lint_family("deffam").warnings == ["definition 'paged' is not used by any row"]
        assert lint_family("deffam", ("pdef",)).warnings == []

    def test_shadowing_seen_through_definitions(self, write_yaml: Write) -> None:
        """A row whose condition a definition already covers is shadowed."""
        load_tables(write_yaml("t.yaml", """\
            version: 1
            family: deffam
            define:
              dense: not has_cache and ndim == 4
            fallback: ref
            rows:
              - name: wide
                impl: tests._impls:fast
                when: dense
              - name: narrow
                impl: tests._impls:slow
                when: ndim == 4 and not has_cache and dtype == float16
              - name: ref
                impl: tests._impls:ref
            """))
        assert [p.message for p in lint_family("deffam").problems] == [
            "row 'narrow' is shadowed by 'wide' (every call it accepts is taken earlier)"]
