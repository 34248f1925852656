"""astrai's ``resolve`` vs the seed's, on the same 4-row table, in one process.

The seed (``seed_dispatch.py``) is imported from ``../shared/seed/`` beside the repo
root, else from ``$ASTR_SEED_DIR``; where neither holds it this prints a skip line.
Both get the same family, registered the seed's way: four rows with the same specs,
priorities and probes, and a callable fallback. The probes are cheap always-true
functions (``_yes``); the provider returns a prebuilt list, so the seed pays for no
record construction per call (the comparison favours the seed). The call is rejected
by the first three rows and served by the last (``math``, origin ``chain``) in both.

Gates (1 thread): cached ``resolve`` (the same context object asked again, as the
seed's is) <= 0.5 us/call and >= 30x faster than the seed;
a never-seen signature (a fresh ``head_dim`` per call, each counted as a cache miss)
costs <= the seed's whole ``resolve``; 10 000 distinct signatures cycling <= 2 us/call
(the same context objects, then fresh equal ones, which the decision cache answers);
20 000 never-seen signatures decided in blocks of 1 000: the worst block <= 3x the median
block, and the median <= the seed's (no pauses from what the cache holds).
"""

from __future__ import annotations

import copy
import gc
import importlib.util
import itertools
import operator
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import interleaved_us, paired_ratios, per_call_us

import astrai.dispatch as d
from astrai.dispatch import state as process
from astrai.dispatch.resolution import set_max_decisions

