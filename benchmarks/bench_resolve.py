"""Cached ``resolve`` vs the naive table walk (contract §11), and how the cache scales.

Prints: per-call cost of a cached resolve and of a naive walk of the same 4-row
table (re-probe availability and re-check every row's spec, as the original
hand-written dispatcher did), their ratio, and cached cost for 4/40/400 rows and
for 1/100/10 000 distinct call signatures (with the cache size, which is bounded).
Targets: >= 15x faster than the walk and < 1 us per call.
"""

from __future__ import annotations

import itertools
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import interleaved_us, per_call_us

import astrai.dispatch as d
from astrai.dispatch import state
from astrai.dispatch.registry import current
from astrai.dispatch.tables.model import check

ROW = """  - name: r{i}
    impl: astrai.backends.linear:torch_linear
    when: {when}
"""

#: The 4-row table of the headline figure: the shipped attention rows plus the fp8
#: probe, so the naive walk pays for real availability probes as the seed did.
FOUR_ROWS = """version: 1
family: walk4
fallback: math
rows:
  - name: flash
    impl: astrai.backends.attention.flash:flash_attention
    available: astrai.backends.attention.flash:flash_available
    when: cuda_device and dtype in {float16, bfloat16} and head_dim <= 256
  - name: fp8
    impl: astrai.backends.linear:fp8_linear
    available: astrai.backends.linear:fp8_available
    when: cuda_device and dtype in {float16, bfloat16}
  - name: torch_native
    impl: astrai.backends.attention.sdpa:sdpa_attention
    available: astrai.backends.rms_norm:torch_rms_norm_available
    when: dtype in {float16, bfloat16} and (not has_cache and ndim == 4 or has_cache and ndim == 3)
  - name: math
    impl: astrai.backends.attention.math:math_attention
"""


def write_table(tmp: Path, family: str, rows: int) -> Path:
    """A table of ``rows`` rows; only the last (``always``) matches the benchmark call."""
    body = [f"version: 1\nfamily: {family}\nfallback: r{rows - 1}\nrows:\n"]
    for i in range(rows - 1):
        when = (f"dtype == bfloat16 and ndim == {i % 5 + 2} and has_cache"
                if i % 2 else f"fwd == decode and head_dim in {{{64 + i}, {128 + i}}}")
        body.append(ROW.format(i=i, when=when))
    body.append(ROW.format(i=rows - 1, when="always"))
    path = tmp / f"{family}.yaml"
    path.write_text("".join(body))
    return path


def naive_walk(family: str, ctx: d.CallContext) -> str:
    """What a hand-written dispatcher does per call: probe and test every row in order."""
    table = current().families[family]
    for rec in table.rows:
        ok, _ = check(rec.available)
        if ok and rec.spec.matches(ctx):
            return rec.name
    return table.fallback


def main() -> None:
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp())
    for n in (4, 40, 400):
        d.load_tables(write_table(tmp, f"bench{n}", n))
    (tmp / "walk4.yaml").write_text(FOUR_ROWS)
    d.load_tables(tmp / "walk4.yaml")
    ctx = d.CallContext("walk4", dtype=torch.float32, ndim=4, head_dim=64)
    assert naive_walk("walk4", ctx) == d.resolve("walk4", ctx).name == "math"

    t = interleaved_us({"cached": lambda: d.resolve("walk4", ctx),
                        "naive": lambda: naive_walk("walk4", ctx)}, number=5000)
    print(f"machine: {torch.get_num_threads()} thread(s), torch {torch.__version__}, "
          f"python {sys.version.split()[0]}")
    print(f"4-row table (real probes): cached resolve {t['cached']:.3f} us/call, naive walk "
          f"{t['naive']:.3f} us/call, ratio {t['naive'] / t['cached']:.1f}x "
          f"(target >= 15x and < 1 us)")
    print("tables of N rows whose last row matches (no probes; the walk only re-tests specs):")

    for n in (4, 40, 400):
        c = d.CallContext(f"bench{n}", dtype=torch.float32, ndim=3, head_dim=64)
        fam = f"bench{n}"
        cached = per_call_us(lambda c=c, fam=fam: d.resolve(fam, c), 20000)
        naive = per_call_us(lambda c=c, fam=fam: naive_walk(fam, c), 200)
        print(f"{n:>4} rows: cached {cached:.3f} us/call, naive {naive:.1f} us/call")

    for distinct in (1, 100, 10_000):
        ctxs = [d.CallContext("bench4", dtype=torch.float32, ndim=3, head_dim=h)
                for h in range(distinct)]
        for c in ctxs:
            d.resolve("bench4", c)
        it = itertools.cycle(ctxs)

        def one(it: Iterator[d.CallContext] = it) -> None:
            d.resolve("bench4", next(it))

        us = per_call_us(one, 20000, repeat=1 if distinct == 10_000 else 5)
        print(f"{distinct:>6} distinct signatures: {us:.3f} us/call, cache holds "
              f"{len(current().decisions)} decisions (bound {state.max_decisions})")


if __name__ == "__main__":
    main()
