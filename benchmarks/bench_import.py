"""Import of astrai + loading every shipped table, beyond ``import torch`` (SPEC §11).

Each measurement runs in a fresh interpreter; medians over repeats.
Target: <= 100 ms beyond ``import torch``.
"""

from __future__ import annotations

import statistics
import subprocess
import sys

TORCH = "import time; t=time.perf_counter(); import torch; print(time.perf_counter()-t)"
ASTRAI = ("import time; import torch; t=time.perf_counter(); import astrai.dispatch as d; "
          "import astrai.ops; d.current(); print(time.perf_counter()-t)")


def run(code: str) -> float:
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    torch_s = [run(TORCH) for _ in range(5)]
    extra_s = [run(ASTRAI) for _ in range(7)]
    print(f"import torch: {statistics.median(torch_s) * 1000:.0f} ms (median of 5)")
    print(f"import astrai.dispatch + astrai.ops + load all shipped tables, after torch: "
          f"{statistics.median(extra_s) * 1000:.0f} ms (median of 7; target <= 100 ms)")


if __name__ == "__main__":
    main()
