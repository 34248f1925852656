"""Resolution (SPEC §3) and explain (SPEC §8): one evaluator behind both.

The order in which sources are consulted is stated once, as data, in
``PRECEDENCE``. ``resolve`` runs the evaluator and caches the decision for the
call's signature; ``explain`` runs the same evaluator on the same snapshot and
prints, row by row, the verdict the chain uses.
"""

from __future__ import annotations

__all__ = [
    "PRECEDENCE",
    "Decision",
    "NoImplementationError",
    "Resolution",
    "Source",
    "decide",
    "explain",
    "explain_plan",
    "explanation",
    "resolve",
    "resolve_plan",
    "same_context",
    "serve_problem",
    "set_max_decisions",
    "settle",
]

import inspect
import itertools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import FunctionType, MethodType
from typing import TYPE_CHECKING, Any

from astrai.dispatch import state as process
from astrai.dispatch._environ import LOCK_ENV, LOCK_KEY, environ_get
from astrai.dispatch._suggest import did_you_mean
from astrai.dispatch.axes import (
    CallContext,
    asked_features,
    context_fields,
    format_context,
    format_value,
    unremarkable,
)
from astrai.dispatch.expr.spec import Spec
from astrai.dispatch.keying import PLAIN, identity_or_base, signature_key
from astrai.dispatch.log import warn_once
from astrai.dispatch.plugins import in_use
from astrai.dispatch.provenance import describe
from astrai.dispatch.registry import Registry, current
from astrai.dispatch.sources import (
    OPS_KEY,
    PRECEDENCE,
    UNCACHEABLE,
    Source,
    active_profiles,
    active_view,
    check_handle,
    current_scope,
    env_now,
    handle_key,
)
from astrai.dispatch.stats import MISSES, QUIET, UNCACHED, counter
from astrai.dispatch.tables.model import ALWAYS_AVAILABLE, ImplRecord, View
from astrai.errors import ExplicitSelectionError, NoImplementationError

if TYPE_CHECKING:
    from astrai.dispatch.lockfile import Drift


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


# -- the evaluator ---------------------------------------------------------

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
    if rec.available is not ALWAYS_AVAILABLE:
        probe = rec.available
        probed = process.probed.get(id(probe))  # == state.availability(rec), inlined
        if not (probed[1] if probed is not None and probed[0] is probe
                else state.availability(rec)[0]):
            return False
    spec = rec.spec
    return asked_features(ctx) <= rec.features and bool((spec._m or spec.matcher())(ctx))


def _adhoc(family: str, obj: Any) -> ImplRecord:
    name = getattr(obj, "name", None) or getattr(obj, "__name__", None) or type(obj).__name__
    probe = getattr(obj, "supports_call", None)
    if callable(probe):
        spec = Spec.of(lambda ctx: bool(probe(*ctx.raw, **ctx.raw_kwargs)),
                       f"{name}.supports_call(...)")
    else:
        spec = Spec.always()
    return ImplRecord(family, str(name), obj, spec, source="ad hoc object",
                      provided_by="ad hoc object")


def _lookup(view: View, handle: Any) -> ImplRecord | None:
    if isinstance(handle, str):
        return view.row(handle)
    for rec in view.rows:
        if rec.obj is handle:
            return rec
    check_handle(view.table.name, handle, view.row_names())
    return _adhoc(view.table.name, handle)


def _why(verdict: str, detail: str) -> str:
    return f"unavailable ({detail})" if verdict == UNAVAILABLE else f"requires {detail}"


def serve_problem(state: Registry, view: View, rec: ImplRecord, ctx: CallContext) -> str | None:
    """Why ``rec`` cannot serve ``ctx`` when selected by name (``None`` when it can)."""
    verdict, detail = row_verdict(state, view, rec, ctx, implicit=False)
    return None if verdict == MATCH else _why(verdict, detail)


