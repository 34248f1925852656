"""The loaded families and profiles: one immutable snapshot, swapped whole.

Readers take ``current()`` once and work on that snapshot, so a concurrent
reload can never show them half a table. Writers build a complete new snapshot
and swap it in under a lock; a failed load raises and leaves the old one in force.
Every swap (and ``refresh()``) bumps ``epoch``, which keys the decision cache.
"""

from __future__ import annotations

__all__ = [
    "Registry",
    "assume_machine",
    "current",
    "env_table_paths",
    "list_families",
    "list_profiles",
    "load_tables",
    "refresh",
    "register_env_alias",
    "register_family",
    "register_impl",
    "reload_tables",
    "shipped_tables_dir",
    "unplugged_families",
    "unregister_impl",
    "validate",
    "yaml_files",
]

import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from astrai.dispatch import hardware
from astrai.dispatch import state as process
from astrai.dispatch.assembly import (
    build_snapshot,
    env_table_paths,
    programmatic_table,
    table_sources,
    yaml_files,
)
from astrai.dispatch.hardware import MachineFacts
from astrai.dispatch.joined import Joined, join_rows
from astrai.dispatch.names import family_name_problem
from astrai.dispatch.plugins import discover, plugin_problems
from astrai.dispatch.snapshot import Registry
from astrai.dispatch.tables.artifact import shipped_tables_dir
from astrai.dispatch.tables.model import (
    FamilyTable,
    ImplRecord,
    table_revision,
)
from astrai.errors import TableError, TableProblem
from astrai.suggestions import did_you_mean


def _swap(new: Registry) -> None:
    process.snapshot = new
    rows = [(r.family, r.name, r.obj) for t in new.families.values() for r in t.rows]
    rows += [(a.family, a.name, a.obj) for p in new.profiles.values()
             for ov in p.overlays.values() for a in ov.add]
    for family, name, obj in rows:
        process.publish(family, name, obj)
    process.note_epoch(new.epoch)



def current() -> Registry:
    """The snapshot in force, loading the shipped tables (plus ``ASTR_TABLES``) on first use."""
    got: Registry | None = process.snapshot
    if got is None:
        # Read outside the lock (concurrent first callers may each read; one result wins).
        got = _commit(lambda base: base or build_snapshot(
            None, table_sources(), replace_all=True, plugins=discover())[0], first=True)
    return got


def _commit(make: Callable[[Registry | None], Registry], *, first: bool = False) -> Registry:
    """Build a snapshot from the one in force with ``make`` - reading files and importing
    modules with no lock held - and swap it in if nothing else was swapped meanwhile
    (else build again on the newer one). The lock only guards the swap itself."""
    while True:
        base = process.snapshot if first else current()
        new = make(base)
        with process.swap_lock:
            if process.snapshot is base:
                if new is not base:
                    _swap(new)
                return new


def load_tables(*paths: str | os.PathLike[str]) -> list[str]:
    """Validate every given file or directory, then add or replace those families and profiles.

    Returns the family names the files defined. Raises ``TableError`` listing every
    problem; on failure the tables in force are unchanged.
    """
    read: list[str] = []

    def make(base: Registry | None) -> Registry:
        new, files = build_snapshot(base, [(os.fspath(p), "load_tables") for p in paths],
                            replace_all=False)
        read[:] = files
        return new

    new = _commit(make)
    loaded = set(read)
    return [n for n, t in new.families.items() if t.source in loaded]


def reload_tables() -> list[str]:
    """Re-read the shipped tables, the plugins (``ASTR_PLUGINS`` read again) and
    ``ASTR_TABLES``; programmatic families and ``register_impl`` rows are kept."""
    new = _commit(lambda base: build_snapshot(base, table_sources(), replace_all=True,
                                      plugins=discover())[0], first=True)
    return sorted(new.families)


def validate(*paths: str | os.PathLike[str]) -> list[TableProblem]:
    """Every problem in these files (default: shipped, the plugins and ``ASTR_TABLES``,
    a broken plugin's problems included); loads nothing."""
    try:
        if paths:
            build_snapshot(current(), [(os.fspath(p), "load_tables") for p in paths],
                   replace_all=False, quiet=True)
            return []
        new, _ = build_snapshot(None, table_sources(), replace_all=True, plugins=discover(),
                        quiet=True)
    except TableError as exc:
        return exc.problems
    return plugin_problems(new.plugins)


def unplugged_families() -> Mapping[str, FamilyTable]:
    """The families as the shipped tables and ``ASTR_TABLES`` give them, without any
    plugin's rows or tables (what a kernel package's files are checked against when it
    is precompiled); loads nothing. Raises ``TableError`` if those tables have problems."""
    return build_snapshot(None, table_sources(), replace_all=True, plugins=[])[0].families


def refresh() -> None:
    """Forget cached availability probes and the machine facts read (the machine axes:
    a thread count set since), and every cached decision."""
    hardware.forget()
    _commit(lambda base: _refreshed(base))


@contextmanager
def assume_machine(**values: Any) -> Iterator[MachineFacts]:
    """Within the block, the machine axes take ``values`` in place of this machine's
    (``assume_machine(cpu_vendor="amd", cpu_isa="avx512")``), for every table, profile
    and decision of the process; the decisions taken before and within are forgotten at
    both ends. What the rows can run is still this machine's (their availability)."""
    facts = hardware.assumed(**values)
    hardware.assume(facts)
    refresh()
    try:
        yield facts
    finally:
        hardware.assume(None)
        refresh()


