"""Profiles: YAML overlays that change tables without editing them (SPEC §6).

A profile says, per family (or ``"*"`` for all): ``force`` a row or the fallback,
``order`` rows, ``disable`` rows, ``enable`` non-faithful rows for the implicit
chain, replace a row's ``when``, set ``fallback``, ``add`` rows. Active profiles
are applied in order on top of a family's table to give its ``View``: the rows as
resolution actually walks them, plus who changed what (for ``explain``).
"""

from __future__ import annotations

__all__ = ["FamilyOverlay", "Profile", "View", "build_profile", "make_view"]

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from astrai.dispatch._suggest import did_you_mean
from astrai.dispatch.expr.spec import Spec
from astrai.dispatch.loader import ParsedFile, build_overlay_rows, compile_when, family_vocabulary
from astrai.dispatch.records import FamilyTable, ImplRecord

ALL = "*"
FALLBACK = "fallback"


@dataclass(frozen=True)
class FamilyOverlay:
    """One profile's changes to one family (or to all, when ``family == "*"``)."""

    family: str
    force: str | None = None
    order: tuple[str, ...] = ()
    disable: tuple[str, ...] = ()
    enable: tuple[str, ...] = ()
    when: Mapping[str, Spec] = field(default_factory=lambda: MappingProxyType({}))
    fallback: str | None = None
    add: tuple[ImplRecord, ...] = ()


@dataclass(frozen=True)
class Profile:
    """A named overlay; ``overlays`` maps a family name or ``"*"`` to its changes."""

    name: str
    overlays: Mapping[str, FamilyOverlay]
    description: str = ""
    source: str = ""
    revision: str = ""

    def for_family(self, family: str) -> list[FamilyOverlay]:
        """The overlays that apply to ``family``: ``"*"`` first, then its own."""
        return [o for key in (ALL, family) if (o := self.overlays.get(key)) is not None]


@dataclass(frozen=True)
class View:
    """A family as resolution sees it under the active profiles."""

    table: FamilyTable
    rows: tuple[ImplRecord, ...]
    fallback: ImplRecord
    profiles: tuple[str, ...] = ()
    disabled: Mapping[str, str] = field(default_factory=dict)  # row -> profile
    enabled: Mapping[str, str] = field(default_factory=dict)  # row -> profile
    forced: tuple[str, str] | None = None  # (row, profile)
    notes: tuple[str, ...] = ()  # what profiles changed, for explain

    def row(self, name: str) -> ImplRecord | None:
        """The row called ``name`` in this view."""
        for r in self.rows:
            if r.name == name:
                return r
        return None

    @property
    def outside_fallback(self) -> bool:
        """Whether the fallback row is outside the chain (a seed-style registration)."""
        return self.fallback not in self.rows

    def row_names(self) -> list[str]:
        """Row names in effective order."""
        return [r.name for r in self.rows]


def make_view(table: FamilyTable, profiles: tuple[Profile, ...]) -> View:
    """Apply ``profiles`` in order to ``table``. Profiles were validated at load time."""
    if not profiles:
        return View(table, table.rows, table.fallback_record)
    rows = list(table.rows)
    fallback = table.fallback
    disabled: dict[str, str] = {}
    enabled: dict[str, str] = {}
    forced: tuple[str, str] | None = None
    notes: list[str] = []
    for prof in profiles:
        for ov in prof.for_family(table.name):
            names = {r.name for r in rows}
            if ov.add:
                rows = [*ov.add, *(r for r in rows if r.name not in {a.name for a in ov.add})]
                notes.append(f"profile {prof.name} added {', '.join(a.name for a in ov.add)}")
            for name, spec in ov.when.items():
                rows = [replace(r, spec=spec) if r.name == name else r for r in rows]
                notes.append(f"profile {prof.name} set {name}.when = {spec.description}")
            order = [n for n in ov.order if n in names]
            if order:
                picked = [r for n in order for r in rows if r.name == n]
                rows = picked + [r for r in rows if r.name not in order]
                notes.append(f"profile {prof.name} ordered {', '.join(order)} first")
            for n in ov.disable:
                if n in names:
                    disabled[n] = prof.name
            for n in ov.enable:
                if n in names:
                    enabled[n] = prof.name
            if ov.fallback is not None and ov.fallback in names:
                fallback = ov.fallback
                notes.append(f"profile {prof.name} set fallback = {fallback}")
            if ov.force is not None and (ov.force == FALLBACK or ov.force in names):
                forced = (ov.force, prof.name)
            elif ov.force is not None:  # only a "*" overlay can name a row this family lacks
                notes.append(f"profile {prof.name}: '*' force: {ov.force} does not apply to "
                             f"{table.name}, which has no row {ov.force!r}")
    by_name = {r.name: r for r in rows}
    if forced is not None and forced[0] == FALLBACK:
        forced = (fallback, forced[1])
    if forced is not None and forced[0] in disabled:
        notes.append(f"profile {forced[1]} forces {forced[0]}, which profile "
                     f"{disabled[forced[0]]} disables: a force beats a disable")
    return View(
        table=table,
        rows=tuple(rows),
        fallback=by_name.get(fallback) or table.fallback_record,
        profiles=tuple(p.name for p in profiles),
        disabled=disabled,
        enabled=enabled,
        forced=forced,
        notes=tuple(notes),
    )


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
                   parsed.file, parsed.revision)


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
                                       family_vocabulary(table.axes)) or []
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
    when: dict[str, Spec] = {}
    vocabulary = family_vocabulary(table.axes if table is not None else {})
    for name, text in ov["when"].items():
        if name not in names:
            parsed.problem((*path, "when", name), f"when: row {name!r} does not exist"
                                                  f"{did_you_mean(name, names)}; rows: "
                                                  f"{', '.join(names)}", key=True)
            continue
        spec = compile_when(parsed, (*path, "when", name), text, vocabulary)
        if spec is not None:
            when[name] = spec
    return FamilyOverlay(family, ov["force"], tuple(ov["order"]), tuple(ov["disable"]),
                         tuple(ov["enable"]), MappingProxyType(when), ov["fallback"],
                         tuple(added))
