"""How a snapshot is assembled: table files, plugins and programmatic families, in order.

A full build reads the shipped tables, then each loaded plugin's files, then each
``ASTR_TABLES`` entry (a later source replaces an earlier one's families and profiles);
every file is parsed and bound with no lock held, and a user's file with a problem fails
the whole build (``TableError``, every problem located) while a plugin with one is left
out with a warning. Profiles and definitions that name what a later source removed are
reported, not silently kept.
"""

from __future__ import annotations

__all__ = [
    "SHIPPED",
    "build_snapshot",
    "env_table_paths",
    "programmatic_table",
    "table_sources",
    "yaml_files",
]

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

from astrai.dispatch import state as process
from astrai.dispatch.axes import EXPRESSION_AXES, PREDICATES
from astrai.dispatch.expr.analysis import named_parts
from astrai.dispatch.expr.spec import Spec
from astrai.dispatch.joined import EMPTY as JOINED_NONE
from astrai.dispatch.joined import Joined, join_rows
from astrai.dispatch.log import warn_once
from astrai.dispatch.plugins import BROKEN, LOADED, Plugin
from astrai.dispatch.provenance import warn_if_elsewhere
from astrai.dispatch.snapshot import Registry
from astrai.dispatch.tables.artifact import shipped_tables_dir
from astrai.dispatch.tables.build import build_extension, build_profile
from astrai.dispatch.tables.load import parse_file, parse_text
from astrai.dispatch.tables.model import (
    FamilyTable,
    ImplRecord,
    Profile,
    table_revision,
)
from astrai.dispatch.tables.parsed import ParsedFile
from astrai.env import TABLES_ENV
from astrai.errors import TableError, TableProblem
from astrai.version import __version__

_YAML_SUFFIXES = (".yaml", ".yml")


def _expand(paths: Iterable[str | os.PathLike[str]]
            ) -> tuple[list[tuple[int, str]], list[TableProblem]]:
    """The table files under ``paths``, each with the index of the path it came from (its
    *source*: a later source replaces an earlier one's families and profiles)."""
    files: list[tuple[int, str]] = []
    problems: list[TableProblem] = []
    for index, p in enumerate(paths):
        if not os.fspath(p).strip():  # Path("") would be the current directory
            problems.append(TableProblem(repr(os.fspath(p)), 1, 1,
                                         "an empty path names no table file or directory"))
            continue
        path = Path(p)
        try:
            is_dir, exists = path.is_dir(), path.exists()
        except OSError as exc:  # a name too long, a parent that cannot be entered, ...
            problems.append(TableProblem(str(path), 1, 1, f"cannot access: "
                                                          f"{exc.strerror or exc}"))
            continue
        if is_dir:
            found, errors = yaml_files(path)
            problems.extend(TableProblem(e.filename or str(path), 1, 1, f"cannot list "
                                         f"directory: {e.strerror or e}") for e in errors)
            files.extend((index, f) for f in found)
        elif exists:
            files.append((index, str(path)))
        else:
            problems.append(TableProblem(str(path), 1, 1, "no such file or directory"))
    return files, problems


def yaml_files(directory: Path) -> tuple[list[str], list[OSError]]:
    """Every ``.yaml``/``.yml`` file under ``directory`` (symlinked directories are not
    entered), and the errors met: an unreadable directory is an error, not an empty one."""
    errors: list[OSError] = []
    # A directory named like a table file is listed too: reading it is then an error.
    found = [os.path.join(root, name)
             for root, dirs, names in os.walk(directory, onerror=errors.append)
             for name in (*names, *dirs) if os.path.splitext(name)[1] in _YAML_SUFFIXES]
    return [str(q) for q in sorted(Path(f) for f in found)], errors


def env_table_paths() -> list[str]:
    raw = os.environ.get(TABLES_ENV, "")
    return [p for p in raw.split(os.pathsep) if p.strip()]


def table_sources() -> list[tuple[str, str]]:
    """The shipped tables and each ``ASTR_TABLES`` entry, with who provided them."""
    return [(str(shipped_tables_dir()), SHIPPED),
            *((p, TABLES_ENV) for p in env_table_paths())]


#: Who provided the shipped tables' rows (``ImplRecord.provided_by``).
SHIPPED = f"shipped with astrai {__version__}"


@dataclass
class _Assembled:
    """What one assembly of the sources gave: the parts of a snapshot, the problems of
    the user's files (fatal) and those of each plugin (which leave that plugin out)."""

    families: dict[str, FamilyTable]
    profiles: dict[str, Profile]
    aliases: dict[str, str]
    programmatic: dict[str, tuple[Any, Any]]
    extended: dict[str, tuple[Joined, ...]]
    problems: list[TableProblem]
    failed: dict[int, list[TableProblem]]  # plugin index -> its problems


