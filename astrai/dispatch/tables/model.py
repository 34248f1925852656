"""The engine objects a table file becomes: immutable once loaded.

This module owns what resolution reads, whatever a table came from (a file, the
precompiled artifact or ``register_family``):

- ``ImplRecord``, one row, and ``FamilyTable``, a family's rows in priority order
  with its fallback;
- ``Profile`` and ``FamilyOverlay``, what a profile (contract §6) changes per family
  (or ``"*"`` for all): ``force`` a row or the fallback, ``order`` rows, ``disable``
  rows, ``enable`` non-faithful or explicit-only rows for the implicit chain, replace a row's
  ``when``, narrow where the implicit chain tries a row (``chain_when``: selection by name
  keeps the row's own ``when``), set ``fallback``, ``add`` rows;
- ``View`` and ``make_view``: active profiles applied in order on top of a family's
  table, giving the rows as resolution actually walks them, plus who changed what
  (for ``explain``);
- availability: a row's ``available`` is a zero-argument probe returning ``True``,
  or a falsy value: ``False`` or, better, ``Unavailable(reason)`` so ``explain`` can
  say why (``check`` runs one). A probe that raises makes the row unavailable with
  the exception as the reason. The registry evaluates probes once per process and
  caches them; ``refresh()`` re-evaluates them.

Reading files into these objects is ``load``; nothing here reads a file.
"""

from __future__ import annotations

__all__ = [
    "ALWAYS_AVAILABLE",
    "FamilyOverlay",
    "FamilyTable",
    "ImplRecord",
    "Profile",
    "Unavailable",
    "View",
    "check",
    "make_view",
    "row_content",
    "table_revision",
]

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from astrai.dispatch.axes import Axis
from astrai.dispatch.expr.spec import Spec


def _always_available() -> bool:
    return True


#: The probe of rows that declare none (never cached: there is nothing to probe).
ALWAYS_AVAILABLE = _always_available


@dataclass(frozen=True, eq=False)
class ImplRecord:
    """One row of a decision table.

    ``obj`` is the implementation itself (called as-is, never instantiated).
    ``available`` is a zero-argument probe (see ``check``).
    When rows come from ``register_family`` a *lower* ``priority`` is tried first (as in
    the seed; ties keep the provider's order); YAML rows take their priority from their
    position (0 for the first row). ``faithful=False`` marks a row that changes
    numerics: only explicit selection or a profile that enables it can pick it.
    ``explicit_only=True`` gives a faithful row the same reach (a row that never wins
    the chain on the calls the tables can tell apart, kept for selection by name).
    ``source`` says where the row was defined (``file:line`` or ``register_family``);
    ``provided_by`` who provided it: astrai's shipped tables, a user's table file
    (``ASTR_TABLES``, ``load_tables``), a plugin distribution and its version, a
    ``register_impl`` caller, ``register_family``, a profile's ``add:``.
    ``features`` are the feature axes (``axes.FEATURE_AXES``: a custom scale,
    soft-capping, ...) the row can honour: a call asking for any other is not its.
    """

    family: str
    name: str
    obj: Any
    spec: Spec = field(default_factory=Spec.always)
    available: Callable[[], Any] = _always_available
    priority: int = 100
    faithful: bool = True
    description: str = ""
    source: str = ""
    features: frozenset[str] = frozenset()
    explicit_only: bool = False
    provided_by: str = ""

    @property
    def implicit(self) -> bool:
        """Whether the implicit chain may pick this row without a profile enabling it:
        faithful and not ``explicit_only``."""
        return self.faithful and not self.explicit_only

    def __repr__(self) -> str:
        return f"ImplRecord({self.family}.{self.name}, when={self.spec.description!r})"


def _named(rows: tuple[ImplRecord, ...], name: str) -> ImplRecord | None:
    """The row called ``name`` among ``rows`` (a table's or a view's), if any."""
    for r in rows:
        if r.name == name:
            return r
    return None


