"""Usage counters: how many calls each row served, per family and origin.

Counting is one ``next()`` on an ``itertools.count`` (atomic in CPython), so the
hot path takes no lock; the decision cache keeps a reference to the counter of
each decision so a cached call does not even look it up. Counters are never
replaced: ``reset`` records a baseline that later reads subtract. This is how a
user notices a silent fallback: ``stats().served("attention", "math")``.
"""

from __future__ import annotations

__all__ = ["MISSES", "QUIET", "UNCACHED", "UsageStats", "counter", "reset_stats", "stats"]

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

Key = tuple[str, str, str]  # family, row, origin

_counters: dict[Key, itertools.count[int]] = {}
# Decision-cache counts. Every lookup that serves a call bumps that row's usage counter;
# ``QUIET`` counts the lookups that serve none (``resolve``); ``MISSES`` and ``UNCACHED``
# (a handle whose verdict depends on the raw call) the ones that were not hits.
QUIET: itertools.count[int] = itertools.count()
MISSES: itertools.count[int] = itertools.count()
UNCACHED: itertools.count[int] = itertools.count()
_baseline: dict[object, int] = {}


def counter(family: str, row: str, origin: str) -> itertools.count[int]:
    """The counter of calls of ``family`` served by ``row`` via ``origin``."""
    key = (family, row, origin)
    c = _counters.get(key)
    if c is None:
        c = _counters.setdefault(key, itertools.count())
    return c


def _value(c: itertools.count[int]) -> int:
    return int(c.__reduce__()[1][0])  # type: ignore[index]


def _hits(usage: dict[Key, int]) -> int:
    """All decision-cache hits so far."""
    return sum(usage.values()) + _value(QUIET) - _value(MISSES) - _value(UNCACHED)


@dataclass(frozen=True)
class UsageStats:
    """A snapshot of the counters."""

    calls: Mapping[Key, int] = field(default_factory=dict)
    cache_hits: int = 0
    cache_misses: int = 0

    def served(self, family: str, row: str | None = None, origin: str | None = None) -> int:
        """Calls of ``family`` served (by ``row`` / via ``origin``, if given)."""
        return sum(n for (f, r, o), n in self.calls.items()
                   if f == family and row in (None, r) and origin in (None, o))

    def by_row(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{family: {row: {origin: calls}}}``."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for (f, r, o), n in sorted(self.calls.items()):
            out.setdefault(f, {}).setdefault(r, {})[o] = n
        return out

    def table(self) -> str:
        """A printable family x row x origin table, with the decision-cache counts."""
        lines = [f"{'family':<12} {'row':<16} {'calls':>8}  origin"]
        for (f, r, o), n in sorted(self.calls.items()):
            lines.append(f"{f:<12} {r:<16} {n:>8}  {o}")
        if len(lines) == 1:
            lines.append("(no calls)")
        lines.append(f"decision cache: {self.cache_hits} hits, {self.cache_misses} misses")
        return "\n".join(lines)


def stats(reset: bool = False) -> UsageStats:
    """The counters now; with ``reset=True`` they start again from zero.

    While calls are in flight in other threads the hit count may be off by the
    number of those calls; it is exact once they return.
    """
    totals = {key: _value(c) for key, c in list(_counters.items())}
    calls = {key: n - _baseline.get(key, 0) for key, n in totals.items()}
    snap = UsageStats({k: n for k, n in calls.items() if n},
                      _hits(totals) - _baseline.get("hits", 0),
                      _value(MISSES) - _baseline.get("misses", 0))
    if reset:
        reset_stats()
    return snap


def reset_stats() -> None:
    """Zero every counter."""
    totals: dict[Key, int] = {key: _value(c) for key, c in list(_counters.items())}
    base: dict[object, int] = {key: n for key, n in totals.items()}
    base["hits"] = _hits(totals)
    base["misses"] = _value(MISSES)
    _baseline.clear()
    _baseline.update(base)
