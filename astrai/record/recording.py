"""Recording a workload: every distinct call the facades (and ``ops.call``) see.

    with astrai.dispatch.record() as wl:
        generate(model, prompts)
    wl.save("workload.yaml")          # or wl.workload(): the calls, in memory

A recording collects, per distinct call, the family, every axis of the call (raw), its
arguments described well enough to rebuild inputs of the same shapes, dtypes and devices
(``astrai.record.workload``), its selection (``backend=``, the ``op_backend`` row and
``use_profile`` profiles in force) and how many calls were alike. A call that is
refused (malformed, or no row can serve it) is not recorded. Arguments that do not change
what a call is (an attention call's ``layer_id``) do not make calls distinct: the first
value seen is kept.

Recordings are process-wide: calls from every thread are recorded, and several
recordings (nested, or in several threads) each get every call made while they are in
force (astrai's own probing calls, ``dispatch_model``'s recognition, are never recorded:
``astrai.dispatch.stats.unobserved``). ``ASTR_RECORD=path`` records a whole process (from
the import of ``astrai.ops``) and writes the workload to ``path`` when the process exits; a
forked child does not record (nor write) its parent's recording, and a process it starts
(which inherits the variable) writes its own calls to ``<stem>.<pid><suffix>`` beside
``path``.

Cost: nothing while nothing records. The facades switch to recording routes when the
first recording starts and back when the last ends (``state.record_switches``), so
their hot path is the same code as without this module; ``ops.call`` of a family
without a facade checks one flag. While recording, every call also rebuilds its full
context and describes its arguments: several microseconds a call (decisions are still
cached), so record a representative run, not production traffic. Calls traced by
``torch.compile`` are not recorded (they are not dispatched per call).
"""

from __future__ import annotations

__all__ = ["DEFAULT_MAX_CALLS", "Recording", "note_call", "process_path", "record",
           "record_process"]

import atexit
import itertools
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from astrai.dispatch import state as process
from astrai.dispatch.axes import CORE_AXES, CallContext, context_fields
from astrai.dispatch.log import warn_once
from astrai.dispatch.machine import cuda_initialized, this_machine
from astrai.dispatch.registry import current
from astrai.dispatch.scopes import current_scope
from astrai.dispatch.stats import UNOBSERVED
from astrai.env import RECORD_ENV, RECORD_OWNER_ENV
from astrai.record.workload import RecordedCall, Workload, describe_value, selection_of

#: The most distinct calls a recording keeps (later new ones are counted as dropped).
DEFAULT_MAX_CALLS = 100_000


