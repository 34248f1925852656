"""A transformers Llama: plain, routed through astrai (both paths) and compiled, side by side.

One process, 1 thread, CPU, ``torch.no_grad()``. The model: ``LlamaForCausalLM`` with
random weights, hidden 512, 8 layers, 8 heads of 64 (4 key/value heads), MLP 1408,
vocabulary 4096, built with ``attn_implementation="sdpa"``. Measured, as paired rounds
(each round times every configuration, the order rotating; the median of the per-round
ratios to plain):

- **generate**: greedy ``generate`` of 32 new tokens after a 16-token prompt, batch 1;
  tokens/s against plain eager.
- **prefill**: one forward of 128 tokens, batch 1; speed against plain eager.

Configurations: plain eager; routed (``dispatch_model(model, mode="inference")``: the
weights declared frozen, as serving declares them) on the path in force - with
astrai's native extension, the default wherever it builds - and routed on the pure-Python
path (a child process with ``ASTR_NATIVE=off``, against its own plain); ``torch.compile``
of the plain model and of the routed one (prefill; cold compile times printed). Plain and
routed eager are one model dispatched and restored in turn, so both read the very same
weights; the compiled ones are two copies of it.

Targets: routed with the extension >= 1.10x plain on both; the pure-Python path >= 1.00x
on both; routed eager >= 1.0x the compiled plain model on prefill; compiled routed >= the
compiled plain model. Then one call of each family, the model's own code against the
dispatched call, at the prefill's and a decode step's sizes (decode attention target:
<= 1.0x the model's own time), and the engine's own figures (``bench_seed.py``: the cached
``resolve`` >= 30x the seed's, an uncached decision <= the seed's, no collection pauses).

Time is the calling thread's CPU time (one intra-op thread: every kernel runs on it), which
leaves out the time it waits for a core on a shared machine. An A/A control (the plain
model against itself) runs in the same rounds: when it strays from 1.00 by more than 2%,
the machine is not quiet and the figures say so.

    python benchmarks/bench_hf.py [--no-compile] [--no-engine]
    python benchmarks/bench_hf.py --instructions   # CPU work by callgrind (slow, noise-free)
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

NATIVE_TARGET, PYTHON_TARGET, COMPILED_TARGET = 1.10, 1.00, 1.00
#: The model; a test shrinks it.
CONFIG: dict[str, Any] = dict(
    vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
PROMPT, NEW_TOKENS, PREFILL = 16, 32, 128
ROUNDS = {"generate": 21, "prefill": 21}
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


def _model() -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.set_num_threads(1)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        LlamaConfig(**CONFIG), attn_implementation="sdpa").eval()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, CONFIG["vocab_size"], (1, PROMPT), generator=g)
    long = torch.randint(3, CONFIG["vocab_size"], (1, PREFILL), generator=g)
    return prompt, long


def _runs(model: Any) -> tuple[Callable[[], object], Callable[[], object]]:
    prompt, long = _inputs()

    def generate() -> object:
        with torch.no_grad():
            return model.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                  do_sample=False, pad_token_id=0)

    def prefill() -> object:
        with torch.no_grad():
            return model(long).logits

    return generate, prefill


def _toggles(model: Any) -> tuple[Callable[[], None], Callable[[], None]]:
    """The setups that make ``model`` plain and routed: ``dispatch_model`` once, then its
    forwards taken out (what ``restore_model`` does) and put back. A setup that probed
    every module again (``dispatch_model``'s recognition runs them on random inputs) would
    leave the allocator and the caches in another state before each routed run than
    before each plain one."""
    from astrai.integrations.transformers import dispatch_model, restore_model
    from astrai.integrations.transformers.routing import ROUTE_ATTR

    restore_model(model)
    dispatch_model(model, mode="inference")
    routes = [(m, {n: m.__dict__[n] for n in ("forward", ROUTE_ATTR)})
              for m in model.modules() if ROUTE_ATTR in m.__dict__]
    restore_model(model)

    def plain() -> None:
        for module, installed in routes:
            for name in installed:
                module.__dict__.pop(name, None)

    def routed() -> None:
        for module, installed in routes:
            module.__dict__.update(installed)

    return plain, routed


def eager_ratios(model: Any) -> dict[str, tuple[float, float, bool, float]]:
    """Per measure: (speed routed / plain, A/A, greedy tokens identical, prefill logits
    gap), on the path in force in this process."""
    generate, prefill = _runs(model)
    plain, routed = _toggles(model)
    with torch.no_grad():
        routed()
        tokens, logits = generate(), prefill()
        plain()
        same = torch.equal(tokens, generate())  # type: ignore[arg-type]
        gap = (logits - prefill()).abs().max().item()  # type: ignore[operator]
    out = {}
    for what, run in (("generate", generate), ("prefill", prefill)):
        r = paired({"plain": (plain, run), "routed": (routed, run), "A/A": (plain, run)},
                   "plain", ROUNDS[what])
        out[what] = (1 / r["routed"], 1 / r["A/A"], same, gap)
    plain()
    return out


def python_path_child() -> None:
    """The child of the pure-Python measurement: ``ASTR_NATIVE=off`` (as a machine
    without a C++ compiler has it); prints its figures as JSON."""
    config, new, prefill, rounds = json.loads(sys.argv[2])
    CONFIG.update(config)
    globals().update(NEW_TOKENS=new, PREFILL=prefill, ROUNDS=rounds)
    from astrai import native

    assert not native.status().loaded, native.status()
    print(json.dumps(eager_ratios(_model())))


def python_path() -> dict[str, tuple[float, float, bool, float]]:
    args = json.dumps([CONFIG, NEW_TOKENS, PREFILL, ROUNDS])
    env = {**os.environ, "ASTR_NATIVE": "off"}
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--python-child", args],
                          capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the pure-Python child failed:\n{done.stderr[-3000:]}")
    got: dict[str, tuple[float, float, bool, float]] = json.loads(done.stdout.splitlines()[-1])
    return got


def compiled_ratios(model: Any) -> dict[str, Any]:
    """Prefill speed of the compiled plain and compiled routed models and of routed eager,
    each against plain eager, in the same rounds; cold compile seconds."""
    from astrai.integrations.transformers import dispatch_model

    _, long = _inputs()
    plain, routed = _toggles(model)
    plain()
    plain_copy, routed_copy = copy.deepcopy(model), copy.deepcopy(model)
    dispatch_model(routed_copy, mode="inference")
    compiled_plain, compiled_routed = torch.compile(plain_copy), torch.compile(routed_copy)
    cold = {}
    with torch.no_grad():
        for name, fn in (("plain", compiled_plain), ("routed", compiled_routed)):
            start = time.perf_counter()
            fn(long)
            cold[name] = time.perf_counter() - start
        gap = (compiled_routed(long).logits - model(long).logits).abs().max().item()
    prefill, compiled_plain_prefill = _runs(model)[1], _runs(compiled_plain)[1]
    compiled_routed_prefill = _runs(compiled_routed)[1]
    r = paired({"plain": (plain, prefill),
                "compiled plain": (lambda: None, compiled_plain_prefill),
                "compiled routed": (lambda: None, compiled_routed_prefill),
                "routed": (routed, prefill), "A/A": (plain, prefill)}, "plain",
               ROUNDS["prefill"])
    plain()
    return {"speed": {k: 1 / v for k, v in r.items()}, "cold": cold, "gap": gap}


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    import astrai.dispatch as d
    from astrai import native
    from astrai.integrations.transformers import dispatch_model, restore_model

    model = _model()
    report = dispatch_model(model, mode="inference")
    restore_model(model)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"Llama {CONFIG['hidden_size']} hidden, {CONFIG['num_hidden_layers']} layers, "
          f"torch {torch.__version__}, 1 thread; load average {load:.2f}")
    print(native.status())
    print(f"routed: {report.counts()}; not routed: {len(report.not_routed)}")
    ok, quiet = True, True

    d.reset_stats()
    paths = {"native" if native.status().loaded else "python": eager_ratios(model)}
    rows = d.stats().table()
    if "python" not in paths:
        paths["python"] = python_path()
    generate, prefill = f"generate {NEW_TOKENS}", f"prefill 1x{PREFILL}"
    print(f"\n{'':<34}{generate:>14}{prefill:>16}   target")
    for path, label, target in (("native", "routed, native extension / plain", NATIVE_TARGET),
                                ("python", "routed, pure-Python path / plain", PYTHON_TARGET)):
        if path not in paths:
            print(f"{label:<34}{'(no extension here)':>30}")
            continue
        g, p = paths[path]["generate"], paths[path]["prefill"]
        passed = g[0] >= target and p[0] >= target
        ok &= passed
        quiet &= abs(g[1] - 1) <= QUIET and abs(p[1] - 1) <= QUIET
        print(f"{label:<34}{g[0]:>13.3f}x{p[0]:>15.3f}x   >= {target:.2f}x {verdict(passed)}"
              f"   (A/A {g[1]:.3f} / {p[1]:.3f})")
        print(f"{'':<4}numerics: greedy tokens {'identical' if g[2] else 'DIFFER'}, prefill "
              f"logits max |routed - plain| {g[3]:.2e}")
        ok &= bool(g[2])

    if "--no-compile" not in argv:
        c = compiled_ratios(model)
        s = c["speed"]
        print(f"\nprefill 1x{PREFILL}, speed against plain eager (cold compile: plain "
              f"{c['cold']['plain']:.1f} s, routed {c['cold']['routed']:.1f} s; compiled routed "
              f"logits max |diff| {c['gap']:.2e}):")
        for name in ("compiled plain", "compiled routed", "routed"):
            print(f"  {name:<16} {s[name]:.3f}x")
        eager = s["routed"] / s["compiled plain"]
        both = s["compiled routed"] / s["compiled plain"]
        print(f"  routed eager / compiled plain     {eager:.3f}x  target >= "
              f"{COMPILED_TARGET:.2f}x {verdict(eager >= COMPILED_TARGET)}")
        print(f"  compiled routed / compiled plain  {both:.3f}x  target >= "
              f"{COMPILED_TARGET:.2f}x {verdict(both >= COMPILED_TARGET)}")
        ok &= eager >= COMPILED_TARGET and both >= COMPILED_TARGET
        quiet &= abs(s["A/A"] - 1) <= QUIET
    if not quiet:
        print(f"the machine is not quiet: an A/A control strays more than {QUIET:.0%} "
              "from 1.00; these figures cannot be trusted")
    print("\nrows that served the routed runs (the path in force):")
    print(rows)
    restore_model(model)
    parts(model, PREFILL, PREFILL, "prefill")
    ok &= parts(model, 1, PROMPT + NEW_TOKENS, "a decode step")
    if "--no-engine" not in argv:
        print("\nthe engine (benchmarks/bench_seed.py):")
        done = subprocess.run([sys.executable, os.path.join(os.path.dirname(
            os.path.abspath(__file__)), "bench_seed.py")], capture_output=True, text=True,
            check=False)
        print("  " + done.stdout.strip().replace("\n", "\n  "))
        ok &= "FAIL" not in done.stdout
    return 0 if ok and quiet else 1


def parts(model: Any, tokens: int, keys: int, what: str) -> bool:
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
    ok = True
    with torch.no_grad():
        for family, (own, routed) in calls.items():
            d.reset_stats()
            t = interleaved_us({"own": own, "astrai": routed}, 20 if tokens > 1 else 2000)
            (row,) = d.stats().by_row()[family]
            ratio = t["astrai"] / t["own"]
            line = (f"  {family:<10} own {t['own']:8.1f} us  astrai ({row}) {t['astrai']:8.1f} us"
                    f"  time {ratio:.2f}x")
            if family == "attention" and tokens == 1:
                ok = ratio <= 1.0
                line += f"  target <= 1.00x {verdict(ok)}"
            print(line)
    return ok


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
        dispatch_model(model, mode="inference")
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
          f"{ratio:.3f}  (target >= {NATIVE_TARGET:.2f}: "
          f"{'PASS' if ratio >= NATIVE_TARGET else 'FAIL'})")
    return 0 if ratio >= NATIVE_TARGET else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--python-child"]:
        python_path_child()
    elif sys.argv[1:2] == ["--child"]:
        _generate_once(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1:2] == ["--instructions"]:
        sys.exit(instructions())
    else:
        sys.exit(main())
