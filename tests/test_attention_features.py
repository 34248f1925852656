"""Attention features (scale, softcap, dropout, window, sinks, return_weights) on the rows.

Every feature a row declares in ``tables/attention.yaml`` is checked, through the
facade, against ``reference``: float64 loops written from the definitions (Gemma 2's
soft-capping, transformers' sliding window, gpt-oss's sinks), independent of the
rows. Then: a row that does not declare a feature is never chosen for it, the
facade's checks, what a row is handed (a spy row), and dropout's statistics.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

import astrai.dispatch as dispatch
from astrai import ops
from astrai.backends.attention.flash import flash_attention, flash_available, flash_options
from astrai.backends.attention.math import math_attention
from astrai.kv_cache import KVPool, decode_batch, prefill_batch
from tests import _impls
from tests.test_backends_attention import dense_inputs, pack, paged_schedule, sequences

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 1e-3}
DTYPES = (torch.float32, torch.bfloat16)
HEADS, KV_HEADS, D = 4, 2, 8
SINKS = torch.tensor([0.5, -1.0, 2.0, 0.0])

#: The features each shipped row declares (the table's ``features:``), as facade keywords
#: with a value that changes the result of the calls below.
VALUES: dict[str, Any] = {"scale": 0.7, "softcap": 1.5, "window": 3, "sinks": SINKS}
DECLARED = {"math": ("scale", "softcap", "window", "sinks"),
            "torch_native": ("scale", "window")}


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
    mask: torch.Tensor | None = None, scale: float | None = None,
    softcap: float | None = None, window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention one query at a time in float64: ``(out [B, Sq, H*Dv], weights)``.

    Logit ``s = q.k * scale`` (``head_dim ** -0.5`` by default); soft-capped to
    ``softcap * tanh(s / softcap)``; query ``i`` sees key ``j`` when the mask allows it
    and, causally, ``j <= i + Sk - Sq``, within the window ``j > i + Sk - Sq - window``;
    a sink logit ``z`` adds ``exp(z)`` to the softmax denominator only.
    """
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    full = None if mask is None else mask.expand(b, h, sq, sk)
    out = torch.zeros(b, sq, h, v.shape[-1], dtype=torch.float64)
    weights = torch.zeros(b, h, sq, sk, dtype=torch.float64)
    for bi, hi, i in itertools.product(range(b), range(h), range(sq)):
        kh = hi // (h // hkv)
        last = i + sk - sq
        logits: dict[int, float] = {}
        for j in range(sk):
            if causal and (j > last or (window is not None and j <= last - window)):
                continue
            if full is not None and full.dtype == torch.bool and not full[bi, hi, i, j]:
                continue
            s = float(q[bi, i, hi].double() @ k[bi, j, kh].double()) * scale
            if softcap:
                s = softcap * math.tanh(s / softcap)
            if full is not None and full.dtype != torch.bool:
                s += float(full[bi, hi, i, j])
            logits[j] = s
        if not logits:
            continue
        sink = None if sinks is None else float(sinks[hi])
        top = max([*logits.values(), *([] if sink is None else [sink])])
        denom = sum(math.exp(s - top) for s in logits.values())
        if sink is not None:
            denom += math.exp(sink - top)
        for j, s in logits.items():
            w = math.exp(s - top) / denom
            weights[bi, hi, i, j] = w
            out[bi, i, hi] += w * v[bi, j, kh].double()
    return out.reshape(b, sq, -1), weights


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=tol)


def padding_mask(sq: int, sk: int) -> torch.Tensor:
    """Bool ``[2, 1, sq, sk]``: the first sequence's first key is padding."""
    keep = torch.ones(2, 1, sq, sk, dtype=torch.bool)
    keep[0, ..., 0] = False
    return keep


#: (q_len, k_len, causal, mask): square and rectangular, causal and not, masked and not.
CALLS = [(5, 5, True, False), (3, 7, True, False), (6, 6, True, True), (4, 6, False, True)]


def served(row: str) -> int:
    return dispatch.stats().served("attention", row)


