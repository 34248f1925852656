"""Every available row of each family, timed side by side on this machine.

For each bucket (one call shape), every row that is available here and whose table
``when`` accepts the call is called directly, as the facade would call it. Compiled
rows compile on an untimed warm-up call. Then the rows are timed in interleaved rounds
(the order rotates from round to round), and the table shows the median microseconds
per call. The fastest faithful row of each bucket is marked ``*`` and named in the
winner column; non-faithful rows (``linear``'s ``bf16``) are timed as well but can
never win. CPU, one thread by default, under ``torch.no_grad()``.

The clock is the calling thread's CPU time (``time.thread_time``): with one intra-op
thread every kernel runs on that thread, and on a shared machine wall-clock medians of
one and the same kernel were seen to differ by 2x between neighbouring rows, while CPU
time leaves out the time the thread waits for a core. ``--wall`` times wall clock, and so
does ``--threads N`` for N > 1: the calling thread's CPU time would leave out what the
other threads do. Inductor keeps the code it compiles in a cache on disk that does not
tell thread counts apart: time each thread count with its own ``TORCHINDUCTOR_CACHE_DIR``,
or the compiled rows may run code made for another.

Buckets:

- attention, batch 1, 8 query heads (GQA: 2 kv heads): decode (q_len 1, kv_len 512);
  causal prefill with q_len == kv_len in {16, 128, 512, 2048}; non-causal in {128, 512};
  chunked prefill (q_len 16, kv_len 512, causal); head_dim 64 and 128, fp32 and bf16.
- attention training (forward + backward of ``out.sum()``, grad mode on): causal
  q_len == kv_len in {16, 128, 512}, head_dim 64 (MHA) and 128 (GQA, 128 only).
- rms_norm, rotary, linear, layer_norm, activation: tokens in {1, 64, 4096} (``--tokens``
  for others), two feature sizes (rms_norm and layer_norm: 512 and 4096; activation 4096;
  ``--hidden`` for others), fp32 and bf16; layer_norm also weightless (OLMo's), every
  activation, and gated_activation with silu and gelu_tanh, each beside the model's own code
  for it (column ``(model)``: nn.LayerNorm, OLMo's float32 norm, transformers' activation
  classes, an MLP's ``act_fn(gate) * up``);
  rms_norm also in LlamaRMSNorm's form (``cast_before_weight``), rotary also in the half
  layout of transformers' ``apply_rotary_pos_emb`` (q and k of 8 heads each).
- moe_experts: 8 experts of hidden 1024 (``--hidden``), intermediate 1408, top 2, at the
  same token counts, beside transformers' Mixtral expert stack; moe_router: Qwen3-MoE's
  choice (64 experts, top 8) and DeepSeek-V3's (256 experts in 8 groups, top 8), beside
  the models' own code for the choice; cross_entropy of logits [tokens, 32000] and
  linear_cross_entropy of hidden 512 against a 32000-word head (inference, and a training
  forward + backward), beside the head and transformers' loss formula.

A row is timed on the buckets its table ``when`` accepts; ``--any-when`` times every
available row serving the bucket's features, to measure where a row's region should end.

Usage: ``python benchmarks/bench_rows.py [--threads N] [--quick] [--json PATH]
[--family F ...] [--no-training] [--wall] [--device cuda] [--tokens N ...]
[--hidden N ...] [--any-when]``.
The whole run takes about three minutes on two cores, about half of it compiling.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import timeit
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

import astrai.dispatch as dispatch
from astrai import ops
from astrai.backends.rotary import rotary_freqs
from astrai.dispatch.axes import asked_features

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SAMPLE_S = 0.004  # each timed sample runs the call this long, at least
TIE = 0.03  # rows within 3% of the fastest are named with it: that close is noise here
OWN = "(model)"  # the column of the model's own code


@dataclass
class Bucket:
    """One call shape: ``args`` for the family's facade, a short label; ``train``: time
    the forward and the backward of ``out.sum()`` with grad mode on."""

    family: str
    label: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    train: bool = False
    #: The model's own code for the same call, timed beside the rows as ``(model)`` (it
    #: never wins: it is what the rows are measured against).
    own: Callable[[], object] | None = None


@dataclass
class Result:
    bucket: Bucket
    us: dict[str, float]  # row -> median us per call
    unfaithful: set[str]
    seconds: float

    @property
    def winner(self) -> str:
        fair = {k: v for k, v in self.us.items() if k not in self.unfaithful and k != OWN}
        return min(fair, key=fair.__getitem__)

    @property
    def ties(self) -> list[str]:
        """Other faithful rows within ``TIE`` of the winner."""
        best = self.us[self.winner]
        return [k for k, v in self.us.items() if k != self.winner and k != OWN
                and k not in self.unfaithful and v <= best * (1 + TIE)]


def _rand(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def attention_buckets(quick: bool) -> list[Bucket]:
    """The attention shapes (see the module docstring)."""
    out: list[Bucket] = []

    def add(q_len: int, kv_len: int, d: int, kv_heads: int, dt: str, causal: bool) -> None:
        dtype = DTYPES[dt]
        q = _rand(1, q_len, 8, d, dtype=dtype, seed=1)
        k = _rand(1, kv_len, kv_heads, d, dtype=dtype, seed=2)
        v = _rand(1, kv_len, kv_heads, d, dtype=dtype, seed=3)
        kind = "mha" if kv_heads == 8 else "gqa"
        label = (f"q{q_len:<4} kv{kv_len:<4} d{d:<3} {kind} {dt} "
                 f"{'causal' if causal else 'full'}")
        out.append(Bucket("attention", label, (q, k, v), {"is_causal": causal}))

    shapes = [(64, 8), (128, 8), (128, 2)]  # (head_dim, kv_heads): MHA 64/128, GQA 128
    lengths = (16, 128) if quick else (16, 128, 512)
    for dt in DTYPES:
        for d, kvh in shapes:
            add(1, 512, d, kvh, dt, True)  # decode
        for n in lengths:
            for d, kvh in ((64, 8), (128, 2)):
                add(n, n, d, kvh, dt, True)  # causal prefill
        for n in lengths[1:]:
            add(n, n, 64, 8, dt, False)  # non-causal (encoder-style)
        add(16, 512, 128, 2, dt, True)  # a chunk of prefill over a cached context
        if not quick:
            add(2048, 2048, 64, 8, dt, True)
    return out


def training_buckets(quick: bool) -> list[Bucket]:
    """Attention forward + backward (grad mode on), causal, batch 1, 8 query heads."""
    out: list[Bucket] = []
    shapes = [(16, 64, 8), (128, 64, 8), (128, 128, 2)] + ([] if quick else [(512, 64, 8)])
    for dt, dtype in DTYPES.items():
        for n, d, kvh in shapes:
            q = _rand(1, n, 8, d, dtype=dtype, seed=1).requires_grad_()
            k = _rand(1, n, kvh, d, dtype=dtype, seed=2).requires_grad_()
            v = _rand(1, n, kvh, d, dtype=dtype, seed=3).requires_grad_()
            kind = "mha" if kvh == 8 else "gqa"
            out.append(Bucket("attention", f"q{n:<4} kv{n:<4} d{d:<3} {kind} {dt} causal",
                              (q, k, v), {"is_causal": True}, train=True))
    return out


def token_buckets(family: str, quick: bool, tokens: tuple[int, ...] | None = None,
                  hidden: tuple[int, ...] | None = None) -> list[Bucket]:
    """rms_norm / rotary / linear over tokens {1, 64, 4096} (or ``tokens``) and two feature
    sizes (rms_norm's: ``hidden``, when given)."""
    out: list[Bucket] = []
    if tokens is None:
        tokens = (1, 64) if quick else (1, 64, 4096)
    for dt, dtype in DTYPES.items():
        for n in tokens:
            if family == "rms_norm":
                for f in hidden or (512, 4096):
                    x = _rand(n, f, dtype=dtype, seed=n)
                    w = torch.rand(f).to(dtype) + 0.5
                    out.append(Bucket(family, f"tokens{n:<5} features{f:<5} {dt}", (x, w)))
                    out.append(Bucket(family, f"tokens{n:<5} features{f:<5} {dt} llama",
                                      (x, w), {"cast_before_weight": True}))
            elif family == "rotary":
                for hd in (64, 128):
                    x = _rand(1, n, 8, hd, dtype=dtype, seed=n)
                    out.append(Bucket(family, f"tokens{n:<5} 8x{hd:<4} {dt}",
                                      (x, rotary_freqs(torch.arange(n)[None], hd))))
                    out.append(Bucket(family, f"tokens{n:<5} 8x{hd:<4} {dt} half",
                                      half_call(n, hd, dtype)))
            elif family == "layer_norm":
                for f in hidden or (512, 4096):
                    x = _rand(n, f, dtype=dtype, seed=n)
                    w, b = torch.rand(f).to(dtype) + 0.5, torch.rand(f).to(dtype)
                    out.append(Bucket(family, f"tokens{n:<5} features{f:<5} {dt}",
                                      (x, w, b, 1e-5), own=partial(_own_layer_norm, x, w, b)))
                    out.append(Bucket(family, f"tokens{n:<5} features{f:<5} {dt} olmo",
                                      (x, None, None, 1e-5), own=partial(_own_olmo, x)))
            elif family == "activation":
                for f in hidden or (4096,):
                    x = _rand(n, f, dtype=dtype, seed=n)
                    for act, own in _OWN_ACTS.items():
                        out.append(Bucket(family, f"tokens{n:<5} features{f:<5} {dt} {act}",
                                          (x, act), own=partial(own, x)))
            elif family == "gated_activation":
                for f in hidden or (4096,):
                    g, u = _rand(n, f, dtype=dtype, seed=n), _rand(n, f, dtype=dtype, seed=n + 1)
                    for act in ("silu", "gelu_tanh"):
                        out.append(Bucket(family, f"tokens{n:<5} features{f:<5} {dt} {act}",
                                          (g, u, act), own=partial(_own_gated, g, u, act)))
            elif family == "gated_rms_norm":
                for f in hidden or (128, 4096):  # a head's (Qwen3-Next), a mixer's (Mamba-2)
                    x = _rand(n, 1, f, dtype=dtype, seed=n)
                    z = _rand(n, 1, f, dtype=dtype, seed=n + 1)
                    w = torch.rand(1, f).to(dtype) + 0.5
                    for first in (False, True):
                        form = "gate-first" if first else "norm-first"
                        out.append(Bucket(family, f"tokens{n:<5} features{f:<5} {dt} {form}",
                                          (x, w, z, 1e-6, first),
                                          own=partial(_own_gated_norm, x, w[0], z, first)))
            elif family == "depthwise_conv1d":
                for c in hidden or (2048, 8192):  # Mamba's expand * hidden channels
                    x = _rand(1, c, n, dtype=dtype, seed=n)
                    w = _rand(c, 1, 4, dtype=dtype, seed=c)
                    b = _rand(c, dtype=dtype, seed=c + 1)
                    conv = torch.nn.Conv1d(c, c, 4, groups=c, padding=3).to(dtype)
                    conv.weight.data, conv.bias.data = w, b  # type: ignore[union-attr]
                    out.append(Bucket(family, f"tokens{n:<5} channels{c:<5} 4 taps {dt}",
                                      (x, w, b, 3), own=partial(conv, x)))
            elif family == "xielu":
                for f in hidden or (4096, 21504):  # Apertus 8B: hidden, intermediate
                    x = _rand(n, f, dtype=dtype, seed=n)
                    act = _own_xielu(dtype)
                    a_p = torch.tensor([0.8], dtype=dtype).expm1().log()  # its initial ones
                    a_n = torch.tensor([0.3], dtype=dtype).expm1().log()
                    out.append(Bucket(family, f"tokens{n:<5} features{f:<5} {dt}",
                                      (x, a_p, a_n, 0.5, -1e-6),
                                      own=None if act is None else partial(act, x)))
            elif family == "moe_experts":
                out += _experts_buckets(n, dt, dtype, hidden)
            elif family == "moe_router":
                out += _router_buckets(n, dt, dtype)
            elif family in ("cross_entropy", "linear_cross_entropy"):
                out += _loss_buckets(family, n, dt, dtype, hidden)
            else:
                for fi, fo in ((512, 512), (1024, 4096)):
                    x = _rand(n, fi, dtype=dtype, seed=n)
                    w = _rand(fo, fi, dtype=dtype, seed=fo) / fi**0.5
                    out.append(Bucket(family, f"tokens{n:<5} {fi}->{fo:<5} {dt}", (x, w)))
    return out


def _own_layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``nn.LayerNorm``'s forward (what GPT-2, BERT, OPT... run)."""
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, 1e-5)


