"""From measured rows to a profile: the second half of ``astrai-ops tune``.

Per family, the tuned calls are grouped into **classes** by the axes that are not sizes
(dtype, fwd, grad mode, ...: every axis with a non-integer value in some call), and
within a class split into **buckets** along one size axis (q_len, kv_len, tokens, ...:
the one whose split costs least) with boundaries where the winner changes. The split is
a segmentation that minimises the workload's total time (each call's time weighted by its
count) plus a small price per extra bucket, so one noisy call does not cut a bucket in
two. On each call the row the figures support counts as the fastest
(``CallTiming.winner``: another row replaces the shipped order's choice only when it is
faster beyond the noise, ``astrai.tune.statistics``), so the tuned order leaves the
shipped choice alone unless another row is measurably faster.

The profile expresses the buckets with the overlay keys a profile has: ``order`` puts the
bucket winners first (the rows that win most calls first), ``chain_when`` narrows where
the implicit chain tries a winner that comes before another winner, so that it leaves
that winner's buckets alone (``not (those buckets)``, and-ed with its own ``when``;
selecting the row by name still reaches every call its ``when`` accepts), and
``enable`` lets an explicit-only (or, with ``--allow-nonfaithful``, non-faithful)
winner into the implicit chain. Rows that win nowhere keep their shipped order, after
the winners.
"""

from __future__ import annotations

__all__ = ["Bucket", "buckets_of", "profile_document", "profile_text", "verify",
           "write_profile"]

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from astrai.dispatch.axes import AXES, format_value
from astrai.dispatch.registry import Registry, current
from astrai.dispatch.resolution import evaluate
from astrai.dispatch.scopes import use_profile
from astrai.dispatch.tables.format import schemas_dir
from astrai.errors import AstraiError
from astrai.formats.common import atomic_write
from astrai.tune.measure import CallTiming, Timing

PRICE = 0.05  # an extra bucket must save 5% of the class's time


class TuneError(AstraiError, RuntimeError):
    """A tuned profile does not give each recorded call its measured winner."""


@dataclass(frozen=True)
class Bucket:
    """A family's calls that one row serves: its condition, its winner, and the calls."""

    family: str
    condition: str
    winner: str
    calls: tuple[CallTiming, ...]

    def table(self) -> dict[str, Timing]:
        """Row -> ``Timing`` over the bucket (the rows timed on every call of it): each
        figure the mean of the calls' own, weighted by their counts - the same weights
        the buckets were chosen by - and likewise its interval and spread."""
        rows = [r for r in self.calls[0].timings if all(r in c.timings for c in self.calls)]
        weights = [c.call.count for c in self.calls]
        total = sum(weights)

        def mean(row: str, pick: Callable[[Timing], float]) -> float:
            return sum(w * pick(c.timings[row]) for w, c in zip(weights, self.calls,
                                                               strict=True)) / total

        return {r: Timing(mean(r, lambda t: t.median_us), mean(r, lambda t: t.spread_us),
                          mean(r, lambda t: t.interval.low), mean(r, lambda t: t.interval.high),
                          min(c.timings[r].samples for c in self.calls))
                for r in rows}

    @property
    def verdicts(self) -> tuple[str, ...]:
        """Why its calls have the winners they have (``statistics.Verdict``), each once,
        ``unclear`` written as ``cannot tell``."""
        words = {"unclear": "cannot tell", "busy": "cannot tell (busy)"}
        said = dict.fromkeys(c.decision()[1] for c in self.calls)
        return tuple(words.get(v, v) for v in said)


def _costs(timing: CallTiming) -> dict[str, float]:
    """Row -> the call's time (weighted by its count), the row the figures support
    evened to just under the fastest (a shipped row that no row beats beyond the noise
    keeps the call). A call timed while other processes competed for the CPU keeps its
    shipped row outright: every other row costs it without bound, so no bucket that
    would give it another row on such figures is ever cheaper."""
    t = {r: v.median_us for r, v in timing.timings.items()}
    winner = timing.winner
    if winner is not None:
        t[winner] = min(t.values()) * (1 - 1e-9)
        if timing.busy:
            t = {r: v if r == winner else math.inf for r, v in t.items()}
    return {r: v * timing.call.count for r, v in t.items()}


