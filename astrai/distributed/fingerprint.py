"""One rank's plan for a set of calls, as a ``Fingerprint``: the rows they resolve to,
the tables, profiles, plugins, lock and versions behind them, and its wire form."""

from __future__ import annotations

__all__ = [
    "MAX_ERROR_TEXT",
    "NOT_CHECKED",
    "NOT_LOADED",
    "WIRE_FORMAT",
    "CallPlan",
    "Contexts",
    "Fingerprint",
    "fingerprint",
    "local_plan",
]

import dataclasses
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from astrai.dispatch.axes import CallContext, call_key
from astrai.dispatch.environment import env_settings
from astrai.dispatch.plugins import in_use
from astrai.dispatch.registry import current
from astrai.dispatch.resolution import evaluate, settle
from astrai.dispatch.scopes import active_profiles
from astrai.dispatch.tables.model import table_revision
from astrai.dispatch.verdicts import MATCH, row_verdict
from astrai.env import LOCK_KEY, environ_get
from astrai.version import __version__

if TYPE_CHECKING:
    pass

#: Shape of the gathered payload; ranks whose payloads differ in shape cannot be compared.
WIRE_FORMAT = 2
NOT_LOADED = "(not loaded)"
NOT_CHECKED = "(not checked)"
_EMPTY: Mapping[str, str] = MappingProxyType({})
#: At most this much of a rank's error text travels in its payload.
MAX_ERROR_TEXT = 8000

Contexts = Mapping[str, CallContext] | Iterable[CallContext]


# -- this rank's fingerprint -------------------------------------------------------

@dataclass(frozen=True)
class CallPlan:
    """One call on one rank: the row it resolves to (or the error), and the rows it could use.

    ``candidates`` are the rows, in table order, that the implicit chain accepts for
    the call on this rank (available, faithful or enabled, not disabled, ``when``
    matches): what consensus chooses from.
    """

    key: str
    family: str
    row: str | None
    origin: str | None
    error: str | None
    candidates: tuple[str, ...] = ()


@dataclass(frozen=True)
class Fingerprint:
    """What one rank would run: plain data, identical on ranks that agree (but ``host``).

    ``tables`` maps each family the calls name to its revision (``table_revision``),
    ``profiles`` lists the active profiles with their file revisions, ``calls`` the
    decision per call, ``lock`` the decision lock in force (digest and mode).
    ``orders`` (rows in effective order) and ``unavailable`` (``(family, row,
    reason)``) explain and settle differences. ``plugins`` are the installed plugins
    (``astrai.dispatch.plugins``) whose rows the checked families hold, as
    ``(distribution, version)``: ranks with different plugin versions are told apart
    (the families' revisions differ too; this names the cause).
    """

    version: str
    host: str
    tables: tuple[tuple[str, str], ...]
    profiles: tuple[tuple[str, str], ...]
    calls: tuple[CallPlan, ...]
    orders: tuple[tuple[str, tuple[str, ...]], ...] = ()
    unavailable: tuple[tuple[str, str, str], ...] = ()
    lock: str = ""  # the decision lock in force (ASTR_LOCK): its digest and mode, or ""
    plugins: tuple[tuple[str, str], ...] = ()

    def to_wire(self) -> dict[str, Any]:
        """Builtins only (JSON-ready), so a rank with another astrai version can read it."""
        return {"wire": WIRE_FORMAT, "version": self.version,
                "fingerprint": dataclasses.asdict(self)}

    @classmethod
    def from_wire(cls, data: Any) -> Fingerprint | None:
        """The fingerprint in a gathered payload, or ``None`` if its format is not ours.

        Sequences may arrive as lists (JSON has no tuples): the result is built of tuples,
        so it equals the sender's own fingerprint. Any other shape or type is ``None``.
        """
        try:
            if not isinstance(data, Mapping) or data["wire"] != WIRE_FORMAT:
                return None
            fields = data["fingerprint"]
            if not isinstance(fields, Mapping) or set(fields) != _FINGERPRINT_FIELDS:
                return None
            orders = [_seq(o, 2) for o in _seq(fields["orders"])]
            return cls(
                version=_text(fields["version"]),
                host=_text(fields["host"]),
                tables=tuple(_pair(t) for t in _seq(fields["tables"])),
                profiles=tuple(_pair(p) for p in _seq(fields["profiles"])),
                calls=tuple(_call_plan(c) for c in _seq(fields["calls"])),
                orders=tuple((_text(family), _texts(rows)) for family, rows in orders),
                unavailable=tuple(_triple(u) for u in _seq(fields["unavailable"])),
                lock=_text(fields["lock"]),
                plugins=tuple(_pair(p) for p in _seq(fields["plugins"])),
            )
        except (KeyError, TypeError, ValueError):
            return None


