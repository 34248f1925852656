"""Usage counters: how many calls each row served, per family and origin.

Counting is one dict lookup and one ``next()`` on an ``itertools.count`` (atomic
in CPython), so the hot path takes no lock. This is how a user notices a silent
fallback: ``stats().served("attention", "math")``.
"""

from __future__ import annotations

__all__ = ["UsageStats", "count", "reset_stats", "stats"]

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

Key = tuple[str, str, str]  # family, row, origin

_counters: dict[Key, itertools.count[int]] = {}
_cache_counts: dict[str, itertools.count[int]] = {"hits": itertools.count(), "misses": itertools.count()}


def count(family: str, row: str, origin: str) -> None:
    """Count one call of ``family`` served by ``row`` (decided by ``origin``)."""
    key = (family, row, origin)
    c = _counters.get(key)
    if c is None:
        c = _counters.setdefault(key, itertools.count())
    next(c)


def count_cache(hit: bool) -> None:
    """Count one decision-cache lookup."""
    next(_cache_counts["hits" if hit else "misses"])


def _value(c: itertools.count[int]) -> int:
    return int(c.__reduce__()[1][0])  # type: ignore[index]


@dataclass(frozen=True)
class UsageStats:
    """A snapshot of the counters."""

    calls: Mapping[Key, int] = field(default_factory=dict)
    cache_hits: int = 0
    cache_misses: int = 0

    def served(self, family: str, row: str | None = None) -> int:
        """Calls of ``family`` served (by ``row``, if given), whatever the origin."""
        return sum(n for (f, r, _), n in self.calls.items()
                   if f == family and (row is None or r == row))

    def by_row(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{family: {row: {origin: calls}}}``."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for (f, r, o), n in sorted(self.calls.items()):
            out.setdefault(f, {}).setdefault(r, {})[o] = n
        return out

    def table(self) -> str:
        """A printable family x row x origin table."""
        lines = [f"{'family':<12} {'row':<16} {'calls':>8}  origin"]
        for (f, r, o), n in sorted(self.calls.items()):
            lines.append(f"{f:<12} {r:<16} {n:>8}  {o}")
        if len(lines) == 1:
            lines.append("(no calls)")
        return "\n".join(lines)


def stats(reset: bool = False) -> UsageStats:
    """The counters now; with ``reset=True`` they start again from zero."""
    snap = UsageStats(
        {k: _value(c) for k, c in list(_counters.items()) if _value(c)},
        _value(_cache_counts["hits"]),
        _value(_cache_counts["misses"]),
    )
    if reset:
        reset_stats()
    return snap


def reset_stats() -> None:
    """Zero every counter."""
    _counters.clear()
    _cache_counts["hits"] = itertools.count()
    _cache_counts["misses"] = itertools.count()
