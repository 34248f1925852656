"""Usage counters: how many calls each row served, per family and origin.

Counting is one ``next()`` on an ``itertools.count`` (atomic in CPython), so the
hot path takes no lock; the decision cache keeps a reference to the counter of
each decision so a cached call does not even look it up. The counters live in
``state``; they are never replaced: ``reset`` records a baseline that later reads
subtract. This is how a
user notices a silent fallback: ``stats().served("attention", "math")``.
"""

from __future__ import annotations

__all__ = ["MISSES", "MODEL_OWN", "QUIET", "UNCACHED", "UsageStats", "count_handoff",
           "count_model_own", "counter",
           "reset_stats", "stats"]

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

from astrai.dispatch import state as process
from astrai.dispatch.state import MISSES, QUIET, UNCACHED

Key = tuple[str, str, str]  # family, row, origin


def counter(family: str, row: str, origin: str) -> itertools.count[int]:
    """The counter of calls of ``family`` served by ``row`` via ``origin``."""
    key = (family, row, origin)
    c = process.counters.get(key)
    if c is None:
        c = process.counters.setdefault(key, itertools.count())
    return c


#: The row and origin under which a call astrai handed back to a model's own code is
#: counted (``count_model_own``): ``stats().served(family, origin=MODEL_OWN)``.
MODEL_OWN = "model"


def count_model_own(family: str) -> None:
    """Count one call of ``family`` that a routed model ran with its own code (no row
    served it): row ``model``, origin ``model``. It made no decision-cache lookup."""
    next(counter(family, MODEL_OWN, MODEL_OWN))
    next(UNCACHED)  # a served count without a lookup: not a hit


def count_handoff(family: str, row: str, to: str) -> None:
    """Count one call of ``family`` that ``row`` was chosen for but handed to ``to`` (what
    computed it instead: a native row's kernel declining hands a call to torch's
    operations); ``stats().handed`` shows them beside the calls the row served."""
    key = (family, row, to)
    c = process.handoffs.get(key)
    if c is None:
        c = process.handoffs.setdefault(key, itertools.count())
    next(c)


def _since_reset(c: itertools.count[int], key: object) -> int:
    return process.count(c) - process.baseline.get(key, 0)


@dataclass(frozen=True)
class UsageStats:
    """A snapshot of the counters."""

    calls: Mapping[Key, int] = field(default_factory=dict)
    cache_hits: int = 0
    cache_misses: int = 0
    #: (family, row, what computed them) -> calls the row was chosen for and served by
    #: handing them on (they are counted in ``calls`` under the row as well)
    handed: Mapping[Key, int] = field(default_factory=dict)

    def handed_off(self, family: str, row: str | None = None) -> int:
        """Calls of ``family`` that a row (``row``, if given) handed to another
        computation."""
        return sum(n for (f, r, _), n in self.handed.items()
                   if f == family and row in (None, r))

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
        for (f, r, to), n in sorted(self.handed.items()):
            lines.append(f"{f:<12} {r:<16} {n:>8}  of them handed to {to}")
        lines.append(f"decision cache: {self.cache_hits} hits, {self.cache_misses} misses")
        return "\n".join(lines)


def stats(reset: bool = False) -> UsageStats:
    """The counters now; with ``reset=True`` they start again from zero.

    While calls are in flight in other threads the hit count may be off by the
    number of those calls; it is exact once they return.
    """
    calls = {key: _since_reset(c, key) for key, c in list(process.counters.items())}
    misses = _since_reset(MISSES, "misses")
    # Every served call bumped a usage counter and ``QUIET`` counts the lookups that
    # served none; of all those lookups, the ones that missed or were uncacheable were
    # not hits.
    hits = (sum(calls.values()) + _since_reset(QUIET, "quiet") - misses
            - _since_reset(UNCACHED, "uncached"))
    handed = {key: _since_reset(c, ("handoff", *key))
              for key, c in list(process.handoffs.items())}
    snap = UsageStats({k: n for k, n in calls.items() if n}, hits, misses,
                      {k: n for k, n in handed.items() if n})
    if reset:
        reset_stats()
    return snap


def reset_stats() -> None:
    """Zero every counter."""
    process.reset_counts()
