"""Usage counters: how many calls each row served, per family and origin.

Counting is one ``next()`` on an ``itertools.count`` (atomic in CPython), so the
hot path takes no lock; the decision cache keeps a reference to the counter of
each decision so a cached call does not even look it up. The counters live in
``state``; they are never replaced: ``reset`` records a baseline that later reads
subtract. This is how a
user notices a silent fallback: ``stats().served("attention", "math")``.

A row chosen for a call may hand it back to torch (a tensor subclass such as a
``DTensor``, autograd recording, a kernel that declines): ``count_handoff`` counts it in
``stats().handed`` beside the row's count, and ``computed`` / ``families()`` /
``table()`` keep the calls astrai's rows computed apart from those handed back.
``mark()`` and ``since(mark)`` count from a moment whatever resets happen meanwhile (a
``dispatch_model`` report's ``calls()``); ``unobserved()`` runs astrai's own probing
calls without a trace in the counts or in a recording.
"""

from __future__ import annotations

__all__ = ["MISSES", "MODEL_OWN", "QUIET", "UNCACHED", "UNOBSERVED", "FamilyCalls", "Mark",
           "UsageStats", "count_handoff", "count_model_own", "counter", "mark",
           "reset_stats", "since", "stats", "unobserved"]

import itertools
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

from astrai.dispatch import state as process
from astrai.dispatch.state import MISSES, QUIET, UNCACHED

Key = tuple[str, str, str]  # family, row, origin
Why = tuple[str, str, str, str]  # family, row, what computed them, why


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


def count_handoff(family: str, row: str, to: str, why: str = "") -> None:
    """Count one call of ``family`` that ``row`` was chosen for but handed to ``to`` (what
    computed it instead: a native row's kernel declining hands a call to torch's
    operations), and ``why`` where the row says (``a DTensor``, ``autograd recording``);
    ``stats().handed`` shows them beside the calls the row served, ``stats().reasons``
    by reason."""
    key = (family, row, to)
    c = process.handoffs.get(key)
    if c is None:
        c = process.handoffs.setdefault(key, itertools.count())
    next(c)
    if why:
        wkey = (family, row, to, why)
        w = process.handoff_reasons.get(wkey)
        if w is None:
            w = process.handoff_reasons.setdefault(wkey, itertools.count())
        next(w)


def _since_reset(c: itertools.count[int], key: object) -> int:
    return process.count(c) - process.baseline.get(key, 0)


@dataclass(frozen=True)
class FamilyCalls:
    """One family's calls, split by what computed them."""

    family: str
    #: Calls astrai's rows computed.
    rows: int = 0
    #: ``(row, what computed them, why) -> calls`` the row was chosen for and handed
    #: back to torch (``why`` empty where the row did not say).
    handed: Mapping[tuple[str, str, str], int] = field(default_factory=dict)
    #: Calls a routed model ran with its own code (no row chosen: ``MODEL_OWN``).
    model: int = 0

    @property
    def handed_total(self) -> int:
        """Every call handed back to torch."""
        return sum(self.handed.values())

    @property
    def total(self) -> int:
        """Every call of the family."""
        return self.rows + self.handed_total + self.model

    def describe(self) -> str:
        """The split in words: ``1 computed by astrai's rows, 14 handed to torch (14 to
        F.linear by row transposed: a DTensor)``."""
        parts = [f"{self.rows} computed by astrai's rows"]
        if self.handed:
            how = "; ".join(f"{n} to {to} by row {row}" + (f": {why}" if why else "")
                            for (row, to, why), n in sorted(self.handed.items()))
            parts.append(f"{self.handed_total} handed to torch ({how})")
        if self.model:
            parts.append(f"{self.model} run by the model's own code")
        return ", ".join(parts)


