"""Engine objects from validated file data: rows bound and their ``when`` compiled
(``FamilyTable``), and profiles checked against the families they change (``Profile``).
The same builders serve the full path (the format's ``model_dump``) and the fast path
(the same dump, stored in the precompiled artifact); problems go to the ``ParsedFile``.
"""

from __future__ import annotations

__all__ = ["build_extension", "build_overlay_rows", "build_profile", "build_table",
           "compile_when",
           "family_axes", "family_definitions", "family_vocabulary", "no_fallback",
           "table_vocabulary"]

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from astrai.dispatch import state as process
from astrai.dispatch.axes import CORE_VOCABULARY, Axis, Vocabulary
from astrai.dispatch.expr.spec import Spec
from astrai.dispatch.joined import Joined
from astrai.dispatch.tables._bind import BindError, bind, missing_requirement
from astrai.dispatch.tables.model import (
    ALL,
    FALLBACK,
    FamilyOverlay,
    FamilyTable,
    ImplRecord,
    Profile,
    Unavailable,
)
from astrai.dispatch.tables.parsed import Data, ParsedFile, PathT, spec_problem
from astrai.errors import SpecSyntaxError
from astrai.suggestions import did_you_mean


def compile_when(out: ParsedFile, path: PathT, text: str, vocabulary: Vocabulary) -> Spec | None:
    """Parse a row's expression; a syntax error is recorded with the file position.

    In a table file (whose vocabulary - axes, definitions - comes from the file itself),
    and in a profile where only the core vocabulary is involved, the parsed form is kept
    in ``out.whens`` (what the precompiled tables store), or taken from there on the fast
    path. An expression the format's validation already rejected (``out.rejected``) is
    not reported again.
    """
    if path in out.rejected:
        return None
    try:
        if out.kind != "table" and vocabulary is not CORE_VOCABULARY:
            return Spec.parse(text, vocabulary)
        plain = out.whens.get(path)
        if plain is not None:
            return Spec.decode(plain, vocabulary)
        spec = Spec.parse(text, vocabulary)
        out.whens[path] = spec.encode()
        return spec
    except SpecSyntaxError as exc:
        spec_problem(out, path, exc)
        return None


def bind_row(out: ParsedFile, path: PathT, family: str, row: Data, spec: Spec,
             priority: int) -> ImplRecord | None:
    """Bind a row's ``impl`` and ``available`` paths into an ``ImplRecord``."""
    requires: list[str] = row["requires"]
    try:
        impl = bind(row["impl"], requires)
    except BindError as exc:
        out.problem((*path, "impl"), str(exc))
        return None
    check = process.row_checks.get(family)
    wrong = None if check is None or impl.obj is None else check(impl.obj)
    if wrong is not None:
        out.problem((*path, "impl"), f"row {row['name']!r} ({row['impl']}): {wrong}")
        return None
    probe: Callable[[], Any] | None = None
    missing = impl.missing or missing_requirement(requires)
    available: str | None = row["available"]
    if missing is not None:
        probe = _missing_probe(missing, available, requires)
    elif available is not None:
        try:
            bound = bind(available, requires)
        except BindError as exc:
            out.problem((*path, "available"), str(exc))
            return None
        if bound.missing is not None:
            missing = bound.missing
            probe = lambda: Unavailable(missing)  # noqa: E731
        elif not callable(bound.obj):
            out.problem((*path, "available"), f"{available!r} is not callable")
            return None
        else:
            probe = bound.obj
    out.lines[path] = out.where(path)
    line = out.lines[path][0]
    kwargs: dict[str, Any] = {} if probe is None else {"available": probe}
    return ImplRecord(
        family=family,
        name=row["name"],
        obj=impl.obj,
        spec=spec,
        priority=priority,
        faithful=row["faithful"],
        description=row["description"],
        source=f"{out.file}:{line}",
        provided_by=out.provided_by,
        features=frozenset(row.get("features", ())),
        explicit_only=row.get("explicit_only", False),
        **kwargs,
    )