def _refreshed(base: Registry | None) -> Registry:
    assert base is not None
    process.probed.clear()
    return replace(base, epoch=next(process.epochs))


def register_family(name: str, provider: Callable[[], Iterable[ImplRecord]]
                    | Iterable[ImplRecord],
                    fallback: Callable[[], ImplRecord] | ImplRecord | str) -> None:
    """Register (or replace) a family in Python, beside the YAML families.

    ``provider`` returns (or is) the family's ``ImplRecord``s; a lower ``priority`` is
    tried first, as in the seed. ``fallback`` is, as in the seed, a zero-argument callable
    returning the fallback ``ImplRecord`` (a record, or the name of one of the rows, is
    accepted too). A callable provider (and fallback) is called again on
    ``reload_tables()``.
    """
    problem = family_name_problem(name)
    if problem is not None:
        raise ValueError(f"register_family: {problem}")

    def make(base: Registry | None) -> Registry:
        assert base is not None
        table = programmatic_table(name, provider, fallback)
        families = dict(base.families)
        families[name] = table
        programmatic = dict(base.programmatic)
        programmatic[name] = (provider, fallback)
        return replace(base, families=MappingProxyType(
            join_rows(families, base.extended, base.joined)), epoch=next(process.epochs),
            programmatic=MappingProxyType(programmatic))

    _commit(make)


def register_impl(record: ImplRecord, before: str | None = None,
                  after: str | None = None) -> None:
    """Join ``record`` to its existing family (a package's row, added in Python).

    Placed ``before`` or ``after`` a named row, else by ``priority`` as in the seed (never
    after the fallback row). Registering a name again replaces that joined row. The row
    survives ``reload_tables()`` and tables loaded later; every registration starts a new
    snapshot, so no cached decision outlives it. ``ValueError`` for a name a table row
    already has, an unknown anchor, or both anchors.
    """
    if not isinstance(record, ImplRecord):
        raise TypeError(f"register_impl: expected an ImplRecord, got {type(record).__name__}")
    if before is not None and after is not None:
        raise ValueError("register_impl: give before= or after=, not both")
    caller = sys._getframe(1).f_globals.get("__name__", "?")
    if not record.source:
        record = replace(record, source=f"register_impl ({caller})")
    if not record.provided_by:
        record = replace(record, provided_by=f"register_impl in {caller}")

    def make(base: Registry | None) -> Registry:
        assert base is not None
        table = base.family(record.family)  # UnknownFamilyError lists the known families
        mine = {j.record.name for j in base.joined.get(record.family, ())}
        names = table.row_names()
        if record.name in names and record.name not in mine:
            raise ValueError(f"register_impl: {record.family} already has a row "
                             f"{record.name!r} (from {table.row(record.name).source or '?'})"  # type: ignore[union-attr]
                             "; choose another name")
        anchor = before or after
        if anchor is not None and anchor not in names:
            raise ValueError(f"register_impl: {record.family} has no row {anchor!r}"
                             f"{did_you_mean(anchor, names)}; rows: {', '.join(names)}")
        joins = [j for j in base.joined.get(record.family, ()) if j.record.name != record.name]
        joins.append(Joined(record, before, after))
        return _rejoined(base, record.family, tuple(joins))

    _commit(make)


def unregister_impl(family: str, name: str) -> None:
    """Remove a row ``register_impl`` joined to ``family`` (a table's own rows stay)."""

    def make(base: Registry | None) -> Registry:
        assert base is not None
        table = base.family(family)
        joins = base.joined.get(family, ())
        if name not in {j.record.name for j in joins}:
            row = table.row(name)
            where = (f"it comes from {row.source or 'the table'}" if row is not None
                     else f"no such row; joined rows: "
                          f"{', '.join(j.record.name for j in joins) or 'none'}")
            raise ValueError(f"unregister_impl: {family}.{name} was not joined by "
                             f"register_impl ({where})")
        return _rejoined(base, family, tuple(j for j in joins if j.record.name != name))

    _commit(make)


def _rejoined(base: Registry, family: str, joins: tuple[Joined, ...]) -> Registry:
    """``base`` with ``family``'s joined rows now ``joins`` (a new snapshot)."""
    joined = dict(base.joined)
    if joins:
        joined[family] = joins
    else:
        joined.pop(family, None)
    families = dict(base.families)
    table = families[family]
    gone = {j.record.name for j in base.joined.get(family, ())} - {j.record.name for j in joins}
    if gone:  # take the removed rows out before placing the rest again
        families[family] = replace(table, rows=tuple(r for r in table.rows if r.name not in gone),
                                   revision=table_revision(table).split("+joined-")[0])
    frozen = MappingProxyType(joined)
    return replace(base, families=MappingProxyType(join_rows(families, base.extended, frozen)),
                   joined=frozen, epoch=next(process.epochs))


def register_env_alias(family: str, varname: str) -> None:
    """Let a legacy single-value variable (e.g. ``ASTR_BACKEND``) pick ``family``'s row.

    An ``ASTR_OPS`` entry for the family wins when both are set.
    """
    def make(base: Registry | None) -> Registry:
        assert base is not None
        base.family(family)
        aliases = dict(base.aliases)
        aliases[family] = varname
        registered = dict(base.registered_aliases)
        registered[family] = varname
        return replace(base, aliases=MappingProxyType(aliases), epoch=next(process.epochs),
                       registered_aliases=MappingProxyType(registered))

    _commit(make)


def list_families() -> list[str]:
    """Names of the loaded families."""
    return sorted(current().families)


def list_profiles() -> list[str]:
    """Names of the loaded profiles."""
    return sorted(current().profiles)
