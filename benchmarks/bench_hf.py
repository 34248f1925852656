"""A transformers Llama, the whole model dispatched through astrai vs the plain model.

One process, 1 thread, CPU, ``torch.no_grad()``. The model: ``LlamaForCausalLM`` with
random weights, hidden 512, 8 layers, 8 heads of 64 (4 key/value heads), MLP 1408,
vocabulary 4096, built with ``attn_implementation="sdpa"``, and dispatched
(``dispatch_model``) and restored (``restore_model``) in turn, so both sides run on the
very same weights. Measured, as paired rounds (each round times both, the
order alternating; the median of the per-round ratios):

- **generate**: greedy ``generate`` of 32 new tokens after a 16-token prompt, batch 1;
  tokens/s dispatched / plain. Target >= 0.98.
- **prefill**: one forward of 512 tokens, batch 1; speed dispatched / plain (plain's
  time over dispatched's). Target >= 1.0.

Time is the calling thread's CPU time (one intra-op thread: every kernel runs on it), which
leaves out the time it waits for a core on a shared machine. An A/A control (the plain
model against itself) runs in the same rounds: when
it strays from 1.00 by more than 2%, the machine is not quiet and the figures say so.
Then the rows that served each family in the dispatched runs. The first line says whether
astrai's native extension (the compiled hot path and the ``native`` rows) is in force: the
targets are met with it (``astrai-ops native --build``), not on the pure-Python path.

    python benchmarks/bench_hf.py
    python benchmarks/bench_hf.py --instructions   # CPU work by callgrind (slow, noise-free)
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

GENERATE_TARGET, PREFILL_TARGET = 0.98, 1.0
#: The model; a test shrinks it.
CONFIG: dict[str, Any] = dict(
    vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
PROMPT, NEW_TOKENS, PREFILL = 16, 32, 512
ROUNDS = {"generate": 21, "prefill": 15}
QUIET = 0.02


#: Written before every timed run: the setups (a dispatch_model call probes every norm)
#: leave the caches in different states, this leaves them alike.
_FLUSH = torch.zeros(16 << 20)
Run = tuple[Callable[[], object], Callable[[], object]]  # (untimed setup, timed run)


def paired(fns: dict[str, Run], base: str, rounds: int) -> dict[str, float]:
    """Median over rounds of ``time(name) / time(base)`` for every other name; within a
    round the order rotates, so no function always runs first. Each run's setup comes
    right before it, untimed."""
    for setup, run in fns.values():
        setup()
        run()
    names = list(fns)
    ratios: dict[str, list[float]] = {n: [] for n in names if n != base}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        took: dict[str, float] = {}
        for name in order:
            setup, run = fns[name]
            setup()
            _FLUSH.mul_(1.0)  # every run starts from caches as cold as the others'
            start = time.thread_time()
            run()
            took[name] = time.thread_time() - start
        for name in ratios:
            ratios[name].append(took[name] / took[base])
    return {n: statistics.median(v) for n, v in ratios.items()}


def main() -> int:
    from transformers import AutoModelForCausalLM, LlamaConfig

    import astrai.dispatch as d
    from astrai import native
    from astrai.integrations.transformers import dispatch_model, restore_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        LlamaConfig(**CONFIG), attn_implementation="sdpa").eval()
    # One model, dispatched and restored in turn: the plain and dispatched runs read the
    # very same weights (two copies of a model were seen to run up to 5% apart from
    # memory placement alone, more than the difference measured).
    report = dispatch_model(model)
    restore_model(model)

    def plain() -> None:
        restore_model(model)

    def routed() -> None:
        dispatch_model(model)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, CONFIG["vocab_size"], (1, PROMPT), generator=g)
    long = torch.randint(3, CONFIG["vocab_size"], (1, PREFILL), generator=g)

    def generate() -> Callable[[], object]:
        def run() -> object:
            with torch.no_grad():
                return model.generate(prompt, max_new_tokens=NEW_TOKENS,
                                      min_new_tokens=NEW_TOKENS, do_sample=False,
                                      pad_token_id=0)
        return run

    def prefill() -> Callable[[], object]:
        def run() -> object:
            with torch.no_grad():
                return model(long).logits
        return run

    gen, pre = generate(), prefill()
    with torch.no_grad():
        routed()
        got_tokens, got_logits = gen(), pre()
        plain()
        same = torch.equal(got_tokens, gen())  # type: ignore[arg-type]
        gap = (got_logits - pre()).abs().max().item()  # type: ignore[operator]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"Llama {CONFIG['hidden_size']} hidden, {CONFIG['num_hidden_layers']} layers, "
          f"torch {torch.__version__}, 1 thread; load average {load:.2f}")
    print(native.status())
    print(f"routed: {report.counts()}; not routed: {len(report.not_routed)}")
    print(f"numerics: greedy tokens {'identical' if same else 'DIFFER'}; prefill logits "
          f"max |dispatched - plain| = {gap:.2e}")

    d.reset_stats()
    results: dict[str, tuple[float, float]] = {}
    for what, make in (("generate", generate), ("prefill", prefill)):
        run = make()
        ratios = paired({"plain": (plain, run), "dispatched": (routed, run),
                         "A/A": (plain, run)}, "plain", ROUNDS[what])
        results[what] = (1 / ratios["dispatched"], 1 / ratios["A/A"])
    quiet = all(abs(aa - 1) <= QUIET for _, aa in results.values())
    ok = True
    for what, target in (("generate", GENERATE_TARGET), ("prefill", PREFILL_TARGET)):
        speed, aa = results[what]
        passed = speed >= target
        ok &= passed
        unit = "tokens/s" if what == "generate" else "speed"
        print(f"{what:<9} {unit} dispatched / plain = {speed:.3f}  (target >= {target:.2f}: "
              f"{'PASS' if passed else 'FAIL'})  A/A {aa:.3f}")
    if not quiet:
        print(f"the machine is not quiet: the A/A control strays more than {QUIET:.0%} "
              "from 1.00; these figures cannot be trusted")
    print("\nrows that served the dispatched runs:")
    print(d.stats().table())
    restore_model(model)
    parts(model, PREFILL, PREFILL, "prefill")
    parts(model, 1, PROMPT + NEW_TOKENS, "a decode step")
    return 0 if ok and quiet and same else 1


def parts(model: Any, tokens: int, keys: int, what: str) -> None:
    """Each family at the sizes of ``tokens`` new tokens over ``keys`` keys: the model's own
    code (a restored layer's modules and transformers' functions) against the call a
    dispatched layer makes, timed in alternation - where the time goes, family by family."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _timing import interleaved_us
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    import astrai.dispatch as d
    from astrai import ops
    from astrai.families.attention.transformers import astrai_attention_forward

    layer = model.model.layers[0]
    attn, norm, proj = layer.self_attn, layer.input_layernorm, layer.mlp.gate_proj
    heads, kv_heads = CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"]
    dim = CONFIG["hidden_size"] // heads
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, tokens, CONFIG["hidden_size"], generator=g)
    q = torch.randn(1, tokens, heads, dim, generator=g).transpose(1, 2)
    k = torch.randn(1, keys, kv_heads, dim, generator=g).transpose(1, 2)
    v = torch.randn(1, keys, kv_heads, dim, generator=g).transpose(1, 2)
    cos, sin = torch.randn(1, tokens, dim, generator=g), torch.randn(1, tokens, dim, generator=g)
    kr = k[:, :, :tokens]  # rotary turns the new keys only
    form = ops.rms_norm_form(cast_before_weight=True)
    causal = tokens > 1
    calls = {
        "rms_norm": (lambda: norm(x), lambda: form(x, norm.weight, norm.variance_epsilon)),
        "linear": (lambda: proj(x), lambda: ops.linear(x, proj.weight, proj.bias)),
        "rotary": (lambda: apply_rotary_pos_emb(q, kr, cos, sin),
                   lambda: ops.apply_rotary_half(q, kr, cos, sin)),
        "attention": (lambda: sdpa_attention_forward(attn, q, k, v, None, is_causal=causal),
                      lambda: astrai_attention_forward(attn, q, k, v, None, is_causal=causal)),
    }
    print(f"\n{what}, one call of each family ({tokens} token(s), {keys} keys): the model's "
          "own code vs the dispatched call (medians in alternation)")
    with torch.no_grad():
        for family, (own, routed) in calls.items():
            d.reset_stats()
            t = interleaved_us({"own": own, "astrai": routed}, 20 if tokens > 1 else 2000)
            (row,) = d.stats().by_row()[family]
            print(f"  {family:<10} own {t['own']:8.1f} us  astrai ({row}) {t['astrai']:8.1f} us"
                  f"  time {t['astrai'] / t['own']:.2f}x")


