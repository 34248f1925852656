"""A routed family measured inside the model: whole runs with the family routed and left
to the model's own code, side by side.

Timing a family's calls one at a time, again and again, keeps its code and inputs in
cache; inside a model they are cold again after each layer's weights have streamed
through, and a routed call pays its dispatch there too. So ``tune_model`` also times the
representative run (a prefill and greedy decode steps) in configurations that differ by
one family: every routed family routed, and for each family, all of them but that one
(its modules back on their own code). The configurations are dispatched once and swapped
in between runs (the modules' ``forward`` and route attributes), in interleaved rounds,
the order rotating. A family's figure is the per-round ratio of the run routed over the
run without it: its median and distribution-free 95% interval. A run is timed on the
calling thread's CPU clock where torch computes on one thread, else on the wall clock.

The model's own code wins only where the interval lies wholly above 1 and the median by
at least ``MARGIN`` (of a whole run), on a quiet machine; otherwise the family stays
routed and the verdict says why.
"""

from __future__ import annotations

__all__ = ["MARGIN", "InModel", "measure_in_model", "routed_families"]

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from astrai.backends.frozen import freeze, is_frozen, thaw
from astrai.integrations.transformers.routing import ROUTE_ATTR, Route, restore_model
from astrai.tune.measure import MORE, Budget, Timing
from astrai.tune.noise import NoiseMonitor

#: How much slower (over a whole run) routing a family must make the run to leave it.
MARGIN = 0.005
#: The fewest timed rounds (a ratio's 95% interval needs several).
ROUNDS = 11
#: A family's configuration name: the run with the family left to the model's code.
_ALL = ""

# The module attributes a routing sets (the instance's forward and astrai's route).
_KEYS = ("forward", ROUTE_ATTR)
_State = list[tuple[nn.Module, dict[str, Any]]]


@dataclass(frozen=True)
class InModel:
    """A family measured inside the model: microseconds per run with the family left to
    the model's own code (``model``) and routed (``astrai``), and the per-round ratio
    routed / model (``ratio``, a plain number in ``Timing``'s fields)."""

    run: str
    model: Timing
    astrai: Timing
    ratio: Timing
    busy: bool = False

    @property
    def verdict(self) -> str:
        """``faster`` (the model's code, beyond the noise), ``routed`` (the routed run,
        beyond the noise), ``tie`` (the interval holds 1), ``cannot tell`` (the median is
        beyond the margin, the interval holds 1) or ``cannot tell (busy)``."""
        low, high, median = self.ratio.interval.low, self.ratio.interval.high, \
            self.ratio.median_us
        if low > 1 and median >= 1 + MARGIN:
            return "cannot tell (busy)" if self.busy else "faster"
        if high < 1:
            return "routed"
        return "cannot tell" if median >= 1 + MARGIN else "tie"

    @property
    def left_to_model(self) -> bool:
        """Whether the model's own code wins."""
        return self.verdict == "faster"

    def plain(self) -> dict[str, Any]:
        """The profile's form (``InModelModel``)."""
        def pair(t: Timing, digits: int) -> list[float]:
            return [round(t.interval.low, digits), round(t.interval.high, digits)]
        return {"run": self.run, "model_us": round(self.model.median_us, 1),
                "model_interval_us": pair(self.model, 1),
                "astrai_us": round(self.astrai.median_us, 1),
                "astrai_interval_us": pair(self.astrai, 1),
                "ratio": round(self.ratio.median_us, 4), "ratio_interval": pair(self.ratio, 4),
                "rounds": self.ratio.samples, "busy": self.busy, "verdict": self.verdict}

    @classmethod
    def from_plain(cls, data: Mapping[str, Any]) -> InModel:
        """The figures of a profile's ``InModelModel`` mapping."""
        n = int(data.get("rounds", 0))

        def timing(median: float, interval: Sequence[float]) -> Timing:
            return Timing(median, 0.0, interval[0], interval[1], n)

        return cls(str(data["run"]), timing(data["model_us"], data["model_interval_us"]),
                   timing(data["astrai_us"], data["astrai_interval_us"]),
                   timing(data["ratio"], data["ratio_interval"]), bool(data.get("busy")))

    @classmethod
    def combine(cls, parts: Sequence[InModel]) -> InModel:
        """Several models' figures as one: the means of their figures (each model's run
        counts once)."""
        def mean(pick: Callable[[InModel], Timing]) -> Timing:
            return Timing.mean([(1, pick(p)) for p in parts])

        runs = sorted({p.run for p in parts})
        return cls("; ".join(runs), mean(lambda p: p.model), mean(lambda p: p.astrai),
                   mean(lambda p: p.ratio), any(p.busy for p in parts))


