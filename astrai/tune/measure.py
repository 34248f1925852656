"""Measuring the rows of a recorded workload: the first half of ``astrai-ops tune``.

For each recorded call that the tables decide (a call made with ``backend=`` or under
an ``op_backend`` row was not theirs to decide, and is left out):

1. whether it can be made here at all (``inputs.unreproducible``: its devices exist,
   its inputs fit in memory); a call that cannot is skipped with the reason, and the run
   goes on. So is one whose inputs cannot be rebuilt, or whose reference row raises;
2. its candidates: every row of its family that is available here and accepts the call
   (its ``when`` and declared ``features``, judged by resolution's own evaluator,
   ``row_verdict``); faithful rows only unless ``allow_nonfaithful``; explicit-only rows
   count;
3. inputs of the recorded shapes (``RecordedCall.arguments``), **fresh for every row**
   (built from the same seed: equal values, their own storage), each row run once through
   ``ops.call(family, ..., backend=row)`` under the call's grad mode and profiles;
4. numerics: each row's output against the family's reference row (the table's fallback)
   within a per-dtype tolerance (``TOLERANCE``), and its inputs after the call against the
   reference's after its own (``inputs.changed_inputs``). A row that disagrees, writes
   into its inputs, or raises is excluded and reported: a wrong kernel never wins on
   speed, and never makes another row look wrong;
5. timing, by wall clock, at the torch thread count in force (tune's ``threads``):
   warm-up calls until two runs in a row agree within ``STEADY`` (a compiled row compiles
   here, untimed), then ``rounds`` interleaved rounds (the order rotates each round, so
   slow drifts of a shared machine fall on every row alike); each sample is the time per
   call over a run at least ``SAMPLE_S`` long, after one untimed call that brings the
   row's own inputs back into cache - short, so that when another process takes the
   core for a scheduler slice, only the few samples it falls in are slowed, and the
   median is still the kernel's. In grad mode the forward call is timed
   (with autograd recording), not a backward pass. A row's figure is the median of its
   samples with a 95% interval (``statistics``); while the figures cannot tell whether a
   row beats the shipped one (``unclear``), or a row's samples scatter (its interval
   wider than ``noise.WIDE`` of its median), more rounds are taken - up to ``MORE`` times
   as many, within the time ``budget`` for the whole workload. The rounds of each call
   also read whether other processes competed for the CPU meanwhile (``noise``): a call
   timed on a busy machine keeps its shipped row.

``astrai.tune.profile`` turns the result into a profile; ``astrai.tune.ranks.combine``
takes the median across ranks under ``torch.distributed``.
"""

from __future__ import annotations

__all__ = ["SAMPLE_S", "TOLERANCE", "Budget", "CallTiming", "Timing", "candidates",
           "measure_call", "measure_workload", "outputs_agree", "shipped_row", "time_rows"]

import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from astrai.dispatch.registry import Registry, current
from astrai.dispatch.scopes import use_profile
from astrai.dispatch.tables.model import ImplRecord
from astrai.dispatch.verdicts import MATCH, row_verdict
from astrai.record.workload import RecordedCall, Workload
from astrai.tune.inputs import changed_inputs, tensors_in, unreproducible
from astrai.tune.noise import WIDE, NoiseMonitor
from astrai.tune.statistics import Interval, Verdict, compare, median_interval

SAMPLE_S = 0.0005  # each timed sample repeats the call this long, at least
WARMUP = 3  # untimed calls per row before its warm-up runs are timed
STEADY = 0.1  # warm-up ends when two runs in a row agree this closely
WARMUP_S = 0.25  # or after this long (seconds per row)
MORE = 4  # at most this many times ``rounds`` more rounds per call, within the budget

#: ``dtype -> (atol, rtol)`` a row's output may differ from the reference's by.
TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-4, 1e-4),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (2e-2, 2e-2),
}


@dataclass(frozen=True)
class Timing:
    """A row's time on one call (microseconds): the median of its samples, their
    interquartile range, and the median's 95% interval (``statistics.median_interval``)
    with the number of samples it rests on."""

    median_us: float
    spread_us: float
    low_us: float = math.nan
    high_us: float = math.nan
    samples: int = 0

    @classmethod
    def of(cls, samples: Sequence[float]) -> Timing:
        """The timing of ``samples`` (microseconds per call)."""
        got = median_interval(samples)
        return cls(got.median, _iqr(samples), got.low, got.high, got.samples)

    @classmethod
    def mean(cls, weighted: Sequence[tuple[float, Timing]]) -> Timing:
        """The means of several timings' figures, weighted (the fewest samples kept)."""
        total = sum(w for w, _ in weighted)

        def avg(pick: Callable[[Timing], float]) -> float:
            return sum(w * pick(t) for w, t in weighted) / total

        return cls(avg(lambda t: t.median_us), avg(lambda t: t.spread_us),
                   avg(lambda t: t.interval.low), avg(lambda t: t.interval.high),
                   min(t.samples for _, t in weighted))

    @property
    def interval(self) -> Interval:
        """The median and its interval (an unknown interval: the median alone)."""
        low = self.median_us if math.isnan(self.low_us) else self.low_us
        high = self.median_us if math.isnan(self.high_us) else self.high_us
        return Interval(self.median_us, low, high, self.samples, 0.0)


