"""Saving and loading a large workload: time and peak memory, beside their targets.

Builds a workload of ``--calls`` distinct recorded calls (rms_norm and linear calls of
distinct sizes, as a long recording makes), saves it, loads it back, and checks the
round trip. Each step runs in a fresh process so its peak resident memory is its own
(``resource.getrusage``), measured above that process's baseline after the imports.

Targets for 20 000 calls: save <= 5 s, load <= 5 s, peak <= 500 MiB each.

Usage: ``python benchmarks/bench_workload_io.py [--calls N]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

TARGET_S, TARGET_MIB = 5.0, 500.0

STEP = r"""
import json, resource, sys, time
import astrai.dispatch  # the imports are the baseline, not the step
from astrai.record.workload import RecordedCall, TensorArg, Workload

def rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

step, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
base = rss_mib()
t0 = time.perf_counter()
if step == "save":
    calls = []
    for i in range(n):
        family = "rms_norm" if i % 2 else "linear"
        axes = {"fwd": None, "dtype": "float32", "device_cuda": False, "ndim": 2,
                "grad_enabled": False, "device": "cpu", "tokens": i + 1}
        args = (TensorArg((i + 1, 64), "float32", "cpu"), TensorArg((64,), "float32", "cpu"))
        calls.append(RecordedCall(family, axes, args, {}, 1 + i % 3))
    Workload.of(calls).save(path)
else:
    got = Workload.load(path)
    assert len(got.calls) == n and got.calls[-1].axes["tokens"] == n
elapsed = time.perf_counter() - t0
print(json.dumps({"s": elapsed, "mib": rss_mib() - base}))
"""


def run(step: str, path: Path, n: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", STEP, step, str(path), str(n)],
                         capture_output=True, text=True, check=True)
    got: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return got


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20_000)
    args = parser.parse_args(argv)
    path = Path(tempfile.mkdtemp()) / "big.yaml"
    ok = True
    for step in ("save", "load"):
        got = run(step, path, args.calls)
        passed = got["s"] <= TARGET_S and got["mib"] <= TARGET_MIB
        ok &= passed
        print(f"{step} {args.calls} calls: {got['s']:.2f} s (target <= {TARGET_S:g} s), "
              f"peak +{got['mib']:.0f} MiB (target <= {TARGET_MIB:g} MiB)  "
              f"{'PASS' if passed else 'FAIL'}")
    print(f"file: {path.stat().st_size / 2**20:.1f} MiB")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