def _no_row(state: Registry, view: View, ctx: CallContext) -> NoImplementationError:
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
            why = _why(verdict, detail)
        reasons.append((f"{rec.name} (fallback)" if rec is view.fallback else rec.name, why))
    lines = [f"no {family} row can serve this call, not even the fallback "
             f"{view.fallback.name!r}; call: {format_context(ctx)}"]
    lines += [f"  {name}: {why}" for name, why in reasons]
    return NoImplementationError("\n".join(lines), family=family, reasons=reasons)


def evaluate(family: str, ctx: CallContext, explicit: Any = None, *,
             state: Registry | None = None, notes: list[str] | None = None) -> Resolution:
    """Decide which row serves ``ctx``, walking ``PRECEDENCE``. The single evaluator.

    ``notes`` (when given) collects what explain prints besides the row verdicts.
    """
    state = state or current()
    env = env_now(state)
    # (a family not loaded: UnknownFamilyError, a KeyError naming the known families)
    view = state.view(family, active_profiles(state, env))
    handled = False
    sources = PRECEDENCE
    if (explicit is None and view.forced is None and family not in env.backends
            and family not in current_scope().handles):
        # Nothing names a row for this call: the table decides, chain then fallback.
        rec = _first_in_chain(state, view, ctx)
        if rec is not None:
            return _resolved(state, rec, "chain")  # the seed's origin, fallback or not
        sources = _FALLBACK
    for source in sources:
        origin = source.origin
        handle = source.handle(family, explicit, env) if source.selects else None
        if handle is not None:
            rec = _lookup(view, handle)
            where = source.where(family, env)
            if rec is None:
                names = view.row_names()
                msg = f"Unknown {family} implementation: {handle!r}"
                if source.strict:
                    raise ValueError(f"{msg}{did_you_mean(handle, names)}; rows: "
                                     f"{', '.join(names)}")
                warn_once(f"{msg} from {where}{did_you_mean(handle, names)}; ignored; rows: "
                          f"{', '.join(names)}")
                if notes is not None:
                    notes.append(f"{origin}: {handle!r} names no row; ignored")
                continue
            handled = True
            # Words and verdict at once: an object's supports_call is probed once per call.
            verdict, detail = row_verdict(state, view, rec, ctx, implicit=False)
            if verdict == MATCH:
                return _resolved(state, rec, origin)
            why = _why(verdict, detail)
            if source.strict:
                raise ExplicitSelectionError(
                    f"{family} implementation {rec.name!r} selected by {where} cannot serve "
                    f"this call: {why}", family=family, row=rec.name)
            # Soft: not honoured for this call, and never silently (once per reason).
            warn_once(f"{family}={rec.name} from {where} cannot serve this call: {why}; "
                      f"using the table's choice instead")
            if notes is not None:
                notes.append(f"{origin}: {rec.name} from {where} cannot serve this call: "
                             f"{why}; falling through")
        elif origin == "profile":
            if handled or view.forced is None:
                continue
            row, prof = view.forced
            rec = view.fallback if row == view.fallback.name else view.row(row)
            assert rec is not None
            if serves(state, view, rec, ctx, implicit=False):
                if notes is not None:
                    notes.append(f"profile {prof} forces {row}")
                return _resolved(state, rec, origin)
            if notes is not None:
                why = _why(*row_verdict(state, view, rec, ctx, implicit=False))
                notes.append(f"profile {prof} forces {row}, which cannot serve this call "
                             f"({why}); falling through")
        elif origin == "chain":
            rec = _first_in_chain(state, view, ctx)
            if rec is not None:
                return _resolved(state, rec, origin)
        elif origin == "fallback":
            rec = view.fallback
            if not serves(state, view, rec, ctx, implicit=False):
                raise _no_row(state, view, ctx)
            if notes is not None:
                notes.append(f"no row of the chain matched; the fallback {rec.name} serves")
            return _resolved(state, rec, origin)
    raise AssertionError("unreachable: PRECEDENCE ends with the fallback")  # pragma: no cover


