"""A transformers Llama: plain, routed through astrai (both paths) and compiled, side by side.

One process, 1 thread, CPU, ``torch.no_grad()``. The model: ``LlamaForCausalLM`` with
random weights, hidden 512, 8 layers, 8 heads of 64 (4 key/value heads), MLP 1408,
vocabulary 4096, built with ``attn_implementation="sdpa"``. Measured, as paired rounds
(each round times every configuration, the order rotating; the median of the per-round
ratios to plain):

- **generate**: greedy ``generate`` of 32 new tokens after a 16-token prompt, batch 1;
  tokens/s against plain eager.
- **prefill**: one forward of 128 tokens, batch 1; speed against plain eager.

Configurations: plain eager; routed (``dispatch_model(model, mode="inference",
tuned=False)``: the shipped tables, the weights declared frozen, as serving declares
them) on the path in force - with astrai's native extension, the default wherever it
builds - and routed on the pure-Python path (a child process with ``ASTR_NATIVE=off``,
against its own plain); ``torch.compile`` of the plain model and of the routed one
(prefill; cold compile times printed). Plain and routed eager are one model whose routed
forwards are put in and taken out in turn, so both read the very same weights; the
compiled ones are two copies of it.

Targets: generate, routed with the extension >= 1.10x plain, on the pure-Python path >=
1.00x; prefill >= 1.00x plain on both paths; routed eager >= 1.0x the compiled plain model
on prefill; compiled routed >= the compiled plain model. Then one call of each family, the
model's own code against the dispatched call, at the prefill's and a decode step's sizes
(decode attention target: <= 1.0x the model's own time), and the engine's own figures
(``bench_seed.py``: the cached ``resolve`` >= 30x the seed's, an uncached decision <= the
seed's, no collection pauses).

Time is the calling thread's CPU time (one intra-op thread: every kernel runs on it), which
leaves out the time it waits for a core on a shared machine. An A/A control (the plain
model against itself) runs in the same rounds: when it strays from 1.00 by more than 2%,
the machine is not quiet and the figures say so.

The first line printed is the machine: the CPU model, the machine axes astrai reads
(``machine_facts().describe()``: vendor, ISA, cores, threads), torch's version and the
instruction-set restriction in force, if any (``ATEN_CPU_CAPABILITY``,
``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS``). ``--emulate avx2`` then runs the
whole bench again in a child process with the three held to AVX2, as on a CPU without
AVX-512 (where this machine's ISA is above AVX2; else it says it skipped and why).

**A profile tuned in the same run** (unless ``--no-tune``, or ``ASTR_TUNED=off``):
``astrai.tune_model`` tunes the model on this machine (a prefill of the prefill's length
and a few decode steps) into a temporary cache folder, so the user's cache is untouched;
the pure-Python child tunes its own in its own folder. "routed, tuned profile" is then
measured beside "routed" (the shipped tables) in the same paired rounds, with the same
targets. Both are dispatched once up front (``dispatch_model(..., tuned=False)`` and
``tuned=<folder>``: the families the profile leaves to the model's own code stay
unrouted there), their forwards kept and swapped in by each run's untimed setup, with the
process-wide profiles (``set_process_profiles``); a switch starts a new table snapshot,
whose decisions the setup makes with one untimed run.

**Decode against the memory roofline**: one decode step (one token over the prompt's
cache, a fresh copy per step, the weights evicted from the caches before it) timed alone,
median over rounds; the weight bytes a step multiplies by (every ``Linear``/``Conv1D``
weight and bias, the LM head included) per second, against the most bytes per second one
thread reads from a buffer twice the last-level cache (``torch.sum`` over it and
``.copy_`` from it, bytes read). Target: routed with the extension >= 80%.

**Prefill against the best GEMM**: the linear layers' products of a 1 x ``PREFILL``
prefill (2 x tokens x in x out each, the head included) at the speed of the best linear
row timed alone at each shape (every faithful CPU row of ``bench_linear_isa.py``, each
weight read from memory), over the time of the whole prefill: the share of the prefill
the products would take at that speed. Target: routed with the extension >= 90%.

    python benchmarks/bench_hf.py [--no-compile] [--no-engine] [--no-tune] [--quick]
                                  [--emulate avx2]
    python benchmarks/bench_hf.py --instructions   # CPU work by callgrind (slow, noise-free)
"""

