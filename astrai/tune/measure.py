"""Measuring the rows of a recorded workload: the first half of ``astrai-ops tune``.

For each recorded call that the tables decide (a call made with ``backend=`` or under
an ``op_backend`` row was not theirs to decide, and is left out):

1. its candidates: every row of its family that is available here and accepts the call
   (its ``when`` and declared ``features``, judged by resolution's own evaluator,
   ``row_verdict``); faithful rows only unless ``allow_nonfaithful``; explicit-only rows
   count;
2. inputs of the recorded shapes (``RecordedCall.arguments``, seeded), the same for every
   row, and each row run once through ``ops.call(family, ..., backend=row)`` under the
   call's grad mode and profiles;
3. numerics: each row's output against the family's reference row (the table's fallback)
   within a per-dtype tolerance (``TOLERANCE``). A row that disagrees, or raises, is
   excluded and reported: a wrong kernel never wins on speed;
4. timing: warm-up calls (a compiled row compiles here, untimed), then ``rounds``
   interleaved rounds (the order rotates each round, so slow drifts of a shared machine
   fall on every row alike); each sample repeats the call for at least ``SAMPLE_S``
   seconds of the calling thread's CPU time (``time.thread_time``: on a shared machine
   wall-clock samples of one kernel were seen to differ 2x while another tenant ran, as
   ``benchmarks/bench_rows.py`` found; kernels that run on several intra-op threads are
   undercounted, so tune small-shape workloads, or ``torch.set_num_threads(1)``).
   A row's time is the median of its samples,
   its spread their interquartile range.

``astrai.tune.profile`` turns the result into a profile; ``astrai.tune.ranks.combine``
takes the median across ranks under ``torch.distributed``.
"""

from __future__ import annotations

__all__ = ["SAMPLE_S", "TOLERANCE", "CallTiming", "Timing", "candidates", "measure_call",
           "measure_workload", "outputs_agree"]

import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from astrai.dispatch.registry import Registry, current
from astrai.dispatch.scopes import use_profile
from astrai.dispatch.tables.model import ImplRecord
from astrai.dispatch.verdicts import MATCH, row_verdict
from astrai.record.workload import RecordedCall, Workload

SAMPLE_S = 0.002  # each timed sample repeats the call this long, at least
WARMUP = 2  # untimed calls per row before the rounds (a compiled row compiles on the first)

#: ``dtype -> (atol, rtol)`` a row's output may differ from the reference's by.
TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-4, 1e-4),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (2e-2, 2e-2),
}


@dataclass(frozen=True)
class Timing:
    """A row's time on one call: median and interquartile range (microseconds)."""

    median_us: float
    spread_us: float


@dataclass(frozen=True)
class CallTiming:
    """What measuring one recorded call found.

    ``timings``: row -> ``Timing`` for the rows that ran and agreed with the reference;
    ``excluded``: row -> why it was not timed (numerics, an exception); ``skipped``: why
    the call was not tuned at all (``None`` when it was).
    """

    call: RecordedCall
    timings: dict[str, Timing] = field(default_factory=dict)
    excluded: dict[str, str] = field(default_factory=dict)
    skipped: str | None = None

    @property
    def winner(self) -> str | None:
        """The fastest row that agreed with the reference (``None``: none timed)."""
        if not self.timings:
            return None
        return min(self.timings, key=lambda r: self.timings[r].median_us)


def candidates(state: Registry, call: RecordedCall, *, allow_nonfaithful: bool = False
               ) -> list[ImplRecord]:
    """The rows of ``call``'s family, in table order, that may serve it here: available
    and accepting it (``when`` and features, by resolution's evaluator), faithful unless
    ``allow_nonfaithful``. Explicit-only rows count."""
    view = state.view(call.family, ())
    ctx = call.context()
    return [rec for rec in view.rows
            if (rec.faithful or allow_nonfaithful)
            and row_verdict(state, view, rec, ctx, implicit=False)[0] == MATCH]


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


def outputs_agree(got: Any, want: Any) -> str | None:
    """Why ``got`` disagrees with the reference output ``want`` (``None``: it agrees):
    the same tensors (shape, dtype) and values within ``TOLERANCE`` of their dtype."""
    a, b = _tensors(got), _tensors(want)
    if len(a) != len(b):
        return f"returned {len(a)} tensors, the reference {len(b)}"
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        where = "" if len(a) == 1 else f" (output {i})"
        if x.shape != y.shape:
            return f"output shape {tuple(x.shape)}, the reference's {tuple(y.shape)}{where}"
        if x.dtype != y.dtype:
            return f"output dtype {x.dtype}, the reference's {y.dtype}{where}"
        x, y = x.detach().cpu(), y.detach().cpu()
        if not (x.is_floating_point() or x.is_complex()):
            if not torch.equal(x, y):
                return f"values differ from the reference's{where}"
            continue
        atol, rtol = TOLERANCE.get(x.dtype, (1e-4, 1e-4))
        if not torch.allclose(x, y, atol=atol, rtol=rtol, equal_nan=True):
            err = (x.double() - y.double()).abs().nan_to_num(nan=float("inf")).max().item()
            return (f"differs from the reference by up to {err:.3g} (tolerance for "
                    f"{str(x.dtype).removeprefix('torch.')}: atol {atol:g}, rtol {rtol:g})"
                    f"{where}")
    return None


