"""Tests of the attention rows (math, torch_native, flash) and of tables/attention.yaml.

Numerics are checked against an independent float64 loop, every pair of faithful
rows is compared on every call both accept (by the table's ``when``: rows are
plain callables whose eligibility is the YAML alone).
"""

from __future__ import annotations

import functools
import importlib
import itertools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import yaml

from astrai import ops
from astrai.backends.attention.flash import flash_attention, flash_available
from astrai.backends.attention.math import math_attention
from astrai.dispatch import Unavailable, shipped_tables_dir
from astrai.dispatch.tables.load import parse_file
from astrai.kv_cache import KVPool, decode_batch, extend_batch, prefill_batch
from astrai.ops import context as ops_context

attention_context = functools.partial(ops_context, "attention")

TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 2e-2, torch.float64: 1e-10}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ROWS = yaml.safe_load((shipped_tables_dir() / "attention.yaml").read_text())["rows"]
#: The rows' ``when`` as the loader builds them (they use the table's definitions).
_TABLE = parse_file(shipped_tables_dir() / "attention.yaml").table
assert _TABLE is not None
WHEN = {row.name: row.spec for row in _TABLE.rows}


def load_impl(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def faithful_rows(*call: Any, **kwargs: Any) -> list[tuple[str, Any]]:
    """Faithful rows available on this machine, as (name, impl); given a call, only the rows
    whose ``when`` accepts it."""
    out = []
    for row in ROWS:
        probe = row.get("available")
        if row.get("faithful", True) and (probe is None or load_impl(probe)()) and (
                not call or WHEN[row["name"]].matches(attention_context(*call, **kwargs))):
            out.append((row["name"], load_impl(row["impl"])))
    return out


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    torch.testing.assert_close(a.double(), b.double(), atol=tol, rtol=tol)


def loop_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: Any = None
) -> torch.Tensor:
    """Dense attention one query at a time, in float64 (independent of the rows)."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    full = None if mask is None else mask.expand(b, h, sq, sk)
    out = torch.zeros(b, sq, h, v.shape[-1], dtype=torch.float64)
    for bi, hi, i in itertools.product(range(b), range(h), range(sq)):
        kh = hi // (h // hkv)
        scores, values = [], []
        for j in range(sk):
            if causal and j > i + sk - sq:
                continue
            s = float(q[bi, i, hi].double() @ k[bi, j, kh].double()) / math.sqrt(d)
            if full is not None:
                if full.dtype == torch.bool:
                    if not full[bi, hi, i, j]:
                        continue
                else:
                    s += float(full[bi, hi, i, j])
            scores.append(s)
            values.append(v[bi, j, kh].double())
        if scores:
            w = torch.softmax(torch.tensor(scores, dtype=torch.float64), 0)
            out[bi, i, hi] = sum(wj * vj for wj, vj in zip(w, values, strict=True))
    return out.reshape(b, sq, -1)


def dense_inputs(dtype: torch.dtype, sq: int, sk: int, heads: int = 4, kv_heads: int = 2,
                 d: int = 8, b: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(sq * 31 + sk * 7 + kv_heads)
    return tuple(  # type: ignore[return-value]
        torch.randn(b, s, n, d, generator=g).to(dtype)
        for s, n in ((sq, heads), (sk, kv_heads), (sk, kv_heads))
    )


MASKS = ("none", "bool", "additive")


def make_mask(kind: str, b: int, sq: int, sk: int) -> torch.Tensor | None:
    if kind == "none":
        return None
    g = torch.Generator().manual_seed(5)
    keep = torch.rand(b, 1, sq, sk, generator=g) > 0.3
    keep[..., 0] = True  # every query keeps at least one key
    if kind == "bool":
        return keep
    return torch.where(keep, torch.randn(b, 1, sq, sk, generator=g), float("-inf"))


class TestDenseNumerics:
    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=lambda n: f"kv{n}")
    @pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
    @pytest.mark.parametrize("lens", [(5, 5), (3, 6), (6, 4)], ids=str)
    @pytest.mark.parametrize("mask", MASKS)
    def test_rows_agree_with_the_loop_and_each_other(
        self, dtype: torch.dtype, kv_heads: int, causal: bool, lens: tuple[int, int], mask: str
    ) -> None:
        """Every faithful row matches the float64 loop and every other row."""
        sq, sk = lens
        q, k, v = dense_inputs(dtype, sq, sk, kv_heads=kv_heads)
        m = make_mask(mask, 2, sq, sk)
        m_in = m if m is None or m.dtype == torch.bool else m.to(dtype)
        want = loop_attention(q, k, v, causal, m_in)
        kwargs = dict(attn_mask=m_in, is_causal=causal)
        outs = {}
        for name, impl in faithful_rows():
            if WHEN[name].matches(attention_context(q, k, v, **kwargs)):
                outs[name] = impl(q, k, v, **kwargs)
                assert outs[name].shape == (2, sq, 32) and outs[name].dtype == dtype
                close(outs[name], want, dtype)
        assert "math" in outs and "torch_native" in outs
        for (_, a), (_, b) in itertools.combinations(outs.items(), 2):
            close(a, b, dtype)

    def test_query_without_visible_keys_gives_zero(self) -> None:
        """A fully masked query row yields zeros in every row that takes masks, never NaN."""
        q, k, v = dense_inputs(torch.float32, 3, 4)
        mask = torch.ones(1, 1, 3, 4, dtype=torch.bool)
        mask[..., 1, :] = False
        for _, impl in faithful_rows(q, k, v, attn_mask=mask):
            out = impl(q, k, v, attn_mask=mask)
            assert not out.isnan().any()
            assert (out[:, 1] == 0).all()

    def test_gradients_flow_through_dense_rows(self) -> None:
        """Dense rows are differentiable and agree on gradients."""
        grads = []
        call = dense_inputs(torch.float32, 4, 4)
        for _, impl in faithful_rows(*call, is_causal=True):
            q, k, v = (t.clone().requires_grad_() for t in call)
            impl(q, k, v, is_causal=True).square().sum().backward()
            grads.append(torch.cat([t.grad.flatten() for t in (q, k, v)]))  # type: ignore[union-attr]
        for a, b in itertools.combinations(grads, 2):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)

    @pytest.mark.parametrize("row", ["math", "torch_native"])
    def test_error_bad_dense_shapes(self, row: str) -> None:
        """Mismatched heads, head_dim or mask shapes are ValueErrors naming the problem, raised
        before any row runs."""
        q, k, v = dense_inputs(torch.float32, 3, 3, heads=4, kv_heads=4)
        with pytest.raises(ValueError, match="not a multiple"):
            ops.attention(q, k[:, :, :3], v[:, :, :3], backend=row)
        with pytest.raises(ValueError, match="head_dim 8 but k has 4"):
            ops.attention(q, k[..., :4], v, backend=row)
        with pytest.raises(ValueError, match="does not broadcast"):
            ops.attention(q, k, v, attn_mask=torch.ones(2, 3, dtype=torch.bool), backend=row)


def sequences(dtype: torch.dtype, lens: list[int], heads: int, kv_heads: int, d: int,
              seed: int) -> list[tuple[torch.Tensor, ...]]:
    """Per request, the q/k/v of its whole sequence: [1, len, heads, d]."""
    g = torch.Generator().manual_seed(seed)
    return [
        tuple(torch.randn(1, n, h, d, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
        for n in lens
    ]


def pack(seqs: list[tuple[torch.Tensor, ...]], spans: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Concatenate positions [a, b) of each request's q, k and v into packed tensors."""
    return [
        torch.cat([s[i][0, a:b] for s, (a, b) in zip(seqs, spans, strict=True)])
        for i in range(3)
    ]