@dataclass(frozen=True)
class UsageStats:
    """A snapshot of the counters."""

    calls: Mapping[Key, int] = field(default_factory=dict)
    cache_hits: int = 0
    cache_misses: int = 0
    #: (family, row, what computed them) -> calls the row was chosen for and served by
    #: handing them on (they are counted in ``calls`` under the row as well)
    handed: Mapping[Key, int] = field(default_factory=dict)
    #: (family, row, what computed them, why) -> those of ``handed`` whose row said why
    reasons: Mapping[Why, int] = field(default_factory=dict)

    def handed_off(self, family: str, row: str | None = None) -> int:
        """Calls of ``family`` that a row (``row``, if given) handed to another
        computation."""
        return sum(n for (f, r, _), n in self.handed.items()
                   if f == family and row in (None, r))

    def served(self, family: str, row: str | None = None, origin: str | None = None) -> int:
        """Calls of ``family`` served (by ``row`` / via ``origin``, if given)."""
        return sum(n for (f, r, o), n in self.calls.items()
                   if f == family and row in (None, r) and origin in (None, o))

    def computed(self, family: str, row: str | None = None) -> int:
        """Calls of ``family`` that astrai's rows (``row``, if given) computed themselves:
        those served by a row less those it handed back to torch (``handed_off``)."""
        got = sum(n for (f, r, o), n in self.calls.items()
                  if f == family and row in (None, r) and o != MODEL_OWN)
        return max(0, got - self.handed_off(family, row))  # a row called directly hands
        # off calls no facade counted

    def families(self) -> dict[str, FamilyCalls]:
        """Every family called, its calls split: computed by astrai's rows, handed back
        to torch (per row, what computed them and why), run by a model's own code."""
        names = sorted({f for f, _, _ in self.calls} | {f for f, _, _ in self.handed})
        return {f: self._split(f) for f in names}

    def _split(self, family: str) -> FamilyCalls:
        handed: dict[tuple[str, str, str], int] = {}
        for (f, r, to), n in self.handed.items():
            if f != family:
                continue
            said = 0
            for (f2, r2, to2, why), m in self.reasons.items():
                if (f2, r2, to2) == (f, r, to):
                    handed[(r, to, why)] = m
                    said += m
            if n > said:
                handed[(r, to, "")] = n - said
        return FamilyCalls(family, self.computed(family), handed,
                           self.served(family, origin=MODEL_OWN))

    def by_row(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{family: {row: {origin: calls}}}``."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for (f, r, o), n in sorted(self.calls.items()):
            out.setdefault(f, {}).setdefault(r, {})[o] = n
        return out

    def table(self) -> str:
        """A printable family x row x origin table (the calls each row was chosen for),
        the calls of them handed back to torch and why, for each family with such calls
        the split of its calls (``families()``), and the decision-cache counts."""
        split = self.families()
        fw = max([12, *(len(f) for f in split)])
        rw = max([16, *(len(r) for _, r, _ in self.calls), *(len(r) for _, r, _ in self.handed)])
        lines = [f"{'family':<{fw}} {'row':<{rw}} {'calls':>8}  origin"]
        for (f, r, o), n in sorted(self.calls.items()):
            lines.append(f"{f:<{fw}} {r:<{rw}} {n:>8}  {o}")
        if len(lines) == 1:
            lines.append("(no calls)")
        for f, calls in split.items():
            for (r, to, why), n in sorted(calls.handed.items()):
                lines.append(f"{f:<{fw}} {r:<{rw}} {n:>8}  of them handed to {to}"
                             + (f": {why}" if why else ""))
        for f, calls in split.items():
            if calls.handed or calls.model:
                lines.append(f"{f}: {calls.describe()}")
        lines.append(f"decision cache: {self.cache_hits} hits, {self.cache_misses} misses")
        return "\n".join(lines)


def _read(value: Callable[[itertools.count[int], object], int]) -> UsageStats:
    """The counters as ``value(counter, its baseline key)`` reads them."""
    calls = {key: value(c, key) for key, c in list(process.counters.items())}
    misses = value(MISSES, "misses")
    # Every served call bumped a usage counter and ``QUIET`` counts the lookups that
    # served none; of all those lookups, the ones that missed or were uncacheable were
    # not hits.
    hits = (sum(calls.values()) + value(QUIET, "quiet") - misses
            - value(UNCACHED, "uncached"))
    handed = {key: value(c, ("handoff", *key)) for key, c in list(process.handoffs.items())}
    reasons = {key: value(c, ("why", *key))
               for key, c in list(process.handoff_reasons.items())}
    return UsageStats({k: n for k, n in calls.items() if n}, hits, misses,
                      {k: n for k, n in handed.items() if n},
                      {k: n for k, n in reasons.items() if n})


def stats(reset: bool = False) -> UsageStats:
    """The counters now; with ``reset=True`` they start again from zero.

    While calls are in flight in other threads the hit count may be off by the
    number of those calls; it is exact once they return.
    """
    snap = _read(_since_reset)
    if reset:
        reset_stats()
    return snap


def _raw(c: itertools.count[int], key: object) -> int:
    """A counter's count since the process started, less what ``unobserved`` kept out."""
    return process.count(c) - process.uncounted.get(key, 0)


@dataclass(frozen=True)
class Mark:
    """The counters at one moment (``mark()``), whatever ``reset_stats`` did before."""

    counts: Mapping[object, int] = field(default_factory=dict)


def mark() -> Mark:
    """The counters now, for ``since``: a ``dispatch_model`` report keeps one."""
    return Mark({key: _raw(c, key) for key, c in process.every_counter().items()})


def since(then: Mark) -> UsageStats:
    """The calls counted since ``then`` (``mark()``), as ``stats()`` gives them; resets
    made meanwhile change nothing."""
    return _read(lambda c, key: _raw(c, key) - then.counts.get(key, 0))


#: ``True`` inside ``unobserved()``: the facade calls of this context are not recorded.
UNOBSERVED: ContextVar[bool] = ContextVar("astrai_unobserved", default=False)


@contextmanager
def unobserved() -> Iterator[None]:
    """Run astrai's own probing calls (``dispatch_model``'s recognition) without a trace:
    the counts they make are taken back out of ``stats()`` and ``since`` when the block
    ends, and no recording (``record()``, ``ASTR_RECORD``) gets the calls of this context.
    The counters are process-wide: calls other threads make during the block are kept
    out of the counts too (never of their recordings)."""
    token = UNOBSERVED.set(True)
    before = {key: process.count(c) for key, c in process.every_counter().items()}
    try:
        yield
    finally:
        UNOBSERVED.reset(token)
        for key, c in process.every_counter().items():
            made = process.count(c) - before.get(key, 0)
            if made:
                process.baseline[key] = process.baseline.get(key, 0) + made
                process.uncounted[key] = process.uncounted.get(key, 0) + made


def reset_stats() -> None:
    """Zero every counter."""
    process.reset_counts()