def _missing_probe(missing: str, available: str | None, requires: Sequence[str]
                   ) -> Callable[[], Any]:
    """The probe of a row whose declared package is not installed: unavailable with that
    reason - unless the row's own ``available`` probe can run without the package and
    says the machine cannot run it anyway (no CUDA device, say): that reason comes first,
    since installing the package would not help."""
    machine: Callable[[], Any] | None = None
    if available is not None:
        try:
            bound = bind(available, requires)
        except BindError:
            bound = None
        if bound is not None and bound.missing is None and callable(bound.obj):
            machine = bound.obj

    def probe() -> Any:
        if machine is not None:
            try:
                said = machine()
            except Exception:  # it needs the package after all: the package's reason
                said = True
            if isinstance(said, Unavailable):
                return said
        return Unavailable(missing)

    return probe


def family_vocabulary(axes: Mapping[str, Axis]) -> Vocabulary:
    """The expression vocabulary of a family with these extra axes."""
    return CORE_VOCABULARY.with_extras(axes) if axes else CORE_VOCABULARY


def family_definitions(out: ParsedFile, texts: Mapping[str, str],
                       vocabulary: Vocabulary) -> Vocabulary:
    """``vocabulary`` with a table's definitions (``define:``), each problem recorded in
    ``out`` at the definition. Their parsed forms are kept in ``out.whens`` (the
    precompiled tables store them), or taken from there on the fast path."""
    if not texts:
        return vocabulary
    paths = {name: ("define", name) for name in texts}
    if all(p in out.whens for p in paths.values()):
        return vocabulary.with_definitions(
            {name: Spec.decode(out.whens[p], vocabulary) for name, p in paths.items()})
    from astrai.dispatch.expr.definitions import define  # parses: not on the fast path

    defined = define(texts, vocabulary)
    for name, problem in defined.problems:
        if isinstance(problem, SpecSyntaxError):
            spec_problem(out, paths[name], problem)
        else:
            out.problem(paths[name], problem, key=True)
    if not defined.problems:
        out.whens.update((p, defined.vocabulary.definitions[n].encode())
                         for n, p in paths.items())
    return defined.vocabulary


def table_vocabulary(table: FamilyTable) -> Vocabulary:
    """What a family's expressions may use: the core names, its axes, its definitions."""
    vocabulary = family_vocabulary(table.axes)
    return vocabulary.with_definitions(table.definitions) if table.definitions else vocabulary


def family_axes(out: ParsedFile | None, declared: list[tuple[int, Data]]) -> dict[str, Axis]:
    """A table's extra axes from its ``axes:`` declarations given as ``(index, axis)``;
    a bad declaration is left out (and recorded in ``out``, when given)."""
    axes: dict[str, Axis] = {}
    for i, decl in declared:
        name = decl["name"]
        if name in CORE_VOCABULARY.axes or name in CORE_VOCABULARY.predicates:
            problem = ("name", f"axis {name!r} is already a core axis")
        elif name in axes:
            problem = ("name", f"duplicate axis {name!r}")
        elif (decl["type"] == "enum") != bool(decl["values"]):
            problem = ("", "'values' is required for an enum axis and only for one")
        else:
            axes[name] = Axis(name, decl["type"], tuple(decl["values"]),
                              nullable=decl["nullable"], description=decl["description"],
                              core=False)
            continue
        if out is not None:
            out.problem(("axes", i, problem[0]) if problem[0] else ("axes", i), problem[1])
    return axes


def build_table(out: ParsedFile, data: Data) -> FamilyTable | None:
    """A validated table's data (a format dump) -> ``FamilyTable``, rows bound."""
    axes = family_axes(out, list(enumerate(data["axes"])))
    vocabulary = family_definitions(out, data["define"], family_vocabulary(axes))
    rows = build_overlay_rows(out, ("rows",), data["family"], list(enumerate(data["rows"])),
                              vocabulary)
    names = list(dict.fromkeys(r["name"] for r in data["rows"]))
    if data["fallback"] not in names:
        no_fallback(out, data["fallback"], names)
    builder: Any = None
    context: str | None = data["context"]
    if context is not None:
        try:
            builder = bind(context).obj
        except BindError as exc:
            out.problem(("context",), str(exc))
        else:
            if not callable(builder):
                out.problem(("context",), f"{context!r} is not callable")
    if out.problems or rows is None:
        return None
    return FamilyTable(
        name=data["family"],
        rows=tuple(rows),
        fallback=data["fallback"],
        description=data["description"],
        env_alias=data["env_alias"],
        axes=MappingProxyType(axes),
        definitions=vocabulary.definitions,
        source=out.file,
        revision=out.revision,
        context=builder,
        provided_by=out.provided_by,
    )


