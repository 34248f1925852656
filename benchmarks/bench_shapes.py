"""1 000 distinct prompt lengths through the attention facade: cache misses and the
cost of a decision, by how the tables key on ``q_len``.

Three attention tables, each served the same 1 000 prefill calls (q [1, L, 1, 8],
L = 1..1000, CPU) - the decision only (the attention facade's route: validate, key, look up,
count; no kernel runs), first pass (with its misses) and then steady state:

- ``shipped``   the shipped table: no row compares a shape axis, so none is read;
- ``cut points`` rows switch at ``q_len == 1`` and ``q_len >= 1024``: the key holds the
  interval of the length (three intervals), so at most three decisions;
- ``raw``       the same rule as a Python predicate (``Spec.of``): nothing tells the
  engine which lengths decide alike, so the raw length is keyed - what a naive
  ``q_len`` axis costs (one decision per length).

Prints misses, microseconds per call for each pass, and the steady-state ratios
against ``shipped``. Gate: ``cut points`` misses <= the table's intervals (3).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import astrai.dispatch as d
from astrai.backends.attention.math import math_attention
from astrai.backends.attention.sdpa import sdpa_attention
from astrai.dispatch.facade import FACADES

LENGTHS = range(1, 1001)
TABLE = """\
version: 1
family: attention
fallback: math
rows:
  - name: decode
    impl: astrai.backends.attention.sdpa:sdpa_attention
    when: q_len == 1
  - name: prefill
    impl: astrai.backends.attention.sdpa:sdpa_attention
    when: q_len < 1024
  - name: long
    impl: astrai.backends.attention.sdpa:sdpa_attention
    when: q_len >= 1024
  - name: math
    impl: astrai.backends.attention.math:math_attention
"""


def _raw_table() -> None:
    """The same rule, as Python predicates the engine cannot look into."""
    rows = [d.ImplRecord("attention", name, sdpa_attention, d.Spec.of(test, text), priority=i)
            for i, (name, test, text) in enumerate([
                ("decode", lambda c: c.q_len == 1, "q_len is 1"),
                ("prefill", lambda c: c.q_len < 1024, "q_len below 1024"),
                ("long", lambda c: c.q_len >= 1024, "q_len from 1024")])]
    rows.append(d.ImplRecord("attention", "math", math_attention, priority=9))
    d.register_family("attention", rows, fallback="math")


def _passes(calls: list[tuple[Any, ...]]) -> tuple[int, float, float]:
    """Misses, then µs per call of the first pass and the median of 5 later passes."""
    d.stats(reset=True)
    pick: Callable[..., Any] = FACADES["attention"].plain
    start = time.perf_counter()
    for args in calls:
        pick(None, args)
    first = (time.perf_counter() - start) / len(calls) * 1e6
    misses = d.stats().cache_misses
    later = []
    for _ in range(5):
        start = time.perf_counter()
        for args in calls:
            pick(None, args)
        later.append((time.perf_counter() - start) / len(calls) * 1e6)
    return misses, first, statistics.median(later)


def main() -> int:
    torch.set_num_threads(1)
    calls = []
    for n in LENGTHS:
        q = torch.randn(1, n, 1, 8)
        calls.append((q, q, q, None, 0, None, True, None, {}))
    results = {}
    with torch.no_grad():
        d.reload_tables()
        results["shipped"] = _passes(calls)
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "attention.yaml").write_text(TABLE)
            d.load_tables(tmp)
            results["cut points"] = _passes(calls)
        _raw_table()
        results["raw"] = _passes(calls)
        d.reload_tables()
    base = results["shipped"][2]
    print(f"{len(calls)} distinct q_len, decision only (validate, key, look up, count)")
    print(f"{'table':<12}{'misses':>8}{'first pass µs':>16}{'steady µs':>12}{'vs shipped':>12}")
    for name, (misses, first, steady) in results.items():
        print(f"{name:<12}{misses:>8}{first:>16.2f}{steady:>12.2f}{steady / base:>11.2f}x")
    ok = results["cut points"][0] <= 3
    print(f"gate: cut points misses {results['cut points'][0]} <= 3 intervals: "
          f"{'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