def paged_schedule(
    impl: Callable[..., torch.Tensor], dtype: torch.dtype, heads: int = 4, kv_heads: int = 2,
    d: int = 8, **features: Any,
) -> tuple[list[tuple[torch.Tensor, ...]], list[torch.Tensor], KVPool]:
    """Three requests through ``impl`` on layer 1 of a pool: a prefill, a chunked extend and
    three decode steps. Returns each request's whole ``(q, k, v)`` ``[1, len, heads, d]``,
    the outputs ``impl`` gave for its tokens, and the pool."""
    prompts, chunk, steps = [3, 6, 1], [2, 1, 4], 3
    total = [p + c + steps for p, c in zip(prompts, chunk, strict=True)]
    seqs = sequences(dtype, total, heads, kv_heads, d, seed=11)
    pool = KVPool(2, 64, kv_heads, d, 4, 16, dtype=dtype)
    got: list[list[torch.Tensor]] = [[] for _ in prompts]

    def run(batch: Any, spans: list[tuple[int, int]], fwd: str) -> None:
        q, k, v = pack(seqs, spans)
        out = impl(q, k, v, kv_cache=batch, layer_id=1, fwd=fwd, **features)
        assert out.shape == (q.shape[0], heads * d) and out.dtype == dtype
        for i, (a, b) in enumerate(spans):
            start = int(batch.qo_indptr[i])
            got[i].append(out[start : start + b - a])

    batch = prefill_batch(pool, prompts)
    run(batch, [(0, p) for p in prompts], "prefill")
    rows = batch.req_pool_indices
    batch = extend_batch(pool, rows, chunk)
    run(batch, [(p, p + c) for p, c in zip(prompts, chunk, strict=True)], "prefill")
    for t in range(steps):
        pos = [p + c + t for p, c in zip(prompts, chunk, strict=True)]
        run(decode_batch(pool, rows), [(n, n + 1) for n in pos], "decode")
    return seqs, [torch.cat(outs) for outs in got], pool


