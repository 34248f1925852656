"""Every piece of process-wide mutable state of the dispatch engine, in one place.

The engine's modules keep no globals of their own that change after import: they
read and write the names below (the hot path reads ``snapshot`` as a module
attribute, which costs what a global does). ``reset()`` returns the state a test
may disturb to a fresh process's (the loaded tables excepted, which tests save and
restore themselves); ``os.register_at_fork`` runs ``_after_fork_in_child`` once,
so a forked child starts with fresh locks and no cached decisions or counts.

Per-context state (``op_backend`` / ``use_profile`` scopes) lives in a
``ContextVar`` in ``scopes``; the torch.compile guard key in ``torch_compile``
is a plain global on purpose (dynamo guards on reading it).
"""

from __future__ import annotations

__all__ = ["reset"]

import dataclasses
import itertools
import os
import threading
from collections.abc import Callable
from typing import Any

#: The tables in force: one immutable snapshot (a ``registry.Registry``), swapped whole.
#: Typed loosely here so that this module imports nothing of the engine's; readers go
#: through ``registry.current()``, which returns it typed.
snapshot: Any = None
#: Guards swaps of ``snapshot`` only: nothing is read or imported under it.
swap_lock = threading.RLock()
#: Serialises the first run of each availability probe.
probe_lock = threading.RLock()
#: Probe results, once per process until ``refresh()``: id(probe) -> (probe, ok, reason),
#: keyed by the zero-argument probe (rows sharing one, and a row's copies, share its
#: answer; a probe need not be hashable).
probed: dict[int, tuple[Any, bool, str]] = {}
#: Snapshot epochs (every swap takes the next one).
epochs = itertools.count(1)
#: The bound of each snapshot's decision cache (``set_max_decisions``).
max_decisions = 1 << 16
#: The precompiled artifact of the shipped tables, read once (``tables.artifact``).
artifact_entries: dict[str, Any] | None = None
#: Profiles in force in every thread (``scopes.set_process_profiles``), before those of
#: ``ASTR_OPS`` and of the ``use_profile`` scopes.
process_profiles: tuple[str, ...] = ()
#: Parsed ``ASTR_OPS`` / alias values, per distinct raw values and epoch (``environment``).
env_parsed: dict[tuple[object, ...], Any] = {}
#: Messages already logged by ``warn_once``.
warned: set[str] = set()
warned_lock = threading.Lock()
#: Usage counters per (family, row, origin), and the decision-cache counts (``stats``).
counters: dict[tuple[str, str, str], itertools.count[int]] = {}
QUIET: itertools.count[int] = itertools.count()
MISSES: itertools.count[int] = itertools.count()
UNCACHED: itertools.count[int] = itertools.count()
#: Calls a row handed to another computation per (family, row, what computed them): a
#: ``native`` row's call its kernel declined, computed with torch's operations.
handoffs: dict[tuple[str, str, str], itertools.count[int]] = {}
#: The same hand-offs per (family, row, what computed them, why), where the row said why.
handoff_reasons: dict[tuple[str, str, str, str], itertools.count[int]] = {}
#: The compiled hot path's ``plan`` (``astrai.native``) while it is in use, else ``None``:
#: a facade's route makes its plan for a snapshot with it.
hot_planner: Callable[..., Any] | None = None
#: The compiled hot path's ``resolved`` (``astrai.native``) while it is in use, else
#: ``None``: ``resolve`` answers a context it answered before with it.
hot_resolved: Callable[..., Any] | None = None
#: What a snapshot's routes found about the compiled hot path, per facade: ``None`` where
#: it reads the facade's calls, else why not.
hot_status: dict[str, str | None] = {}
#: ``(family, snapshot) -> notes``: why the compiled hot path, in use, reads no call of a
#: family's facade there (set by ``astrai.ops``; ``explain`` adds its notes).
hot_notes: Callable[[str, Any], list[str]] | None = None
#: What ``stats(reset=True)`` subtracts from the never-replaced counters.
baseline: dict[object, int] = {}
#: The counts ``stats.unobserved`` scopes kept out (astrai's own probing calls), per
#: ``baseline`` key, since the process started: never cleared (``stats.since`` reads them).
uncounted: dict[object, int] = {}

