"""The CPU linear rows against ``F.linear``, per instruction set: the figures behind the
machine conditions of ``tables/linear.yaml``.

For each token count, the five weight shapes of a Llama layer of hidden 512 (512->512,
512->256, 512->1408, 1408->512) and the head (512->4096) are multiplied by every CPU row,
each weight read from memory (a pool of copies larger than the caches, taken in turn), and
the medians of the calling thread's CPU time are summed over the shapes. One thread,
float32, ``torch.no_grad()``. Rows: ``F.linear`` (MKL's product with the weight as stored,
the model's own code), ``onednn`` (``torch.ops.mkldnn._linear_pointwise``), ``transposed``
(one product with a contiguous ``[in, out]`` copy of the weight) and ``native`` (astrai's
extension, 1 to 4 tokens, where it is loaded).

The machine is printed first (CPU model, vendor, the ISA torch's kernels run). With
``--emulate avx2`` the same run is repeated in a child process whose libraries are held to
AVX2 (``ATEN_CPU_CAPABILITY=avx2``, ``ONEDNN_MAX_CPU_ISA=AVX2``,
``MKL_ENABLE_INSTRUCTIONS=AVX2``), as on a CPU without AVX-512.

    python benchmarks/bench_linear_isa.py [--emulate avx2] [--tokens 1 4 16 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

SHAPES = ((512, 512), (512, 256), (512, 1408), (1408, 512), (512, 4096))
#: Bytes of weights each shape's pool holds: past the last-level cache of most machines.
POOL_BYTES = 96 << 20
EMULATE = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                    "MKL_ENABLE_INSTRUCTIONS": "AVX2"}}

def held_environment(isa: str) -> dict[str, str]:
    """The environment of a child process whose libraries are held to ``isa``: its machine
    axes read what the libraries then run (an ``ASTR_MACHINE`` statement is dropped), and
    inductor keeps its code in a cache of its own. Inductor's cache does not tell
    ``ATEN_CPU_CAPABILITY`` apart: code compiled in a process without it, loaded in one
    with it, was seen to compute garbage here (an RMS norm 1e37 off, a Llama's logits
    NaN, with torch 2.13)."""
    import tempfile

    env = {k: v for k, v in os.environ.items() if k != "ASTR_MACHINE"}
    env.update(EMULATE[isa])
    user = os.getuid() if hasattr(os, "getuid") else 0
    env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(),
                                                  f"torchinductor-held-{isa}-{user}")
    return env


def run_held(isa: str, script: str, args: list[str], *, ok: tuple[int, ...] = (0,)
             ) -> int | None:
    """``script`` again, with ``args``, in a child process with its libraries held to
    ``isa``, its output printed under a header; its exit status, or ``None`` where this
    machine's ISA is not above ``isa`` (skipped, saying so). An exit status not in ``ok``
    prints the end of the child's errors."""
    from astrai.dispatch.hardware import machine_facts

    here = machine_facts().cpu_isa
    print(f"\n==== the same bench, libraries held to {isa.upper()} ("
          + ", ".join(f"{k}={v}" for k, v in EMULATE[isa].items()) + ") ====")
    if here is None or not here > isa:
        print(f"skipped: this machine's ISA is {here or 'unknown'}, not above {isa} (there is "
              "nothing to hold back)")
        return None
    sys.stdout.flush()
    done = subprocess.run([sys.executable, os.path.abspath(script), *args],
                          capture_output=True, text=True, env=held_environment(isa),
                          check=False)
    print(done.stdout.rstrip())
    if done.returncode not in ok:
        print(f"the emulated run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return done.returncode


Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def machine_line() -> str:
    from astrai.dispatch.hardware import machine_facts
    from astrai.dispatch.machine import this_machine

    held = {k: v for k, v in os.environ.items() if k in EMULATE["avx2"]}
    return (f"{this_machine(gpu=False).cpu}; {machine_facts().describe()}; torch "
            f"{torch.__version__}" + (f"; libraries held by {held}" if held else ""))


def rows() -> dict[str, tuple[Kernel, int]]:
    """Row -> (its kernel taking x, the weight and its [in, out] copy; the most tokens)."""
    got: dict[str, tuple[Kernel, int]] = {
        "F.linear": (lambda x, w, t: F.linear(x, w), 1 << 30),
        "transposed": (lambda x, w, t: torch.mm(x, t), 1 << 30),
    }
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        got["onednn"] = (lambda x, w, t: torch.ops.mkldnn._linear_pointwise(
            x, w, None, "none", [], ""), 1 << 30)
    from astrai.backends.native import _kernels

    kernels = _kernels()
    if kernels is not None and kernels.linear_rows_vectorised():
        from astrai.backends.native import native_linear

        got["native"] = (lambda x, w, t: native_linear(x, w), 4)
    return got


def time_shape(n: int, k_in: int, k_out: int, kernels: dict[str, tuple[Kernel, int]],
               rounds: int) -> dict[str, float]:
    count = max(2, POOL_BYTES // (k_in * k_out * 4))
    weights = [torch.randn(k_out, k_in) * 0.05 for _ in range(count)]
    copies = [w.t().contiguous() for w in weights]
    x = torch.randn(n, k_in)
    names = [r for r, (_, most) in kernels.items() if n <= most]
    samples: dict[str, list[float]] = {r: [] for r in names}
    at = 0
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn = kernels[name][0]
            reps = 20
            start = time.thread_time()
            for _ in range(reps):
                fn(x, weights[at], copies[at])
                at = (at + 1) % count
            samples[name].append((time.thread_time() - start) / reps * 1e6)
    return {name: statistics.median(s) for name, s in samples.items()}


def run(tokens: list[int], rounds: int) -> None:
    torch.set_num_threads(1)
    print(machine_line())
    kernels = rows()
    print(f"{'tokens':>6}  " + "  ".join(f"{r:>12}" for r in kernels)
          + "   (us, the five shapes summed; ratio to F.linear)")
    with torch.no_grad():
        for n in tokens:
            total: dict[str, float] = {}
            for k_in, k_out in SHAPES:
                for name, us in time_shape(n, k_in, k_out, kernels, rounds).items():
                    total[name] = total.get(name, 0.0) + us
            base = total["F.linear"]
            print(f"{n:>6}  " + "  ".join(
                (f"{total[r]:>7.0f} {total[r] / base:4.2f}" if r in total else f"{'-':>12}")
                for r in kernels))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="*", default=[1, 2, 4, 8, 16, 64, 128, 512])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--emulate", choices=sorted(EMULATE), action="append", default=[])
    args = parser.parse_args()
    run(args.tokens, args.rounds)
    for isa in args.emulate:
        print()
        sys.stdout.flush()
        subprocess.run([sys.executable, __file__, "--rounds", str(args.rounds), "--tokens",
                        *map(str, args.tokens)], env=held_environment(isa),
                       check=True)


if __name__ == "__main__":
    main()
