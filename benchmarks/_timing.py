"""Shared timing helper for the benchmark scripts: medians over repeats, in one process."""

from __future__ import annotations

import statistics
import timeit
from collections.abc import Callable


def per_call_us(fn: Callable[[], object], number: int, repeat: int = 9) -> float:
    """Median over ``repeat`` runs of the time of one call, in microseconds."""
    fn()
    runs = timeit.repeat(fn, number=number, repeat=repeat)
    return statistics.median(runs) / number * 1e6


def interleaved_us(fns: dict[str, Callable[[], object]], number: int,
                   repeat: int = 15) -> dict[str, float]:
    """Per-call medians of several functions timed in alternation (fair on a noisy box)."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            samples[name].append(timeit.timeit(fn, number=number) / number * 1e6)
    return {k: statistics.median(v) for k, v in samples.items()}