@dataclass(frozen=True, eq=False)
class FamilyTable:
    """A family: its rows in priority order, its fallback row, and where it came from.

    ``fallback`` names the fallback row. It is one of ``rows``, except for a family
    registered seed-style with a fallback record that the provider does not list: that
    record is ``outside_fallback``, used only when nothing in the chain matched.
    """

    name: str
    rows: tuple[ImplRecord, ...]
    fallback: str
    description: str = ""
    env_alias: str | None = None
    axes: Mapping[str, Axis] = field(default_factory=lambda: MappingProxyType({}))
    #: The table's definitions (``define:``): name -> its named ``Spec``.
    definitions: Mapping[str, Spec] = field(default_factory=lambda: MappingProxyType({}))
    source: str = ""
    revision: str = ""
    outside_fallback: ImplRecord | None = None
    provided_by: str = ""  # who provided the table (see ``ImplRecord.provided_by``)
    context: Callable[..., Any] | None = None  # the table's ``context:`` builder (ops.call)

    def row(self, name: str) -> ImplRecord | None:
        """The row called ``name``, if any."""
        return _named(self.rows, name)

    def row_names(self) -> list[str]:
        """Row names in priority order."""
        return [r.name for r in self.rows]

    def provider_of(self, record: ImplRecord) -> str:
        """Who provided ``record`` (a row of this family): its own ``provided_by``, else
        the table's (a seed-style record given to ``register_family`` names none)."""
        return record.provided_by or self.provided_by

    @property
    def fallback_record(self) -> ImplRecord:
        """The fallback row."""
        rec = self.outside_fallback or self.row(self.fallback)
        assert rec is not None, f"family {self.name!r} has no fallback row {self.fallback!r}"
        return rec


def _object_path(obj: Any) -> str:
    target = obj if hasattr(obj, "__qualname__") else type(obj)
    return f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', '?')}"


def table_revision(table: FamilyTable) -> str:
    """A revision of a table's content, equal in every process that loaded the same table.

    A YAML table's is the SHA-256 of its file's text (whatever its path; rows whose
    import fails keep the same revision). A ``register_family`` table's hashes its rows:
    names, implementation and probe paths, ``when`` text, ``faithful`` (and
    ``explicit_only`` and ``features`` where set), the fallback.
    """
    if table.revision and table.source != "register_family":
        return table.revision
    rows = [row_content(r) for r in table.rows]
    text = json.dumps([table.name, table.fallback, table.env_alias, rows])
    return "py-" + hashlib.sha256(text.encode()).hexdigest()[:16]


def row_content(r: ImplRecord) -> list[Any]:
    """What a row is, wherever it was loaded from: name, implementation and probe paths,
    ``when`` text, ``faithful`` (and ``explicit_only`` and ``features`` where set)."""
    return [r.name, _object_path(r.obj), r.spec.description,
            "" if r.available is ALWAYS_AVAILABLE else _object_path(r.available), r.faithful,
            *(["explicit_only"] if r.explicit_only else []),
            *([sorted(r.features)] if r.features else [])]


# -- availability --------------------------------------------------------

@dataclass(frozen=True)
class Unavailable:
    """A falsy probe result that carries the reason the row cannot run."""

    reason: str

    def __bool__(self) -> bool:
        return False

    def __str__(self) -> str:
        return self.reason


def check(probe: Callable[[], Any]) -> tuple[bool, str]:
    """Run a probe: ``(True, "")`` or ``(False, reason)``; never raises, never exits.

    A probe answers ``True``, ``False`` or ``Unavailable(reason)``. Anything else it
    returns, and any failure (``SystemExit`` included), makes the row unavailable with
    the reason; only ``KeyboardInterrupt`` passes through.
    """
    name = getattr(probe, "__qualname__", repr(probe))
    try:
        result = probe()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # a probe must not take the process down
        detail = f": {exc}" if str(exc) else ""
        return False, f"probe raised {type(exc).__name__}{detail}"
    if isinstance(result, Unavailable):
        return False, result.reason
    if result is True:
        return True, ""
    if result is False:
        return False, f"{name}() returned False"
    return False, (f"{name}() returned a {type(result).__name__}, not True, False or "
                   f"astrai.dispatch.Unavailable(reason)")