def _is_size(values: set[Any]) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def _one_row(costs: list[dict[str, float]]) -> tuple[str, float]:
    """The cheapest row timed on every one of ``costs``' calls, with its cost; the cost is
    ``math.inf`` where no row serves them all (none timed on all, or a call keeps
    another row), and the row then the first call's own."""
    rows = sorted(set.intersection(*(set(c) for c in costs)))
    if rows:
        row = min(rows, key=lambda r: sum(c[r] for c in costs))
        return row, sum(c[row] for c in costs)
    return min(costs[0], key=costs[0].__getitem__), math.inf


def _segment(groups: list[tuple[int, list[dict[str, float]]]], price: float
             ) -> list[tuple[int, int, str, float]]:
    """Cut the value-sorted groups into runs minimising time + ``price`` per run:
    ``[(first, last, row, cost)]``."""
    n = len(groups)
    best: list[float] = [0.0] + [math.inf] * n
    how: list[tuple[int, str, float]] = [(0, "", 0.0)] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):
            costs = [c for _, cs in groups[i:j] for c in cs]
            row, cost = _one_row(costs)
            if math.isinf(cost):  # no row timed on every call, or one keeps another row
                continue
            if best[i] + cost + price < best[j]:
                best[j], how[j] = best[i] + cost + price, (i, row, cost)
    if math.isinf(best[n]):  # no row serves every call of some value: one run per value
        return [(k, k, *_one_row(cs)) for k, (_, cs) in enumerate(groups)]
    runs, j = [], n
    while j > 0:
        i, row, cost = how[j]
        runs.append((i, j - 1, row, cost))
        j = i
    return runs[::-1]


def _class_buckets(family: str, prefix: list[str], timings: list[CallTiming],
                   costs: list[dict[str, float]]) -> list[Bucket]:
    """The buckets of one class: split along the size axis that costs least."""
    sizes = [a for a in AXES if len({t.call.axes.get(a) for t in timings}) > 1
             and _is_size({t.call.axes.get(a) for t in timings})]
    extra = sorted({k for t in timings for k in t.call.axes if k not in AXES})
    sizes += [a for a in extra if len({t.call.axes.get(a) for t in timings}) > 1
              and _is_size({t.call.axes.get(a) for t in timings})]
    price = PRICE * sum(min(c.values()) for c in costs)  # a run's price, on every axis
    plans: list[tuple[float, str, list[tuple[int, int, str, float]], list[int]]] = []
    for axis in sizes or [""]:
        values: list[int] = sorted({t.call.axes[axis] for t in timings}) if axis else [0]
        groups = [(v, [c for t, c in zip(timings, costs, strict=True)
                       if not axis or t.call.axes[axis] == v]) for v in values]
        runs = _segment(groups, price)
        plans.append((sum(r[3] for r in runs) + price * len(runs), axis, runs, values))
    _, axis, runs, values = min(plans, key=lambda p: p[0])
    out = []
    for first, last, row, _ in runs:
        cond = list(prefix)
        lo = (values[first - 1] + values[first]) // 2 + 1 if axis and first > 0 else None
        hi = (values[last] + values[last + 1]) // 2 if axis and last < len(values) - 1 else None
        if lo is not None and lo == hi:
            cond.append(f"{axis} == {lo}")
        else:
            cond += [*([f"{axis} >= {lo}"] if lo is not None else []),
                     *([f"{axis} <= {hi}"] if hi is not None else [])]
        members = tuple(t for t in timings
                        if not axis or values[first] <= t.call.axes[axis] <= values[last])
        out.append(Bucket(family, " and ".join(cond) or "always", row, members))
    return out


def buckets_of(timings: Sequence[CallTiming], state: Registry | None = None) -> list[Bucket]:
    """The buckets of every family's tuned calls (module docstring)."""
    state = state or current()
    by_family: dict[str, list[CallTiming]] = {}
    for t in timings:
        if t.timings:
            by_family.setdefault(t.call.family, []).append(t)
    out: list[Bucket] = []
    for family, calls in by_family.items():
        names = list(dict.fromkeys(k for t in calls for k in t.call.axes))
        discrete = [a for a in names if len({t.call.axes.get(a) for t in calls}) > 1
                    and not _is_size({t.call.axes.get(a) for t in calls})]
        classes: dict[tuple[Any, ...], list[CallTiming]] = {}
        for t in calls:
            classes.setdefault(tuple(t.call.axes.get(a) for a in discrete), []).append(t)
        for key, members in classes.items():
            prefix = [f"{a} == {format_value(v)}" for a, v in zip(discrete, key, strict=True)]
            costs = [_costs(t) for t in members]
            out += _class_buckets(family, prefix, members, costs)
    return out


