"""Making a decision lock from a recorded workload, and checking a lock against the
tables in force now: ``astrai-ops lock WORKLOAD -o astrai.lock`` and ``astrai-ops lock
--check astrai.lock`` (the check to run in CI after upgrading torch or a kernel package).

Each recorded call is resolved as it was made: its axes, its ``backend=``, under its
``op_backend`` row and ``use_profile`` profiles, with the tables, profiles and
``ASTR_OPS`` of this process. Calls with the same axes and selection make one locked
decision (their counts summed). Calls that selected an implementation object rather
than a row are not locked (an object is not something a file can name). The check
resolves every locked decision again and reports each whose row changed, with the
reason; a table edit that changes no locked decision (a comment, a row that wins
nowhere in the workload) changes nothing the check reports as drift, only a note.
"""

from __future__ import annotations

__all__ = ["Change", "LockCheck", "check_lock", "lock_workload"]

import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from typing import Any

from astrai.dispatch.axes import call_key, context_from_fields
from astrai.dispatch.environment import env_now
from astrai.dispatch.machine import this_machine
from astrai.dispatch.plugins import in_use
from astrai.dispatch.registry import Registry, current
from astrai.dispatch.resolution import evaluate
from astrai.dispatch.scopes import active_profiles, op_backend, use_profile
from astrai.dispatch.tables.model import ImplRecord, table_revision
from astrai.dispatch.verdicts import serve_problem
from astrai.env import OPS_ENV, PLUGINS_ENV, TABLES_ENV
from astrai.lock.enforce import drift_reason
from astrai.lock.model import Lock, LockedDecision
from astrai.record.workload import ObjectArg, RecordedCall, Workload, now_utc

_NOT_LOADED = "(not loaded)"


@contextmanager
def _made_under(family: str, scope_backend: Any,
                scope_profiles: tuple[str, ...]) -> Iterator[None]:
    """Within the block, the ``op_backend`` row and ``use_profile`` profiles a recorded
    call was made under."""
    with ExitStack() as stack:
        if scope_backend is not None:
            stack.enter_context(op_backend(**{family: scope_backend}))
        if scope_profiles:
            stack.enter_context(use_profile(*scope_profiles))
        yield


def _decide(state: Registry, family: str, axes: Any, backend: Any, scope_backend: Any,
            scope_profiles: tuple[str, ...]) -> tuple[str | None, str | None, str | None,
                                                      dict[str, str]]:
    """``(row, origin, error, profiles in force)`` for a recorded call resolved now."""
    ctx = context_from_fields(family, axes)
    profiles: dict[str, str] = {}
    try:
        with _made_under(family, scope_backend, scope_profiles):
            names = active_profiles(state, env_now(state))
            profiles = {n: state.profiles[n].revision for n in names}
            res = evaluate(family, ctx, backend, state=state)
    except (ValueError, RuntimeError, KeyError) as exc:
        return None, None, f"{type(exc).__name__}: {str(exc).splitlines()[0]}", profiles
    return res.name, res.origin, None, profiles


def _environment(state: Registry, families: list[str]) -> dict[str, str | None]:
    names = [OPS_ENV, TABLES_ENV, PLUGINS_ENV, *sorted({state.aliases[f] for f in families
                                           if f in state.aliases})]
    return {name: os.environ.get(name) for name in names}


def lock_workload(workload: Workload, source: str = "") -> Lock:
    """The lock of ``workload``'s calls on the tables in force (see the module docstring);
    ``source`` names the workload file."""
    state = current()
    decisions: dict[tuple[Any, ...], LockedDecision] = {}
    for call in workload.calls:
        if isinstance(call.backend, ObjectArg) or isinstance(call.scope_backend, ObjectArg):
            continue
        key = (call.family, tuple(call.axes.items()), call.backend, call.scope_backend,
               call.scope_profiles)
        got = decisions.get(key)
        if got is not None:
            decisions[key] = replace(got, calls=got.calls + call.count)
            continue
        decisions[key] = _locked(state, call)
    families = list(dict.fromkeys(d.family for d in decisions.values()))
    tables = {f: (table_revision(state.families[f]), state.families[f].source)
              for f in families if f in state.families}
    plugins = in_use(state.plugins, (state.families[f] for f in families
                                     if f in state.families))
    return Lock(tuple(decisions.values()), this_machine(), tables,
                _environment(state, families), now_utc(), source, plugins=plugins)