def build_snapshot(base: Registry | None, paths: list[tuple[str, str]], *, replace_all: bool,
           plugins: list[Plugin] | None = None, quiet: bool = False
           ) -> tuple[Registry, list[str]]:
    """A new snapshot: ``base`` with the tables under ``paths`` (each with who provided
    it; read and bound here, with no lock held), and the files read. On a full build
    (``replace_all``) the first path is the shipped tables and ``plugins`` (found by
    ``plugins.discover``) come right after it; otherwise ``base``'s plugins stay, their
    row overlays placed again on the families as they now are. Raises ``TableError``
    listing every problem of the given files; a plugin with a problem is left out, with
    a warning (unless ``quiet``: ``validate`` returns the problems instead), and the
    snapshot lists it as broken."""
    files, problems = _expand([p for p, _ in paths])
    parsed: list[ParsedFile] = [parse_file(f, paths[index][1]) for index, f in files]
    layers: list[list[ParsedFile]] = [[] for _ in paths]
    for (index, _), pf in zip(files, parsed, strict=True):
        layers[index].append(pf)
        problems.extend(pf.problems)
    found = list(plugins if plugins is not None else (base.plugins if base else ()))
    while True:
        got = _assemble(base, layers, found, replace_all=replace_all, problems=problems)
        if got.problems or not got.failed:
            break
        # Leave out the first failing plugin only, and assemble again: a later plugin's
        # problem may come from the rows of one left out (it is then reported again).
        first = min(got.failed)
        found[first] = found[first].broken(got.failed[first])
    if got.problems:
        raise TableError(sorted(got.problems, key=lambda p: (p.file, p.line, p.column)))
    for plugin in () if quiet else found:
        if plugin.status == BROKEN:
            warn_once(f"{plugin.provided_by} (entry point {plugin.name}) is left out: "
                      f"{plugin.reason}:\n" + "\n".join(f"  {p}" for p in plugin.problems))
    for name, prof in got.profiles.items():
        if prof.provenance is not None and (base is None or base.profiles.get(name) is not prof):
            warn_if_elsewhere(name, prof.source, prof.provenance)
    registered = dict(base.registered_aliases) if base is not None else {}
    got.aliases.update({f: v for f, v in registered.items() if f in got.families})
    joined = base.joined if base is not None else JOINED_NONE
    extended = MappingProxyType(got.extended)
    return Registry(MappingProxyType(got.families), MappingProxyType(got.profiles),
                    MappingProxyType(got.aliases), next(process.epochs),
                    MappingProxyType(got.programmatic), MappingProxyType(registered), joined,
                    tuple(found), extended), [f for _, f in files]