def _own_olmo(x: torch.Tensor) -> torch.Tensor:
    """OLMo's weightless norm: float32, then cast back."""
    return torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), None, None,
                                          eps=1e-5).to(x.dtype)


def _own_gelu_new(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``NewGELUActivation``, op by op in x's dtype."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi)
                                       * (x + 0.044715 * torch.pow(x, 3.0))))


#: Each activation with the code models run for it (transformers' ``ACT2FN`` classes).
_OWN_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu,
    "gelu_tanh": _own_gelu_new, "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": torch.nn.functional.relu,
    "relu2": lambda x: torch.square(torch.nn.functional.relu(x))}


def _own_xielu(dtype: torch.dtype) -> Any:
    """transformers' XIELUActivation at its initial coefficients (its Python forward, the
    one CPU runs); ``None`` where transformers is not installed."""
    try:
        from transformers.activations import XIELUActivation
    except ImportError:
        return None
    return XIELUActivation(dtype=dtype).requires_grad_(False)


def _own_gated_norm(x: torch.Tensor, w: torch.Tensor, z: torch.Tensor, gate_first: bool
                    ) -> torch.Tensor:
    """transformers' RMSNormGated forwards: Mamba-2's (gate, norm, weight in x's dtype) or
    Qwen3-Next's (norm, weight in x's dtype, gate in float32, cast)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    if gate_first:
        h = h * torch.nn.functional.silu(z.to(torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    h = w * h.to(dtype)
    if gate_first:
        return h
    return (h * torch.nn.functional.silu(z.to(torch.float32))).to(dtype)


def _own_gated(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """A Llama-style MLP's ``act_fn(gate) * up`` (transformers' activation class, then the
    product)."""
    return _OWN_ACTS[act](gate) * up


def _experts_buckets(n: int, dt: str, dtype: torch.dtype, hidden: tuple[int, ...] | None
                     ) -> list[Bucket]:
    """moe_experts: 8 experts, top 2, hidden 1024 (or ``hidden``), intermediate 1408, beside
    transformers' own expert stack (Mixtral's) where transformers is installed."""
    out = []
    for h in hidden or (1024,):
        e, i, k = 8, 1408, 2
        gate_up = _rand(e, 2 * i, h, dtype=dtype, seed=11) / h**0.5
        down = _rand(e, h, i, dtype=dtype, seed=12) / i**0.5
        x = _rand(n, h, dtype=dtype, seed=n)
        g = torch.Generator().manual_seed(n)
        index = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
        weights = torch.rand(n, k, generator=g)
        out.append(Bucket("moe_experts", f"tokens{n:<5} {e}x{h}x{i} top{k} {dt}",
                          (x, index, weights, gate_up, down, "silu"),
                          own=_own_experts(x, index, weights, gate_up, down)))
    return out


def _own_experts(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                 gate_up: torch.Tensor, down: torch.Tensor) -> Callable[[], object] | None:
    """transformers' Mixtral expert stack holding these weights, called as its block
    calls it (``None`` without transformers)."""
    try:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    except ImportError:
        return None
    config = MixtralConfig(hidden_size=x.shape[1], intermediate_size=down.shape[2],
                           num_local_experts=gate_up.shape[0], hidden_act="silu")
    stack = MixtralExperts(config)
    stack.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=False)
    stack.down_proj = torch.nn.Parameter(down, requires_grad=False)
    return partial(stack, x, index, weights)


def _router_buckets(n: int, dt: str, dtype: torch.dtype) -> list[Bucket]:
    """moe_router: Qwen3-MoE's choice (64 experts, softmax, top 8, renormalised) and
    DeepSeek-V3's (256 experts, sigmoid + bias, 8 groups keeping 4, top 8, times 2.5),
    each beside the models' own code for it."""
    qwen = _rand(n, 64, dtype=dtype, seed=n)
    deep = _rand(n, 256, dtype=torch.float32, seed=n)  # DeepSeek's router runs in float32
    bias = _rand(256, dtype=torch.float32, seed=9) * 0.1
    return [Bucket("moe_router", f"tokens{n:<5} qwen3 64e top8 {dt}", (qwen, 8, "softmax", True),
                   own=partial(_own_qwen_router, qwen)),
            Bucket("moe_router", f"tokens{n:<5} deepseek 256e top8 fp32",
                   (deep, 8, "sigmoid", True, bias, 8, 4, 2.5),
                   own=partial(_own_deepseek_router, deep, bias))]


