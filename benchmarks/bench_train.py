"""A training step of a large-vocabulary transformers Llama: dispatched through astrai
(the head and the loss fused, ``linear_cross_entropy``'s ``chunked`` row) vs the plain
model.

The model: ``LlamaForCausalLM`` with random weights, vocabulary 32 000, hidden 512,
4 layers, 8 heads of 64, MLP 1408, float32, train mode; one step is the forward of
1 x 1024 tokens with ``labels`` and the backward of its loss. Both sides hold the same
weights (the dispatched model is a copy of the plain one) and see the same tokens.

Measured, side by side in one run:

- **peak memory** of a step: every allocation and free ``torch.profiler`` records
  (``profile_memory=True``), summed in time order; the peak is the most the step holds
  above what it started with. Target: routed <= 0.5 x plain.
- **step time**: paired rounds (each round times both, the order alternating; the
  median of the per-round ratios), wall clock over the threads torch uses (2 by
  default; ``--threads``). Target: routed / plain <= 1.0. An A/A control (plain against
  itself) runs in the same rounds: when it strays from 1.00 by more than 3%, the machine
  is not quiet and the figures say so.
- **equal results**: the loss and every parameter's gradient, routed against plain
  (largest difference, relative to the gradient's largest value).

The first line printed is the machine (as ``bench_linear_isa.py`` prints it: the CPU
model, the machine axes, torch's version, the instruction-set restriction in force).
``--emulate avx2`` then runs the bench again in a child process with its libraries held
to AVX2 (``ATEN_CPU_CAPABILITY=avx2``, ``ONEDNN_MAX_CPU_ISA=AVX2``,
``MKL_ENABLE_INSTRUCTIONS=AVX2``), where this machine's ISA is above AVX2.

    python benchmarks/bench_train.py [--threads N] [--rounds N] [--tokens N] [--emulate avx2]
"""

from __future__ import annotations

import argparse
import copy
import importlib
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

MEMORY_TARGET, TIME_TARGET, QUIET = 0.5, 1.0, 0.03
#: The model; a test shrinks it.
CONFIG: dict[str, Any] = dict(
    vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=2048,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)


def build() -> torch.nn.Module:
    """The plain model (random weights, float32, train mode)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    return model.float().train()


def step(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """One training step's forward and backward; the loss."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach()


def peak_bytes(fn: Callable[[], object]) -> int:
    """The most ``fn`` holds above what it started with, from every allocation and free
    ``torch.profiler`` records."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    held = peak = 0
    for _, nbytes in events:
        held += nbytes
        peak = max(peak, held)
    return peak


def paired(base: Callable[[], object], others: dict[str, Callable[[], object]], rounds: int
           ) -> dict[str, float]:
    """Median per-round ratio other / base, the order within a pair alternating."""
    ratios: dict[str, list[float]] = {k: [] for k in others}
    for i in range(rounds):
        for name, fn in others.items():
            first, second = (fn, base) if i % 2 else (base, fn)
            t0 = time.perf_counter()
            first()
            t1 = time.perf_counter()
            second()
            t2 = time.perf_counter()
            t_first, t_second = t1 - t0, t2 - t1
            t_other, t_base = (t_first, t_second) if i % 2 else (t_second, t_first)
            ratios[name].append(t_other / t_base)
    return {k: statistics.median(v) for k, v in ratios.items()}


def gradient_gap(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """Largest difference of two models' gradients, relative to the gradient's largest
    value, over every parameter."""
    gap = 0.0
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        if p.grad is None or q.grad is None:
            if (p.grad is None) != (q.grad is None):
                raise AssertionError(f"{name}: a gradient on one side only")
            continue
        scale = float(q.grad.abs().max()) or 1.0
        here = float((p.grad - q.grad).abs().max()) / scale
        if math.isnan(here):  # a NaN on either side is no agreement (max() would drop it)
            return math.nan
        gap = max(gap, here)
    return gap


def _isa_bench() -> Any:
    """``bench_linear_isa.py``: the machine line and the emulated instruction sets."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    return importlib.import_module("bench_linear_isa")


def emulated(isa: str, args: argparse.Namespace) -> None:
    """This bench again in a child process with its libraries held to ``isa``
    (``bench_linear_isa.run_held``)."""
    _isa_bench().run_held(isa, __file__, ["--threads", str(args.threads), "--rounds",
                                          str(args.rounds), "--tokens", str(args.tokens)])


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--emulate", choices=["avx2"], action="append", default=[],
                        help="then the bench again with the libraries held to AVX2")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(_isa_bench().machine_line())
    from astrai import dispatch
    from astrai.integrations.transformers import dispatch_model
    plain = build()
    routed = copy.deepcopy(plain)
    dispatch_model(routed)
    ids = torch.randint(3, CONFIG["vocab_size"],
                        (1, args.tokens), generator=torch.Generator().manual_seed(1))
    print(f"torch {torch.__version__}, {args.threads} thread(s), Llama vocab "
          f"{CONFIG['vocab_size']}, hidden {CONFIG['hidden_size']}, "
          f"{CONFIG['num_hidden_layers']} layers, 1 x {args.tokens} tokens, float32, train")

    dispatch.reset_stats()
    loss_routed = step(routed, ids)
    by_row = dispatch.stats().by_row()
    loss_plain = step(plain, ids)
    loss_gap = abs(float(loss_routed) - float(loss_plain))
    grad_gap = gradient_gap(routed, plain)
    agree = grad_gap <= 1e-4 and loss_gap <= 1e-4 * max(1.0, abs(float(loss_plain)))
    fused = by_row.get("linear_cross_entropy", {})
    print(f"loss: routed {float(loss_routed):.6f}, plain {float(loss_plain):.6f}, "
          f"difference {loss_gap:.2e}; gradients: largest relative difference "
          f"{grad_gap:.2e} (target <= 1e-4, the loss too: {'PASS' if agree else 'FAIL'})")
    print(f"the loss was served by linear_cross_entropy rows {sorted(fused) or 'none'}")

    mem_plain = peak_bytes(lambda: step(plain, ids))
    mem_routed = peak_bytes(lambda: step(routed, ids))
    mem_ratio = mem_routed / mem_plain
    print(f"peak memory of a step (torch.profiler): plain {mem_plain / 2**20:.1f} MiB, "
          f"routed {mem_routed / 2**20:.1f} MiB, ratio {mem_ratio:.3f} (target <= "
          f"{MEMORY_TARGET}: {'PASS' if mem_ratio <= MEMORY_TARGET else 'FAIL'})")

    ratios = paired(lambda: step(plain, ids),
                    {"routed": lambda: step(routed, ids), "plain (A/A)": lambda: step(plain, ids)},
                    args.rounds)
    quiet = abs(ratios["plain (A/A)"] - 1.0) <= QUIET
    verdict = "PASS" if ratios["routed"] <= TIME_TARGET else "FAIL"
    print(f"step time routed / plain: {ratios['routed']:.3f} (target <= {TIME_TARGET}: "
          f"{verdict}); A/A control {ratios['plain (A/A)']:.3f}"
          + ("" if quiet else " - the machine is not quiet: the time figure is not to be "
             "trusted"))
    for isa in args.emulate:
        emulated(isa, args)
    return {"memory": mem_ratio, "time": ratios["routed"], "grad_gap": grad_gap,
            "loss_gap": loss_gap}


if __name__ == "__main__":
    main()