class Recording:
    """A recording of calls (see the module docstring); a context manager that starts
    it on entry and ends it on exit, returning itself."""

    def __init__(self, max_calls: int = DEFAULT_MAX_CALLS) -> None:
        if max_calls < 1:
            raise ValueError(f"a recording needs room for at least 1 call, got {max_calls}")
        self.max_calls = max_calls
        self._calls: dict[tuple[Any, ...], tuple[RecordedCall, itertools.count[int]]] = {}
        self._dropped = itertools.count()

    def start(self) -> Recording:
        """Start recording (again, if it was stopped: calls add to what it holds)."""
        process.update_recordings(lambda now: now if self in now else (*now, self))
        return self

    def stop(self) -> None:
        """Stop recording; what was recorded stays."""
        process.update_recordings(lambda now: tuple(r for r in now if r is not self))

    @property
    def active(self) -> bool:
        """Whether calls are being recorded."""
        return self in process.recordings

    def __enter__(self) -> Recording:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def add(self, key: tuple[Any, ...], make: Callable[[], RecordedCall]) -> None:
        """Count a call whose identity is ``key`` (``make`` describes it the first time)."""
        got = self._calls.get(key)
        if got is None:
            if len(self._calls) >= self.max_calls:
                next(self._dropped)
                warn_once(f"a recording holds {self.max_calls} distinct calls, its most; "
                          f"further new calls are counted as dropped (record(max_calls=...))")
                return
            got = self._calls.setdefault(key, (make(), itertools.count()))
        next(got[1])

    @property
    def calls(self) -> tuple[RecordedCall, ...]:
        """The distinct calls so far, in the order first seen, with their counts."""
        return tuple(replace(call, count=process.count(n))
                     for call, n in list(self._calls.values()))

    def workload(self) -> Workload:
        """The recorded calls as a ``Workload`` (with this machine's fingerprint)."""
        return Workload.of(self.calls, this_machine(gpu=cuda_initialized()),
                           process.count(self._dropped))

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the workload recorded so far to ``path`` (YAML)."""
        return self.workload().save(path)

    def __len__(self) -> int:
        return len(self._calls)


def record(max_calls: int = DEFAULT_MAX_CALLS) -> Recording:
    """A new recording: ``with record() as wl: ...`` records the calls made in the block
    (in every thread); ``wl.save(path)`` writes them. Keeps at most ``max_calls``
    distinct calls."""
    return Recording(max_calls)


#: What an axis value in a workload file can be.
_PLAIN = (type(None), bool, int, float, str)


def note_call(ctx: CallContext, explicit: Any, incidental: tuple[str, ...] = ()) -> None:
    """Add a call, described by its full context (``raw`` / ``raw_kwargs`` holding the
    arguments the row gets), to every recording in force. ``incidental`` names keyword
    arguments that do not make calls distinct."""
    recordings = process.recordings
    if not recordings or UNOBSERVED.get():  # astrai's own probing calls: not the workload
        return
    state = process.snapshot or current()
    scope = current_scope()
    family = ctx.family
    odd = [f"{k}={v}" for k, v in (*((a, getattr(ctx, a)) for a in CORE_AXES),
                                    *ctx.extra.items())
           if not (v.__class__ in _PLAIN or isinstance(v, torch.dtype))]
    if odd:  # a value no file can hold (a nested tensor's symbolic size, say)
        warn_once(f"record: a {family} call is not recorded: its axes {', '.join(odd)} are "
                  f"not plain values a workload file can hold")
        return
    axes = context_fields(ctx)
    args = tuple(describe_value(v) for v in ctx.raw)
    kwargs = {k: describe_value(v) for k, v in ctx.raw_kwargs.items()}
    backend = selection_of(state, family, explicit)
    scoped = selection_of(state, family, scope.handles.get(family))
    key = (family, tuple(axes.items()), args,
           tuple((k, v) for k, v in kwargs.items() if k not in incidental), backend, scoped,
           scope.profiles)

    def make() -> RecordedCall:
        return RecordedCall(family, axes, args, kwargs, 1, backend, scoped, scope.profiles)

    for recording in recordings:
        recording.add(key, make)


process.note_call = note_call


def record_process(path: str) -> Recording:
    """Record this whole process and write the workload at exit (``ASTR_RECORD``); a
    forked child writes nothing. The process that set ``ASTR_RECORD`` writes ``path``;
    a process it starts (a subprocess or a ``spawn`` worker, which inherit the variable)
    writes its own file beside it, ``<stem>.<pid><suffix>`` (``process_path``), so no
    process's calls overwrite another's."""
    recording = Recording().start()
    pid = os.getpid()
    owner = os.environ.get(RECORD_OWNER_ENV)
    if owner is None:
        os.environ[RECORD_OWNER_ENV] = str(pid)  # what the processes it starts inherit
    elif owner != str(pid):
        path = process_path(path, pid)
    atexit.register(_write_at_exit, recording, path, pid)
    return recording


def process_path(path: str, pid: int) -> str:
    """Where a process started by the recording one writes its workload: ``wl.yaml`` ->
    ``wl.<pid>.yaml`` beside it."""
    p = Path(path)
    return str(p.with_name(f"{p.stem}.{pid}{p.suffix}"))


def _write_at_exit(recording: Recording, path: str, pid: int) -> None:
    if os.getpid() != pid:
        return
    recording.stop()
    try:
        recording.save(path)
    except Exception as exc:  # at exit, the only place left to say it is stderr
        print(f"astrai: {RECORD_ENV}={path}: cannot write the workload: {exc}",
              file=sys.stderr)