from __future__ import annotations

import argparse
import copy
import importlib
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

NATIVE_TARGET, PYTHON_TARGET, COMPILED_TARGET = 1.10, 1.00, 1.00
#: The prefill's target on both paths: never slower than plain.
PREFILL_TARGET = 1.00
DECODE_TARGET, GEMM_TARGET = 0.80, 0.90
#: The model; a test shrinks it.
CONFIG: dict[str, Any] = dict(
    vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
PROMPT, NEW_TOKENS, PREFILL = 16, 32, 128
ROUNDS = {"generate": 21, "prefill": 21}
QUIET = 0.02
#: Decode steps timed per configuration; rounds of each linear shape timed alone.
DECODE_ROUNDS, GEMM_ROUNDS = 15, 5
#: ``tune_model``'s timed rounds and its budget of extra seconds; decode steps it records.
TUNE: dict[str, Any] = {"rounds": 7, "budget": 20.0, "new_tokens": 8}
#: ``--quick``: a tiny model, few rounds (a test's run).
QUICK: dict[str, Any] = dict(
    CONFIG={**CONFIG, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "vocab_size": 128},
    NEW_TOKENS=4, PREFILL=32, ROUNDS={"generate": 3, "prefill": 3}, DECODE_ROUNDS=3,
    GEMM_ROUNDS=2, TUNE={"rounds": 1, "budget": 0.0, "new_tokens": 2},
)
TUNED = "routed, tuned profile"


#: Written before every timed run: the setups (a dispatch_model call probes every norm)
#: leave the caches in different states, this leaves them alike.
_FLUSH = torch.zeros(16 << 20)
Run = tuple[Callable[[], object], Callable[[], object]]  # (untimed setup, timed run)


def timed_rounds(fns: dict[str, Run], rounds: int) -> dict[str, list[float]]:
    """Each run's seconds (the calling thread's CPU time) per round; within a round the
    order rotates, so no function always runs first. Each run's setup comes right before
    it, untimed."""
    for setup, run in fns.values():
        setup()
        run()
    names = list(fns)
    took: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            setup, run = fns[name]
            setup()
            _FLUSH.mul_(1.0)  # every run starts from caches as cold as the others'
            start = time.thread_time()
            run()
            took[name].append(time.thread_time() - start)
    return took


def paired(fns: dict[str, Run], base: str, rounds: int) -> dict[str, float]:
    """Median over rounds of ``time(name) / time(base)`` for every other name
    (``timed_rounds``)."""
    return ratios(timed_rounds(fns, rounds), base)


def ratios(took: dict[str, list[float]], base: str) -> dict[str, float]:
    """Median over rounds of each name's time over ``base``'s in the same round."""
    return {n: statistics.median(a / b for a, b in zip(t, took[base], strict=True))
            for n, t in took.items() if n != base}


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


Routes = list[tuple[Any, dict[str, Any]]]  # (module, the attributes dispatch_model set)


def _routes(model: Any, tuned: bool | str) -> Routes:
    """``dispatch_model(model, mode="inference", tuned=tuned)``'s forwards, taken out
    again (the model left plain, its weights declared frozen as serving declares them)."""
    from astrai.integrations.transformers import dispatch_model, restore_model
    from astrai.integrations.transformers.routing import ROUTE_ATTR

    restore_model(model)
    dispatch_model(model, mode="inference", tuned=tuned)
    routes = [(m, {n: m.__dict__[n] for n in ("forward", ROUTE_ATTR)})
              for m in model.modules() if ROUTE_ATTR in m.__dict__]
    _take_out(routes)
    return routes


def _take_out(routes: Routes) -> None:
    for module, installed in routes:
        for name in installed:
            module.__dict__.pop(name, None)


@dataclass(frozen=True)
class Profile:
    """The profile tuned in this run: its name and the cache folder it is kept in."""

    name: str
    cache: str


class Configurations:
    """The untimed setups that put one model (the very same weights) in each
    configuration: plain, routed on the shipped tables and, with a profile, routed under
    it. Each routing is dispatched once here and its forwards kept: a setup that probed
    every module again (``dispatch_model``'s recognition runs them on random inputs)
    would leave the allocator and the caches in another state before each routed run
    than before each plain one. A setup also puts the routing's process-wide profiles in
    force; a switch starts a new table snapshot with no decision made, so the setup then
    runs ``warm`` once, untimed, to make them."""

    def __init__(self, model: Any, profile: Profile | None) -> None:
        self.profile = profile
        self.routings: dict[str, tuple[Routes, tuple[str, ...]]] = {
            "routed": (_routes(model, False), ())}
        if profile is not None:
            self.routings[TUNED] = (_routes(model, profile.cache), (profile.name,))

    def plain(self) -> None:
        for routes, _ in self.routings.values():
            _take_out(routes)

    def routed(self, name: str, warm: Callable[[], object]) -> Callable[[], None]:
        """The setup of the routing ``name``."""
        from astrai.dispatch.scopes import process_profiles, set_process_profiles

        routes, profiles = self.routings[name]

        def setup() -> None:
            self.plain()
            for module, installed in routes:
                module.__dict__.update(installed)
            if process_profiles() != profiles:
                set_process_profiles(*profiles)
                warm()

        return setup

    def runs(self, run: Callable[[], object], prepare: Callable[[], object] = lambda: None
             ) -> dict[str, Run]:
        """Every configuration's (setup, run), the A/A control last; ``prepare`` ends
        each setup."""
        def then(setup: Callable[[], None]) -> Callable[[], None]:
            def both() -> None:
                setup()
                prepare()
            return both

        def warm() -> None:
            prepare()
            run()

        got: dict[str, Run] = {"plain": (then(self.plain), run)}
        for name in self.routings:
            got[name] = (then(self.routed(name, warm)), run)
        got["A/A"] = (then(self.plain), run)
        return got


def eager_ratios(model: Any, configs: Configurations) -> dict[str, dict[str, Any]]:
    """Per measure, on the path in force in this process: ``speed`` (each configuration
    against plain, and the A/A control), ``seconds`` (median per configuration), and per
    routed configuration ``same`` (greedy tokens identical to plain's) and ``gap``
    (prefill logits, largest difference to plain's)."""
    generate, prefill = _runs(model)
    with torch.no_grad():
        configs.plain()
        tokens, logits = generate(), prefill()
        same, gap = {}, {}
        for name in configs.routings:
            configs.routed(name, lambda: None)()
            same[name] = torch.equal(tokens, generate())  # type: ignore[arg-type]
            gap[name] = (logits - prefill()).abs().max().item()  # type: ignore[operator]
    out = {}
    for what, run in (("generate", generate), ("prefill", prefill)):
        took = timed_rounds(configs.runs(run), ROUNDS[what])
        out[what] = {"speed": {n: 1 / r for n, r in ratios(took, "plain").items()},
                     "seconds": {n: statistics.median(t) for n, t in took.items()},
                     "same": same, "gap": gap}
    configs.plain()
    return out


def tune(model: Any, cache: str) -> tuple[Profile, Any]:
    """``astrai.tune_model`` on ``model`` (plain) into ``cache``: the profile and what
    ``tune_model`` returned. The model is left plain."""
    import astrai
    from astrai.integrations.transformers import restore_model

    got = astrai.tune_model(model, cache=cache, threads=1, prompt=PREFILL,
                            new_tokens=TUNE["new_tokens"], rounds=TUNE["rounds"],
                            budget=TUNE["budget"])
    restore_model(model)
    return Profile(got.name, cache), got


def tuning_note(tuned: Any) -> str:
    """Whether the machine was quiet while tuning, and what the profile leaves to the
    model's own code."""
    noise = tuned.tuned.noise
    quiet = ("quiet" if noise is None or noise.quiet
             else "NOT quiet (" + "; ".join(noise.reasons()) + ")")
    return (f"the machine was {quiet} while tuning; left to the model's own code: "
            f"{', '.join(tuned.left_to_model()) or 'nothing'}")


def _tune_allowed() -> str | None:
    """Why no profile is tuned here (``ASTR_TUNED=off``), or None."""
    from astrai.dispatch.tuned import tuned_setting

    return None if tuned_setting() else "ASTR_TUNED=off leaves tuned profiles out"


def python_path_child() -> None:
    """The child of the pure-Python measurement: ``ASTR_NATIVE=off`` (as a machine
    without a C++ compiler has it), its own profile tuned in its own temporary folder
    where asked; prints its figures as JSON."""
    config, new, prefill, rounds, tune_it, tune_settings = json.loads(sys.argv[2])
    CONFIG.update(config)
    globals().update(NEW_TOKENS=new, PREFILL=prefill, ROUNDS=rounds, TUNE=tune_settings)
    from astrai import native

    assert not native.status().loaded, native.status()
    model = _model()
    with tempfile.TemporaryDirectory() as cache:
        profile, tuned = tune(model, cache) if tune_it else (None, None)
        figures = eager_ratios(model, Configurations(model, profile))
    print(json.dumps({"figures": figures,
                      "tuning": None if tuned is None else tuning_note(tuned)}))


def python_path(tune_it: bool) -> dict[str, Any]:
    args = json.dumps([CONFIG, NEW_TOKENS, PREFILL, ROUNDS, tune_it, TUNE])
    env = {**os.environ, "ASTR_NATIVE": "off"}
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--python-child", args],
                          capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the pure-Python child failed:\n{done.stderr[-3000:]}")
    got: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return got


def compiled_ratios(model: Any, configs: Configurations) -> dict[str, Any]:
    """Prefill speed of the compiled plain and compiled routed models (the shipped
    tables) and of routed eager, each against plain eager, in the same rounds; cold
    compile seconds."""
    from astrai.dispatch.scopes import set_process_profiles
    from astrai.integrations.transformers import dispatch_model

    _, long = _inputs()
    prefill = _runs(model)[1]
    plain, routed = configs.plain, configs.routed("routed", prefill)
    plain()
    set_process_profiles()
    plain_copy, routed_copy = copy.deepcopy(model), copy.deepcopy(model)
    dispatch_model(routed_copy, mode="inference", tuned=False)
    compiled_plain, compiled_routed = torch.compile(plain_copy), torch.compile(routed_copy)
    cold = {}
    with torch.no_grad():
        for name, fn in (("plain", compiled_plain), ("routed", compiled_routed)):
            start = time.perf_counter()
            fn(long)
            cold[name] = time.perf_counter() - start
        gap = (compiled_routed(long).logits - model(long).logits).abs().max().item()
    compiled_plain_prefill = _runs(compiled_plain)[1]
    compiled_routed_prefill = _runs(compiled_routed)[1]
    r = paired({"plain": (plain, prefill),
                "compiled plain": (lambda: None, compiled_plain_prefill),
                "compiled routed": (lambda: None, compiled_routed_prefill),
                "routed": (routed, prefill), "A/A": (plain, prefill)}, "plain",
               ROUNDS["prefill"])
    plain()
    return {"speed": {k: 1 / v for k, v in r.items()}, "cold": cold, "gap": gap}


def _sibling(name: str) -> Any:
    """Another script of benchmarks/ as a module."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    return importlib.import_module(name)


def _linear_shapes(model: Any) -> list[tuple[Any, int, int]]:
    """Every ``Linear`` and ``Conv1D`` (GPT-2's, weight stored ``[in, out]``) of the model,
    the LM head included: (module, in features, out features)."""
    from transformers.pytorch_utils import Conv1D

    got: list[tuple[Any, int, int]] = []
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            got.append((m, m.in_features, m.out_features))
        elif isinstance(m, Conv1D):
            got.append((m, m.weight.shape[0], m.weight.shape[1]))
    return got


def weight_bytes(model: Any) -> int:
    """The bytes a forward reads multiplying by the model's weights: every ``Linear``'s
    and ``Conv1D``'s weight and bias, the LM head included."""
    total = 0
    for m, _, _ in _linear_shapes(model):
        total += m.weight.nbytes + (m.bias.nbytes if m.bias is not None else 0)
    return total


def _last_level_cache() -> int:
    """The largest CPU cache's bytes (Linux's sysfs; 32 MiB where it cannot be read)."""
    sizes = []
    base = "/sys/devices/system/cpu/cpu0/cache"
    for index in (os.listdir(base) if os.path.isdir(base) else []):
        try:
            with open(os.path.join(base, index, "size")) as f:
                text = f.read().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KM")) * unit)
    return max(sizes, default=32 << 20)


_BIG: list[torch.Tensor] = []


def big_buffer() -> torch.Tensor:
    """A float32 buffer twice the last-level cache (at least 256 MiB), made once."""
    if not _BIG:
        _BIG.append(torch.ones(max(2 * _last_level_cache(), 256 << 20) // 4))
    return _BIG[0]


def read_bandwidth(reps: int = 5) -> tuple[float, str]:
    """The most bytes per second one thread read from ``big_buffer()``: ``torch.sum``
    over it and ``.copy_`` from it into another buffer alike (bytes read, the writes not
    counted), best of ``reps`` each; and how."""
    src = big_buffer()
    dst = torch.empty_like(src)
    best: dict[str, float] = {}
    runs: dict[str, Callable[[], object]] = {"torch.sum": src.sum,
                                             ".copy_": lambda: dst.copy_(src)}
    for name, fn in runs.items():
        fn()
        for _ in range(reps):
            start = time.thread_time()
            fn()
            took = time.thread_time() - start
            best[name] = max(best.get(name, 0.0), src.nbytes / took)
    how = max(best, key=best.__getitem__)
    return best[how], (f"{how} of a {src.nbytes >> 20} MiB buffer (twice the last-level "
                       f"cache of {_last_level_cache() >> 20} MiB, at least 256 MiB), best of "
                       f"{reps}; torch.sum {best['torch.sum'] / 1e9:.1f} GB/s, .copy_ "
                       f"{best['.copy_'] / 1e9:.1f} GB/s")


def decode_seconds(model: Any, configs: Configurations) -> dict[str, float]:
    """One decode step (one token over the prompt's cache, a fresh copy each time; the
    weights evicted from the caches first, reading ``big_buffer()``) timed alone: the
    median seconds per configuration over ``DECODE_ROUNDS`` rounds."""
    prompt, _ = _inputs()
    named = inspect.signature(type(model).forward).parameters
    kv = "cache" if "cache" in named else "past_key_values"  # transformers 5 names it cache
    configs.plain()
    with torch.no_grad():
        out = model(prompt, use_cache=True)
    cache, token = getattr(out, kv), out.logits[:, -1:].argmax(-1)
    fresh: list[Any] = [None]

    def prepare() -> None:
        fresh[0] = copy.deepcopy(cache)
        big_buffer().sum()

    def step() -> object:
        with torch.no_grad():
            return model(token, use_cache=True, **{kv: fresh[0]}).logits

    took = timed_rounds(configs.runs(step, prepare), DECODE_ROUNDS)
    configs.plain()
    return {n: statistics.median(t) for n, t in took.items()}


def decode_roofline(model: Any, configs: Configurations, native_loaded: bool) -> bool:
    """Print the decode step's weight bytes per second against the read bandwidth;
    whether the routed configurations meet the target (with the extension)."""
    nbytes = weight_bytes(model)
    bandwidth, how = read_bandwidth()
    seconds = decode_seconds(model, configs)
    print(f"\ndecode step against the memory roofline (1 token over the {PROMPT}-token "
          f"prompt's cache, median of {DECODE_ROUNDS}, the weights evicted from the caches "
          f"before each):")
    print(f"  weights a step multiplies by: {nbytes / 1e6:.1f} MB (every Linear's weight and "
          "bias, the LM head included; the embedding row, the KV cache and the activations "
          "not counted)")
    print(f"  single-thread read bandwidth: {bandwidth / 1e9:.1f} GB/s ({how})")
    ok = True
    for name in ("plain", *configs.routings):
        rate = nbytes / seconds[name]
        line = (f"  {name:<22} {seconds[name] * 1e3:8.3f} ms  {rate / 1e9:6.1f} GB/s  "
                f"{rate / bandwidth:6.1%} of the bandwidth")
        if name != "plain":
            if native_loaded:
                passed = rate / bandwidth >= DECODE_TARGET
                ok &= passed
                line += f"   target >= {DECODE_TARGET:.0%} {verdict(passed)}"
            else:
                line += f"   (target >= {DECODE_TARGET:.0%} with the extension: not loaded)"
        print(line)
    print(f"  A/A {seconds['A/A'] / seconds['plain']:.3f}")
    return ok


def best_linear_us(model: Any, tokens: int) -> dict[tuple[int, int], tuple[str, float, int]]:
    """Per weight shape (in, out) of the model: the best linear row timed alone at
    ``tokens`` tokens (``bench_linear_isa.py``'s rows that serve that many: F.linear and
    astrai's faithful CPU rows, each weight read from memory), its microseconds, and how
    many layers have that shape."""
    isa = _sibling("bench_linear_isa")
    counts: dict[tuple[int, int], int] = {}
    for _, k_in, k_out in _linear_shapes(model):
        counts[(k_in, k_out)] = counts.get((k_in, k_out), 0) + 1
    kernels = isa.rows()
    got = {}
    with torch.no_grad():
        for (k_in, k_out), n in counts.items():
            timed = isa.time_shape(tokens, k_in, k_out, kernels, GEMM_ROUNDS)
            row = min(timed, key=timed.__getitem__)
            got[(k_in, k_out)] = (row, timed[row], n)
    return got


def prefill_gemm(model: Any, seconds: dict[str, float], routings: list[str],
                 native_loaded: bool) -> bool:
    """Print the prefill's linear products at the best row's speed against the whole
    prefill's time, per configuration; whether the routed ones meet the target."""
    best = best_linear_us(model, PREFILL)
    flops = sum(2 * PREFILL * k_in * k_out * n for (k_in, k_out), (_, _, n) in best.items())
    ideal = sum(us * n for _, us, n in best.values()) / 1e6
    print(f"\nprefill 1x{PREFILL} against the best GEMM: the linear layers' products "
          f"(2 x tokens x in x out each, the head included) are {flops / 1e9:.2f} GFLOP")
    print("  best row alone per shape (in x out: row, us, layers): " + "; ".join(
        f"{k_in}x{k_out}: {row} {us:.0f} x{n}" for (k_in, k_out), (row, us, n) in best.items()))
    print(f"  at those speeds: {ideal * 1e3:.2f} ms, {flops / ideal / 1e9:.1f} GFLOP/s")
    print("  the figure: that time over the whole prefill's - the share of the prefill the "
          "products would take at the best row's speed (the rest: attention, norms, rotary, "
          "Python, and products run slower than that)")
    ok = True
    for name in ("plain", *routings):
        share = ideal / seconds[name]
        line = (f"  {name:<22} {seconds[name] * 1e3:8.2f} ms  {flops / seconds[name] / 1e9:6.1f}"
                f" GFLOP/s  {share:6.1%}")
        if name != "plain":
            if native_loaded:
                ok &= share >= GEMM_TARGET
                line += f"   target >= {GEMM_TARGET:.0%} {verdict(share >= GEMM_TARGET)}"
            else:
                line += f"   (target >= {GEMM_TARGET:.0%} with the extension: not loaded)"
        print(line)
    return ok


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    parser.add_argument("--no-engine", action="store_true", help="leave bench_seed.py out")
    parser.add_argument("--no-tune", action="store_true", help="tune no profile")
    parser.add_argument("--quick", action="store_true", help="a tiny model, few rounds")
    parser.add_argument("--emulate", choices=["avx2"], action="append", default=[],
                        help="then the whole bench again with the libraries held to AVX2")
    parser.add_argument("--hidden", type=int, default=CONFIG["hidden_size"],
                        help="the model's hidden size (a multiple of 128; the MLP 2.75 times "
                             "as wide, heads of 64 features, half as many key-value heads)")
    return parser.parse_args(argv)


def sized(hidden: int) -> dict[str, Any]:
    """The bench's model at ``hidden`` features (the default's proportions)."""
    if hidden < 128 or hidden % 128:
        raise SystemExit(f"--hidden must be a multiple of 128, got {hidden}")
    heads = hidden // 64
    return {**CONFIG, "hidden_size": hidden, "intermediate_size": hidden * 11 // 4,
            "num_attention_heads": heads, "num_key_value_heads": heads // 2}


def tuned_profile(model: Any, cache: str, skip: bool) -> tuple[Profile | None, str | None]:
    """The profile tuned for ``model`` into ``cache`` (None with ``skip`` or where tuned
    profiles are off), printing its summary; and why none, or None."""
    why = "--no-tune" if skip else _tune_allowed()
    if why is not None:
        print(f"\nno profile tuned: {why}")
        return None, why
    start = time.perf_counter()
    profile, tuned = tune(model, cache)
    print(f"\nastrai.tune_model, this run's profile ({time.perf_counter() - start:.0f} s, "
          f"in a temporary cache folder; the user's cache untouched):")
    print("  " + tuned.summary().replace("\n", "\n  "))
    print(f"  left to the model's own code: {', '.join(tuned.left_to_model()) or 'nothing'}")
    return profile, None


def print_paths(paths: dict[str, dict[str, Any]], python_tuning: str | None) -> tuple[bool, bool]:
    """The speed table, routed (and tuned) against plain on both paths; (targets met,
    quiet)."""
    ok, quiet = True, True
    generate, prefill = f"generate {NEW_TOKENS}", f"prefill 1x{PREFILL}"
    print(f"\n{'':<48}{generate:>14}{prefill:>16}   target")
    for path, label, target in (("native", "native extension", NATIVE_TARGET),
                                ("python", "pure-Python path", PYTHON_TARGET)):
        # generate against the path's target; prefill against plain (>= 1.00x) on both
        if path not in paths:
            print(f"{f'routed, {label} / plain':<48}{'(no extension here)':>30}")
            continue
        g, p = paths[path]["generate"], paths[path]["prefill"]
        aa = (g["speed"]["A/A"], p["speed"]["A/A"])
        quiet &= abs(aa[0] - 1) <= QUIET and abs(aa[1] - 1) <= QUIET
        for name in g["same"]:
            speed = (g["speed"][name], p["speed"][name])
            passed = speed[0] >= target and speed[1] >= PREFILL_TARGET
            ok &= passed and bool(g["same"][name])
            print(f"{f'{name}, {label} / plain':<48}{speed[0]:>13.3f}x{speed[1]:>15.3f}x"
                  f"   >= {target:.2f}x / {PREFILL_TARGET:.2f}x {verdict(passed)}   "
                  f"(A/A {aa[0]:.3f} / {aa[1]:.3f})")
            print(f"{'':<4}numerics: greedy tokens "
                  f"{'identical' if g['same'][name] else 'DIFFER'}, prefill logits max "
                  f"|routed - plain| {g['gap'][name]:.2e}")
    if python_tuning is not None:
        print(f"the pure-Python path's own profile: {python_tuning}")
    return ok, quiet


def print_compiled(model: Any, configs: Configurations) -> tuple[bool, bool]:
    """torch.compile against eager on the prefill; (targets met, quiet)."""
    c = compiled_ratios(model, configs)
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
    return eager >= COMPILED_TARGET and both >= COMPILED_TARGET, abs(s["A/A"] - 1) <= QUIET


def emulated(isa: str, argv: list[str]) -> bool:
    """The whole bench again in a child process with its libraries held to ``isa``
    (``bench_linear_isa.run_held``); whether its targets were met (True where skipped:
    this machine's ISA is not above it)."""
    rest = [a for i, a in enumerate(argv) if a != "--emulate" and argv[i - 1:i] != ["--emulate"]
            and not a.startswith("--emulate=")]
    status = _sibling("bench_linear_isa").run_held(isa, __file__, rest, ok=(0, 1))
    return status in (None, 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _args(argv)
    if args.quick:
        globals().update(QUICK)
    elif args.hidden != CONFIG["hidden_size"]:
        CONFIG.update(sized(args.hidden))
    torch.set_num_threads(1)
    print(_sibling("bench_linear_isa").machine_line())
    import astrai.dispatch as d
    from astrai import native
    from astrai.dispatch.scopes import process_profiles, set_process_profiles
    from astrai.integrations.transformers import dispatch_model, restore_model

    model = _model()
    report = dispatch_model(model, mode="inference", tuned=False)
    restore_model(model)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"Llama {CONFIG['hidden_size']} hidden, {CONFIG['num_hidden_layers']} layers, "
          f"torch {torch.__version__}, 1 thread; load average {load:.2f}")
    print(native.status())
    print(f"routed: {report.counts()}; not routed: {len(report.not_routed)}")
    loaded = native.status().loaded
    before = process_profiles()
    with tempfile.TemporaryDirectory() as cache:
        profile, why = tuned_profile(model, cache, args.no_tune)
        configs = Configurations(model, profile)
        d.reset_stats()
        paths = {"native" if loaded else "python": eager_ratios(model, configs)}
        rows = d.stats().table()
        python_tuning = None
        if "python" not in paths:
            child = python_path(why is None)
            paths["python"], python_tuning = child["figures"], child["tuning"]
        ok, quiet = print_paths(paths, python_tuning)
        here = paths["native" if loaded else "python"]
        ok &= decode_roofline(model, configs, loaded)
        ok &= prefill_gemm(model, here["prefill"]["seconds"], list(configs.routings), loaded)
        if not args.no_compile:
            passed, calm = print_compiled(model, configs)
            ok, quiet = ok and passed, quiet and calm
        set_process_profiles(*before)
    if not quiet:
        print(f"the machine is not quiet: an A/A control strays more than {QUIET:.0%} "
              "from 1.00; these figures cannot be trusted")
    print("\nrows that served the routed runs (the path in force):")
    print(rows)
    restore_model(model)
    parts(model, PREFILL, PREFILL, "prefill")
    ok &= parts(model, 1, PROMPT + NEW_TOKENS, "a decode step")
    if not args.no_engine:
        print("\nthe engine (benchmarks/bench_seed.py):")
        done = subprocess.run([sys.executable, os.path.join(os.path.dirname(
            os.path.abspath(__file__)), "bench_seed.py")], capture_output=True, text=True,
            check=False)
        print("  " + done.stdout.strip().replace("\n", "\n  "))
        ok &= "FAIL" not in done.stdout
    for isa in args.emulate:
        ok &= emulated(isa, argv)
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