def _overlay(state: Registry, family: str, buckets: list[Bucket]) -> dict[str, Any]:
    """The family's overlay: ``order``, ``chain_when`` (narrowed winners), ``enable``."""
    won: dict[str, float] = {}
    for b in buckets:
        won[b.winner] = won.get(b.winner, 0) + sum(t.call.count for t in b.calls)
    view = state.view(family, ())
    position = {n: i for i, n in enumerate(view.row_names())}
    order = sorted(won, key=lambda r: (-won[r], position[r]))
    overlay: dict[str, Any] = {"order": order}
    when: dict[str, str] = {}
    for i, row in enumerate(order):
        rec = view.row(row)
        assert rec is not None
        later = [b for b in buckets if b.winner in order[i + 1:]
                 and any(row in t.timings or row in t.excluded for t in b.calls)]
        if later:
            when[row] = f"not ({' or '.join(f'({b.condition})' for b in later)})"
    if when:
        overlay["chain_when"] = when
    enable = [r for r in order if not (rec := view.row(r)) or not rec.implicit]
    if enable:
        overlay["enable"] = enable
    return overlay


def profile_document(name: str, buckets: Sequence[Bucket], provenance: Mapping[str, Any],
                     state: Registry | None = None, description: str = "") -> dict[str, Any]:
    """The profile file's content (``ProfileFile``'s form) for ``buckets``."""
    state = state or current()
    families: dict[str, Any] = {}
    for family in dict.fromkeys(b.family for b in buckets):
        families[family] = _overlay(state, family, [b for b in buckets if b.family == family])
    measured = [{"family": b.family, "bucket": b.condition, "row": row,
                 "median_us": round(t.median_us, 2), "spread_us": round(t.spread_us, 2),
                 "interval_us": [round(t.low_us, 2), round(t.high_us, 2)],
                 "samples": t.samples, "winner": row == b.winner,
                 **({"verdict": ", ".join(b.verdicts)} if row == b.winner else {})}
                for b in buckets for row, t in b.table().items()]
    return {"version": 1, "profile": name,
            "description": description or "measured by astrai-ops tune: per shape bucket, "
                                          "the row that agreed with the reference and that "
                                          "the figures support (the shipped row unless "
                                          "another is faster beyond the noise)",
            "families": families, "provenance": {**provenance, "measured": measured}}


def verify(name: str, buckets: Sequence[Bucket]) -> list[str]:
    """With profile ``name`` (already loaded) active, each tuned call's row; raises
    ``TuneError`` listing every call that does not resolve to its bucket's winner."""
    wrong = []
    with use_profile(name):
        for b in buckets:
            for t in b.calls:
                got = evaluate(b.family, t.call.context()).name
                if got != b.winner:
                    wrong.append(f"{b.family} call {dict(t.call.axes)} resolves to {got}, "
                                 f"measured winner {b.winner} (bucket {b.condition})")
    if wrong:
        raise TuneError(f"the tuned profile {name!r} does not give {len(wrong)} recorded "
                        f"calls their measured winner:\n  " + "\n  ".join(wrong))
    return [b.winner for b in buckets]


def profile_text(path: Path, doc: dict[str, Any]) -> str:
    """A profile document as the file's text: a head of comments (the families, how to
    activate it, the schema for editors), then the YAML."""
    text = yaml.safe_dump(doc, sort_keys=False, width=100)
    head = (f"# astrai tuned profile: {sum(1 for _ in doc['families'])} families\n"
            f"# activate: ASTR_TABLES={path} ASTR_OPS=profile={doc['profile']}\n"
            f"# yaml-language-server: $schema={schemas_dir() / 'profile.schema.json'}\n")
    return head + text


def write_profile(path: Path, doc: dict[str, Any]) -> None:
    """Write a profile document as YAML, with a schema line for editors."""
    atomic_write(path, profile_text(path, doc))  # ranks sharing a directory read it whole
