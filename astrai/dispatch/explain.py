"""Explain: why each row wins or loses for a call, from the same evaluator as resolution.

``explanation`` runs ``resolution.evaluate`` on the snapshot in force, collecting its
notes, and gives every row's verdict (``verdicts.row_verdict``) beside the row that
serves and its origin; ``explain`` is its text, ``explain_plan`` several families' at once.
"""

from __future__ import annotations

__all__ = ["Explanation", "RowVerdict", "explain", "explain_plan", "explanation"]

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from astrai.dispatch import state as process
from astrai.dispatch.axes import (
    MACHINE_AXES,
    CallContext,
    context_fields,
    format_value,
    unremarkable,
)
from astrai.dispatch.hardware import machine_facts
from astrai.dispatch.keying import family_specs
from astrai.dispatch.plugins import in_use
from astrai.dispatch.provenance import describe, left_to_model
from astrai.dispatch.registry import Registry, current
from astrai.dispatch.resolution import evaluate, settle
from astrai.dispatch.scopes import active_view
from astrai.dispatch.stats import stats
from astrai.dispatch.verdicts import (
    BY_NAME,
    DISABLED,
    MATCH,
    REJECT,
    UNAVAILABLE,
    UNFAITHFUL,
    row_verdict,
)
from astrai.env import LOCK_ENV


@dataclass(frozen=True)
class RowVerdict:
    """One row's line in an explanation."""

    name: str
    verdict: str  # MATCH | reject | unavailable | unfaithful | explicit-only | disabled
    detail: str
    fallback: bool
    provided_by: str = ""  # who provided the row (``ImplRecord.provided_by``)
    source: str = ""  # where it was defined
    #: Shown in the text form: the row comes from someone other than its table's provider.
    joined: bool = False


@dataclass(frozen=True)
class Explanation:
    """Structured ``explain`` output (the CLI's ``--json`` prints this)."""

    family: str
    context: dict[str, Any]  # axis -> int, bool, None or str (a dtype as its name)
    profiles: tuple[str, ...]
    rows: tuple[RowVerdict, ...]
    notes: tuple[str, ...]
    row: str | None
    origin: str | None
    error: str | None
    source: str = ""  # the file (or registration) the family's table came from
    provided_by: str = ""  # who provided the family's table
    #: The plugins whose rows (or table) the family holds: distribution -> version.
    plugins: Mapping[str, str] = field(default_factory=dict)
    #: Profile -> where it comes from, for those in force process-wide (the tuned one
    #: ``dispatch_model`` found): the file and when it was tuned.
    origins: Mapping[str, str] = field(default_factory=dict)
    #: The machine axes the decision was taken under (empty when no spec of the family
    #: reads one and the call states none): name -> value.
    machine: Mapping[str, Any] = field(default_factory=dict)
    #: Those the call stated for another machine: name -> this machine's own value.
    stated: Mapping[str, Any] = field(default_factory=dict)

    def render(self) -> str:
        """The contract §8 text."""
        lines = [f"[{self.family}] " + " ".join(f"{k}={format_value(v)}"
                                                for k, v in self.context.items()
                                                if not unremarkable(k, v)
                                                and k not in MACHINE_AXES)]
        if self.machine:
            lines.append("  machine: " + " ".join(
                f"{k}={format_value(v)}" + (f" (stated; here {format_value(self.stated[k])})"
                                            if k in self.stated else "")
                for k, v in self.machine.items()))
        if self.profiles:
            lines.append("  profiles: " + " + ".join(
                f"{p} ({self.origins[p]})" if p in self.origins else p
                for p in self.profiles))
        lines += [_row_text(r) for r in self.rows]
        lines += [f"  note: {n}" for n in self.notes]
        if self.source:
            by = (f" ({self.provided_by})"
                  if self.provided_by and self.provided_by != self.source else "")
            lines.append(f"  table: {self.source}{by}")
        lines.append(f"=> ERROR: {self.error}" if self.error is not None
                     else f"=> {self.row} (origin={self.origin})")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; context values keep their types (int, bool, null, str)."""
        return {
            "family": self.family,
            "source": self.source,
            "provided_by": self.provided_by,
            "plugins": dict(self.plugins),
            "context": {k: v for k, v in self.context.items() if k not in MACHINE_AXES},
            "machine": {k: format_value(v) if v is not None else None
                        for k, v in self.machine.items()},
            "machine_stated": sorted(self.stated),
            "profiles": list(self.profiles),
            "profile_origins": dict(self.origins),
            "rows": [{"name": r.name, "verdict": r.verdict, "detail": r.detail,
                      "fallback": r.fallback, "provided_by": r.provided_by,
                      "source": r.source} for r in self.rows],
            "notes": list(self.notes),
            "decision": None if self.row is None else {"row": self.row, "origin": self.origin},
            "error": self.error,
        }


def _row_text(r: RowVerdict) -> str:
    tag = "  (fallback)" if r.fallback else ""
    if r.joined:
        tag += f"  [{r.provided_by}]"
    if r.verdict == MATCH:
        return f"  {r.name}: MATCH ({r.detail}){tag}"
    if r.verdict == REJECT:
        return f"  {r.name}: reject ({r.detail}){tag}"
    if r.verdict == UNAVAILABLE:
        return f"  {r.name}: SKIP unavailable ({r.detail}){tag}"
    if r.verdict == UNFAITHFUL:
        return f"  {r.name}: SKIP not faithful (explicit-only){tag}"
    if r.verdict == BY_NAME:
        return f"  {r.name}: SKIP explicit-only (selected by name or a profile){tag}"
    return f"  {r.name}: SKIP disabled by profile {r.detail}{tag}"


def explanation(family: str, ctx: CallContext, explicit: Any = None) -> Explanation:
    """Structured explain: each row's verdict (as the chain sees it) and the decision."""
    state = current()
    view = active_view(state, family)
    rows = []
    for rec in view.rows:
        verdict, detail = row_verdict(state, view, rec, ctx)
        if verdict == MATCH and not rec.implicit:
            detail += f"; enabled by profile {view.enabled[rec.name]}"
        elif verdict == DISABLED and view.forced is not None and view.forced[0] == rec.name:
            detail += f" in the chain, but forced by profile {view.forced[1]}"
        by = view.table.provider_of(rec)
        rows.append(RowVerdict(rec.name, verdict, detail, rec is view.fallback, by,
                               rec.source, by != view.table.provided_by))
    notes: list[str] = list(view.notes)
    notes += [describe(p.name, p.provenance) for p in map(state.profiles.get, view.profiles)
              if p is not None and p.provenance is not None]
    notes += _left_to_model(state, family, view.profiles)
    if process.hot_notes is not None:
        notes += process.hot_notes(family, state)
    handed = stats().handed
    notes += [f"of the calls row {r} was chosen for, {n} ran on {to} (its kernel "
              f"declined them; stats().handed)"
              for (f, r, to), n in sorted(handed.items()) if f == family]
    row = origin = error = None
    try:
        res = evaluate(family, ctx, explicit, state=state, notes=notes)
        res, drift = settle(state, family, explicit, ctx, res, enforce=False)
        row, origin = res.name, res.origin
        if origin == "lock":
            notes.append(f"the lock {os.environ.get(LOCK_ENV)} pins {row}")
        if drift is not None:
            notes.append(f"lock: {drift.message()}")
            if drift.fatal:
                error = drift.error().args[0]
    except (ValueError, RuntimeError) as exc:
        error = str(exc)
    machine, stated = _machine(state, family, ctx)
    return Explanation(family, context_fields(ctx), view.profiles, tuple(rows), tuple(notes),
                       row, origin, error, source=view.table.source,
                       provided_by=view.table.provided_by,
                       plugins=in_use(state.plugins, (view.table,)), machine=machine,
                       stated=stated, origins=_origins(state, view.profiles))