#: The last source: the fallback.
_FALLBACK = tuple(s for s in PRECEDENCE if s.origin == "fallback")


def _first_in_chain(state: Registry, view: View, ctx: CallContext) -> ImplRecord | None:
    """The first row of ``view``'s chain that serves ``ctx``: ``serves`` row by row,
    inlined (the hot walk of every decision)."""
    probed = process.probed
    asked = asked_features(ctx)
    for rec in view.chain:
        if rec.available is not ALWAYS_AVAILABLE:
            probe = rec.available
            got = probed.get(id(probe))
            if not (got[1] if got is not None and got[0] is probe
                    else state.availability(rec)[0]):
                continue
        spec = rec.spec
        if (not asked or asked <= rec.features) and (spec._m or spec.matcher())(ctx):
            return rec
    return None


# -- resolve, with its decision cache -----------------------------------------


def set_max_decisions(n: int) -> None:
    """Bound the decision cache of each table snapshot to ``n`` entries (default 65 536)."""
    if n < 1:
        raise ValueError(f"the decision cache needs room for at least 1 entry, got {n}")
    process.max_decisions = n


class Decision:
    """A cached decision: the resolution, the object to call, and its usage counter.

    ``call`` is ``obj`` itself, or for an instance of a Python class its bound
    ``__call__``: calling that with keyword arguments skips the slot wrapper that
    ``obj(...)`` goes through (a few hundred ns per call).
    """

    __slots__ = ("call", "counter", "obj", "resolution")

    def __init__(self, resolution: Resolution) -> None:
        self.resolution = resolution
        self.obj = obj = resolution.record.obj
        # The function in the class, as written: a staticmethod is not bound to obj.
        method = inspect.getattr_static(type(obj), "__call__", None)
        self.call = MethodType(method, obj) if isinstance(method, FunctionType) else obj
        self.counter = counter(resolution.record.family, resolution.record.name,
                               resolution.origin)


def decide(family: str, sig: Any, explicit: Any, build: Callable[..., CallContext],
           args: tuple[Any, ...], state: Registry | None = None) -> Decision:
    """The decision for a call of ``family`` whose axis values are ``sig``: the one hot
    path behind every facade, ``ops.call`` and ``resolve``.

    The cache key holds everything a decision depends on besides the snapshot (which
    owns the cache): the family and ``sig``, the explicit handle, the whole
    ``op_backend`` / ``use_profile`` scope, and the raw values of ``ASTR_OPS`` and the
    family's legacy alias. A hit is a few lookups; on a miss ``build(*args)`` makes
    the full ``CallContext`` and the evaluator runs. Calls under a handle whose
    verdict depends on the raw call (an object with ``supports_call``) are never cached.
    A caller that does not then count a served call bumps ``stats.QUIET``. ``state``
    is the snapshot ``sig`` was made for (the one in force when not given).
    """
    state = state or process.snapshot or current()
    scope = current_scope()
    if explicit is None or explicit.__class__ is str:
        ekey = explicit
    else:
        ekey = handle_key(explicit)
        if ekey is UNCACHEABLE:
            return _uncached(state, family, explicit, build(*args))
    if scope.uncacheable and family in scope.uncacheable:
        return _uncached(state, family, explicit, build(*args))
    key = (family, sig, ekey, scope.cache_token, environ_get(OPS_KEY),
           environ_get(state.alias_keys.get(family)))
    got = state.decisions.get(key)
    if got is None:
        return miss(state, key, family, explicit, build(*args))
    return got  # type: ignore[no-any-return]


def _uncached(state: Registry, family: str, explicit: Any, ctx: CallContext) -> Decision:
    next(UNCACHED)
    return Decision(_evaluate_counted(state, family, ctx, explicit))