@dataclass(frozen=True)
class CallTiming:
    """What measuring one recorded call found.

    ``timings``: row -> ``Timing`` for the rows that ran and agreed with the reference;
    ``excluded``: row -> why it was not timed (numerics, its inputs, an exception);
    ``skipped``: why the call was not tuned at all (``None`` when it was); ``index``: its
    place in the workload (0-based; -1 when not from one); ``shipped``: the row the
    shipped order gives the call; ``busy``: whether other processes competed for the CPU
    while it was timed (then no row replaces the shipped one).
    """

    call: RecordedCall
    timings: dict[str, Timing] = field(default_factory=dict)
    excluded: dict[str, str] = field(default_factory=dict)
    skipped: str | None = None
    index: int = -1
    shipped: str | None = None
    busy: bool = False  # other processes competed for the CPU while it was timed

    def decision(self) -> tuple[str, Verdict, str]:
        """``statistics.compare`` on the timed rows: ``(winner, verdict, rival)``."""
        return compare({r: t.interval for r, t in self.timings.items()}, self.shipped,
                       busy=self.busy)

    @property
    def winner(self) -> str | None:
        """The row the figures support (``None``: no row timed): a row faster than the
        shipped one beyond the noise, else the shipped row (``statistics``)."""
        return self.decision()[0] if self.timings else None

    @property
    def where(self) -> str:
        """The call in words: its place in the workload and its family."""
        at = f"call {self.index + 1}" if self.index >= 0 else "a call"
        return f"{at} ({self.call.family})"


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


def shipped_row(state: Registry, call: RecordedCall) -> str | None:
    """The row the shipped order (no profile) gives ``call``: the first row of the chain
    whose verdict is a match, else the fallback."""
    if call.family not in state.families:
        return None
    view = state.view(call.family, ())
    ctx = call.context()
    for rec in view.chain:
        if row_verdict(state, view, rec, ctx)[0] == MATCH:
            return rec.name
    return view.fallback.name


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