def routed_families(model: nn.Module) -> set[str]:
    """The families routed in ``model`` (its modules' routes)."""
    got: set[str] = set()
    for module in model.modules():
        route: Route | None = module.__dict__.get(ROUTE_ATTR)
        if route is not None:
            got |= route.families
    return got


def _snapshot(model: nn.Module) -> _State:
    return [(m, {k: m.__dict__[k] for k in _KEYS if k in m.__dict__}) for m in model.modules()]


def _apply(state: _State) -> None:
    for module, attrs in state:
        for key in _KEYS:
            if key in attrs:
                module.__dict__[key] = attrs[key]
            else:
                module.__dict__.pop(key, None)


def _configurations(model: nn.Module, families: Iterable[str],
                    without: Callable[[str], object]) -> dict[str, _State]:
    """The routing as it is (``_ALL``) and, per family, the model routed by ``without``
    (given the family), each dispatched once; the model is left routed as it was, its
    parameters' frozen declarations as they were."""
    names = sorted(families)
    frozen = [p for p in model.parameters() if is_frozen(p)]
    states = {_ALL: _snapshot(model)}
    try:
        for family in names:
            restore_model(model)
            without(family)
            states[family] = _snapshot(model)
    finally:
        restore_model(model)
        _apply(states[_ALL])
        thaw(model.parameters())
        freeze(frozen)
    return states


def _clock() -> Callable[[], float]:
    """The calling thread's CPU time where torch computes on that thread alone (other
    processes' turns on the core left out), else the wall clock."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def _time_runs(states: Mapping[str, _State], run: Callable[[], object], rounds: int,
               monitor: NoiseMonitor) -> dict[str, list[float]]:
    """Microseconds per run in each configuration: ``rounds`` interleaved rounds, the
    order rotating; each run right after its configuration is put in place."""
    clock = _clock()
    names = list(states)
    took: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        monitor.round()
        for name in names[r % len(names):] + names[:r % len(names)]:
            _apply(states[name])
            start = clock()
            run()
            took[name].append((clock() - start) * 1e6)
    return took


def measure_in_model(model: nn.Module, run: Callable[[], object], what: str,
                     without: Callable[[str], object], rounds: int, budget: float,
                     monitor: NoiseMonitor) -> dict[str, InModel]:
    """Per routed family of ``model``: ``run`` (described by ``what``) timed with the
    family left to the model's own code against routed (module docstring);
    ``without(family)`` routes the restored model as it is routed now but for that family
    (``dispatch_model(..., leave=[family])`` where dispatch_model decided the families).
    Extra rounds where a figure cannot tell yet, within ``budget`` seconds. The model is
    left routed as it was."""
    names = sorted(routed_families(model))
    if not names:
        return {}
    states = _configurations(model, names, without)
    mark = monitor.mark()
    left = Budget(budget)
    try:
        for state in states.values():  # each configuration's decisions made, untimed
            _apply(state)
            run()
        rounds = max(rounds, ROUNDS)
        took = _time_runs(states, run, rounds, monitor)
        for _ in range(MORE):
            if left.left() <= 0 or not any(
                    _figures(what, took, f, False).verdict == "cannot tell" for f in names):
                break
            for name, more in _time_runs(states, run, rounds, monitor).items():
                took[name].extend(more)
    finally:
        _apply(states[_ALL])
    busy = monitor.busy_since(mark)
    return {f: _figures(what, took, f, busy) for f in names}


def _figures(what: str, took: Mapping[str, list[float]], family: str, busy: bool) -> InModel:
    routed, own = took[_ALL], took[family]
    ratios = [a / b for a, b in zip(routed, own, strict=True)]
    return InModel(what, Timing.of(own), Timing.of(routed), Timing.of(ratios), busy)