# -- profiles and views --------------------------------------------------

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
    #: Row -> where the implicit chain may try it (and-ed with its ``when``); selecting
    #: the row by name, or forcing it, is not narrowed (a tuned profile's buckets).
    chain_when: Mapping[str, Spec] = field(default_factory=lambda: MappingProxyType({}))
    #: A model routed by ``dispatch_model`` while the profile is in force leaves the family
    #: to the model's own code (a tuned profile's measured choice).
    model_code: bool = False


@dataclass(frozen=True)
class Profile:
    """A named overlay; ``overlays`` maps a family name or ``"*"`` to its changes."""

    name: str
    overlays: Mapping[str, FamilyOverlay]
    description: str = ""
    source: str = ""
    revision: str = ""
    #: A tuned profile's ``provenance:`` (the file's mapping; ``astrai.dispatch.provenance``
    #: reads it), else ``None``.
    provenance: Mapping[str, Any] | None = None
    provided_by: str = ""  # who provided the file (see ``ImplRecord.provided_by``)

    @property
    def file(self) -> str:
        """The file the profile was read from: its ``source`` without the ``:line``."""
        return source_place(self.source)[0]

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
    #: Row -> the profiles' ``chain_when`` for it: where the implicit chain may try it.
    narrowed: Mapping[str, Spec] = field(default_factory=lambda: MappingProxyType({}))
    #: The rows the implicit chain may try, in order: not disabled, and implicit (faithful,
    #: not explicit-only) or enabled (availability and ``when`` are checked per call); a
    #: row a profile narrowed for the chain is there as a copy whose ``spec`` is its
    #: ``when`` and that narrowing (``in_chain``).
    chain: tuple[ImplRecord, ...] = field(init=False, default=())
    _chained: Mapping[str, ImplRecord] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        chained = {name: replace(r, spec=r.spec & self.narrowed[name])
                   for r in self.rows if (name := r.name) in self.narrowed}
        object.__setattr__(self, "_chained", MappingProxyType(chained))
        object.__setattr__(self, "chain", tuple(
            chained.get(r.name, r) for r in self.rows if r.name not in self.disabled
            and (r.implicit or r.name in self.enabled)))

    def in_chain(self, rec: ImplRecord) -> ImplRecord:
        """``rec`` as the implicit chain tries it: with the profiles' ``chain_when``
        narrowing its ``when``, if any."""
        return self._chained.get(rec.name, rec) if self._chained else rec

    def row(self, name: str) -> ImplRecord | None:
        """The row called ``name`` in this view."""
        return _named(self.rows, name)

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
    narrowed: dict[str, Spec] = {}
    for prof in profiles:
        for ov in prof.for_family(table.name):
            if ov.add:
                rows = [*ov.add, *(r for r in rows if r.name not in {a.name for a in ov.add})]
                notes.append(f"profile {prof.name} added {', '.join(a.name for a in ov.add)}")
            names = {r.name for r in rows}  # the overlay's own added rows included
            for name, spec in ov.when.items():
                rows = [replace(r, spec=spec) if r.name == name else r for r in rows]
                notes.append(f"profile {prof.name} set {name}.when = {spec.description}")
            for name, spec in ov.chain_when.items():
                if name in names:
                    narrowed[name] = narrowed[name] & spec if name in narrowed else spec
                    notes.append(f"profile {prof.name}: the chain tries {name} only where "
                                 f"{spec.description}")
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
        narrowed=MappingProxyType(narrowed),
    )


def source_place(source: str) -> tuple[str, int]:
    """``(file, line)`` of a row's or profile's ``source`` (``file:line``; line 0 where
    it names none, as ``register_family`` does)."""
    head, sep, line = source.rpartition(":")
    return (head, int(line)) if sep and line.isdigit() else (source, 0)
