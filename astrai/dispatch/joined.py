"""Rows a package joins to an existing family in Python (``register_impl``).

A joined row is kept apart from the tables (``Registry.joined``) and placed into its
family's rows whenever a snapshot is built, so it survives ``reload_tables()`` and a
``load_tables`` that replaces the family. Placement: ``before`` or ``after`` a named row;
without either, by ``priority`` as in the seed (a lower priority is tried first; a YAML
row's priority is its position), never after the family's fallback row, which stays the
last resort. A joined row changes the family's revision, so ranks and lockfiles tell a
table with it from one without.
"""

from __future__ import annotations

__all__ = ["Joined", "join_rows"]

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

from astrai.dispatch.log import warn_once
from astrai.dispatch.tables.model import FamilyTable, ImplRecord, table_revision


@dataclass(frozen=True)
class Joined:
    """One ``register_impl`` call: the row and where it asked to go."""

    record: ImplRecord
    before: str | None = None
    after: str | None = None


def _place(rows: list[ImplRecord], table: FamilyTable, join: Joined) -> int:
    """The index ``join``'s row goes to among ``rows``."""
    names = [r.name for r in rows]
    anchor = join.before or join.after
    if anchor is not None:
        if anchor in names:
            return names.index(anchor) + (1 if join.after else 0)
        warn_once(f"register_impl: {join.record.family}.{join.record.name} asked to go "
                  f"{'before' if join.before else 'after'} {anchor!r}, which the table no "
                  f"longer has; placed by priority ({join.record.priority})")
    last = names.index(table.fallback) if table.fallback in names else len(rows)
    for i, rec in enumerate(rows[:last]):
        if rec.priority > join.record.priority:
            return i
    return last


def join_rows(families: Mapping[str, FamilyTable],
              joined: Mapping[str, tuple[Joined, ...]]) -> dict[str, FamilyTable]:
    """``families`` with each family's joined rows placed among its rows (a family that
    no longer exists keeps its joined rows aside, with a warning)."""
    out = dict(families)
    for family, joins in joined.items():
        table = out.get(family)
        if table is None:
            warn_once(f"register_impl: family {family!r} no longer exists; its rows "
                      f"{', '.join(j.record.name for j in joins)} wait for it")
            continue
        rows = [r for r in table.rows if r.name not in {j.record.name for j in joins}]
        for join in joins:
            rows.insert(_place(rows, table, join), join.record)
        digest = hashlib.sha256(json.dumps(
            [[j.record.name, j.record.source, j.before, j.after, j.record.priority]
             for j in joins]).encode()).hexdigest()[:12]
        base = table_revision(table).split("+joined-")[0]
        out[family] = replace(table, rows=tuple(rows), revision=f"{base}+joined-{digest}")
    return out


EMPTY: Mapping[str, tuple[Joined, ...]] = MappingProxyType({})