def _evaluate_counted(state: Registry, family: str, ctx: CallContext,
                      explicit: Any) -> Resolution:
    """``evaluate``, then the lock in force (``ASTR_LOCK``) has its say; a lookup that
    raises serves no call, so it counts as ``QUIET``."""
    try:
        res = evaluate(family, ctx, explicit, state=state)
        if environ_get(LOCK_KEY) is not None:
            res = settle(state, family, explicit, ctx, res)[0]
        return res
    except BaseException:
        next(QUIET)
        raise


def settle(state: Registry, family: str, explicit: Any, ctx: CallContext, res: Resolution,
           *, enforce: bool = True) -> tuple[Resolution, Drift | None]:
    """``res`` as the lock in force (``ASTR_LOCK``, ``astrai.dispatch.lockfile``) has
    it: the locked row instead (origin ``lock``) in ``pin`` mode, and the drift from the
    lock, if any. With ``enforce`` a drift warns once, or raises ``LockDriftError`` when
    the lock's mode makes it fatal."""
    if environ_get(LOCK_KEY) is None:
        return res, None
    from astrai.dispatch.lockfile import lock_in_force  # deferred: only with a lock in force

    active = lock_in_force()
    if active is None:
        return res, None
    view = active_view(state, family)
    pinned, drift = active.judge(state, family, explicit, ctx, res.name,
                                 lambda rec: serve_problem(state, view, rec, ctx))
    if pinned is not None:
        res = _resolved(state, pinned, "lock")
    if drift is not None and enforce:
        if drift.fatal:
            raise drift.error()
        warn_once(drift.message())
    return res, drift


def miss(state: Registry, key: tuple[Any, ...], family: str, explicit: Any,
         ctx: CallContext) -> Decision:
    """Evaluate ``ctx`` on ``state`` and remember the decision under ``key`` (bounded)."""
    next(MISSES)
    got = _decision(state, _evaluate_counted(state, family, ctx, explicit))
    decisions = state.decisions
    if len(decisions) >= process.max_decisions:
        _evict(decisions)
    decisions[key] = got
    return got


def _evict(decisions: dict[Any, Any]) -> None:
    """Drop the oldest eighth of a full decision cache (at least one entry). In batches:
    a dict finds its first live entry by walking past the ones deleted before it, so
    dropping one entry per miss would cost a walk over every earlier eviction."""
    try:  # another thread may be evicting too
        for key in list(itertools.islice(decisions, max(1, len(decisions) >> 3))):
            decisions.pop(key, None)
    except RuntimeError:  # pragma: no cover - the dict changed size under the iteration
        pass


def _decision(state: Registry, res: Resolution) -> Decision:
    """The ``Decision`` of a resolution: one object per (row, origin) and snapshot,
    shared by every cache entry that reaches it."""
    key = (id(res.record), res.origin)
    made = state.made
    got = made.get(key)
    if got is None or got.resolution.record is not res.record:
        if len(made) >= process.max_decisions:  # ad hoc objects make new records
            made.clear()
        got = made[key] = Decision(res)
    return got  # type: ignore[no-any-return]


def _resolved(state: Registry, rec: ImplRecord, origin: str) -> Resolution:
    """``Resolution(rec, origin)``, made once per snapshot (``Decision`` holds it)."""
    got = state.made.get((id(rec), origin))
    if got is not None and got.resolution.record is rec:
        return got.resolution  # type: ignore[no-any-return]
    return Resolution(rec, origin)


def same_context(ctx: CallContext) -> CallContext:
    """The ``build`` of ``decide`` for a call whose context is already made."""
    return ctx


