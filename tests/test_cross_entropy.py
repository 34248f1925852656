"""The loss families: ``cross_entropy`` (logits given) and ``linear_cross_entropy`` (a
linear head's loss as one call; the ``chunked`` row never holds the whole logits); their
facades' validation; and ``dispatch_model`` serving a language model's ``loss_function``
- in training the head and the loss fused, the loss and every gradient the plain
model's."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import astrai.dispatch as d
from astrai import ops
from astrai.backends import linear_cross_entropy as lce
from astrai.backends.cross_entropy import reference_cross_entropy, torch_cross_entropy
from astrai.families.cross_entropy.deferred import DeferredLogits
from astrai.families.linear_cross_entropy import linear_cross_entropy
from astrai.integrations.transformers import dispatch_model, restore_model, verify_model
from tests import _zoo

LCE_ROWS = [lce.chunked_linear_cross_entropy, lce.torch_linear_cross_entropy,
            lce.reference_linear_cross_entropy]


def _served() -> dict[str, dict[str, int]]:
    """Calls served so far per family, by row."""
    return {f: {row: sum(origins.values()) for row, origins in rows.items()}
            for f, rows in d.stats().by_row().items()}


def _labels(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    labels = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))
    labels[::5] = -100
    return labels


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_cross_entropy_rows_agree_with_torch(reduction: str, dtype: torch.dtype) -> None:
    logits = (torch.randn(23, 17, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    labels = _labels(23, 17)
    want = F.cross_entropy(logits.double(), labels, reduction=reduction)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for row in (torch_cross_entropy, reference_cross_entropy):
        got = row(logits, labels, -100, reduction)
        assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(ops.cross_entropy(logits, labels, reduction=reduction).double(),
                               want, atol=tol, rtol=tol)


def test_every_token_ignored_gives_nan_as_torch_does() -> None:
    labels = torch.full((4,), -100)
    for row in (torch_cross_entropy, reference_cross_entropy):
        assert torch.isnan(row(torch.randn(4, 5), labels))
    assert torch.isnan(lce.chunked_linear_cross_entropy(torch.randn(4, 3), torch.randn(5, 3),
                                                        labels))


def test_a_label_outside_the_vocabulary_is_an_error() -> None:
    labels = torch.tensor([1, 7, -100])
    with pytest.raises(ValueError, match=r"label 7 is outside the vocabulary 0\.\.4"):
        reference_cross_entropy(torch.randn(3, 5), labels)
    with pytest.raises(ValueError, match=r"label 7 is outside the vocabulary 0\.\.4"):
        lce.chunked_linear_cross_entropy(torch.randn(3, 4), torch.randn(5, 4), labels)


def _leaves(dtype: torch.dtype, n: int = 300, h: int = 24, v: int = 50, bias: bool = True
            ) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(v, h, generator=g, dtype=torch.float64) / 2).to(dtype)
    b = torch.randn(v, generator=g, dtype=torch.float64).to(dtype) if bias else None
    return [t.requires_grad_() if t is not None else None for t in (hidden, weight, b)]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bias", [True, False])
def test_the_fused_row_gives_the_loss_and_every_gradient(reduction: str, bias: bool,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lce, "_CHUNK_BYTES", 4 * 50 * 64)  # 64 tokens a chunk: 5 chunks
    labels = _labels(300, 50)
    results = []
    for row in LCE_ROWS:
        hidden, weight, b = _leaves(torch.float64, bias=bias)
        loss = row(hidden, weight, labels, b, -100, reduction)
        (loss * 1.5).backward()  # a gradient other than 1 reaches the saved ones
        results.append((loss, hidden.grad, weight.grad, None if b is None else b.grad))
    for other in results[1:]:
        for a, c in zip(results[0], other, strict=True):
            if a is not None:
                torch.testing.assert_close(a, c, atol=1e-10, rtol=1e-10)


def test_the_fused_row_in_bfloat16_stays_near_the_whole_logits() -> None:
    labels = _labels(300, 50)
    got, want = [], []
    for row, out in ((lce.chunked_linear_cross_entropy, got),
                     (lce.torch_linear_cross_entropy, want)):
        hidden, weight, b = _leaves(torch.bfloat16)
        row(hidden, weight, labels, b).backward()
        out += [hidden.grad, weight.grad]
    for a, c in zip(got, want, strict=True):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), c.float(), atol=2e-2, rtol=2e-2)


def test_a_frozen_head_gets_no_gradient_and_nothing_is_made_for_it() -> None:
    hidden, weight, _ = _leaves(torch.float32, bias=False)
    assert weight is not None
    weight.requires_grad_(False)
    lce.chunked_linear_cross_entropy(hidden, weight, _labels(300, 50)).backward()
    assert hidden.grad is not None and weight.grad is None


def test_the_table_sends_reductions_the_fused_row_cannot_make_to_torch() -> None:
    hidden, weight, _ = _leaves(torch.float32, bias=False)

    def row(reduction: str) -> str:
        ctx = ops.context("linear_cross_entropy", hidden, weight, _labels(300, 50), None, -100,
                          reduction)
        return d.resolve("linear_cross_entropy", ctx).name

    assert row("mean") == row("sum") == "torch"  # 300 tokens: below the fused region

    hidden = torch.randn(512, 24)
    ctx = ops.context("linear_cross_entropy", hidden, weight, _labels(512, 50))
    assert d.resolve("linear_cross_entropy", ctx).name == "chunked"
    ctx = ops.context("linear_cross_entropy", hidden, weight, _labels(512, 50), None, -100, "none")
    assert d.resolve("linear_cross_entropy", ctx).name == "torch"


@pytest.mark.parametrize("args, match", [
    ((torch.randn(3, 4), torch.randn(5, 3), torch.zeros(3, dtype=torch.long)),
     r"weight must be \[vocab, 4\]"),
    ((torch.randn(3, 4), torch.randn(5, 4), torch.zeros(2, dtype=torch.long)),
     r"labels must be an integer \[3\]"),
    ((torch.randn(3, 4), torch.randn(5, 4), torch.zeros(3)), r"labels must be an integer"),
    ((torch.randn(3, 4), torch.randn(5, 4), torch.zeros(3, dtype=torch.long), torch.zeros(4)),
     r"bias must be None or \[vocab\]"),
])
def test_a_malformed_linear_cross_entropy_is_refused(args: tuple[Any, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(*args)


def test_a_malformed_cross_entropy_is_refused_with_the_valid_names() -> None:
    with pytest.raises(ValueError, match="reduction must be one of mean, sum, none"):
        ops.cross_entropy(torch.randn(3, 4), torch.zeros(3, dtype=torch.long), -100, "avg")
    with pytest.raises(ValueError, match="ignore_index must be an int"):
        ops.cross_entropy(torch.randn(3, 4), torch.zeros(3, dtype=torch.long), None)
    with pytest.raises(ValueError, match=r"logits must be a floating \[tokens, vocab\]"):
        ops.cross_entropy(torch.randn(2, 3, 4), torch.zeros(3, dtype=torch.long))


# -- a model's loss ----------------------------------------------------------------------


def _pair(name: str = "llama") -> tuple[nn.Module, nn.Module]:
    plain = _zoo.build(name)
    routed = copy.deepcopy(plain)
    dispatch_model(routed)
    plain.train()
    routed.train()
    return plain, routed


def _step(model: nn.Module, **feed: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    model.zero_grad()
    torch.manual_seed(0)  # dropout draws the same
    out = model(**feed)
    out.loss.backward()
    return out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _same_step(plain: nn.Module, routed: nn.Module, **feed: Any) -> Any:
    want, want_grads = _step(plain, **feed)
    got, grads = _step(routed, **feed)
    torch.testing.assert_close(got.loss, want.loss, atol=1e-6, rtol=1e-6)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], atol=1e-6, rtol=1e-5, msg=name)
    return got, want


@pytest.mark.skipif(not _zoo.available("llama"), reason="transformers without Llama")
def test_a_training_step_fuses_the_head_and_the_loss_and_changes_nothing() -> None:
    plain, routed = _pair()
    ids = _zoo.inputs(plain)["input_ids"]
    d.reset_stats()
    _same_step(plain, routed, input_ids=ids, labels=ids)
    assert _served()["linear_cross_entropy"] == {"torch": 1}  # 20 tokens: the whole logits
    long = torch.randint(3, 128, (1, 520), generator=torch.Generator().manual_seed(3))
    d.reset_stats()
    got, want = _same_step(plain, routed, input_ids=long, labels=long)  # the fused region
    assert _served()["linear_cross_entropy"] == {"chunked": 1}
    assert "cross_entropy" not in _served()
    # the logits were never made; asking for them makes them, the model's own
    assert isinstance(got.logits, DeferredLogits) and not got.logits.computed
    torch.testing.assert_close(got.logits * 1.0, want.logits)
    assert got.logits.computed


@pytest.mark.skipif(not _zoo.available("llama"), reason="transformers without Llama")
def test_the_loss_keeps_transformers_arguments() -> None:
    plain, routed = _pair()
    ids = _zoo.inputs(plain)["input_ids"]
    labels = ids.clone()
    labels[:, :3] = -100
    _same_step(plain, routed, input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(9))
    shifted = torch.roll(ids, 2, dims=1)  # given, they are taken as they are
    _same_step(plain, routed, input_ids=ids, labels=ids, shift_labels=shifted)


@pytest.mark.skipif(not _zoo.available("gemma2"), reason="transformers without Gemma 2")
def test_soft_capped_logits_are_made_and_the_loss_takes_them() -> None:
    plain, routed = _pair("gemma2")  # logits = cap * tanh(head(x) / cap) before the loss
    ids = _zoo.inputs(plain)["input_ids"]
    d.reset_stats()
    _same_step(plain, routed, input_ids=ids, labels=ids)
    assert _served()["cross_entropy"] == {"torch": 1} and "linear_cross_entropy" not in _served()


@pytest.mark.skipif(not _zoo.available("llama"), reason="transformers without Llama")
def test_without_labels_or_autograd_nothing_is_deferred() -> None:
    plain, routed = _pair()
    feed = _zoo.inputs(plain)
    out = routed(**feed)
    assert type(out.logits) is torch.Tensor and out.loss is None
    d.reset_stats()
    with torch.no_grad():
        out = routed(**feed, labels=feed["input_ids"])
        want = plain(**feed, labels=feed["input_ids"])
    assert type(out.logits) is torch.Tensor and _served()["cross_entropy"] == {"torch": 1}
    torch.testing.assert_close(out.loss, want.loss)


@pytest.mark.skipif(not _zoo.available("llama"), reason="transformers without Llama")
def test_verify_counts_the_loss_only_when_labels_are_given_and_restore_is_exact() -> None:
    plain, routed = _pair()
    routed.eval()
    feed = _zoo.inputs(plain)
    assert verify_model(routed, **feed)["cross_entropy"] == 0  # no labels: no loss, no error
    assert verify_model(routed, **feed, labels=feed["input_ids"])["cross_entropy"] == 1
    assert "_loss_function" not in routed.__dict__  # given for the length of a call only
    restore_model(routed)
    assert "forward" not in routed.__dict__


class Scaled:
    """A loss function computing something else: twice the causal-LM loss."""

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                 **kwargs: Any) -> torch.Tensor:
        from transformers.loss.loss_utils import ForCausalLMLoss
        return 2 * ForCausalLMLoss(logits, labels, vocab_size, **kwargs)


@pytest.mark.skipif(not _zoo.available("llama"), reason="transformers without Llama")
def test_a_loss_function_computing_something_else_is_refused_and_kept() -> None:
    plain = _zoo.build("llama")
    plain.loss_function = Scaled()
    routed = copy.deepcopy(plain)
    report = dispatch_model(routed)
    refused = [n for n in report.not_routed if n.family == "cross_entropy"]
    assert refused and "computes neither a causal nor a masked" in refused[0].reason
    feed = _zoo.inputs(plain)
    torch.testing.assert_close(routed(**feed, labels=feed["input_ids"]).loss,
                               plain(**feed, labels=feed["input_ids"]).loss)