def _locked(state: Registry, call: RecordedCall) -> LockedDecision:
    row, origin, error, profiles = _decide(state, call.family, call.axes, call.backend,
                                           call.scope_backend, call.scope_profiles)
    table = state.families.get(call.family)
    return LockedDecision(call.family, call_key(call.context()), dict(call.axes), row, origin,
                          _NOT_LOADED if table is None else table_revision(table), profiles,
                          call.backend, call.scope_backend, call.scope_profiles, error,
                          call.count)


@dataclass(frozen=True)
class Change:
    """A locked decision whose row is not the row the tables give now."""

    decision: LockedDecision
    row: str | None
    origin: str | None
    reason: str


@dataclass(frozen=True)
class LockCheck:
    """What ``check_lock`` found: the changed decisions, and notes (tables revised
    without changing a locked decision, another machine)."""

    lock: Lock
    changes: tuple[Change, ...]
    notes: tuple[str, ...]

    @property
    def ok(self) -> bool:
        """Whether every locked decision still holds."""
        return not self.changes

    def render(self, shown: int = 3) -> str:
        """The report: a summary line, then the diff table - one row per family, locked
        row, live row and reason, with how many locked signatures and calls it covers
        and the first ``shown`` signatures - then the notes."""
        n = len(self.lock.decisions)
        name = self.lock.source or "lock"
        lines = [f"{name}: all {n} locked decisions hold" if self.ok
                 else f"{name}: {len(self.changes)} of {n} locked decisions changed"]
        groups: dict[tuple[str, str, str, str], list[Change]] = {}
        for c in self.changes:
            d = c.decision
            groups.setdefault((d.family, d.row or "(none)", c.row or "(none)", c.reason),
                              []).append(c)
        if groups:
            lines.append(f"  {'family':<12} {'locked':<16} {'live':<16} {'signatures':>10} "
                         f"{'calls':>7}")
        for (family, locked, live, reason), changes in groups.items():
            calls = sum(c.decision.calls for c in changes)
            lines.append(f"  {family:<12} {locked:<16} {live:<16} {len(changes):>10} "
                         f"{calls:>7}")
            lines.append(f"      reason: {reason}")
            lines += [f"      {c.decision.signature}" for c in changes[:shown]]
            if len(changes) > shown:
                lines.append(f"      (and {len(changes) - shown} more)")
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


def _can_serve(state: Registry, decision: LockedDecision
               ) -> Callable[[ImplRecord], str | None]:
    """Why a row cannot serve ``decision``'s call on ``state`` now (``None``: it can)."""
    view = state.view(decision.family, active_profiles(state, env_now(state)))
    ctx = decision.context()

    def can_serve(rec: ImplRecord) -> str | None:
        return serve_problem(state, view, rec, ctx)

    return can_serve


def check_lock(lock: Lock) -> LockCheck:
    """Resolve every decision of ``lock`` again on the tables in force; report the ones
    whose row changed, each with its reason."""
    state = current()
    changes: list[Change] = []
    for d in lock.decisions:
        row, origin, error, _ = _decide(state, d.family, d.axes, d.backend, d.scope_backend,
                                        d.scope_profiles)
        if row == d.row:
            continue
        if d.family not in state.families:
            reason = f"family {d.family!r} is no longer loaded"
        elif row is None:
            reason = f"no row can serve the call now: {error}"
        else:
            with _made_under(d.family, d.scope_backend, d.scope_profiles):
                reason = drift_reason(state, d, _can_serve(state, d))[0]
        changes.append(Change(d, row, origin, reason))
    notes = []
    changed = {c.decision.family for c in changes}
    for family, (revision, source) in lock.tables.items():
        table = state.families.get(family)
        now = _NOT_LOADED if table is None else table_revision(table)
        if now != revision and family not in changed:
            where = "" if table is None or table.source == source else f", now {table.source}"
            notes.append(f"the {family} table changed (revision {revision} -> {now}{where}), "
                         f"but no locked decision did")
    now_plugins = in_use(state.plugins, (state.families[f] for f in lock.tables
                                         if f in state.families))
    for dist in sorted(set(lock.plugins) | set(now_plugins)):
        was, has = lock.plugins.get(dist), now_plugins.get(dist)
        if was != has:
            notes.append(f"plugin {dist}: {was or 'not in use'} when the lock was made, "
                         f"{has or 'not in use'} now")
    differs = this_machine().differences(lock.machine)
    if differs:
        notes.append(f"the lock was made on another machine: {'; '.join(differs)}")
    return LockCheck(lock, tuple(changes), tuple(notes))