@contextmanager
def _made_as(call: RecordedCall) -> Iterator[None]:
    """The recorded call's grad mode and ``use_profile`` profiles (not its selection)."""
    with ExitStack() as stack:
        stack.enter_context(torch.set_grad_enabled(bool(call.axes.get("grad_enabled",
                                                                      True))))
        if call.scope_profiles:
            stack.enter_context(use_profile(*call.scope_profiles))
        yield


def _iqr(samples: Sequence[float]) -> float:
    if len(samples) < 2:
        return 0.0
    q = statistics.quantiles(samples, n=4, method="inclusive")
    return q[2] - q[0]


def time_rows(calls: dict[str, Callable[[], object]], rounds: int,
              timer: Callable[[], float] = time.thread_time) -> dict[str, Timing]:
    """Each function's time per call: ``WARMUP`` untimed calls, then ``rounds``
    interleaved rounds (the order rotating), each sample at least ``SAMPLE_S`` long."""
    number: dict[str, int] = {}
    for name, fn in calls.items():
        for _ in range(WARMUP):
            fn()
        start = timer()
        fn()
        number[name] = max(1, int(SAMPLE_S / max(timer() - start, 1e-7)))
    samples: dict[str, list[float]] = {k: [] for k in calls}
    names = list(calls)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            fn, n = calls[name], number[name]
            start = timer()
            for _ in range(n):
                fn()
            samples[name].append((timer() - start) / n * 1e6)
    return {k: Timing(statistics.median(v), _iqr(v)) for k, v in samples.items()}


def measure_call(call: RecordedCall, *, rounds: int = 7, allow_nonfaithful: bool = False,
                 state: Registry | None = None, seed: int = 0) -> CallTiming:
    """Candidates, numerics and timing for one recorded call (module docstring)."""
    from astrai import ops  # the facades sit above the dispatch layer

    state = state or current()
    if call.selection is not None:
        return CallTiming(call, skipped="made with a row selected by name (backend= or "
                                        "op_backend): the tables did not decide it")
    if call.family not in state.families:
        return CallTiming(call, skipped=f"family {call.family!r} is not loaded")
    rows = candidates(state, call, allow_nonfaithful=allow_nonfaithful)
    reference = state.view(call.family, ()).fallback
    if reference not in rows:
        return CallTiming(call, skipped=f"the reference row {reference.name!r} cannot serve "
                                        f"it here, so no row's numerics can be checked")
    try:
        args, kwargs = call.arguments(generator=torch.Generator().manual_seed(seed))
    except ValueError as exc:
        return CallTiming(call, skipped=f"its arguments cannot be rebuilt: {exc}")

    def runner(name: str) -> Callable[[], object]:
        return lambda: ops.call(call.family, *args, backend=name, **kwargs)

    result = CallTiming(call)
    with _made_as(call):
        want = runner(reference.name)()
        calls: dict[str, Callable[[], object]] = {}
        for rec in rows:
            fn = runner(rec.name)
            try:
                why = None if rec is reference else outputs_agree(fn(), want)
            except Exception as exc:  # a row that fails on the call is reported, not timed
                why = f"raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if why is None:
                calls[rec.name] = fn
            else:
                result.excluded[rec.name] = why
        result.timings.update(time_rows(calls, rounds))
    return result


class _Progress:
    """A progress bar on stderr: tqdm when installed, else a counter line; nothing when
    stderr is not a terminal."""

    def __init__(self, total: int, enabled: bool | None = None) -> None:
        self.total, self.done = total, 0
        self.shown = sys.stderr.isatty() if enabled is None else enabled
        self.bar: Any = None
        if self.shown:
            try:
                from tqdm import tqdm  # type: ignore[import-untyped]
            except ImportError:
                pass
            else:
                self.bar = tqdm(total=total, desc="tune", unit="call", file=sys.stderr)

    def step(self, label: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(label, refresh=False)
            self.bar.update(1)
        elif self.shown:
            sys.stderr.write(f"\rtune: {self.done}/{self.total} calls ({label})\033[K")
            sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.shown:
            sys.stderr.write("\n")


def measure_workload(workload: Workload, *, rounds: int = 7, allow_nonfaithful: bool = False,
                     progress: bool | None = None) -> list[CallTiming]:
    """``measure_call`` for every call of ``workload``, in order, with a progress bar on
    stderr (``progress=None``: when stderr is a terminal)."""
    state = current()
    bar = _Progress(len(workload.calls), progress)
    out = []
    try:
        for i, call in enumerate(workload.calls):
            out.append(measure_call(call, rounds=rounds, allow_nonfaithful=allow_nonfaithful,
                                    state=state, seed=i))
            bar.step(call.family)
    finally:
        bar.close()
    return out