def _generate_once(mode: str, tokens: int) -> None:
    """The child of ``--instructions``: build the model (dispatched or not), warm up, and
    generate ``tokens`` tokens (none: the setup alone, subtracted)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from astrai.integrations.transformers import dispatch_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        LlamaConfig(**CONFIG), attn_implementation="sdpa").eval()
    if mode == "dispatched":
        dispatch_model(model)
    prompt = torch.randint(3, CONFIG["vocab_size"], (1, PROMPT),
                           generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for n in (4, tokens):
            if n:
                model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=0)


def instructions(tokens: int = 16) -> int:
    """Instructions per generated token, plain and dispatched, counted by callgrind: the
    CPU work, the same on a busy machine as on a quiet one (memory stalls are not in it).
    Four runs under valgrind (about 25 minutes here): each mode with and without the
    ``tokens`` to generate, the difference being theirs."""
    import re
    import subprocess
    import tempfile

    counts: dict[tuple[str, int], int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("plain", "dispatched"):
            for n in (0, tokens):
                out = f"{tmp}/{mode}.{n}"
                subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                                sys.executable, __file__, "--child", mode, str(n)],
                               check=True, capture_output=True)
                with open(out) as fh:
                    counts[(mode, n)] = int(re.search(r"^summary: (\d+)", fh.read(),
                                                      re.M).group(1))  # type: ignore[union-attr]
    per = {m: (counts[(m, tokens)] - counts[(m, 0)]) / tokens for m in ("plain", "dispatched")}
    ratio = per["plain"] / per["dispatched"]
    print(f"instructions per generated token: plain {per['plain'] / 1e6:.2f} M, dispatched "
          f"{per['dispatched'] / 1e6:.2f} M; dispatched / plain speed by CPU work = "
          f"{ratio:.3f}  (target >= {GENERATE_TARGET:.2f}: "
          f"{'PASS' if ratio >= GENERATE_TARGET else 'FAIL'})")
    return 0 if ratio >= GENERATE_TARGET else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        _generate_once(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1:2] == ["--instructions"]:
        sys.exit(instructions())
    else:
        sys.exit(main())