class TestDenseFeatures:
    """Each declared feature, alone and all together, against ``reference`` on dense calls."""

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize(("row", "feature", "call"), [
        (r, f, c) for r, fs in DECLARED.items() for f in fs for c in CALLS
        if f != "window" or c[2]  # a window needs a causal call
    ], ids=str)
    def test_feature_matches_reference(self, row: str, feature: str,
                                       call: tuple[int, int, bool, bool],
                                       dtype: torch.dtype) -> None:
        """The row serves the call asking for the feature, and agrees with the reference."""
        sq, sk, causal, masked = call
        q, k, v = dense_inputs(dtype, sq, sk)
        mask = padding_mask(sq, sk) if masked else None
        asked = {feature: VALUES[feature]}
        out = ops.attention(q, k, v, attn_mask=mask, is_causal=causal, backend=row, **asked)
        want, _ = reference(q, k, v, causal=causal, mask=mask, **asked)
        assert out.shape == (2, sq, HEADS * D) and out.dtype == dtype
        close(out, want, dtype)
        plain, _ = reference(q, k, v, causal=causal, mask=mask)
        assert not torch.allclose(want, plain, atol=1e-3)  # the feature changes this call

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    def test_every_feature_at_once_on_math(self, dtype: torch.dtype) -> None:
        """scale, softcap, window, sinks and weights together, as the chain serves them."""
        q, k, v = dense_inputs(dtype, 6, 8)
        mask = padding_mask(6, 8)
        out, weights = ops.attention(q, k, v, attn_mask=mask, is_causal=True,
                                     return_weights=True, **VALUES)
        want, want_w = reference(q, k, v, causal=True, mask=mask, **VALUES)
        close(out, want, dtype)
        close(weights, want_w, dtype)
        assert served("math") == 1

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    def test_scale_and_window_together_on_torch_native(self, dtype: torch.dtype) -> None:
        """The chain gives torch_native a call asking for a scale and a window."""
        q, k, v = dense_inputs(dtype, 5, 9)
        out = ops.attention(q, k, v, is_causal=True, scale=0.2, window=2)
        close(out, reference(q, k, v, causal=True, scale=0.2, window=2)[0], dtype)
        assert served("torch_native") == 1

    def test_additive_mask_with_softcap_applies_after_the_cap(self) -> None:
        """Soft-capping applies to the scaled logits, before an additive mask (Gemma 2's order)."""
        q, k, v = dense_inputs(torch.float32, 4, 4)
        bias = torch.randn(2, 1, 4, 4, generator=torch.Generator().manual_seed(3)) * 3
        out = ops.attention(q, k, v, attn_mask=bias, softcap=1.0)
        close(out, reference(q, k, v, mask=bias, softcap=1.0)[0], torch.float32)

    def test_window_of_one_sees_only_itself(self) -> None:
        """``window=1``: each query attends to its own position only, so out equals v."""
        q, k, v = dense_inputs(torch.float32, 5, 5, heads=2, kv_heads=2)
        for row in ("math", "torch_native"):
            out = ops.attention(q, k, v, is_causal=True, window=1, backend=row)
            torch.testing.assert_close(out, v.reshape(2, 5, -1))

    def test_window_wider_than_the_keys_changes_nothing(self) -> None:
        """A window at least as long as the keys is plain causal attention."""
        q, k, v = dense_inputs(torch.float32, 4, 6)
        for row in ("math", "torch_native"):
            torch.testing.assert_close(
                ops.attention(q, k, v, is_causal=True, window=6, backend=row),
                ops.attention(q, k, v, is_causal=True, backend=row))

    def test_sinks_absorb_probability(self) -> None:
        """With sinks the weights of a row sum to less than one; a huge sink silences the head."""
        q, k, v = dense_inputs(torch.float32, 4, 4)
        sinks = torch.tensor([0.0, 1.0, 2.0, 60.0])
        out, weights = ops.attention(q, k, v, is_causal=True, sinks=sinks, return_weights=True)
        sums = weights.sum(-1)
        assert (sums < 1).all() and (sums > 0).all()
        assert weights[:, 3].abs().max() < 1e-20
        assert out.view(2, 4, HEADS, D)[:, :, 3].abs().max() < 1e-20

    def test_sinks_are_learnable(self) -> None:
        """Gradients reach the sinks (gpt-oss trains them)."""
        q, k, v = dense_inputs(torch.float32, 4, 4)
        sinks = SINKS.clone().requires_grad_()
        ops.attention(q, k, v, is_causal=True, sinks=sinks).square().sum().backward()
        assert sinks.grad is not None and sinks.grad.abs().min() > 0

    def test_query_without_keys_stays_zero_with_every_feature(self) -> None:
        """A fully masked query row gives zeros (never NaN), sinks and cap included."""
        q, k, v = dense_inputs(torch.float32, 3, 4)
        mask = torch.ones(1, 1, 3, 4, dtype=torch.bool)
        mask[..., 1, :] = False
        out, weights = ops.attention(q, k, v, attn_mask=mask, return_weights=True,
                                     scale=0.3, softcap=2.0, sinks=SINKS)
        assert not out.isnan().any() and (out[:, 1] == 0).all()
        assert (weights[:, :, 1] == 0).all()