def build_overlay_rows(out: ParsedFile, path: PathT, family: str,
                       rows: list[tuple[int, Data]],
                       vocabulary: Vocabulary) -> list[ImplRecord] | None:
    """Compile and bind rows given as ``(index, row data)`` (a table's, or a profile's
    ``add``). Every row is checked even after a failing one, so all problems are reported.
    """
    seen: set[str] = set()
    records: list[ImplRecord] = []
    ok = True
    for i, row in rows:
        rpath = (*path, i)
        name = row["name"]
        if name in seen:
            out.problem((*rpath, "name"), f"duplicate row name {name!r}")
            ok = False
        seen.add(name)
        spec = compile_when(out, (*rpath, "when"), row["when"], vocabulary)
        rec = bind_row(out, rpath, family, row, spec or Spec.never(), priority=i)
        if spec is None or rec is None:
            ok = False
            continue
        records.append(rec)
    return records if ok else None


# -- row overlays ----------------------------------------------------------

def build_extension(parsed: ParsedFile, families: Mapping[str, FamilyTable],
                    taken: Mapping[str, str], *, replaced: bool = False) -> list[Joined] | None:
    """A row overlay's rows (``extends:``), compiled against the family they join and
    checked against its rows; ``taken`` maps the names earlier overlays already joined
    to that family to who joined them. ``None`` (problems in ``parsed``) if anything is
    wrong. When the user ``replaced`` the family's table, a ``before``/``after`` naming
    a row it lacks is not the plugin's mistake: the row is placed by default, with a
    warning (``joined``), instead."""
    data = parsed.overlay
    assert data is not None
    family = data["extends"]
    table = families.get(family)
    before = len(parsed.problems)
    if table is None:
        parsed.problem(("extends",), f"unknown family {family!r}"
                                     f"{did_you_mean(family, families)}; known families: "
                                     f"{', '.join(sorted(families)) or '(none)'}")
        return None
    rows = build_overlay_rows(parsed, ("rows",), family, list(enumerate(data["rows"])),
                              table_vocabulary(table))
    names = [*table.row_names(), *taken]
    mine: list[str] = []
    for i, row in enumerate(data["rows"]):
        name = row["name"]
        if name in names:
            who = taken.get(name) or (table.row(name).source  # type: ignore[union-attr]
                                      or "the table")
            parsed.problem(("rows", i, "name"), f"{family} already has a row {name!r} (from "
                                                f"{who}); choose another name")
        for key in ("before", "after"):
            anchor = row.get(key)
            if (anchor is not None and anchor not in names and anchor not in mine
                    and not replaced):
                known = [*names, *mine]
                later = anchor in {r["name"] for r in data["rows"]}
                parsed.problem(("rows", i, key), (
                    f"{key}: row {anchor!r} comes later in this file; a row is placed "
                    f"relative to the family's rows or to rows before it" if later else
                    f"{key}: {family} has no row {anchor!r}{did_you_mean(anchor, known)}; "
                    f"rows: {', '.join(known)}"))
        if row.get("after") is not None and row.get("after") == table.fallback:
            parsed.problem(("rows", i, "after"), (
                f"after: {table.fallback!r} is {family}'s fallback row, the last resort: a "
                f"row placed after it is never reached; place it before {table.fallback!r}"
                f" (or name no anchor)"))
        mine.append(name)
    if rows is None or len(parsed.problems) > before:
        return None
    return [Joined(rec, row.get("before"), row.get("after"), by=parsed.file)
            for rec, row in zip(rows, data["rows"], strict=True)]


# -- profiles ------------------------------------------------------------