def _assemble(base: Registry | None, layers: list[list[ParsedFile]], plugins: list[Plugin],
              *, replace_all: bool, problems: list[TableProblem]) -> _Assembled:
    """Families, profiles and row overlays from ``base`` and the sources, in order (on a
    full build: the shipped tables, each loaded plugin, each ``ASTR_TABLES`` entry)."""
    got = _Assembled({}, {}, {}, {}, {}, list(problems), {})
    if base is not None:
        got.programmatic = dict(base.programmatic)
        if not replace_all:
            got.aliases, got.families = dict(base.aliases), dict(base.families)
            got.profiles = dict(base.profiles)
            # A plugin left out now takes its tables and profiles along (its rows go below).
            gone = {p.provided_by for p in plugins if p.status != LOADED}
            for name in [n for n, t in got.families.items() if t.provided_by in gone]:
                del got.families[name]
            for name in [n for n, p in got.profiles.items() if p.provided_by in gone]:
                del got.profiles[name]
            for fam, joins in base.joined.items():  # placed again below, after the overlays
                if fam in got.families:
                    got.families[fam] = _without(got.families[fam], joins)
            for fam, joins in base.extended.items():
                if fam in got.families:
                    got.families[fam] = _without(got.families[fam], joins)
        else:
            for name, (provider, fallback) in got.programmatic.items():
                got.families[name] = programmatic_table(name, provider, fallback)
    live = [(i, p) for i, p in enumerate(plugins) if p.status == LOADED]
    # (files, plugin index or None): a plugin's tables and profiles only on a full build
    sources: list[tuple[list[ParsedFile], int | None]] = [(layer, None) for layer in layers]
    if replace_all:
        sources[1:1] = [(list(p.files), i) for i, p in live]

    def report(owner: int | None, problem: TableProblem) -> None:
        (got.problems if owner is None else got.failed.setdefault(owner, [])).append(problem)

    # A family or profile defined twice within one source is an error; a later source
    # (shipped, then each plugin, each ASTR_TABLES entry, each load_tables path) replaces
    # it, except that a plugin adds families and never replaces one (it joins rows to an
    # existing family with a row overlay instead).
    seen: dict[str, tuple[str, int]] = {}
    for index, (files, owner) in enumerate(sources):
        for pf in files:
            if pf.overlay is not None and owner is None:
                report(None, TableProblem(pf.file, *pf.where(("extends",), key=True), (
                    "a row overlay (extends:) is read from a plugin package only; to add "
                    "rows to a family from your own files, use a profile's add: (or a copy "
                    "of the family's table: astrai-ops init). A plugin's files are checked "
                    "with astrai-ops precompile DIR")))
            if pf.table is None:
                continue
            name = pf.table.name
            if name in seen and seen[name][0] != pf.file and seen[name][1] == index:
                report(owner, TableProblem(pf.file, *pf.where(("family",)),
                                           f"family {name!r} is also defined in "
                                           f"{seen[name][0]}"))
            if owner is not None and name in got.families:
                other = got.families[name]
                report(owner, TableProblem(pf.file, *pf.where(("family",)), (
                    f"family {name!r} already exists ({other.provided_by or other.source}); "
                    f"a plugin adds rows to it with a row overlay (extends: {name})")))
                continue
            seen[name] = (pf.file, index)
            got.families[name] = pf.table
            got.programmatic.pop(name, None)
            got.aliases.pop(name, None)  # a replaced table brings its own alias, or none
            if pf.table.env_alias:
                got.aliases[name] = pf.table.env_alias
    for i, plugin in live:  # row overlays join the families as they now are
        mine: dict[str, tuple[Joined, ...]] = {}
        for pf in plugin.files:
            if pf.overlay is None:
                continue
            family = pf.overlay["extends"]
            taken = {j.record.name: f"{j.record.provided_by}, {j.record.source}"
                     for j in (*got.extended.get(family, ()),
                               *(base.joined.get(family, ()) if base is not None else ()))}
            table = got.families.get(family)
            replaced = table is not None and not (table.provided_by == SHIPPED or
                                                  table.provided_by.startswith("plugin "))
            taken.update({j.record.name: f"{j.record.provided_by}, {j.record.source}"
                          for j in mine.get(family, ())})
            fresh, built = _built(pf, partial(build_extension, families=got.families,
                                              taken=taken, replaced=replaced))
            for problem in fresh.problems:
                report(i, problem)
            if built:
                mine[family] = (*mine.get(family, ()), *built)
        if i not in got.failed:  # a plugin with a problem joins no row (others still may)
            for family, rows in mine.items():
                got.extended[family] = (*got.extended.get(family, ()), *rows)
    got.families = families = join_rows(got.families, got.extended,
                                        base.joined if base is not None else JOINED_NONE)
    # profiles may name rows joined by overlays and in Python
    seen_profiles: dict[str, tuple[str, int]] = {}
    for index, (files, owner) in enumerate(sources):
        for pf in files:
            if pf.profile is None:
                continue
            name = pf.profile["profile"]
            if owner is not None and (name in seen_profiles or name in got.profiles):
                where = seen_profiles[name][0] if name in seen_profiles else \
                    got.profiles[name].source
                report(owner, TableProblem(pf.file, *pf.where(("profile",)), (
                    f"profile {name!r} already exists ({where}); a plugin adds profiles "
                    f"and never replaces one: choose another name")))
                continue
            if (name in seen_profiles and seen_profiles[name][0] != pf.file
                    and seen_profiles[name][1] == index):
                report(owner, TableProblem(pf.file, *pf.where(("profile",)),
                                           f"profile {name!r} is also defined in "
                                           f"{seen_profiles[name][0]}"))
            seen_profiles[name] = (pf.file, index)
    for files, owner in sources:
        for pf in files:
            if (pf.profile is None or pf.profile["profile"] not in seen_profiles
                    or seen_profiles[pf.profile["profile"]][0] != pf.file):
                continue  # replaced by a later source (not built against the final tables),
                # or a plugin's that would replace one
            fresh, prof = _built(pf, partial(build_profile, families=families))
            for problem in fresh.problems:
                report(owner, problem)
            if prof is not None:
                got.profiles[prof.name] = prof
    # Profiles loaded earlier must still make sense against replaced tables.
    if not replace_all and base is not None:
        for name, prof in list(got.profiles.items()):
            if name in seen_profiles:
                continue
            stale = _stale_profile(prof, families)
            if stale:
                got.problems.append(TableProblem(prof.source or "<profile>", 1, 1,
                                                 f"loaded profile {name!r} {stale}"))
    return got


_T = TypeVar("_T")