class TestPagedNumerics:
    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("row", ["math", "torch_native"])
    def test_prefill_chunk_and_decode_match_dense_attention(
        self, dtype: torch.dtype, row: str
    ) -> None:
        """Prefill, a chunked extend and decode steps equal causal attention per request."""
        seqs, got, pool = paged_schedule(dict(faithful_rows())[row], dtype)
        for (q, k, v), out in zip(seqs, got, strict=True):
            close(out, loop_attention(q, k, v, causal=True)[0], dtype)
        assert not pool.k_buffer[0].any(), "layer 0 must be untouched"

    def test_paged_rows_agree_on_one_batch(self) -> None:
        """Every faithful row gives the same prefill output on identical pools."""
        outs = []
        pool = KVPool(1, 32, 1, 8, 4, 8)
        call = pack(sequences(torch.float32, [2, 5, 3], 3, 1, 8, 3), [(0, 2), (0, 5), (0, 3)])
        for _, impl in faithful_rows(*call, kv_cache=prefill_batch(pool, [2, 5, 3]),
                                     fwd="prefill"):
            pool = KVPool(1, 32, 1, 8, 4, 8)
            batch = prefill_batch(pool, [2, 5, 3])
            seqs = sequences(torch.float32, [2, 5, 3], 3, 1, 8, 3)
            q, k, v = pack(seqs, [(0, 2), (0, 5), (0, 3)])
            outs.append(impl(q, k, v, kv_cache=batch, fwd="prefill"))
        for a, b in itertools.combinations(outs, 2):
            close(a, b, torch.float32)

    @pytest.mark.parametrize("row", ["math", "torch_native"])
    def test_error_bad_paged_calls(self, row: str) -> None:
        """Paged calls with a wrong cache, mode, mask, layer or shape raise clearly, before any
        row runs."""
        pool = KVPool(1, 32, 2, 8, 4, 8)
        batch = prefill_batch(pool, [2, 3])
        q, k, v = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
        impl = functools.partial(ops.attention, backend=row)
        with pytest.raises(TypeError, match=r"must be an astrai\.kv_cache\.PagedBatch"):
            impl(q, k, v, kv_cache={"k": 1}, fwd="prefill")
        with pytest.raises(ValueError, match="one new token per request"):
            impl(q, k, v, kv_cache=batch, fwd="decode")
        with pytest.raises(ValueError, match="needs fwd in"):
            impl(q, k, v, kv_cache=batch)
        with pytest.raises(ValueError, match="takes no attn_mask"):
            impl(q, k, v, kv_cache=batch, fwd="prefill", attn_mask=torch.ones(1, dtype=torch.bool))
        with pytest.raises(ValueError, match=r"layer_id 1 is out of range"):
            impl(q, k, v, kv_cache=batch, layer_id=1, fwd="prefill")
        with pytest.raises(ValueError, match=r"expects k as \[5, 2, 8\]"):
            impl(q, k[:, :1], v, kv_cache=batch, fwd="prefill")


class TestFlash:
    @pytest.mark.skipif(bool(flash_available()), reason="flash-attn is usable here")
    def test_probe_says_why_unavailable(self) -> None:
        """Without flash-attn or a GPU the probe is an Unavailable with a useful reason."""
        result = flash_available()
        assert isinstance(result, Unavailable) and not result
        assert "flash_attn is not installed" in result.reason or "CUDA" in result.reason

    @pytest.mark.skipif(bool(flash_available()), reason="flash-attn is usable here")
    def test_error_direct_call_raises_runtime_error(self) -> None:
        """Calling the unavailable row raises RuntimeError with the probe's reason."""
        q, k, v = dense_inputs(torch.float16, 2, 2)
        with pytest.raises(RuntimeError, match="flash attention row cannot run"):
            flash_attention(q, k, v)

    @pytest.mark.gpu
    @pytest.mark.skipif(not flash_available(), reason="needs flash-attn on a CUDA GPU")
    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
    def test_flash_matches_math_on_gpu(self, dtype: torch.dtype) -> None:
        """On a GPU, flash agrees with math for dense causal GQA and paged prefill/decode."""
        q, k, v = (t.cuda() for t in dense_inputs(dtype, 6, 9))
        close(flash_attention(q, k, v, is_causal=True), math_attention(q, k, v, is_causal=True),
              dtype)
        outs = []
        for impl in (flash_attention, math_attention):
            pool = KVPool(1, 64, 2, 8, 4, 16, dtype=dtype, device="cuda")
            batch = prefill_batch(pool, [3, 7])
            seqs = sequences(dtype, [4, 8], 4, 2, 8, seed=2)
            q, k, v = (t.cuda() for t in pack(seqs, [(0, 3), (0, 7)]))
            first = impl(q, k, v, kv_cache=batch, fwd="prefill")
            q, k, v = (t.cuda() for t in pack(seqs, [(3, 4), (7, 8)]))
            step = decode_batch(pool, batch.req_pool_indices)
            outs.append(torch.cat([first, impl(q, k, v, kv_cache=step, fwd="decode")]))
        close(outs[0], outs[1], dtype)