class Budget:
    """The time left for extra rounds (seconds, wall clock, from its creation)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._deadline = time.perf_counter() + max(0.0, seconds)

    def left(self) -> float:
        """Seconds left (0 when spent)."""
        return max(0.0, self._deadline - time.perf_counter())


def _warm(fn: Callable[[], object], timer: Callable[[], float]) -> int:
    """Run ``fn`` until steady (``WARMUP`` calls, then runs of about ``SAMPLE_S`` until two
    in a row agree within ``STEADY``, at most ``WARMUP_S``); the calls per sample."""
    for _ in range(WARMUP):
        fn()
    began = timer()
    n, last = 1, math.inf
    while True:
        start = timer()
        for _ in range(n):
            fn()
        per = max(timer() - start, 1e-9) / n
        steady = abs(per - last) <= STEADY * min(per, last)
        last = per
        n = max(1, int(SAMPLE_S / per))
        if steady or timer() - began > WARMUP_S:
            return n


def time_rows(calls: Mapping[str, Callable[[], object]], rounds: int,
              timer: Callable[[], float] = time.perf_counter,
              monitor: NoiseMonitor | None = None,
              number: dict[str, int] | None = None) -> dict[str, list[float]]:
    """Each function's samples (microseconds per call): warmed up until steady (unless
    ``number`` gives the calls per sample already), then ``rounds`` interleaved rounds,
    the order rotating, each sample at least ``SAMPLE_S`` long and after one untimed call
    (the rows have inputs of their own: the one call brings this row's back into cache,
    as they are for a row called again and again)."""
    if number is None:
        number = {name: _warm(fn, timer) for name, fn in calls.items()}
    samples: dict[str, list[float]] = {k: [] for k in calls}
    names = list(calls)
    for r in range(rounds):
        if monitor is not None:
            monitor.round()
        for name in names[r % len(names):] + names[: r % len(names)]:
            fn, n = calls[name], number[name]
            fn()  # untimed: the row's inputs back in cache after the other rows ran
            start = timer()
            for _ in range(n):
                fn()
            samples[name].append((timer() - start) / n * 1e6)
    return samples


def measure_call(call: RecordedCall, *, rounds: int = 7, allow_nonfaithful: bool = False,
                 state: Registry | None = None, seed: int = 0, index: int = -1,
                 budget: Budget | None = None, monitor: NoiseMonitor | None = None
                 ) -> CallTiming:
    """Candidates, numerics and timing for one recorded call (module docstring)."""
    from astrai import ops  # the facades sit above the dispatch layer

    state = state or current()
    if call.selection is not None:
        return CallTiming(call, skipped="made with a row selected by name (backend= or "
                                        "op_backend): the tables did not decide it", index=index)
    if call.family not in state.families:
        return CallTiming(call, skipped=f"family {call.family!r} is not loaded", index=index)
    rows = candidates(state, call, allow_nonfaithful=allow_nonfaithful)
    reference = state.view(call.family, ()).fallback
    if reference not in rows:
        return CallTiming(call, skipped=f"the reference row {reference.name!r} cannot serve "
                                        f"it here, so no row's numerics can be checked",
                          index=index)
    why_not = unreproducible(call, copies=len(rows) + 2)
    if why_not is not None:
        return CallTiming(call, skipped=why_not, index=index)
    shipped = shipped_row(state, call)

    def fresh() -> tuple[tuple[Any, ...], dict[str, Any]]:
        return call.arguments(generator=torch.Generator().manual_seed(seed))

    def runner(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
               ) -> Callable[[], object]:
        return lambda: ops.call(call.family, *args, backend=name, **kwargs)

    result = CallTiming(call, index=index, shipped=shipped)
    with _made_as(call):
        try:
            inputs = fresh()
        except Exception as exc:  # a described value this machine cannot rebuild
            return replace(result, skipped=f"its arguments cannot be rebuilt: {_said(exc)}")
        try:
            want = runner(reference.name, *inputs)()
        except Exception as exc:
            return replace(result, skipped=f"the reference row {reference.name!r} "
                                           f"{_said(exc)}, so no row's numerics can be checked")
        after = tensors_in(inputs)
        calls: dict[str, Callable[[], object]] = {reference.name: runner(reference.name,
                                                                           *inputs)}
        for rec in rows:
            if rec is reference:
                continue
            try:
                own = fresh()
                fn = runner(rec.name, *own)
                why = outputs_agree(fn(), want) or changed_inputs(tensors_in(own), after)
            except Exception as exc:  # a row that fails on the call is reported, not timed
                why = _said(exc)
            if why is None:
                calls[rec.name] = fn
            else:
                result.excluded[rec.name] = why
        del want, after
        calls = {r.name: calls[r.name] for r in rows if r.name in calls}  # table order
        number = {name: _warm(fn, time.perf_counter) for name, fn in calls.items()}
        mark = monitor.mark() if monitor is not None else 0
        samples = time_rows(calls, rounds, monitor=monitor, number=number)
        busy = monitor is not None and monitor.busy_since(mark)
        for _ in range(MORE):
            if budget is None or budget.left() <= 0:
                break
            figures = {r: Timing.of(v).interval for r, v in samples.items()}
            _, verdict, rival = compare(figures, shipped, busy=busy)
            if verdict == "unclear":  # more samples may tell: the two rows weighed
                again = {r: calls[r] for r in (shipped, rival) if r in calls}
            elif max(f.relative_width for f in figures.values()) > WIDE:
                again = calls  # the samples scatter (a busy machine): steadier medians
            else:
                break
            for r, v in time_rows(again, rounds, monitor=monitor, number=number).items():
                samples[r].extend(v)
            busy = busy or (monitor is not None and monitor.busy_since(mark))
    result.timings.update({r: Timing.of(v) for r, v in samples.items()})
    return replace(result, busy=busy)


def _said(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"raised {type(exc).__name__}: {text}".rstrip(": ")


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
                     progress: bool | None = None, budget: float = 0.0,
                     monitor: NoiseMonitor | None = None) -> list[CallTiming]:
    """``measure_call`` for every call of ``workload``, in order, with a progress bar on
    stderr (``progress=None``: when stderr is a terminal). ``budget``: seconds, for the
    whole workload, of extra rounds where the figures cannot tell yet."""
    state = current()
    bar = _Progress(len(workload.calls), progress)
    left = Budget(budget)
    out = []
    try:
        for i, call in enumerate(workload.calls):
            out.append(measure_call(call, rounds=rounds, allow_nonfaithful=allow_nonfaithful,
                                    state=state, seed=i, index=i, budget=left,
                                    monitor=monitor))
            bar.step(call.family)
    finally:
        bar.close()
    return out
