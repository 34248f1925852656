"""What a row's samples say, and when one row is faster than another beyond the noise.

A row's figure on a call is the **median** of its samples (each sample: the wall-clock
time per call over a run of calls at least ``SAMPLE_S`` long). Its **interval** is a
distribution-free confidence interval for that median: with ``n`` samples, the ``k``-th
smallest and ``k``-th largest, ``k`` the largest rank for which the chance that the true
median lies outside is at most 5% (the binomial law of ``n`` fair coins; no assumption
about how the samples spread). With fewer than 6 samples no pair of order statistics
reaches 95%; the interval is then the whole range and says so by its ``level``.

A row **replaces** the shipped choice (the row the shipped order picks for the call)
only when it is faster beyond the noise: its interval lies wholly below the shipped
row's, and its median is at least ``MARGIN`` below the shipped row's - and the call was
not timed while other processes competed for the CPU (their load changes which kernel
is faster: a kernel on several threads suffers more than one on a single thread).
Otherwise the shipped choice stays, and the call's verdict says why (``Verdict``).
"""

from __future__ import annotations

__all__ = ["LEVEL", "MARGIN", "Interval", "Verdict", "compare", "median_interval"]

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

#: The confidence level of a row's interval.
LEVEL = 0.95
#: How much faster than the shipped row another row must be (by median) to replace it.
MARGIN = 0.05


@dataclass(frozen=True)
class Interval:
    """A median with its confidence interval (microseconds), the samples it rests on and
    the interval's actual coverage (``level``)."""

    median: float
    low: float
    high: float
    samples: int
    level: float

    def below(self, other: Interval) -> bool:
        """Whether this interval lies wholly below ``other``."""
        return self.high < other.low

    @property
    def relative_width(self) -> float:
        """The interval's width over the median (0 for a single sample)."""
        return (self.high - self.low) / self.median if self.median > 0 else math.inf


def median_interval(samples: Sequence[float], level: float = LEVEL) -> Interval:
    """The median of ``samples`` and its distribution-free confidence interval (module
    docstring). ``samples`` must not be empty."""
    if not samples:
        raise ValueError("no samples")
    s = sorted(samples)
    n = len(s)
    # Excluding the k smallest and k largest leaves the median outside with chance
    # 2 * P(B <= k - 1), B ~ Binomial(n, 1/2).
    k, tail, below = 0, 0.0, 0.0
    for i in range(n // 2):
        below += math.comb(n, i) / 2.0 ** n
        if 2 * below > 1 - level:
            break
        k, tail = i + 1, below
    if k == 0:  # too few samples for the level: the whole range
        return Interval(statistics.median(s), s[0], s[-1], n, 1 - 2 / 2.0 ** n if n > 1 else 0.0)
    return Interval(statistics.median(s), s[k - 1], s[n - k], n, 1 - 2 * tail)


#: Why a call's winner is what it is:
#: ``faster`` - another row is faster than the shipped one beyond the noise, and wins;
#: ``shipped`` - the shipped row has the lowest median;
#: ``tie`` - another row's median is lower, but by less than ``MARGIN``: the shipped stays;
#: ``unclear`` - another row's median is lower by ``MARGIN`` or more, but the intervals
#: overlap: more samples may tell (after the time budget: the shipped row stays);
#: ``busy`` - another row looked faster beyond the noise, but other processes competed
#: for the CPU while the call was timed: such figures are not the kernels' costs, so the
#: shipped row stays;
#: ``no shipped`` - the shipped row was not timed (excluded): the fastest row wins.
Verdict = Literal["faster", "shipped", "tie", "unclear", "busy", "no shipped"]


def compare(figures: Mapping[str, Interval], shipped: str | None, *, busy: bool = False
            ) -> tuple[str, Verdict, str]:
    """``(winner, verdict, rival)`` for one call: the row the figures support, why, and
    the row it was weighed against (``""`` when there is none). Of the rows faster than
    the shipped one beyond the noise, the one with the lowest median wins - unless the
    call was timed on a ``busy`` machine; the rival of a shipped row that stays is the
    fastest other row."""
    if not figures:
        raise ValueError("no rows were timed")

    def by_median(rows: list[str]) -> str:
        return min(rows, key=lambda r: (figures[r].median, r))

    if shipped is None or shipped not in figures:
        return by_median(list(figures)), "no shipped", ""
    others = [r for r in figures if r != shipped]
    if not others:
        return shipped, "shipped", ""
    mine = figures[shipped]
    rival = by_median(others)
    clear = [r for r in others if figures[r].median <= mine.median * (1 - MARGIN)]
    beyond = [r for r in clear if figures[r].below(mine)]
    if beyond:
        if busy:
            return shipped, "busy", by_median(beyond)
        return by_median(beyond), "faster", shipped
    if clear:
        return shipped, "unclear", by_median(clear)
    if figures[rival].median < mine.median:
        return shipped, "tie", rival
    return shipped, "shipped", rival