class TestReturnWeights:
    """``return_weights=True``: ``(output, weights)`` from the row that declares it."""

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("call", CALLS, ids=str)
    def test_weights_match_reference(self, call: tuple[int, int, bool, bool],
                                     dtype: torch.dtype) -> None:
        """Weights ``[batch, heads, q_len, k_len]`` in q's dtype, per query head under GQA."""
        sq, sk, causal, masked = call
        q, k, v = dense_inputs(dtype, sq, sk)
        mask = padding_mask(sq, sk) if masked else None
        out, weights = ops.attention(q, k, v, attn_mask=mask, is_causal=causal,
                                     return_weights=True)
        want, want_w = reference(q, k, v, causal=causal, mask=mask)
        assert weights.shape == (2, HEADS, sq, sk) and weights.dtype == dtype
        close(weights, want_w, dtype)
        close(out, want, dtype)
        assert torch.equal(out, ops.attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              backend="math"))

    def test_served_by_math_through_the_chain(self) -> None:
        """torch_native, first in the chain, does not declare it: math serves (origin chain)."""
        q, k, v = dense_inputs(torch.float32, 4, 4)
        ops.attention(q, k, v, return_weights=True)
        assert dispatch.stats().served("attention", "math", "chain") == 1

    def test_false_is_the_plain_call(self) -> None:
        """``return_weights=False`` returns the output alone, from the chain's usual row."""
        q, k, v = dense_inputs(torch.float32, 4, 4)
        out = ops.attention(q, k, v, return_weights=False)
        assert isinstance(out, torch.Tensor)
        assert served("torch_native") == 1

    def test_error_paged_call(self) -> None:
        """A paged batch has no single weight matrix: no row serves it, and the error says why."""
        pool = KVPool(1, 32, KV_HEADS, D, 4, 8)
        batch = prefill_batch(pool, [2, 3])
        q, k, v = torch.randn(5, HEADS, D), torch.randn(5, KV_HEADS, D), torch.randn(5, KV_HEADS, D)
        with pytest.raises(dispatch.NoImplementationError) as info:
            ops.attention(q, k, v, kv_cache=batch, fwd="prefill", return_weights=True)
        text = str(info.value)
        assert "torch_native: requires features: [return_weights]" in text
        assert ("math (fallback): requires dense or paged and mask_free and not "
                "return_weights") in text
        with pytest.raises(ValueError, match=r"dense .* calls only"):
            math_attention(q, k, v, kv_cache=batch, fwd="prefill", return_weights=True)


def paged_run(row: str, dtype: torch.dtype, **features: Any) -> None:
    """Prefill, a chunked extend and decode steps with ``features``, against ``reference``."""
    facade = functools.partial(ops.attention, backend=row)
    seqs, got, _ = paged_schedule(facade, dtype, HEADS, KV_HEADS, D, **features)
    for (q, k, v), out in zip(seqs, got, strict=True):
        close(out, reference(q, k, v, causal=True, **features)[0][0], dtype)


class TestPagedFeatures:
    """The features the paged path serves, per request, against ``reference``."""

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize(("row", "feature"),
                             [(r, f) for r, fs in DECLARED.items() for f in fs])
    def test_feature_matches_reference(self, row: str, feature: str,
                                       dtype: torch.dtype) -> None:
        """Prefill, extend and decode with the feature equal causal attention per request."""
        paged_run(row, dtype, **{feature: VALUES[feature]})

    def test_all_at_once_on_math(self) -> None:
        """scale, softcap, window and sinks together on the paged path."""
        paged_run("math", torch.float32, **VALUES)

    def test_window_reaches_into_the_cache(self) -> None:
        """A decode step's window spans cached positions: window 2 of a long context."""
        paged_run("torch_native", torch.float32, window=2)
        paged_run("math", torch.float32, window=2)


