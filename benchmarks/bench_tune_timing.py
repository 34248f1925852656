"""Does tune time what the kernel costs? Its median per (call, row) against timing that
row directly on the same inputs with ``torch.utils.benchmark``, quiet and loaded.

Steps: record the demo's calls; measure each as ``astrai-ops tune`` does
(``measure_call``), and right after, for every row tune timed on it, build the call's
inputs again (same seed) and time ``ops.call(family, *args, backend=row)`` under the
call's grad mode with ``torch.utils.benchmark.Timer`` at the same thread count: the
median of short blocks (as long as tune's samples), and ``blocked_autorange`` for
reference (its ~10 ms blocks include any waiting for the CPU, so under load it measures
the machine as much as the kernel). Report the ratios tune / direct. Then the same with
``--load`` processes spinning on the CPU (default: one per core) for the whole
measurement, tune and direct alike.

Target, quiet and loaded: tune's median ratio within 1.5x either way, and at least 90%
of the pairs within 1.5x - or, on a machine where two direct timings of the same pair
agree less often than that (printed as the floor), as often as they do, less 5 points.
Each run also prints what tune's noise reading said about the machine.

Usage: ``python benchmarks/bench_tune_timing.py [--rounds N] [--load N] [--blocks N]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils import benchmark

from astrai import ops
from astrai.demo import run_demo
from astrai.dispatch import record
from astrai.record.workload import Workload
from astrai.tune.measure import SAMPLE_S, Budget, CallTiming, measure_call
from astrai.tune.noise import NoiseMonitor
from astrai.tune.run import DEFAULT_BUDGET_S

TARGET = 1.5
SHARE = 0.9  # of the (call, row) pairs within TARGET, at least (unless the floor is lower)
BLOCK_S = SAMPLE_S  # the direct timing's short blocks: as long as tune's samples


@contextmanager
def spinning(n: int) -> Iterator[None]:
    """``n`` processes spinning on the CPU for the duration."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    time.sleep(0.5)
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def direct(timing: CallTiming, row: str, seed: int, blocks: int) -> tuple[float, float]:
    """``row`` on ``timing``'s call, timed by ``torch.utils.benchmark`` on inputs built
    again from the same seed (microseconds per call): the median of ``blocks`` blocks of
    about ``BLOCK_S`` each (robust to another process taking the core now and then, as
    tune's samples are), and ``blocked_autorange``'s median (blocks of ~10 ms: each one
    includes any waiting for the CPU)."""
    call = timing.call
    args, kwargs = call.arguments(generator=torch.Generator().manual_seed(seed))
    with torch.set_grad_enabled(bool(call.axes.get("grad_enabled", True))):
        timer = benchmark.Timer(
            stmt="fn()", num_threads=torch.get_num_threads(),
            globals={"fn": lambda: ops.call(call.family, *args, backend=row, **kwargs)})
        once = timer.timeit(number=20).mean  # warm, and the size of a block
        number = max(1, int(BLOCK_S / max(once, 1e-9)))
        short = statistics.median(timer.timeit(number=number).mean for _ in range(blocks))
        auto = timer.blocked_autorange(min_run_time=0.05).median
    return float(short * 1e6), float(auto * 1e6)


def compare(workload: Workload, rounds: int, blocks: int
            ) -> tuple[list[float], list[float], list[float], str]:
    """Per (call, row): tune / direct, a second direct timing / the first (how far two
    direct timings of the same thing differ on this machine: the floor any agreement
    sits on), and tune / ``blocked_autorange``. Each call is timed directly right after
    tune measured it, so slow drifts of the machine fall on both alike."""
    monitor = NoiseMonitor()
    monitor.start()
    budget = Budget(DEFAULT_BUDGET_S)  # as astrai-ops tune gives the whole workload
    tune, floor, auto, widths = [], [], [], []
    for i, call in enumerate(workload.calls):
        timing = measure_call(call, rounds=rounds, seed=i, index=i, monitor=monitor,
                              budget=budget)
        for row, got in timing.timings.items():
            widths.append(got.interval.relative_width)
            first, blocked = direct(timing, row, i, blocks)
            second, _ = direct(timing, row, i, blocks)
            tune.append(got.median_us / first)
            floor.append(second / first)
            auto.append(got.median_us / blocked)
    noise = monitor.finish(widths)
    said = "quiet" if noise.quiet else "NOT quiet: " + "; ".join(noise.reasons())
    return tune, floor, auto, said


def _within(ratios: list[float]) -> float:
    return sum(1 / TARGET <= r <= TARGET for r in ratios) / len(ratios)


def _summary(ratios: list[float]) -> str:
    q = statistics.quantiles(ratios, n=10)
    return (f"median {statistics.median(ratios):.3f} (10%..90%: {q[0]:.2f}..{q[-1]:.2f}), "
            f"{_within(ratios):.0%} within {TARGET}x")


def report(label: str, tune: list[float], floor: list[float], auto: list[float],
           said: str) -> bool:
    """Print one run's figures; whether it met the target: tune's median ratio within
    ``TARGET`` and at least ``SHARE`` of its pairs within ``TARGET``, or as many as two
    direct timings of the same pair agree on this machine (less 5 points), if fewer."""
    share = min(SHARE, _within(floor) - 0.05)
    ok = 1 / TARGET <= statistics.median(tune) <= TARGET and _within(tune) >= share
    print(f"{label}: {len(tune)} (call, row) pairs")
    print(f"  tune / direct (torch.utils.benchmark, short blocks): {_summary(tune)}  "
          f"target: median within {TARGET}x and >= {share:.0%} of pairs within "
          f"{TARGET}x: {'PASS' if ok else 'FAIL'}")
    print(f"  direct / direct again (this machine's own floor): {_summary(floor)}")
    print(f"  tune / blocked_autorange (10 ms blocks, waiting included): {_summary(auto)}")
    print(f"  tune's reading of the machine: {said}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="tune's timing rounds")
    parser.add_argument("--load", type=int, default=os.cpu_count() or 1,
                        help="spinning processes for the loaded run (0: skip it)")
    parser.add_argument("--blocks", type=int, default=41,
                        help="short blocks per (call, row) for the direct timing")
    args = parser.parse_args(argv)
    with record() as rec:
        run_demo()
    workload = rec.workload()
    print(f"demo workload: {len(workload.calls)} distinct calls, "
          f"{torch.get_num_threads()} torch threads")
    ok = report("quiet", *compare(workload, args.rounds, args.blocks))
    if args.load:
        with spinning(args.load):
            ok &= report(f"loaded ({args.load} spinning processes)",
                         *compare(workload, args.rounds, args.blocks))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