def _own_qwen_router(logits: torch.Tensor) -> Any:
    """Qwen3-MoE's choice after its router's matmul."""
    top, index = torch.topk(torch.softmax(logits, dtype=torch.float, dim=-1), 8, dim=-1)
    return (top / top.sum(dim=-1, keepdim=True)).to(logits.dtype), index


def _own_deepseek_router(logits: torch.Tensor, bias: torch.Tensor) -> Any:
    """DeepSeek-V3's choice after its router's matmul (groups, correction bias)."""
    scores = logits.sigmoid()
    choice = scores + bias
    groups = choice.view(-1, 8, 32).topk(2, dim=-1)[0].sum(dim=-1)
    kept = torch.zeros_like(groups).scatter_(1, torch.topk(groups, 4, dim=-1, sorted=False)[1], 1)
    mask = kept.unsqueeze(-1).expand(-1, 8, 32).reshape(-1, 256)
    index = torch.topk(choice.masked_fill(~mask.bool(), float("-inf")), 8, dim=-1,
                       sorted=False)[1]
    top = scores.gather(1, index)
    return top / (top.sum(dim=-1, keepdim=True) + 1e-20) * 2.5, index


def _loss_buckets(family: str, n: int, dt: str, dtype: torch.dtype,
                  hidden: tuple[int, ...] | None) -> list[Bucket]:
    """cross_entropy of logits [n, 32000], and linear_cross_entropy of hidden [n, 512]
    (``--hidden``) against a 32000-word head, in inference and as a training step
    (forward + backward), beside the models' own code: the head, then transformers'
    ``ForCausalLMLoss`` formula (float32 logits, ``F.cross_entropy``)."""
    vocab = 32000
    labels = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n))
    if family == "cross_entropy":
        logits = _rand(n, vocab, dtype=dtype, seed=n)
        return [Bucket(family, f"tokens{n:<5} vocab{vocab} {dt}", (logits, labels),
                       own=partial(_own_loss, logits, labels))]
    out = []
    for h in hidden or (512,):
        x = _rand(n, h, dtype=dtype, seed=n)
        w = _rand(vocab, h, dtype=dtype, seed=7) / h**0.5
        out.append(Bucket(family, f"tokens{n:<5} {h}->{vocab} {dt}", (x, w, labels),
                          own=partial(_own_head_loss, x, w, labels)))
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        out.append(Bucket(family, f"tokens{n:<5} {h}->{vocab} {dt} train", (xg, wg, labels),
                          train=True, own=partial(_own_head_loss, xg, wg, labels, True)))
    return out