def big_batch(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One small call repeated ``n`` times along the batch: independent dropout draws."""
    q, k, v = dense_inputs(torch.float32, 4, 6, b=1)
    return q.expand(n, -1, -1, -1), k.expand(n, -1, -1, -1), v.expand(n, -1, -1, -1)


class TestDropout:
    """``dropout_p``: dropout on the probabilities, by the rows that declare it."""

    def test_math_zeroes_and_rescales(self) -> None:
        """math's weights are 0 or the reference's / (1 - p), and its output uses exactly them."""
        p = 0.4
        q, k, v = dense_inputs(torch.float32, 6, 6)
        torch.manual_seed(0)
        out, weights = ops.attention(q, k, v, is_causal=True, dropout_p=p, return_weights=True)
        _, want_w = reference(q, k, v, causal=True)
        kept = weights != 0
        dropped = (want_w > 0) & ~kept
        assert 0.2 < dropped.sum() / (want_w > 0).sum() < 0.6
        torch.testing.assert_close(weights[kept].double(), want_w[kept] / (1 - p))
        vv = v.double().transpose(1, 2).repeat_interleave(HEADS // KV_HEADS, 1)
        by_hand = (weights.double() @ vv).transpose(1, 2).reshape(2, 6, -1)
        torch.testing.assert_close(out.double(), by_hand, atol=1e-6, rtol=1e-6)

    @pytest.mark.parametrize("row", ["math", "torch_native"])
    def test_seeded_and_unbiased(self, row: str) -> None:
        """Same seed, same result; another seed, another; the mean of draws is the plain output."""
        q, k, v = big_batch(4000)
        runs = []
        for seed in (1, 1, 2):
            torch.manual_seed(seed)
            runs.append(ops.attention(q, k, v, is_causal=True, dropout_p=0.5, backend=row))
        assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
        plain = ops.attention(q[:1], k[:1], v[:1], is_causal=True, backend=row)
        assert not torch.allclose(runs[0][0], plain[0], atol=1e-3)
        torch.testing.assert_close(runs[0].mean(0), plain[0], atol=0.06, rtol=0)

    def test_gradients_flow(self) -> None:
        """Training with dropout: gradients reach q, k and v through torch_native."""
        q, k, v = (t.requires_grad_() for t in dense_inputs(torch.float32, 4, 4))
        ops.attention(q, k, v, is_causal=True, dropout_p=0.1).sum().backward()
        assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (q, k, v))
        assert served("torch_native") == 1


SPY_TABLE = """\
version: 1
family: attention
description: a spy first, then math
fallback: math
rows:
  - name: spy
    impl: tests._impls:attention_spy
    when: not has_cache and ndim == 4
    features: [scale, softcap, dropout, window, sinks, return_weights]
  - name: math
    impl: astrai.backends.attention.math:math_attention
"""


@pytest.fixture
def spy(write_yaml: Callable[[str, str], Path]) -> list[dict[str, Any]]:
    """Load a table whose first row records its keywords; returns the record."""
    dispatch.load_tables(write_yaml("attention.yaml", SPY_TABLE))
    _impls.SPY_CALLS.clear()
    return _impls.SPY_CALLS


class TestWhatRowsAreHanded:
    """A row is called with exactly the feature keywords the call asks for."""

    BASE: ClassVar[dict[str, Any]] = {"kv_cache": None, "layer_id": 0, "attn_mask": None,
                                      "is_causal": True, "fwd": None}

    def test_dropout_p_reaches_the_row(self, spy: list[dict[str, Any]]) -> None:
        """``dropout_p=0.1`` arrives as ``dropout_p=0.1``, nothing else added."""
        q, k, v = dense_inputs(torch.float32, 3, 3)
        ops.attention(q, k, v, is_causal=True, dropout_p=0.1)
        assert spy == [{**self.BASE, "dropout_p": 0.1}]

    def test_defaults_are_not_passed(self, spy: list[dict[str, Any]]) -> None:
        """Features at their default (scale head_dim**-0.5, cap 0, p 0, None) are left out,
        so a row that declares nothing keeps its old signature."""
        q, k, v = dense_inputs(torch.float32, 3, 3)
        ops.attention(q, k, v, is_causal=True, scale=D ** -0.5, softcap=0, dropout_p=0.0,
                      window=None, sinks=None, return_weights=False)
        ops.attention(q, k, v, is_causal=True, softcap=None, scale=None)
        assert spy == [self.BASE, self.BASE]

    def test_every_feature_is_passed_as_asked(self, spy: list[dict[str, Any]]) -> None:
        """Each asked feature arrives under its facade keyword, with its value."""
        q, k, v = dense_inputs(torch.float32, 3, 3)
        out, _ = ops.attention(q, k, v, is_causal=True, return_weights=True, **VALUES)
        assert spy[0].keys() == {*self.BASE, *VALUES, "return_weights"}
        assert spy[0]["sinks"] is SINKS and spy[0]["window"] == 3
        assert out.shape == (2, 3, HEADS * D)


class TestSelection:
    """A row that does not declare a feature is never chosen for it."""

    @pytest.mark.parametrize(("feature", "winner"), [
        ("scale", "torch_native"), ("window", "torch_native"), ("dropout_p", "torch_native"),
        ("softcap", "math"), ("sinks", "math"), ("return_weights", "math"),
    ])
    def test_chain_picks_the_first_row_declaring_it(self, feature: str, winner: str) -> None:
        """explain rejects torch_native naming the feature when it lacks it; the call agrees."""
        value = {**VALUES, "dropout_p": 0.1, "return_weights": True}[feature]
        q, k, v = dense_inputs(torch.float32, 4, 4)
        ctx = ops.context("attention", q, k, v, is_causal=True, **{feature: value})
        text = dispatch.explain("attention", ctx)
        assert text.endswith(f"=> {winner} (origin=chain)")
        axis = "dropout" if feature == "dropout_p" else feature
        if winner == "math":
            assert (f"torch_native: reject (features: [{axis}] (the call asks for {axis}; the "
                    "row declares dropout, scale, window))") in text
        ops.attention(q, k, v, is_causal=True, **{feature: value})
        assert served(winner) == 1

    def test_error_strict_scope_on_an_undeclared_feature(self) -> None:
        """``op_backend(attention="torch_native")`` with softcap is an error naming it."""
        q, k, v = dense_inputs(torch.float32, 4, 4)
        with dispatch.op_backend(attention="torch_native"), \
                pytest.raises(dispatch.ExplicitSelectionError, match=r"features: \[softcap\]"):
            ops.attention(q, k, v, softcap=2.0)
        assert served("torch_native") == 0

    def test_soft_env_choice_falls_through(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """``ASTR_OPS=attention=torch_native`` cannot serve sinks: math serves, from the chain."""
        monkeypatch.setenv("ASTR_OPS", "attention=torch_native")
        q, k, v = dense_inputs(torch.float32, 4, 4)
        ops.attention(q, k, v, sinks=SINKS)
        ops.attention(q, k, v)
        usage = dispatch.stats()
        assert usage.served("attention", "math", "chain") == 1
        assert usage.served("attention", "torch_native", "env") == 1

    def test_flash_declares_its_features(self) -> None:
        """flash's ``when`` turns down softcap with dropout (flash-attn refuses that pair)."""
        q, k, v = dense_inputs(torch.float16, 4, 4)
        ctx = ops.context("attention", q, k, v, is_causal=True, softcap=2.0, dropout_p=0.1)
        table = dispatch.current().family("attention")
        flash = table.row("flash")
        assert flash is not None
        assert flash.features == {"scale", "softcap", "dropout", "window"}
        assert not flash.spec.matches(ctx.evolve(device_cuda=True))
        assert flash.spec.matches(ctx.evolve(device_cuda=True, dropout=False))


class TestFacadeChecks:
    """Bad feature values are clear errors, raised before any row runs."""

    @pytest.mark.parametrize(("kwargs", "error", "message"), [
        ({"scale": 0.0}, ValueError, r"scale must be > 0, got 0\.0"),
        ({"scale": "big"}, TypeError, r"scale must be a number, got 'big'"),
        ({"scale": True}, TypeError, r"scale must be a number, got True"),
        ({"softcap": -1.0}, ValueError, r"softcap must be >= 0, got -1\.0"),
        ({"softcap": float("nan")}, TypeError, r"softcap must be a number, got nan"),
        ({"dropout_p": 1.0}, ValueError, r"dropout_p must be in \[0, 1\), got 1\.0"),
        ({"dropout_p": -0.1}, ValueError, r"dropout_p must be in \[0, 1\)"),
        ({"window": 0}, ValueError, r"window must be an int >= 1, got 0"),
        ({"window": 2.0}, ValueError, r"window must be an int >= 1, got 2\.0"),
        ({"window": True}, ValueError, r"window must be an int >= 1, got True"),
        ({"sinks": torch.zeros(3)}, ValueError, r"sinks must be a float tensor \[heads\] = \[4\], "
                                                r"got \(3,\)"),
        ({"sinks": torch.zeros(4, dtype=torch.long)}, ValueError, r"sinks must be a float"),
        ({"sinks": [0.0] * 4}, ValueError, r"sinks must be a float tensor"),
        ({"return_weights": 1}, TypeError, r"return_weights must be a bool, got 1"),
        ({"softcapping": 3.0}, TypeError, r"unexpected keyword argument 'softcapping'; "
                                          r"features: scale, softcap, dropout_p, window"),
    ])
    def test_error_bad_value(self, kwargs: dict[str, Any], error: type[Exception],
                             message: str) -> None:
        """Each bad value names the feature, what is expected and what it got."""
        q, k, v = dense_inputs(torch.float32, 3, 3)
        with pytest.raises(error, match=message):
            ops.attention(q, k, v, is_causal=True, **kwargs)
        assert dispatch.stats().served("attention") == 0

    def test_error_window_without_causal(self) -> None:
        """A dense window needs ``is_causal=True``; the paged path is causal already."""
        q, k, v = dense_inputs(torch.float32, 3, 3)
        with pytest.raises(ValueError, match="a sliding window needs is_causal=True"):
            ops.attention(q, k, v, window=2)

    def test_error_context_checks_too(self) -> None:
        """``ops.context`` checks the features as the facade does."""
        q, k, v = dense_inputs(torch.float32, 3, 3)
        with pytest.raises(ValueError, match="dropout_p must be in"):
            ops.context("attention", q, k, v, dropout_p=2.0)


class TestFlashOptions:
    """``flash_options``: the feature keywords flash-attn gets (checked here without a GPU)."""

    def test_none_asked_none_passed(self) -> None:
        """A call asking nothing passes no keyword (an old flash-attn still serves it)."""
        assert flash_options(None, None, 0.0, None) == {}

    def test_mapping(self) -> None:
        """scale, softcap, dropout and window map to flash-attn's names; the window keeps
        ``window - 1`` keys to the left of the query and none to the right."""
        assert flash_options(0.3, 30.0, 0.1, 4) == {
            "softmax_scale": 0.3, "softcap": 30.0, "dropout_p": 0.1, "window_size": (3, 0)}

    @pytest.mark.gpu
    @pytest.mark.skipif(not flash_available(), reason="needs flash-attn on a CUDA GPU")
    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
    @pytest.mark.parametrize("feature", ["scale", "softcap", "window"])
    def test_flash_matches_math_on_gpu(self, feature: str, dtype: torch.dtype) -> None:
        """On a GPU, flash agrees with math for the feature, dense (rectangular causal GQA)
        and paged (prefill then decode)."""
        asked = {feature: VALUES[feature]}
        q, k, v = (t.cuda() for t in dense_inputs(dtype, 6, 9))
        close(flash_attention(q, k, v, is_causal=True, **asked),
              math_attention(q, k, v, is_causal=True, **asked), dtype)
        outs = []
        for impl in (flash_attention, math_attention):
            pool = KVPool(1, 64, KV_HEADS, D, 4, 16, dtype=dtype, device="cuda")
            batch = prefill_batch(pool, [3, 7])
            seqs = sequences(dtype, [4, 8], HEADS, KV_HEADS, D, seed=2)
            q, k, v = (t.cuda() for t in pack(seqs, [(0, 3), (0, 7)]))
            first = impl(q, k, v, kv_cache=batch, fwd="prefill", **asked)
            q, k, v = (t.cuda() for t in pack(seqs, [(3, 4), (7, 8)]))
            step = decode_batch(pool, batch.req_pool_indices)
            outs.append(torch.cat([first, impl(q, k, v, kv_cache=step, fwd="decode", **asked)]))
        close(outs[0], outs[1], dtype)

    @pytest.mark.gpu
    @pytest.mark.skipif(not flash_available(), reason="needs flash-attn on a CUDA GPU")
    def test_flash_serves_feature_calls_on_gpu(self) -> None:
        """On a GPU the chain gives flash a bf16 call asking for softcap and a window."""
        q, k, v = (t.cuda() for t in dense_inputs(torch.bfloat16, 6, 6))
        ops.attention(q, k, v, is_causal=True, softcap=1.5, window=3)
        assert served("flash") == 1
