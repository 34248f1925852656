"""Import of astrai + loading every shipped table, beyond ``import torch`` (SPEC §11, issue 12).

Each measurement runs in a fresh interpreter, which imports torch first (untimed for
the astrai figure), then times ``import astrai``, ``astrai.dispatch`` and ``astrai.ops``
and the first ``current()``, which loads every shipped table. Medians over repeats.
Target: <= 50 ms beyond ``import torch``.
"""

from __future__ import annotations

import statistics
import subprocess
import sys

TARGET_MS = 50.0
TORCH = "import time; t=time.perf_counter(); import torch; print(time.perf_counter()-t)"
ASTRAI = ("import time; import torch; t=time.perf_counter(); import astrai; "
          "import astrai.dispatch as d; import astrai.ops; d.current(); "
          "print(time.perf_counter()-t)")


def run_ms(code: str) -> float:
    """Seconds printed by ``code`` in a fresh interpreter, in milliseconds."""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True)
    return float(out.stdout.strip().splitlines()[-1]) * 1000


def main() -> None:
    torch_ms = [run_ms(TORCH) for _ in range(5)]
    extra_ms = sorted(run_ms(ASTRAI) for _ in range(9))
    extra = statistics.median(extra_ms)
    print(f"import torch: {statistics.median(torch_ms):.0f} ms (median of 5 fresh processes)")
    print(f"import astrai + load all shipped tables beyond import torch: {extra:.1f} ms "
          f"(median of 9 fresh processes; min {extra_ms[0]:.1f}, max {extra_ms[-1]:.1f})  "
          f"target <= {TARGET_MS:.0f} ms  {'PASS' if extra <= TARGET_MS else 'FAIL'}")


if __name__ == "__main__":
    main()