# -- recording and decision locks (``astrai.record``, ``astrai.lock``) ---------------------
#: The recordings in force (``record()``, ``ASTR_RECORD``): each facade call is added to
#: every one of them. A tuple, replaced whole (never changed in place).
recordings: tuple[Any, ...] = ()
#: Called with ``True`` when recording starts (no recording was in force) and ``False``
#: when it ends: the facades switch to their recording routes and back, so a call costs
#: nothing extra while nothing records (``astrai.dispatch.facade`` registers its switch on import).
record_switches: list[Callable[[bool], None]] = []
#: ``note(ctx, backend, incidental)``: adds a call to the recordings in force (set by
#: ``astrai.record.recording`` when it is loaded, which starting a recording does).
note_call: Callable[..., None] | None = None
#: Serialises starting and ending recordings (never taken on the call path).
record_lock = threading.Lock()
#: Decision locks read for ``ASTR_LOCK``: (raw path, raw mode) -> the lock in force, or
#: the error reading it gave (``astrai.lock.enforce``).
locks: dict[tuple[Any, Any], Any] = {}
#: Per lock in force and table snapshot: its decisions by decision key (``astrai.lock.enforce``).
lock_indexes: dict[tuple[int, int], Any] = {}

#: Per family with a schema (``astrai.dispatch.schema``): why a row's function cannot take
#: the facade's arguments (``None`` where it can); a table load refuses such a row.
row_checks: dict[str, Callable[[Any], str | None]] = {}

# -- torch.compile support (see ``torch_compile``) ---------------------------------
#: Every object a decision taken at trace time may return, by ``impl_key``: dynamo
#: reads this dict as it was when tracing started, so objects are published beforehand.
impls: dict[str, Any] = {}
#: The guard of compiled decisions: ``(table epoch, scope most recently entered or
#: left)``. A plain global: dynamo installs a value guard on reading it, so a reload, a
#: ``refresh()`` or another scope recompiles.
compile_key: tuple[Any, ...] = (0, ((), ()))


def impl_key(family: str, name: str, obj: Any) -> str:
    """The ``impls`` key of an implementation object."""
    return f"{family}.{name}@{id(obj):x}"


def publish(family: str, name: str, obj: Any) -> None:
    """Make ``obj`` reachable from traced code (see ``impls``)."""
    impls[impl_key(family, name, obj)] = obj


def note_epoch(epoch: int) -> None:
    """A new table snapshot is in force (its rows are published by the registry)."""
    global compile_key
    compile_key = (epoch, compile_key[1])


def note_scope(scope_key: tuple[Any, ...]) -> None:
    """A scope was entered or left; ``scope_key`` describes the scope now in force."""
    global compile_key
    compile_key = (compile_key[0], scope_key)


def count(counter: itertools.count[int]) -> int:
    """How far ``counter`` has counted (without advancing it)."""
    return int(counter.__reduce__()[1][0])  # type: ignore[index]


def every_counter() -> dict[object, itertools.count[int]]:
    """Every counter, by its key in ``baseline``."""
    out: dict[object, itertools.count[int]] = dict(list(counters.items()))
    out.update({("handoff", *key): c for key, c in list(handoffs.items())})
    out.update({("why", *key): c for key, c in list(handoff_reasons.items())})
    out.update(quiet=QUIET, misses=MISSES, uncached=UNCACHED)
    return out


def reset_counts() -> None:
    """Start every count from zero: record what later reads subtract (the counters
    themselves are never replaced: cached decisions hold them)."""
    base = {key: count(c) for key, c in every_counter().items()}
    baseline.clear()
    baseline.update(base)


def reset() -> None:
    """Forget warnings, parsed environment values, probe results, counts and cached
    decisions (the snapshot in force is replaced by a copy with empty caches)."""
    with warned_lock:
        warned.clear()
    probed.clear()
    env_parsed.clear()
    locks.clear()
    lock_indexes.clear()
    reset_counts()
    global snapshot, process_profiles
    process_profiles = ()
    if snapshot is not None:
        # A new snapshot of the same tables, its caches empty, rather than caches cleared
        # in place: what resolve left on call contexts and what a facade keeps of its last
        # world name the snapshot they came from, so they are forgotten too.
        snapshot = dataclasses.replace(snapshot)


def update_recordings(change: Callable[[tuple[Any, ...]], tuple[Any, ...]]) -> None:
    """Put ``change(recordings)`` in force as the recordings (under ``record_lock``),
    switching the facades' routes when recording starts or ends."""
    global recordings
    with record_lock:
        was = bool(recordings)
        recordings = now = change(recordings)
        if was != bool(now):
            for switch in record_switches:
                switch(bool(now))


def _after_fork_in_child() -> None:
    """A forked child starts clean: fresh locks (the parent's may have been held by
    another thread), no cached decisions or parsed environment, counters from zero, and
    no recording (the parent's recordings are the parent's to write)."""
    global swap_lock, probe_lock, warned_lock, record_lock
    swap_lock = threading.RLock()
    probe_lock = threading.RLock()
    warned_lock = threading.Lock()
    record_lock = threading.Lock()
    update_recordings(lambda _: ())
    reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
