"""``ops.attention_heads_first``: transformers' ``[batch, heads, seq, head_dim]`` tensors
through the attention table, untouched where the row takes that layout."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import astrai.dispatch as dispatch
from astrai import ops
from astrai.backends.attention.dense import takes_heads_first
from astrai.dispatch import record
from astrai.families.attention.transformers import astrai_attention_forward
from astrai.record.workload import TensorArg

#: The shipped rows that serve dense CPU calls.
CPU_ROWS = ("torch_native", "math", "sdpa_math", "sdpa_flash")


def _call(b: int = 2, heads: int = 8, kv_heads: int = 4, q_len: int = 5, kv_len: int = 7,
          d: int = 16, dtype: torch.dtype = torch.float32
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v heads-first, each a transposed view of seq-first memory (as a model's
    projections make them)."""
    g = torch.Generator().manual_seed(q_len * 31 + kv_len)
    q = torch.randn(b, q_len, heads, d, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(b, kv_len, kv_heads, d, generator=g).to(dtype).transpose(1, 2)
    v = torch.randn(b, kv_len, kv_heads, d, generator=g).to(dtype).transpose(1, 2)
    return q, k, v


def _seq_first(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
    out = ops.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw)
    return out.unflatten(-1, (q.shape[1], -1))


MASKS = {
    "none": lambda q_len, kv_len: None,
    "bool": lambda q_len, kv_len: torch.rand(
        2, 1, q_len, kv_len, generator=torch.Generator().manual_seed(3)) > 0.3,
    "float": lambda q_len, kv_len: torch.randn(
        1, 8, q_len, kv_len, generator=torch.Generator().manual_seed(4)),
}


@pytest.mark.parametrize("row", CPU_ROWS)
@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize(("q_len", "kv_len", "causal"),
                         [(5, 7, False), (5, 7, True), (6, 6, True), (1, 9, False)])
def test_every_row_computes_the_seq_first_answer(row: str, mask: str, q_len: int, kv_len: int,
                                                 causal: bool) -> None:
    q, k, v = _call(q_len=q_len, kv_len=kv_len)
    m = MASKS[mask](q_len, kv_len)
    want = _seq_first(q, k, v, attn_mask=m, is_causal=causal, backend=row)
    got = ops.attention_heads_first(q, k, v, m, causal, backend=row)
    assert got.shape == (2, q_len, 8, 16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_it_is_decided_as_the_seq_first_call() -> None:
    """One call, two layouts: the same row, and a scope or ASTR_OPS reaches both."""
    q, k, v = _call()
    dispatch.stats(reset=True)
    ops.attention_heads_first(q, k, v)
    _seq_first(q, k, v)
    ((row, origins),) = dispatch.stats().by_row()["attention"].items()
    assert origins == {"chain": 2}
    with dispatch.op_backend(attention="math"):
        dispatch.stats(reset=True)
        ops.attention_heads_first(q, k, v)
        assert dispatch.stats().by_row()["attention"] == {"math": {"context": 1}}
    assert row == "torch_native"


def test_a_row_that_takes_the_layout_gets_the_tensors_untouched() -> None:
    q, k, v = _call()
    seen: list[tuple[Any, ...]] = []

    @takes_heads_first
    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        seen.append((q, k, v, kw))
        return torch.zeros(q.shape[0], q.shape[2], q.shape[1], v.shape[-1])

    out = ops.attention_heads_first(q, k, v, None, True, backend=spy)
    ((sq, sk, sv, kw),) = seen
    assert sq is q and sk is k and sv is v
    assert kw == {"attn_mask": None, "is_causal": True, "heads_first": True}
    assert out.shape == (2, 5, 8, 16)


def test_any_other_row_gets_the_seq_first_call() -> None:
    """An implementation that does not declare the layout (a user's, a kernel package's)
    serves heads-first calls too: it is handed the seq-first views, as always."""
    q, k, v = _call()
    seen: list[tuple[int, ...]] = []

    def seq_first_only(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       **kw: Any) -> torch.Tensor:
        assert "heads_first" not in kw
        seen.append(tuple(q.shape))
        return ops.attention(q, k, v, backend="math", **kw)

    got = ops.attention_heads_first(q, k, v, backend=seq_first_only)
    assert seen == [(2, 5, 8, 16)]
    torch.testing.assert_close(got, _seq_first(q, k, v))


def test_a_recording_records_the_seq_first_call() -> None:
    q, k, v = _call(b=1, q_len=3, kv_len=4)
    with record() as wl:
        ops.attention_heads_first(q, k, v, None, True)
    (call,) = wl.calls
    assert call.family == "attention"
    assert call.args == (TensorArg((1, 3, 8, 16), "float32", "cpu"),
                         TensorArg((1, 4, 4, 16), "float32", "cpu"),
                         TensorArg((1, 4, 4, 16), "float32", "cpu"))
    assert (call.axes["q_len"], call.axes["kv_len"], call.axes["heads"]) == (3, 4, 8)


@pytest.mark.parametrize(("change", "match"), [
    (lambda q, k, v: (q[0], k, v), r"heads-first attention expects q as \[batch, heads, seq"),
    (lambda q, k, v: (q, k[:1], v[:1]), "batch sizes differ"),
    (lambda q, k, v: (q[:, :6], k, v), "not a multiple"),
    (lambda q, k, v: (q, k, v.double()), "dtypes differ"),
    (lambda q, k, v: (q, k, "v"), "v must be a torch.Tensor"),
])
def test_a_malformed_call_says_what_is_wrong(change: Any, match: str) -> None:
    q, k, v = _call()
    with pytest.raises((ValueError, TypeError), match=match):
        ops.attention_heads_first(*change(q, k, v))


def test_a_mask_that_does_not_fit_is_refused() -> None:
    q, k, v = _call()
    with pytest.raises(ValueError, match="does not broadcast"):
        ops.attention_heads_first(q, k, v, torch.ones(1, 1, 5, 3, dtype=torch.bool))


def test_transformers_plain_calls_reach_the_row_untouched() -> None:
    """The adapter hands a plain call's tensors to the table as they are, and returns
    the contiguous ``[batch, seq, heads, head_dim]`` transformers' sdpa returns."""
    q, k, v = _call(q_len=1, kv_len=9)
    seen: list[Any] = []

    @takes_heads_first
    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        seen.append((q, k, v, kw["is_causal"]))
        return ops.attention_heads_first(q, k, v, kw["attn_mask"], kw["is_causal"],
                                         backend="torch_native")

    with dispatch.op_backend(attention=spy):
        out, weights = astrai_attention_forward(None, q, k, v, None)
    # One query of a causal layer sees every key: not causal, as transformers' sdpa has it.
    assert seen == [(q, k, v, False)] and weights is None
    assert out.is_contiguous() and out.shape == (2, 1, 8, 16)
    torch.testing.assert_close(out, _seq_first(q, k, v, backend="math"))


def test_it_compiles_without_a_graph_break() -> None:
    q, k, v = _call(q_len=6, kv_len=6)

    @torch.compile(backend="eager", fullgraph=True)
    def block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ops.attention_heads_first(q, k, v, None, True)

    torch.testing.assert_close(block(q, k, v), _seq_first(q, k, v, is_causal=True))
