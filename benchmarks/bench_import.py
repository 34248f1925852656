"""Import of astrai + loading every shipped table, beyond ``import torch`` (contract §11).

Each measurement runs in a fresh interpreter, which imports torch first (untimed for
the astrai figure), then times ``import astrai``, ``astrai.dispatch`` and ``astrai.ops``
and the first ``current()``, which loads every shipped table. Medians over repeats.
Target: <= 50 ms beyond ``import torch``.

As installed: pip compiles a package's modules to bytecode when it installs them, so
one untimed process first imports everything with bytecode writing allowed (this
machine sets ``PYTHONDONTWRITEBYTECODE=1``, which would otherwise time the compiler on
every import of a checkout). The figure without that warm-up is printed too.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile

TARGET_MS = 50.0
TORCH = "import time; t=time.perf_counter(); import torch; print(time.perf_counter()-t)"
ASTRAI = ("import time; import torch; t=time.perf_counter(); import astrai; "
          "import astrai.dispatch as d; import astrai.ops; d.current(); "
          "print(time.perf_counter()-t)")


def run_ms(code: str, env: dict[str, str] | None = None) -> float:
    """Seconds printed by ``code`` in a fresh interpreter, in milliseconds."""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, env=env)
    return float(out.stdout.strip().splitlines()[-1]) * 1000


def main() -> None:
    no_cache = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONPYCACHEPREFIX=tempfile.mkdtemp())
    cold = statistics.median(run_ms(ASTRAI, no_cache) for _ in range(3))
    writes = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    run_ms(ASTRAI, writes)  # the warm-up: bytecode written, as pip does at install time
    torch_ms = [run_ms(TORCH) for _ in range(5)]
    extra_ms = sorted(run_ms(ASTRAI) for _ in range(9))
    extra = statistics.median(extra_ms)
    print(f"import torch: {statistics.median(torch_ms):.0f} ms (median of 5 fresh processes)")
    print(f"import astrai + load all shipped tables beyond import torch: {extra:.1f} ms "
          f"(median of 9 fresh processes; min {extra_ms[0]:.1f}, max {extra_ms[-1]:.1f})  "
          f"target <= {TARGET_MS:.0f} ms  {'PASS' if extra <= TARGET_MS else 'FAIL'}")
    print(f"the same with no bytecode at all (every module compiled on import, as from a "
          f"fresh checkout): {cold:.1f} ms (median of 3)")


if __name__ == "__main__":
    main()