def _machine(state: Registry, family: str, ctx: CallContext
             ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The machine axes the decision was taken under, when some spec of the family reads
    one or the call states one (else nothing), and those stated: name -> this machine's
    value."""
    here = machine_facts().as_dict()
    stated = {name: here[name] for name in MACHINE_AXES if name in ctx.extra}
    read = set().union(*(spec.axes() for spec in family_specs(state, family)))
    if not stated and not read.intersection(MACHINE_AXES):
        return {}, {}
    return {name: axis.getter(ctx) for name, axis in MACHINE_AXES.items()}, stated


def explain(family: str, ctx: CallContext, explicit: Any = None) -> str:
    """Why each row won or lost for ``ctx``, then the decision (contract §8)."""
    return explanation(family, ctx, explicit).render()


def explain_plan(ctxs: Mapping[str, CallContext],
                 explicit: Mapping[str, Any] | None = None) -> str:
    """``explain`` for several families, one block each."""
    explicit = explicit or {}
    return "\n\n".join(explain(fam, ctx, explicit.get(fam)) for fam, ctx in ctxs.items())


# -- profiles in force process-wide, and families a routed model leaves to its code -----

def _origins(state: Registry, profiles: tuple[str, ...]) -> dict[str, str]:
    """Profile -> ``in force process-wide, from FILE, tuned DATE`` for the profiles of
    ``profiles`` put in force process-wide (``scopes.set_process_profiles``)."""
    out: dict[str, str] = {}
    for name in profiles:
        prof = state.profiles.get(name)
        if prof is None or name not in process.process_profiles:
            continue
        tuned = (prof.provenance or {}).get("tuned")
        out[name] = f"in force process-wide, from {prof.file}" + (f", tuned {tuned}" if tuned
                                                                  else "")
    return out


def _left_to_model(state: Registry, family: str, profiles: tuple[str, ...]) -> list[str]:
    """A note per profile in force that leaves ``family`` to a routed model's own code."""
    notes = []
    for name in profiles:
        prof = state.profiles.get(name)
        if prof is not None and any(ov.model_code for ov in prof.for_family(family)):
            notes.append(f"a model routed by dispatch_model leaves {family} to the model's "
                         f"own code: {left_to_model(name, prof.provenance, family)}")
    return notes