FAMILY = "seedbench"
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def load_seed() -> ModuleType | None:
    """The seed module, or ``None`` where it is not found."""
    dirs = [Path(__file__).resolve().parents[2] / "shared" / "seed"]
    if os.environ.get("ASTR_SEED_DIR"):
        dirs.append(Path(os.environ["ASTR_SEED_DIR"]))
    for folder in dirs:
        path = folder / "seed_dispatch.py"
        if path.is_file():
            spec = importlib.util.spec_from_file_location("seed_dispatch", path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules["seed_dispatch"] = module
            spec.loader.exec_module(module)
            return module
    return None


def _yes() -> bool:
    return True


def _impl(*args: Any) -> None:
    return None


def register(m: Any) -> None:
    """The 4-row family, registered the seed's way; ``m`` is the seed or ``astrai.dispatch``."""
    s = m.Spec
    math = m.ImplRecord(FAMILY, "math", _impl, s.always(), available=_yes, priority=100)
    rows = [
        m.ImplRecord(FAMILY, "flash", _impl, s.cuda_device() & s.dtype_in(F16, BF16)
                     & s.head_dim_in(64, 128, 256), available=_yes, priority=10),
        m.ImplRecord(FAMILY, "paged", _impl, s.fwd_in("prefill", "decode") & s.has_cache()
                     & s.ndim(3), available=_yes, priority=20),
        m.ImplRecord(FAMILY, "sdpa", _impl, s.dtype_in(F16, BF16) & s.mask_free(),
                     available=_yes, priority=30),
        math,
    ]
    m.register_family(FAMILY, lambda: rows, lambda: math)


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def main() -> None:
    seed = load_seed()
    if seed is None:
        print("SKIP bench_seed: seed_dispatch.py not found in ../shared/seed/ or $ASTR_SEED_DIR")
        return
    if os.environ.get("ASTR_OPS"):
        print("note: ASTR_OPS is set; both resolvers read it")
    torch.set_num_threads(1)
    register(seed)
    register(d)
    call: dict[str, Any] = dict(fwd="decode", dtype=F32, ndim=4, head_dim=64)
    ours_ctx, seed_ctx = d.CallContext(FAMILY, **call), seed.CallContext(FAMILY, **call)
    got, want = d.resolve(FAMILY, ours_ctx), seed.resolve(FAMILY, seed_ctx)
    assert (got.name, got.origin) == (want.record.name, want.origin) == ("math", "chain")

    # Both resolvers are called by name, as ``from astrai.dispatch import resolve`` gives
    # it: a module with a PEP 562 ``__getattr__`` (astrai.dispatch loads rank agreement and
    # locks on first use) is not specialised by CPython 3.11, so ``d.resolve`` costs about
    # 15 ns more per call than a bound name; that line is printed alongside.
    ours, theirs = d.resolve, seed.resolve

    def cached() -> object:
        return ours(FAMILY, ours_ctx)

    def cached_copy() -> object:  # the A/A control: the same call, a separate function
        return ours(FAMILY, ours_ctx)

    def seed_resolve() -> object:
        return theirs(FAMILY, seed_ctx)

    def cached_attribute() -> object:
        return d.resolve(FAMILY, ours_ctx)

    print(f"machine: {torch.get_num_threads()} thread, torch {torch.__version__}, "
          f"python {sys.version.split()[0]}; seed from {seed.__file__}")
    print("table: 4 rows (flash, paged, sdpa, math), always-true probes; the call is served "
          "by math (origin chain) in both")
    t = interleaved_us({"cached": cached, "seed": seed_resolve,
                        "attribute": cached_attribute}, number=20_000)
    r = paired_ratios(cached, {"seed": seed_resolve, "control": cached_copy}, number=20_000)
    print(f"seed resolve            {t['seed']:.3f} us/call")
    from astrai.dispatch import state

    path = ("the compiled hot path's checks" if state.hot_resolved is not None
            else "Python's checks: no native extension in use")
    print(f"astrai cached resolve   {t['cached']:.3f} us/call  target <= 0.5 us  "
          f"{verdict(t['cached'] <= 0.5)}  ({path})")
    print(f"seed / cached, paired   {r['seed']:.1f}x  target >= 30x  {verdict(r['seed'] >= 30)}")
    print(f"A/A control (cached / a copy of cached), paired: {r['control']:.3f}x")
    print(f"  (called as d.resolve, through the module attribute: {t['attribute']:.3f} us/call)")

    # Uncached: every call a signature never seen before (a fresh head_dim). The contexts
    # are built beforehand, as the seed's is; computing each one's signature is timed.
    pool = [d.CallContext(FAMILY, fwd="decode", dtype=F32, ndim=4, head_dim=1000 + i)
            for i in range(16_000)]
    fresh = iter(pool)

    def miss() -> object:
        return d.resolve(FAMILY, next(fresh))

    before = d.stats().cache_misses
    u = interleaved_us({"miss": miss, "seed": seed_resolve}, number=1000)
    calls, misses = len(pool) - operator.length_hint(fresh), d.stats().cache_misses - before
    assert misses == calls, f"{calls} calls but {misses} cache misses"
    print(f"astrai uncached resolve {u['miss']:.3f} us/call (all {calls} calls were misses); "
          f"seed alongside {u['seed']:.3f} us/call")
    print(f"uncached / seed         {u['miss'] / u['seed']:.2f}x  target <= 1.0x  "
          f"{verdict(u['miss'] <= u['seed'])}")

    # The same, with the cache full: every miss also evicts (a bound of 2 048 entries,
    # filled first), as in a long-running server seeing ever new signatures.
    saved = process.max_decisions
    set_max_decisions(2048)
    try:
        full = iter([d.CallContext(FAMILY, fwd="decode", dtype=F32, ndim=4, head_dim=50_000 + i)
                     for i in range(20_000)])
        for _ in range(2048):
            d.resolve(FAMILY, next(full))
        f = interleaved_us({"miss": lambda: d.resolve(FAMILY, next(full)),
                            "seed": seed_resolve}, number=1000)
    finally:
        set_max_decisions(saved)
    print(f"uncached, cache full    {f['miss']:.3f} us/call (each miss evicts); seed alongside "
          f"{f['seed']:.3f} us/call: {f['miss'] / f['seed']:.2f}x  target <= 1.0x  "
          f"{verdict(f['miss'] <= f['seed'])}")

    pauses(seed)

    ctxs = [d.CallContext(FAMILY, fwd="decode", dtype=F32, ndim=4, head_dim=h)
            for h in range(10_000)]
    for c in ctxs:
        d.resolve(FAMILY, c)
    cycling("10 000 distinct signatures cycling", itertools.cycle(ctxs), 20_000)
    # The same 10 000 signatures through fresh, equal context objects (copies, which carry
    # nothing resolve left on the originals): the decision cache answers, not the object.
    cycling("  the same, each call a fresh equal context",
            iter([copy.copy(c) for c in ctxs * 3]), 5_000)


def pauses(seed: ModuleType, calls: int = 20_000, block: int = 1000) -> None:
    """Deciding ``calls`` never-seen signatures in blocks of ``block``, astrai's block and
    the seed's in turn (so both see the same machine): the median and the worst block per
    miss. A decision cache that kept collector-tracked objects alive would make Python's
    full collections land in decisions, longer the fuller it gets; the collector is left
    on, as a user has it, and its full collections during the run are counted."""
    full = [0]

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            full[0] += 1

    ours = [d.CallContext(FAMILY, fwd="decode", dtype=F32, ndim=4, head_dim=200_000 + i)
            for i in range(calls)]
    theirs = [seed.CallContext(FAMILY, fwd="decode", dtype=F32, ndim=4, head_dim=200_000 + i)
              for i in range(calls)]
    got: dict[str, list[float]] = {"astrai": [], "seed": []}
    gc.callbacks.append(count)
    try:
        for start in range(0, calls, block):
            for name, resolve, ctxs in (("astrai", d.resolve, ours),
                                        ("seed", seed.resolve, theirs)):
                t0 = time.perf_counter()
                for ctx in ctxs[start:start + block]:
                    resolve(FAMILY, ctx)
                got[name].append((time.perf_counter() - t0) / block * 1e6)
    finally:
        gc.callbacks.remove(count)
    med = {name: statistics.median(v) for name, v in got.items()}
    worst = {name: max(v) for name, v in got.items()}
    print(f"{calls} new signatures in blocks of {block}: astrai median {med['astrai']:.2f}, "
          f"worst {worst['astrai']:.2f} us/miss; seed median {med['seed']:.2f}, worst "
          f"{worst['seed']:.2f} us/miss ({full[0]} full collections during the run)")
    spread = worst["astrai"] / med["astrai"]
    print(f"  worst / median block     {spread:.2f}x  target <= 3x  {verdict(spread <= 3)}")
    ratio = med["astrai"] / med["seed"]
    print(f"  median / seed's median   {ratio:.2f}x  target <= 1.0x  {verdict(ratio <= 1.0)}")


def cycling(label: str, contexts: Iterator[d.CallContext], number: int) -> None:
    """Print the per-call cost of resolving ``contexts`` in turn, with the hit rate."""
    before = d.stats()
    us = per_call_us(lambda: d.resolve(FAMILY, next(contexts)), number, repeat=5)
    after = d.stats()
    hits = after.cache_hits - before.cache_hits
    total = hits + after.cache_misses - before.cache_misses
    print(f"{label}: {us:.3f} us/call (cache hit rate {hits / total:.0%})  target <= 2 us  "
          f"{verdict(us <= 2.0)}")


if __name__ == "__main__":
    main()