def build_profile(parsed: ParsedFile, families: Mapping[str, FamilyTable]) -> Profile | None:
    """Check a parsed profile against the families it names; problems go to ``parsed``."""
    model = parsed.profile
    assert model is not None
    overlays: dict[str, FamilyOverlay] = {}
    before = len(parsed.problems)
    for family, ov in model["families"].items():
        path = ("families", family)
        if family == ALL:
            known = sorted({r.name for t in families.values() for r in t.rows})
            table = None
        elif family not in families:
            parsed.problem(path, f"unknown family {family!r}"
                                 f"{did_you_mean(family, families)}; known families: "
                                 f"{', '.join(sorted(families)) or '(none)'}, or '*'", key=True)
            continue
        else:
            table = families[family]
            known = table.row_names()
        overlays[family] = _build_overlay(parsed, path, family, ov, table, known)
    if len(parsed.problems) > before:
        return None
    return Profile(model["profile"], MappingProxyType(overlays), model["description"],
                   parsed.file, parsed.revision, model.get("provenance"), parsed.provided_by)


def _build_overlay(parsed: ParsedFile, path: tuple[str, ...], family: str,
                   ov: Mapping[str, Any], table: FamilyTable | None,
                   known: list[str]) -> FamilyOverlay:
    """One family's overlay data (a format dump) -> ``FamilyOverlay``, checked against
    the family's rows (or every family's, for ``"*"``)."""
    added: list[ImplRecord] = []
    if ov["add"]:
        if table is None:
            parsed.problem((*path, "add"), "'add' needs a family, not '*'", key=True)
        else:
            added = build_overlay_rows(parsed, (*path, "add"), family,
                                       list(enumerate(ov["add"])),
                                       table_vocabulary(table)) or []
            assert parsed.profile is not None
            by = f"profile {parsed.profile['profile']} (add)"
            by += f", {parsed.provided_by}" if parsed.provided_by else ""
            added = [replace(a, provided_by=by) for a in added]
    if table is not None:
        for i, row in enumerate(ov["add"]):
            if row["name"] in known:
                existing = table.row(row["name"])
                where = existing.source if existing is not None and existing.source else (
                    "the table")
                parsed.problem((*path, "add", i, "name"),
                               f"add: {family} already has a row {row['name']!r} (from "
                               f"{where}); an added row with its name would shadow it - "
                               f"choose another name")
    names = [*known, *(a["name"] for a in ov["add"])]

    def check(key: str, values: Sequence[str], *, allow_fallback: bool = False) -> None:
        for i, name in enumerate(values):
            if allow_fallback and name == FALLBACK:
                continue
            if name not in names:
                where = f"family {family!r}" if table is not None else "any family"
                parsed.problem((*path, key, i) if key != "force" else (*path, key),
                               f"{key}: row {name!r} does not exist in {where}"
                               f"{did_you_mean(name, names)}; rows: {', '.join(names)}")

    if ov["force"] is not None:
        check("force", [ov["force"]], allow_fallback=True)
    check("order", ov["order"])
    check("disable", ov["disable"])
    check("enable", ov["enable"])
    if ov["fallback"] is not None:
        check("fallback", [ov["fallback"]])
    vocabulary = table_vocabulary(table) if table is not None else CORE_VOCABULARY
    conditions: dict[str, dict[str, Spec]] = {"when": {}, "chain_when": {}}
    for key, specs in conditions.items():
        for name, text in ov.get(key, {}).items():
            if name not in names:
                parsed.problem((*path, key, name), f"{key}: row {name!r} does not exist"
                                                   f"{did_you_mean(name, names)}; rows: "
                                                   f"{', '.join(names)}", key=True)
                continue
            spec = compile_when(parsed, (*path, key, name), text, vocabulary)
            if spec is not None:
                specs[name] = spec
    return FamilyOverlay(family, ov["force"], tuple(ov["order"]), tuple(ov["disable"]),
                         tuple(ov["enable"]), MappingProxyType(conditions["when"]),
                         ov["fallback"], tuple(added),
                         MappingProxyType(conditions["chain_when"]),
                         bool(ov.get("model_code", False)))


def no_fallback(out: ParsedFile, fallback: str, names: list[str]) -> None:
    out.problem(("fallback",), f"fallback {fallback!r} names no row"
                               f"{did_you_mean(fallback, names)}; rows: {', '.join(names)}")