def _built(pf: ParsedFile, make: Callable[[ParsedFile], _T]) -> tuple[ParsedFile, _T | None]:
    """``make`` run on a copy of ``pf`` with no problems yet (so a file built again per
    snapshot reports its problems once each time). A file read from a precompiled entry
    whose data does not build (a plugin's artifact edited by hand, or from an astrai
    that wrote something else) is read again the full way, which reports it properly."""
    fresh = replace(pf, problems=[])
    try:
        return fresh, make(fresh)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError):
        if pf.dump is not None or pf.text is None:
            raise  # validated the full way: a bug, not a bad entry
    full = parse_text(pf.text, pf.file, pf.provided_by)
    return full, (None if full.problems else make(full))


def _without(table: FamilyTable, joins: tuple[Joined, ...]) -> FamilyTable:
    """``table`` without the rows ``joins`` placed in it (and their revision suffix)."""
    gone = {j.record.name for j in joins}
    return replace(table, rows=tuple(r for r in table.rows if r.name not in gone),
                   revision=table_revision(table).split("+joined-")[0])


def _stale_profile(prof: Profile, families: Mapping[str, FamilyTable]) -> str:
    for fam, ov in prof.overlays.items():
        if fam == "*":
            continue
        table = families.get(fam)
        if table is None:
            return f"names family {fam!r}, which no longer exists"
        names = set(table.row_names()) | {a.name for a in ov.add}
        for n in (*ov.order, *ov.disable, *ov.enable, *ov.when, *ov.chain_when,
                  *(x for x in (ov.force, ov.fallback) if x and x != "fallback")):
            if n not in names:
                return f"names row {n!r} of family {fam!r}, which no longer exists"
        for spec in (*ov.when.values(), *ov.chain_when.values(), *(a.spec for a in ov.add)):
            stale = _stale_definition(spec, table)
            if stale:
                return stale
            gone = sorted(spec.axes() - set(EXPRESSION_AXES) - set(table.axes))
            if gone:
                return (f"compares axis {gone[0]!r}, which family {fam!r} no longer "
                        f"declares; load the profile again with it")
    return ""


def _stale_definition(spec: Spec, table: FamilyTable) -> str:
    """Why ``spec`` (a profile's, built with ``table``'s family's definitions when it was
    loaded) no longer fits ``table``: a definition it uses is gone or changed."""
    for part in named_parts(spec):
        name = part.description
        now = table.definitions.get(name)
        if now is None and name not in PREDICATES:
            return (f"uses definition {name!r} of family {table.name!r}, which no longer "
                    f"exists")
        if now is not None and now != part:
            return (f"uses definition {name!r} of family {table.name!r}, which the new table "
                    f"defines differently; load the profile again with it")
    return ""


def programmatic_table(name: str, provider: Any, fallback: Any) -> FamilyTable:
    """A ``register_family`` family: rows by ascending ``priority`` (the seed's order).

    ``fallback`` is, as in the seed, a zero-argument callable returning the fallback
    ``ImplRecord``; a record or a row name is accepted too. A fallback record that the
    provider does not list stays outside the chain, as in the seed: it serves only
    calls that no row of the chain matched (origin ``fallback``).
    """
    records = list(provider() if callable(provider) else provider)
    for r in records:
        if not isinstance(r, ImplRecord):
            raise TypeError(f"register_family({name!r}): provider gave {r!r}, not an ImplRecord")
    if callable(fallback) and not isinstance(fallback, (str, ImplRecord)):
        fallback = fallback()
        if not isinstance(fallback, ImplRecord):
            raise TypeError(f"register_family({name!r}): the fallback callable returned "
                            f"{fallback!r}, not an ImplRecord")
    ordered = sorted(records, key=lambda r: r.priority)  # stable: ties keep given order
    names = [r.name for r in ordered]
    if len(set(names)) != len(names):
        raise ValueError(f"register_family({name!r}): duplicate row names in {names}")
    outside: ImplRecord | None = None
    if isinstance(fallback, ImplRecord):
        fb_name = fallback.name
        if fb_name not in names:  # else the provider's row of that name is the fallback
            outside = fallback if fallback.family == name else replace(fallback, family=name)
    elif isinstance(fallback, str):
        fb_name = fallback
        if fb_name not in names:
            raise ValueError(f"register_family({name!r}): fallback {fb_name!r} is not one of "
                             f"the rows {names}")
    else:
        raise TypeError(f"register_family({name!r}): fallback must be a zero-argument callable "
                        f"returning an ImplRecord, an ImplRecord, or a row name; got "
                        f"{fallback!r}")
    rows = tuple(r if r.family == name else replace(r, family=name) for r in ordered)
    revision = ",".join(names) + (f";fallback={fb_name}" if outside is not None else "")
    return FamilyTable(name, rows, fb_name, source="register_family",
                       revision="python:" + revision, outside_fallback=outside,
                       provided_by="register_family")
