"""Rows that join an existing family: a plugin's row overlays (``extends:`` files,
``astrai.dispatch.plugins``) and ``register_impl`` calls in Python.

Joined rows are kept apart from the tables (``Registry.extended``, ``Registry.joined``)
and placed into their family's rows whenever a snapshot is built, so they survive
``reload_tables()`` and a ``load_tables`` that replaces the family. Placement: ``before``
or ``after`` a named row (rows joined after the same row keep their order); without
either - one rule for an overlay's row and a ``register_impl`` row alike - before the
family's first faithful row (rows joined earlier stay ahead of it), where the chain tries
it before the table's own choices; never after the family's fallback row, which stays
the last resort (``register_family``'s own rows keep the seed's ``priority`` order).
Overlays are placed first, then ``register_impl`` rows. Joined
rows change the family's revision (with who provided them: a plugin's version is part
of it), so ranks and lockfiles tell a table with them from one without.
"""

from __future__ import annotations

__all__ = ["Joined", "join_rows"]

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

from astrai.dispatch.log import warn_once
from astrai.dispatch.tables.model import FamilyTable, ImplRecord, row_content, table_revision


@dataclass(frozen=True)
class Joined:
    """One joined row and where it asked to go; ``by`` says who joined it (for
    messages: ``register_impl`` or the overlay file)."""

    record: ImplRecord
    before: str | None = None
    after: str | None = None
    by: str = "register_impl"

    @property
    def overlay(self) -> bool:
        """Whether the row comes from a row overlay rather than ``register_impl``."""
        return self.by != "register_impl"


def _by_default(rows: list[ImplRecord], table: FamilyTable, join: Joined,
                joined: set[str]) -> int:
    """Where ``join``'s row goes when it names no row (or one the table lacks)."""
    names = [r.name for r in rows]
    last = names.index(table.fallback) if table.fallback in names else len(rows)
    # Before the first faithful row of the table itself (rows joined earlier stay ahead):
    # a row someone joins is one they mean to be tried.
    return next((i for i, r in enumerate(rows[:last])
                 if r.faithful and r.name not in joined), last)


def _place(rows: list[ImplRecord], table: FamilyTable, join: Joined, joined: set[str],
           behind: dict[str, str]) -> int:
    """The index ``join``'s row goes to among ``rows``; ``behind`` maps an ``after``
    anchor to the row last placed after it (so such rows keep their order)."""
    names = [r.name for r in rows]
    anchor = join.before or join.after
    if anchor is not None:
        if anchor in names:
            if join.before:
                return names.index(anchor)
            return names.index(behind.get(anchor, anchor)) + 1
        how = "placed before the first faithful row"
        where = join.record.source if join.overlay else join.by  # an overlay's: file:line
        warn_once(f"{where}: {join.record.family}.{join.record.name} asked to go "
                  f"{'before' if join.before else 'after'} {anchor!r}, which the table no "
                  f"longer has; {how}")
    return _by_default(rows, table, join, joined)


def join_rows(families: Mapping[str, FamilyTable],
              *layers: Mapping[str, tuple[Joined, ...]]) -> dict[str, FamilyTable]:
    """``families`` with each family's joined rows (``layers`` in order: the plugins'
    overlays, then ``register_impl``'s) placed among its rows. A family that no longer
    exists keeps its joined rows aside, with a warning."""
    out = dict(families)
    for family in dict.fromkeys(f for layer in layers for f in layer):
        joins = [j for layer in layers for j in layer.get(family, ())]
        table = out.get(family)
        if table is None:
            for by in dict.fromkeys(j.by for j in joins):
                warn_once(f"{by}: family {family!r} does not exist; its rows "
                          f"{', '.join(j.record.name for j in joins if j.by == by)} wait "
                          f"for it")
            continue
        names = {j.record.name for j in joins}
        rows = [r for r in table.rows if r.name not in names]
        behind: dict[str, str] = {}
        for join in joins:
            rows.insert(_place(rows, table, join, names, behind), join.record)
            if join.after:
                behind[join.after] = join.record.name
        # The rows' content and who provided them (a plugin's version), never a path: equal
        # in every process that joined the same rows.
        digest = hashlib.sha256(json.dumps(
            [[*row_content(j.record), j.record.provided_by, j.before, j.after,
              j.record.priority] for j in joins]).encode()).hexdigest()[:12]
        base = table_revision(table).split("+joined-")[0]
        out[family] = replace(table, rows=tuple(rows), revision=f"{base}+joined-{digest}")
    return out


EMPTY: Mapping[str, tuple[Joined, ...]] = MappingProxyType({})
