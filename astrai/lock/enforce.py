"""Enforcing a decision lock: the live check of every decision against the lock in force.

A ``Lock`` (``astrai.lock.model``, made by ``astrai-ops lock WORKLOAD``) holds one
``LockedDecision`` per recorded call signature: the call's axes, its selection
(``backend=``, ``op_backend`` row, ``use_profile`` profiles), the row and origin it
resolved to, and the revisions of the family's table and of the profiles in force; with
the machine's fingerprint.

``ASTR_LOCK=astrai.lock`` puts a lock in force for the process. Each decision the
engine takes - on a decision-cache miss, so a cached call costs nothing more - is
compared with the lock's decision for the same call: the lock's decisions are keyed by
the live tables' decision key (``keying``) of their recorded axes, so a live call matches
a locked one when the live tables cannot tell them apart. ``ASTR_LOCK_MODE`` says what
a difference (a *drift*) does:

- ``warn`` (default): a warning on the ``astrai`` logger, once per drift;
- ``strict``: ``LockDriftError`` naming the family, the call, the locked and live rows
  and the reason (a row became unavailable or was removed, a table or profile edit, a
  new signature the lock does not hold); the call does not run;
- ``pin``: the locked row serves the call when it can (origin ``lock``), with a warning,
  once, naming the row the tables would pick and why they differ (and saying so when the
  locked row is not faithful); when it cannot, ``LockDriftError``. A call the lock does
  not hold warns and runs as decided.

A value of ``ASTR_LOCK_MODE`` that is none of these fails closed: ``strict``, with a
warning.

The variables are read when a decision is taken; decisions already cached are not
re-checked when they change (``refresh()`` drops the cache).
"""

from __future__ import annotations

__all__ = ["MODES", "ActiveLock", "Drift", "drift_reason", "lock_in_force"]

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from astrai.dispatch import state as process
from astrai.dispatch.axes import CallContext, call_key
from astrai.dispatch.environment import env_now
from astrai.dispatch.keying import signature_key
from astrai.dispatch.log import warn_once
from astrai.dispatch.machine import cuda_initialized, this_machine
from astrai.dispatch.registry import Registry
from astrai.dispatch.scopes import active_profiles, current_scope
from astrai.dispatch.tables.model import ImplRecord, table_revision
from astrai.env import LOCK_ENV, LOCK_KEY, LOCK_MODE_ENV, LOCK_MODE_KEY, environ_get
from astrai.errors import FileFormatError, LockDriftError
from astrai.lock.model import Lock, LockedDecision
from astrai.record.workload import ObjectArg, selection_of

MODES = ("warn", "strict", "pin")


@dataclass(frozen=True)
class Drift:
    """A live decision that differs from the lock's. ``locked`` is ``None`` for a call
    the lock does not hold, ``live`` when no row can serve it; ``fatal`` says whether
    the lock's mode makes it an error (else a warning)."""

    family: str
    signature: str
    locked: str | None
    live: str | None
    reason: str
    lock: str
    fatal: bool

    def message(self) -> str:
        """The drift in words (the warning, and the error's message)."""
        locked = "not in the lock" if self.locked is None else f"locked row {self.locked!r}"
        return (f"{self.family} decision drifted from the lock {self.lock}: {self.signature}: "
                f"{locked}, live row {self.live!r}: {self.reason}")

    def error(self) -> LockDriftError:
        """The error ``strict`` (and a failed ``pin``) raises."""
        return LockDriftError(self.message(), family=self.family, signature=self.signature,
                              locked=self.locked, live=self.live, reason=self.reason)


Index = dict[tuple[Any, ...], list[LockedDecision]]