def resolve(family: str, ctx: CallContext, explicit: Any = None) -> Resolution:
    """Which row serves ``ctx`` and why (SPEC §3). Cached per call signature; the same
    ``ctx`` object asked about again (a third time) while nothing changed is answered
    from what the second answer left on it, by identity checks alone."""
    memo = ctx._resolved
    if (memo is not None and memo[0] is process.snapshot and memo[1] is family
            and memo[2] is explicit and memo[3] is current_scope()
            and memo[4] is environ_get(OPS_KEY)
            and (memo[5] is None or memo[6] is environ_get(memo[5]))):
        next(QUIET)  # a hit that serves no call
        return memo[7]  # type: ignore[no-any-return]
    state, fields = process.snapshot, ctx.__dict__
    again = "_signature" in fields  # resolved before: worth remembering on the object
    sig = ctx.signature()
    if sig[0] != family:
        raise ValueError(f"resolve({family!r}, ...) got a context for {ctx.family!r}")
    state = state or current()
    if len(sig) != PLAIN or state.signature_keys.get(family) is not identity_or_base:
        sig = signature_key(state, ctx)  # else the signature is the key (the common case)
    seen = _world(state, family) if again else None
    got = decide(family, sig, explicit, same_context, (ctx,), state).resolution
    next(QUIET)  # a lookup that serves no call (a failed one counted itself)
    if seen is not None and seen == _world(state, family) and (
            explicit is None or explicit.__class__ is str
            or handle_key(explicit) is not UNCACHEABLE):
        scope, ops, alias_key, alias = seen
        if family not in scope.uncacheable:
            # Everything the decision-cache key holds besides the signature, by identity:
            # the snapshot (a reload, refresh() or reset() puts a new one in force, its
            # decision cache empty), the scope and the variables.
            object.__setattr__(ctx, _MEMO, (state, family, explicit, scope, ops, alias_key,
                                            alias, got))
    return got


#: Where ``resolve`` leaves its answer on a ``CallContext`` (``CallContext.__getstate__``
#: leaves it out of copies and pickles).
_MEMO = "_resolved"


def _world(state: Registry, family: str) -> tuple[Any, Any, Any, Any]:
    """What a decision of ``family`` depends on besides the call: the scope, ``ASTR_OPS``
    and the family's legacy alias (its name and raw value)."""
    alias_key = state.alias_keys.get(family)
    return current_scope(), environ_get(OPS_KEY), alias_key, environ_get(alias_key)


def resolve_plan(ctxs: Mapping[str, CallContext],
                 explicit: Mapping[str, Any] | None = None) -> dict[str, Resolution]:
    """Resolve several families against one snapshot of tables, profiles and environment."""
    state = current()
    explicit = explicit or {}
    for fam, ctx in ctxs.items():
        if ctx.family != fam:
            raise ValueError(f"resolve_plan: the context under {fam!r} is for {ctx.family!r}")
    return {fam: evaluate(fam, ctx, explicit.get(fam), state=state) for fam, ctx in ctxs.items()}


# -- explain -------------------------------------------------------------------

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

    def render(self) -> str:
        """The SPEC §8 text."""
        lines = [f"[{self.family}] " + " ".join(f"{k}={format_value(v)}"
                                                for k, v in self.context.items()
                                                if not unremarkable(k, v))]
        if self.profiles:
            lines.append(f"  profiles: {' + '.join(self.profiles)}")
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
            "context": dict(self.context),
            "profiles": list(self.profiles),
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
    return Explanation(family, context_fields(ctx), view.profiles, tuple(rows), tuple(notes),
                       row, origin, error, source=view.table.source,
                       provided_by=view.table.provided_by,
                       plugins=in_use(state.plugins, (view.table,)))


def explain(family: str, ctx: CallContext, explicit: Any = None) -> str:
    """Why each row won or lost for ``ctx``, then the decision (SPEC §8)."""
    return explanation(family, ctx, explicit).render()


def explain_plan(ctxs: Mapping[str, CallContext],
                 explicit: Mapping[str, Any] | None = None) -> str:
    """``explain`` for several families, one block each."""
    explicit = explicit or {}
    return "\n\n".join(explain(fam, ctx, explicit.get(fam)) for fam, ctx in ctxs.items())
