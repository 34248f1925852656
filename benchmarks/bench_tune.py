"""Tuned against shipped: record the demo, tune it, and compare the demo's decode
throughput under the shipped order and under the tuned profile, paired, in one run.

Steps: record the demo's calls (``astrai.dispatch.record``); ``tune_workload`` them into
a profile in a temporary directory (verified: each recorded call resolves to its measured
winner); then time ``generate_paged`` of the demo (same model, prompts, decode steps) in
adjacent pairs, shipped then tuned, alternating which goes first, and report the median
tokens/s each way and the median of the per-pair ratios with its 95% interval (target:
the interval reaches 0.99 - the tuned plan is not slower than shipped beyond the noise).
Numerics: the tuned run's
generated tokens equal the shipped run's, and the logits of one forward agree within
float32 tolerance.

Usage: ``python benchmarks/bench_tune.py [--rounds N] [--pairs N]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import astrai.dispatch as dispatch
from astrai.demo import DECODE_STEPS, PROMPT_LENS, run_demo
from astrai.models.llama import LlamaConfig, TinyLlama, generate_paged
from astrai.tune.run import tune_workload
from astrai.tune.statistics import median_interval

TARGET = 0.99  # tuned / shipped: a tuned plan is never slower than shipped, within noise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="tune's timing rounds")
    parser.add_argument("--pairs", type=int, default=15, help="paired demo runs")
    args = parser.parse_args(argv)
    with dispatch.record() as rec:
        run_demo()
    workload = rec.workload()
    out = Path(tempfile.mkdtemp()) / "tuned.yaml"
    start = time.perf_counter()
    tuned = tune_workload(workload, out, rounds=args.rounds, source="(demo, recorded)")
    print(f"tuned {len(workload.calls)} distinct calls in {time.perf_counter() - start:.0f} s "
          f"into {len(tuned.buckets)} buckets:")
    print(tuned.summary())
    model = TinyLlama(LlamaConfig(), seed=0)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,), generator=gen).tolist()
               for n in PROMPT_LENS]

    def run(profile: str | None) -> tuple[float, list[list[int]]]:
        with dispatch.use_profile(profile) if profile else dispatch.use_profile():
            t0 = time.perf_counter()
            with torch.no_grad():
                outputs = generate_paged(model, prompts, DECODE_STEPS)
            return sum(len(o) for o in outputs) / (time.perf_counter() - t0), outputs

    shipped_out = run(None)[1]
    tuned_out = run(tuned.name)[1]
    batch = torch.randint(0, model.cfg.vocab_size, (2, 24), generator=gen)
    with torch.no_grad():
        want = model(batch)
        with dispatch.use_profile(tuned.name):
            got = model(batch)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert tuned_out == shipped_out, "the tuned profile changed the generated tokens"
    shipped, tuned_tps, ratios = [], [], []
    for i in range(args.pairs):
        first, second = (None, tuned.name) if i % 2 == 0 else (tuned.name, None)
        a, b = run(first)[0], run(second)[0]
        s, t = (a, b) if first is None else (b, a)
        shipped.append(s)
        tuned_tps.append(t)
        ratios.append(t / s)
    ratio = median_interval(ratios)
    ok = ratio.high >= TARGET
    print(f"\ndemo decode, {args.pairs} pairs, {torch.get_num_threads()} threads:")
    print(f"  shipped order: {statistics.median(shipped):8.0f} tokens/s (median)")
    print(f"  tuned profile: {statistics.median(tuned_tps):8.0f} tokens/s (median)")
    print(f"  tuned / shipped, median of paired ratios: {ratio.median:.3f}, "
          f"{ratio.level:.0%} interval [{ratio.low:.3f}, {ratio.high:.3f}]  target: >= "
          f"{TARGET} within the noise (the interval reaches it): {'PASS' if ok else 'FAIL'}")
    print("  numerics: generated tokens identical; one forward's logits within 1e-4")
    if not tuned.noise or not tuned.noise.quiet:
        print("  note: tune found the machine busy: " + "; ".join(
            tuned.noise.reasons() if tuned.noise else ["no reading"]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