@dataclass(frozen=True, eq=False)
class ActiveLock:
    """The lock in force (``ASTR_LOCK``) and its mode, or why it cannot be read."""

    path: str
    mode: str
    lock: Lock | None
    problem: str = ""

    @property
    def digest(self) -> str:
        """What ``check_agreement`` compares across ranks: the decisions and the mode."""
        return f"{self.lock.digest if self.lock else 'unreadable'} ({self.mode})"

    def index(self, state: Registry) -> Index:
        """The lock's decisions by the key ``state``'s tables give their calls."""
        key = (id(self), state.epoch)
        got: Index | None = process.lock_indexes.get(key)
        if got is None:
            got = {}
            for d in self.lock.decisions if self.lock else ():
                if d.family in state.families:
                    live = (d.family, signature_key(state, d.context()), *d.identity())
                    got.setdefault(live, []).append(d)
            if len(process.lock_indexes) >= 8:
                process.lock_indexes.clear()
            process.lock_indexes[key] = got
        return got

    def judge(self, state: Registry, family: str, explicit: Any, ctx: CallContext,
              row: str, can_serve: Callable[[ImplRecord], str | None]
              ) -> tuple[ImplRecord | None, Drift | None]:
        """Compare the live decision (``row``) for ``ctx`` with the lock's: the row the
        lock pins in its place (``pin`` mode, when it can serve: ``can_serve`` returns
        ``None`` or why not), and the drift, if any."""
        signature = call_key(ctx)
        if self.lock is None:
            return None, Drift(family, signature, None, row, f"the lock cannot be read: "
                               f"{self.problem}", self.path, self.mode != "warn")
        scope = current_scope()
        chosen = selection_of(state, family, explicit)
        scoped = selection_of(state, family, scope.handles.get(family))
        if isinstance(chosen, ObjectArg) or isinstance(scoped, ObjectArg):
            return None, None  # an implementation object's calls are not locked
        found = self.index(state).get((family, signature_key(state, ctx), chosen, scoped,
                                       scope.profiles))
        if not found:
            return None, Drift(family, signature, None, row, "a new signature, not in the "
                               "lock", self.path, self.mode == "strict")
        differs = next((d for d in found if d.row != row), None)
        if differs is None:
            return None, None
        reason, pinned = drift_reason(state, differs, can_serve)
        if self.mode == "pin" and pinned is not None:
            unfaithful = ("; the locked row is not faithful: it changes numerics"
                          if not pinned.faithful else "")
            warn_once(f"{LOCK_ENV}={self.path} ({LOCK_MODE_ENV}=pin): the {family} call "
                      f"{signature} runs the locked row {pinned.name!r} where the tables now "
                      f"pick {row!r} ({reason}){unfaithful}")
            return pinned, None
        return None, Drift(family, signature, differs.row, row, reason, self.path,
                           self.mode != "warn")


def drift_reason(state: Registry, decision: LockedDecision,
                 can_serve: Callable[[ImplRecord], str | None]) -> tuple[str, ImplRecord | None]:
    """Why the live decision for ``decision``'s call is not its row, and that row's
    record when it can still serve the call (``can_serve`` returns ``None``, or why not)."""
    if decision.row is None:
        return f"no row could serve the call when locked ({decision.error})", None
    env = env_now(state)
    names = active_profiles(state, env)
    locked = state.view(decision.family, names).row(decision.row)
    if locked is None:
        return f"row {decision.row!r} is no longer in the {decision.family} table", None
    why = can_serve(locked)
    revision = table_revision(state.families[decision.family])
    edited = [f"the {decision.family} table changed (revision {decision.table} -> "
              f"{revision})"] if revision != decision.table else []
    profiles = {n: state.profiles[n].revision for n in names}
    if profiles != dict(decision.profiles):
        edited.append(f"the profiles in force changed ({_profiles(decision.profiles)} -> "
                      f"{_profiles(profiles)})")
    if why is not None:
        return "; ".join([f"row {decision.row!r} cannot serve the call now: {why}",
                          *edited]), None
    if decision.family in env.backends:
        edited.append(f"{env.source_of(decision.family)} selects "
                      f"{env.backends[decision.family]}")
    return "; ".join(edited) or "an earlier row now serves the call", locked


def _profiles(profiles: Mapping[str, str]) -> str:
    return " + ".join(f"{n}@{rev}" for n, rev in profiles.items()) or "none"


def lock_in_force() -> ActiveLock | None:
    """The lock ``ASTR_LOCK`` names, in the mode ``ASTR_LOCK_MODE`` gives (read once per
    distinct pair of values; a lock made on another machine warns once)."""
    raw = environ_get(LOCK_KEY)
    if raw is None:
        return None
    mode_raw = environ_get(LOCK_MODE_KEY)
    got: ActiveLock | None = process.locks.get((raw, mode_raw))
    if got is None:
        got = _read(os.environ.get(LOCK_ENV, ""), os.environ.get(LOCK_MODE_ENV, ""))
        process.locks[(raw, mode_raw)] = got
    return got


def _read(path: str, mode: str) -> ActiveLock | None:
    if not path.strip():
        return None
    mode = mode.strip().lower() or "warn"
    if mode not in MODES:  # fail closed: a typo must not turn a strict check into a warning
        warn_once(f"{LOCK_MODE_ENV}={mode!r} is not a lock mode ({', '.join(MODES)}); "
                  f"failing closed: strict")
        mode = "strict"
    try:
        lock = Lock.load(path)
    except FileFormatError as exc:
        warn_once(f"{LOCK_ENV}={path}: the lock cannot be read, so no decision is checked "
                  f"against it{'' if mode == 'warn' else ' and every call fails'}:\n{exc}")
        return ActiveLock(path, mode, None, str(exc).splitlines()[0])
    gpu = cuda_initialized()
    differs = this_machine(gpu=gpu).differences(lock.machine, gpu=gpu)
    if differs:
        warn_once(f"{LOCK_ENV}={path} was made on another machine ({'; '.join(differs)}): "
                  f"its decisions may not hold here")
    return ActiveLock(path, mode, lock)
