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


def paired_ratios(base: Callable[[], object], others: dict[str, Callable[[], object]],
                  number: int, repeat: int = 41) -> dict[str, float]:
    """Median over rounds of ``other / base``, each ratio from two adjacent timings.

    Pairing cancels the slow drifts of a shared machine (another tenant, frequency
    changes) that separate medians would fold into the ratio; the order within a
    pair alternates so neither side always runs second.
    """
    base()
    for fn in others.values():
        fn()
    ratios: dict[str, list[float]] = {k: [] for k in others}
    for i in range(repeat):
        for name, fn in others.items():
            if i % 2:
                t_other = timeit.timeit(fn, number=number)
                t_base = timeit.timeit(base, number=number)
            else:
                t_base = timeit.timeit(base, number=number)
                t_other = timeit.timeit(fn, number=number)
            ratios[name].append(t_other / t_base)
    return {k: statistics.median(v) for k, v in ratios.items()}
