"""What a row says to a call: the verdicts, and the resolution a decision ends in.

``row_verdict`` gives, for one row and one call, the verdict and its words (explain and
errors use them); ``serves`` and ``first_in_chain`` give the same answer without the
words, for the hot walk of the chain. Every source of ``precedence`` and explain judge
rows with these, so a row means the same thing to all of them.
"""

from __future__ import annotations

__all__ = [
    "BY_NAME",
    "DISABLED",
    "MATCH",
    "REJECT",
    "UNAVAILABLE",
    "UNFAITHFUL",
    "Resolution",
    "chain_resolution",
    "first_in_chain",
    "lookup",
    "no_row_error",
    "resolved",
    "row_verdict",
    "serve_problem",
    "serves",
    "undeclared_reason",
    "why_not",
]

from dataclasses import dataclass
from typing import Any

from astrai.dispatch import state as process
from astrai.dispatch.axes import (
    FEATURES_OFF,
    NO_FEATURES,
    CallContext,
    asked_features,
    format_context,
    read_features,
)
from astrai.dispatch.expr.spec import Spec
from astrai.dispatch.registry import Registry
from astrai.dispatch.tables.model import ALWAYS_AVAILABLE, ImplRecord, View
from astrai.errors import NoImplementationError


@dataclass(frozen=True)
class Resolution:
    """What serves a call: the row, and which source decided (``origin``)."""

    record: ImplRecord
    origin: str

    @property
    def name(self) -> str:
        """The row's name."""
        return self.record.name

    @property
    def obj(self) -> Any:
        """The implementation object."""
        return self.record.obj


MATCH, REJECT, UNAVAILABLE = "MATCH", "reject", "unavailable"
UNFAITHFUL, DISABLED, BY_NAME = "unfaithful", "disabled", "explicit-only"


def row_verdict(state: Registry, view: View, rec: ImplRecord, ctx: CallContext, *,
                implicit: bool = True) -> tuple[str, str]:
    """``(verdict, detail)`` for one row and one call; the chain and explain both use this.

    ``implicit`` is true for the chain: there, disabled, non-faithful and explicit-only
    rows (none of them enabled by a profile) are skipped, and a profile's ``chain_when``
    narrows the row's ``when``.
    """
    if implicit and rec.name in view.disabled:
        return DISABLED, view.disabled[rec.name]
    if implicit:
        rec = view.in_chain(rec)
    ok, reason = state.availability(rec)
    if not ok:
        return UNAVAILABLE, reason
    if implicit and not rec.implicit and rec.name not in view.enabled:
        return (UNFAITHFUL if not rec.faithful else BY_NAME), ""
    undeclared = asked_features(ctx) - rec.features
    if undeclared:
        return REJECT, undeclared_reason(rec, undeclared)
    why = rec.spec.failure(ctx)
    if why is not None:
        return REJECT, why
    return MATCH, rec.spec.description


def undeclared_reason(rec: ImplRecord, undeclared: frozenset[str]) -> str:
    """Why a row cannot serve a call asking for features it does not declare."""
    asked = ", ".join(sorted(undeclared))
    declared = ", ".join(sorted(rec.features)) or "none"
    return f"features: [{asked}] (the call asks for {asked}; the row declares {declared})"


def serves(state: Registry, view: View, rec: ImplRecord, ctx: CallContext, *,
           implicit: bool = True) -> bool:
    """Whether ``row_verdict`` would say MATCH, without building its words (the
    evaluator's fast path; the words are built only for explain and errors)."""
    if implicit and (rec.name in view.disabled
                     or (not rec.implicit and rec.name not in view.enabled)):
        return False
    if implicit:
        rec = view.in_chain(rec)
    spec = rec.spec
    if not (asked_features(ctx) <= rec.features and (spec._m or spec.matcher())(ctx)):
        return False  # the probe is asked only for a call the row would take
    if rec.available is not ALWAYS_AVAILABLE:
        probe = rec.available
        probed = process.probed.get(id(probe))  # == state.availability(rec), inlined
        return bool(probed[1] if probed is not None and probed[0] is probe
                    else state.availability(rec)[0])
    return True