def _own_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers' causal-LM loss on given logits (float32, ``F.cross_entropy``)."""
    return torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=-100)


def _own_head_loss(x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor,
                   train: bool = False) -> Any:
    """A model's head and its loss: the whole logits, then the loss (and its backward)."""
    with torch.enable_grad() if train else torch.no_grad():
        loss = _own_loss(torch.nn.functional.linear(x, w), labels)
        if train:
            loss.backward()
    return loss


def half_call(tokens: int, head_dim: int, dtype: torch.dtype) -> tuple[Any, ...]:
    """A half-layout rotary call as transformers makes it: q and k [1, 8, tokens,
    head_dim] (transposed from the projections' layout), cos/sin [1, tokens, head_dim]."""
    q = _rand(1, tokens, 8, head_dim, dtype=dtype, seed=tokens).transpose(1, 2)
    k = _rand(1, tokens, 8, head_dim, dtype=dtype, seed=tokens + 1).transpose(1, 2)
    angles = torch.arange(tokens)[None, :, None] * 10000.0 ** (
        -torch.arange(0, head_dim, 2) / head_dim)
    emb = torch.cat((angles, angles), -1)
    return q, k, emb.cos().to(dtype), emb.sin().to(dtype), 1


def rows_for(bucket: Bucket, any_when: bool = False
             ) -> tuple[dict[str, Callable[[], object]], set[str]]:
    """The rows that serve ``bucket`` here (``any_when``: whatever their ``when`` says):
    name -> zero-argument call; and the non-faithful ones."""
    reg = dispatch.current()
    with torch.set_grad_enabled(bucket.train or torch.is_grad_enabled()):
        ctx = ops.context(bucket.family, *bucket.args, **bucket.kwargs)
    calls: dict[str, Callable[[], object]] = {}
    unfaithful: set[str] = set()
    for rec in reg.family(bucket.family).rows:
        if (not reg.availability(rec)[0] or not (any_when or rec.spec.matches(ctx))
                or not asked_features(ctx) <= rec.features):
            continue
        obj, args, kwargs = rec.obj, bucket.args, bucket.kwargs
        if bucket.train:
            calls[rec.name] = partial(_train_call, obj, args, kwargs)
        else:
            calls[rec.name] = lambda obj=obj, args=args, kwargs=kwargs: obj(*args, **kwargs)
        if not rec.faithful:
            unfaithful.add(rec.name)
    if bucket.own is not None and calls:
        calls[OWN] = bucket.own
    return calls, unfaithful