_FINGERPRINT_FIELDS = frozenset(f.name for f in dataclasses.fields(Fingerprint))
_CALL_FIELDS = frozenset(f.name for f in dataclasses.fields(CallPlan))


def _seq(value: Any, length: int | None = None) -> tuple[Any, ...]:
    """A list or tuple from the wire as a tuple (of ``length`` items, if given)."""
    if not isinstance(value, list | tuple) or (length is not None and len(value) != length):
        raise TypeError(f"expected a sequence of {length or 'any number of'} items")
    return tuple(value)


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


def _texts(value: Any) -> tuple[str, ...]:
    return tuple(_text(v) for v in _seq(value))


def _pair(value: Any) -> tuple[str, str]:
    first, second = _seq(value, 2)
    return _text(first), _text(second)


def _triple(value: Any) -> tuple[str, str, str]:
    first, second, third = _seq(value, 3)
    return _text(first), _text(second), _text(third)


def _optional_text(value: Any) -> str | None:
    return None if value is None else _text(value)


def _call_plan(data: Any) -> CallPlan:
    if not isinstance(data, Mapping) or set(data) != _CALL_FIELDS:
        raise TypeError("not a CallPlan")
    return CallPlan(_text(data["key"]), _text(data["family"]), _optional_text(data["row"]),
                    _optional_text(data["origin"]), _optional_text(data["error"]),
                    _texts(data["candidates"]))


def _contexts(contexts: Contexts) -> dict[str, CallContext]:
    if isinstance(contexts, Mapping):
        for family, ctx in contexts.items():
            if isinstance(ctx, CallContext) and ctx.family != family:
                raise ValueError(f"contexts[{family!r}] is a context for {ctx.family!r}")
        found = list(contexts.values())
    else:
        found = list(contexts)
    unique: dict[str, CallContext] = {}
    for ctx in found:
        if not isinstance(ctx, CallContext):
            raise TypeError(f"expected CallContext objects, got {type(ctx).__name__}: {ctx!r}")
        unique.setdefault(call_key(ctx), ctx)
    return unique


def local_plan(contexts: Contexts) -> tuple[Fingerprint, dict[str, Exception]]:
    calls = _contexts(contexts)
    state = current()
    names = active_profiles(state, env_settings(state.families, state.profiles, state.aliases,
                                                state.epoch))
    tables: dict[str, str] = {}
    orders: dict[str, tuple[str, ...]] = {}
    unavailable: list[tuple[str, str, str]] = []
    plans: list[CallPlan] = []
    errors: dict[str, Exception] = {}
    for key, ctx in sorted(calls.items()):
        family = ctx.family
        table = state.families.get(family)
        if family not in tables:
            tables[family] = NOT_LOADED if table is None else table_revision(table)
            if table is not None:
                view = state.view(family, names)
                orders[family] = tuple(view.row_names())
                for rec in view.rows:
                    ok, reason = state.availability(rec)
                    if not ok:
                        unavailable.append((family, rec.name, reason))
        try:  # never leave before the collective: a failure is data like any decision
            res = settle(state, family, None, ctx, evaluate(family, ctx, state=state),
                         enforce=False)[0]  # a pinning lock's row is the one that runs
            view = state.view(family, names)
            candidates = tuple(r.name for r in view.rows
                               if row_verdict(state, view, r, ctx)[0] == MATCH)
        except Exception as exc:
            errors[key] = exc
            plans.append(CallPlan(key, family, None, None, f"{type(exc).__name__}: {exc}"))
            continue
        plans.append(CallPlan(key, family, res.name, res.origin, None, candidates))
    profiles = tuple((n, state.profiles[n].revision) for n in names)
    plugins = tuple(in_use(state.plugins, (state.families[f] for f in tables
                                           if f in state.families)).items())
    return Fingerprint(__version__, socket.gethostname(), tuple(sorted(tables.items())),
                       profiles, tuple(plans), tuple(sorted(orders.items())),
                       tuple(unavailable), _lock_digest(), plugins), errors


def _lock_digest() -> str:
    """The decision lock in force (``ASTR_LOCK``): its digest and mode, or ``""``."""
    if environ_get(LOCK_KEY) is None:
        return ""
    from astrai.lock.enforce import lock_in_force  # deferred: only with a lock in force

    active = lock_in_force()
    return "" if active is None else active.digest


def fingerprint(contexts: Contexts) -> Fingerprint:
    """This rank's fingerprint for ``contexts`` (no communication)."""
    return local_plan(contexts)[0]