def adhoc_record(family: str, obj: Any) -> ImplRecord:
    name = getattr(obj, "name", None) or getattr(obj, "__name__", None) or type(obj).__name__
    probe = getattr(obj, "supports_call", None)
    if callable(probe):
        spec = Spec.of(lambda ctx: bool(probe(*ctx.raw, **ctx.raw_kwargs)),
                       f"{name}.supports_call(...)")
    else:
        spec = Spec.always()
    return ImplRecord(family, str(name), obj, spec, source="ad hoc object",
                      provided_by="ad hoc object")


def lookup(view: View, handle: Any) -> ImplRecord | None:
    if isinstance(handle, str):
        return view.row(handle)
    for rec in view.rows:
        if rec.obj is handle:
            return rec
    return adhoc_record(view.table.name, handle)


def why_not(verdict: str, detail: str) -> str:
    return f"unavailable ({detail})" if verdict == UNAVAILABLE else f"requires {detail}"


def serve_problem(state: Registry, view: View, rec: ImplRecord, ctx: CallContext) -> str | None:
    """Why ``rec`` cannot serve ``ctx`` when selected by name (``None`` when it can)."""
    verdict, detail = row_verdict(state, view, rec, ctx, implicit=False)
    return None if verdict == MATCH else why_not(verdict, detail)


def no_row_error(state: Registry, view: View, ctx: CallContext) -> NoImplementationError:
    """Every row of ``view`` and why it cannot serve ``ctx`` (the fallback last)."""
    family = view.table.name
    rows = view.rows if not view.outside_fallback else (*view.rows, view.fallback)
    reasons: list[tuple[str, str]] = []
    for rec in rows:
        verdict, detail = row_verdict(state, view, rec, ctx, implicit=rec is not view.fallback)
        if verdict == DISABLED:
            why = f"disabled by profile {detail}"
        elif verdict == UNFAITHFUL:
            why = "not faithful (explicit or profile-enabled only)"
        elif verdict == BY_NAME:
            why = "explicit-only (explicit or profile-enabled only)"
        else:
            why = why_not(verdict, detail)
        reasons.append((f"{rec.name} (fallback)" if rec is view.fallback else rec.name, why))
    lines = [f"no {family} row can serve this call, not even the fallback "
             f"{view.fallback.name!r}; call: {format_context(ctx)}"]
    lines += [f"  {name}: {why}" for name, why in reasons]
    return NoImplementationError("\n".join(lines), family=family, reasons=reasons)


def first_in_chain(state: Registry, view: View, ctx: CallContext) -> ImplRecord | None:
    """The first row of ``view``'s chain that serves ``ctx``: ``serves`` row by row,
    inlined (the hot walk of every decision). A row's features and ``when`` are asked
    before its availability, so a probe (which may import a compiler, or touch a device)
    runs only for a call its row would take."""
    probed = process.probed
    asked = NO_FEATURES if read_features(ctx) == FEATURES_OFF else asked_features(ctx)
    for rec in view.chain:
        spec = rec.spec
        if (asked and not asked <= rec.features) or not (spec._m or spec.matcher())(ctx):
            continue
        if rec.available is not ALWAYS_AVAILABLE:
            probe = rec.available
            got = probed.get(id(probe))
            if not (got[1] if got is not None and got[0] is probe
                    else state.availability(rec)[0]):
                continue
        return rec
    return None


def chain_resolution(state: Registry, view: View, ctx: CallContext,
                     origin: str) -> Resolution | None:
    """``first_in_chain``'s row as a resolution of ``origin``, or ``None``."""
    rec = first_in_chain(state, view, ctx)
    return None if rec is None else resolved(state, rec, origin)


def resolved(state: Registry, rec: ImplRecord, origin: str) -> Resolution:
    """``Resolution(rec, origin)``, made once per snapshot (``Decision`` holds it)."""
    got = state.made.get((id(rec), origin))
    if got is not None and got.resolution.record is rec:
        return got.resolution  # type: ignore[no-any-return]
    return Resolution(rec, origin)