def _train_call(obj: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
                ) -> None:
    """The forward and the backward of ``out.sum()``, autograd recording."""
    with torch.enable_grad():
        obj(*args, **kwargs).sum().backward()


def time_rows(calls: dict[str, Callable[[], object]], rounds: int,
              timer: Callable[[], float]) -> dict[str, float]:
    """Median us per call of each function, in interleaved rounds after a warm-up."""
    number: dict[str, int] = {}
    for name, fn in calls.items():
        fn()  # compiles a compiled row
        t = timeit.timeit(fn, number=1, timer=timer)
        number[name] = max(1, int(SAMPLE_S / max(t, 1e-7)))
    samples: dict[str, list[float]] = {k: [] for k in calls}
    names = list(calls)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            n = number[name]
            samples[name].append(timeit.timeit(calls[name], number=n, timer=timer) / n * 1e6)
    return {k: statistics.median(v) for k, v in samples.items()}


def run(buckets: list[Bucket], rounds: int, timer: Callable[[], float],
        any_when: bool = False) -> list[Result]:
    results = []
    for b in buckets:
        start = time.perf_counter()
        calls, unfaithful = rows_for(b, any_when)
        # Few rounds for the slow shapes: their medians are steady and the run stays short.
        probe = min(timeit.timeit(fn, number=1, timer=timer) for fn in calls.values())
        n_rounds = rounds if probe < 0.02 else max(3, rounds // 3)
        us = time_rows(calls, n_rounds, timer)
        results.append(Result(b, us, unfaithful, time.perf_counter() - start))
        print(f"  {b.family:9} {b.label:40} {time.perf_counter() - start:6.1f}s", file=sys.stderr)
    return results


def render(family: str, results: list[Result], title: str = "") -> str:
    rows = [name for name in (r.name for r in dispatch.current().family(family).rows)
            if any(name in res.us for res in results)]
    if any(OWN in res.us for res in results):
        rows.append(OWN)
    width = max(len(r.bucket.label) for r in results)
    head = f"{'bucket':{width}}  " + "  ".join(f"{n:>13}" for n in rows) + "  winner"
    lines = [f"{title or family} (median us per call; * fastest faithful row; ~ not faithful)",
             head]
    for res in results:
        cells = []
        for n in rows:
            if n not in res.us:
                cells.append(f"{'-':>13}")
                continue
            mark = "*" if n == res.winner else ("~" if n in res.unfaithful else " ")
            cells.append(f"{res.us[n]:12.1f}{mark}")
        tie = f" (= {', '.join(res.ties)} within {TIE:.0%})" if res.ties else ""
        lines.append(f"{res.bucket.label:{width}}  " + "  ".join(cells) + f"  {res.winner}{tie}")
    return "\n".join(lines)


def on(buckets: list[Bucket], device: torch.device) -> list[Bucket]:
    """``buckets`` with their tensors moved to ``device``."""
    if device.type == "cpu":
        return buckets

    def move(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.detach().to(device).requires_grad_(value.requires_grad)
        return value

    return [Bucket(b.family, b.label, tuple(move(a) for a in b.args),
                   {k: move(v) for k, v in b.kwargs.items()}, b.train) for b in buckets]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--quick", action="store_true", help="fewer, smaller buckets")
    parser.add_argument("--json", help="write every median here")
    parser.add_argument("--family", action="append", help="only these families")
    parser.add_argument("--no-training", action="store_true",
                        help="leave out the attention forward + backward buckets")
    parser.add_argument("--wall", action="store_true",
                        help="time wall clock instead of this thread's CPU time")
    parser.add_argument("--device", default="cpu",
                        help="where the calls' tensors live (cuda: wall clock, synchronised)")
    parser.add_argument("--tokens", type=int, nargs="+",
                        help="token counts of the rms_norm, rotary and linear buckets")
    parser.add_argument("--hidden", type=int, nargs="+",
                        help="feature sizes of the rms_norm buckets (channels of the "
                             "depthwise_conv1d ones)")
    parser.add_argument("--any-when", action="store_true",
                        help="time every available row, whatever its table when says")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    families = args.family or ["attention", "rms_norm", "rotary", "linear", "layer_norm",
                               "activation", "gated_activation", "gated_rms_norm",
                               "depthwise_conv1d", "xielu",
                               "moe_experts", "moe_router", "cross_entropy",
                               "linear_cross_entropy"]
    reg = dispatch.current()
    wall = args.wall or args.threads > 1  # other threads' work is no CPU time of this one
    timer: Callable[[], float] = time.perf_counter if wall else time.thread_time
    clock = "wall clock" if wall else "CPU time of the calling thread"
    if device.type == "cuda":  # kernels run asynchronously: each reading waits for them
        def timer() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()
        clock = f"wall clock, {device} synchronised at each reading"
    print(f"torch {torch.__version__}, {args.threads} thread(s), torch.no_grad(), {clock}, "
          f"tensors on {device}")
    for fam in families:
        for rec in reg.family(fam).rows:
            ok, why = reg.availability(rec)
            if not ok:
                print(f"{fam}.{rec.name}: not timed, unavailable ({why})")
    report: dict[str, list[dict[str, Any]]] = {}
    for fam in families:
        with torch.no_grad():
            buckets = (attention_buckets(args.quick) if fam == "attention"
                       else token_buckets(fam, args.quick, args.tokens and tuple(args.tokens),
                                          args.hidden and tuple(args.hidden)))
            results = run(on(buckets, device), args.rounds, timer, args.any_when)
        print()
        print(render(fam, results))
        report[fam] = [{"bucket": r.bucket.label, "us": r.us, "winner": r.winner,
                        "ties": r.ties} for r in results]
        if fam == "attention" and not args.no_training:
            results = run(on(training_buckets(args.quick), device), args.rounds, timer)
            print()
            print(render(fam, results, "attention training: forward + backward"))
            report["attention-training"] = [
                {"bucket": r.bucket.label, "us": r.us, "winner": r.winner, "ties": r.ties}
                for r in results]
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
