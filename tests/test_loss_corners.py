"""Every available row of the loss families against torch's own loss,
``F.cross_entropy(logits)`` and ``F.cross_entropy(F.linear(hidden, weight, bias))`` with
int64 labels: the value and every gradient (``torch.autograd.grad``) in the corners -
every label ignored, some (a whole chunk of the ``chunked`` row among them), no tokens;
mean, sum and none; float64, float32, bfloat16 and float16 (the half types against the
float32 reference, rounded to them); a bias or none; each leaf alone, all of them or none
needing a gradient; a cotangent of one and another; ``ignore_index`` inside and outside
the vocabulary; labels of other integer dtypes - and a fully masked batch that leaves a
training step's weights as they were."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import astrai.dispatch as d
from astrai import ops
from astrai.backends import linear_cross_entropy as lce

Tensor = torch.Tensor
FAMILIES = ("cross_entropy", "linear_cross_entropy")
#: Rows whose ``when`` leaves out ``reduction: none``: called with it, they refuse.
WITHOUT_NONE = {("linear_cross_entropy", "chunked")}
REDUCTIONS = ("mean", "sum", "none")
MASKS = ("kept", "some", "all", "empty")
VOCAB, FEATURES, TOKENS, CHUNK = 7, 5, 11, 4  # 11 tokens in chunks of 4: three chunks


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Tensors of a few elements: one thread (on a busy machine, waking others costs
    more than these calls)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _rows(family: str) -> list[tuple[str, Callable[..., Tensor]]]:
    """The rows of ``family``'s table that are available here, by name."""
    snapshot = d.current()
    rows = [(r.name, r.obj) for r in snapshot.family(family).rows
            if snapshot.availability(r)[0]]
    assert {"torch", "reference"} <= {name for name, _ in rows}
    return rows


@contextmanager
def _chunks_of(tokens: int, vocab: int) -> Iterator[None]:
    """The ``chunked`` row runs ``tokens`` tokens a chunk."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lce, "_CHUNK_BYTES", 4 * vocab * tokens)
        yield


def _wide(t: Tensor | None) -> Tensor | None:
    return t if t is None or t.dtype == torch.float64 else t.float()


def _torch_loss(family: str, leaves: list[Tensor | None], labels: Tensor, ignore_index: int,
                reduction: str) -> Tensor:
    """torch's loss on the leaves in float32 (float64 for float64), labels as int64."""
    if family == "cross_entropy":
        logits = _wide(leaves[0])
    else:
        hidden, weight, bias = (_wide(t) for t in leaves)
        assert hidden is not None and weight is not None
        logits = F.linear(hidden, weight, bias)
    assert logits is not None
    return F.cross_entropy(logits, labels.long(), ignore_index=ignore_index,
                           reduction=reduction)


def _labels(n: int, vocab: int, mask: str, ignore_index: int, seed: int) -> Tensor:
    labels = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))
    if mask == "some":
        labels[0] = labels[4:8] = labels[-1] = ignore_index  # tokens 4..7: a whole chunk
    elif mask == "all":
        labels[:] = ignore_index
    return labels


def _leaves(family: str, n: int, dtype: torch.dtype, bias: bool, seed: int,
            vocab: int = VOCAB, features: int = FEATURES) -> list[Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    if family == "cross_entropy":
        return [(torch.randn(n, vocab, generator=g, dtype=torch.float64) * 3).to(dtype)]
    return [torch.randn(n, features, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(vocab, features, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(vocab, generator=g, dtype=torch.float64).to(dtype) if bias else None]


def _needs(family: str, bias: bool) -> list[tuple[int, ...]]:
    """Which leaves need a gradient: none, each alone, all."""
    count = 1 if family == "cross_entropy" else 3 if bias else 2
    return [(), *((i,) for i in range(count)), tuple(range(count))]


def _check(got: Tensor, want: Tensor, dtype: torch.dtype, what: str) -> None:
    if dtype in (torch.bfloat16, torch.float16):  # the logits rounded to it by the head
        tol = 2e-2
        peak = float(want.detach().nan_to_num().abs().max()) if want.numel() else 0.0
        atol = tol * max(1.0, peak)
    else:
        tol = atol = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got.detach().double(), want.detach().double(), atol=atol,
                               rtol=tol, equal_nan=True, msg=lambda m: f"{what}: {m}")


def _compare(family: str, row: Callable[..., Tensor], leaves: list[Tensor | None],
             labels: Tensor, ignore_index: int, reduction: str, needs: tuple[int, ...],
             what: str) -> None:
    """``row`` against torch: the value, and each needed leaf's gradient for the
    cotangents one, -1.5 and (per token, for ``none``) a ramp."""
    assert leaves[0] is not None
    dtype = leaves[0].dtype
    mine = [None if t is None else t.detach().clone().requires_grad_(i in needs)
            for i, t in enumerate(leaves)]
    ref = [None if t is None else t.detach().clone().requires_grad_(i in needs)
           for i, t in enumerate(leaves)]
    got = row(*mine, labels, ignore_index, reduction) if family == "cross_entropy" \
        else row(mine[0], mine[1], labels, mine[2], ignore_index, reduction)
    want = _torch_loss(family, ref, labels, ignore_index, reduction)
    assert got.shape == want.shape and got.dtype == want.dtype, what
    _check(got, want, dtype, f"{what} value")
    assert got.requires_grad == bool(needs), what
    if not needs:
        return
    inputs_mine = [mine[i] for i in needs]
    inputs_ref = [ref[i] for i in needs]
    cotangents = [torch.ones_like(want), torch.full_like(want, -1.5)]
    if reduction == "none":
        cotangents.append(torch.linspace(-2.0, 2.0, want.numel(), dtype=want.dtype))
    for k, cot in enumerate(cotangents):
        last = k == len(cotangents) - 1
        gm = torch.autograd.grad(got, inputs_mine, cot, retain_graph=not last)
        gr = torch.autograd.grad(want, inputs_ref, cot, retain_graph=not last)
        for i, a, b in zip(needs, gm, gr, strict=True):
            assert a.dtype == leaves[i].dtype and a.shape == b.shape, what  # type: ignore[union-attr]
            assert bool(torch.isfinite(a).all()), f"{what} gradient {i}: not finite"
            _check(a, b.to(a.dtype), dtype, f"{what} gradient {i} cotangent {k}")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16],
                         ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_every_row_gives_torchs_loss_and_gradients_in_every_corner(
        family: str, dtype: torch.dtype, reduction: str) -> None:
    biases = (False,) if family == "cross_entropy" else (False, True)
    with _chunks_of(CHUNK, VOCAB):
        for name, row in _rows(family):
            for mask, bias, ignore_index in itertools.product(MASKS, biases, (-100, 2)):
                n = 0 if mask == "empty" else TOKENS
                labels = _labels(n, VOCAB, mask, ignore_index, seed=n)
                for needs in _needs(family, bias):
                    what = (f"{family}.{name} {dtype} {reduction} {mask} bias={bias} "
                            f"ignore_index={ignore_index} needs={needs}")
                    leaves = _leaves(family, n, dtype, bias, seed=3)
                    if (family, name) in WITHOUT_NONE and reduction == "none":
                        with pytest.raises(ValueError, match="mean or sum"):
                            row(leaves[0], leaves[1], labels, leaves[2], ignore_index,
                                reduction)
                        continue
                    _compare(family, row, leaves, labels, ignore_index, reduction, needs,
                             what)


@settings(max_examples=60, deadline=None)
@given(family=st.sampled_from(FAMILIES), tokens=st.integers(0, 24),
       vocab=st.integers(1, 9), features=st.integers(1, 6), chunk=st.integers(1, 7),
       ignore=st.sampled_from(["-100", "-1", "0", "last", "beyond"]),
       ignored=st.floats(0.0, 1.0), reduction=st.sampled_from(REDUCTIONS),
       dtype=st.sampled_from([torch.float32, torch.float64]), bias=st.booleans(),
       labels_dtype=st.sampled_from([torch.int64, torch.int32, torch.int16, torch.uint8]),
       seed=st.integers(0, 2**16))
def test_random_calls_agree_with_torch(family: str, tokens: int, vocab: int, features: int,
                                       chunk: int, ignore: str, ignored: float,
                                       reduction: str, dtype: torch.dtype, bias: bool,
                                       labels_dtype: torch.dtype, seed: int) -> None:
    ignore_index = {"-100": -100, "-1": -1, "0": 0, "last": vocab - 1,
                    "beyond": vocab + 3}[ignore]
    if labels_dtype == torch.uint8 and ignore_index < 0:
        labels_dtype = torch.int16  # uint8 cannot hold a negative ignore_index
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    labels[torch.rand(tokens, generator=g) < ignored] = ignore_index
    labels = labels.to(labels_dtype)
    leaves = _leaves(family, tokens, dtype, bias and family != "cross_entropy", seed,
                     vocab=vocab, features=features)
    every = tuple(i for i, t in enumerate(leaves) if t is not None)
    with _chunks_of(chunk, vocab):
        for name, row in _rows(family):
            if (family, name) in WITHOUT_NONE and reduction == "none":
                continue
            _compare(family, row, leaves, labels, ignore_index, reduction, every,
                     f"{family}.{name} labels {labels.tolist()} ignore_index {ignore_index}")


@pytest.mark.parametrize("labels_dtype", [torch.int32, torch.int16, torch.uint8], ids=str)
def test_labels_of_another_integer_dtype_are_read_as_int64(labels_dtype: torch.dtype) -> None:
    labels = torch.tensor([3, 0, 156, 4, 6])  # as uint8, -100 is 156: yet a label
    leaves = _leaves("linear_cross_entropy", 5, torch.float32, True, seed=5, vocab=200)
    for name, row in _rows("linear_cross_entropy"):
        got = row(leaves[0], leaves[1], labels.to(labels_dtype), leaves[2])
        want = _torch_loss("linear_cross_entropy", leaves, labels, -100, "mean")
        torch.testing.assert_close(got, want, msg=lambda m, n=name: f"{n}: {m}")
    hidden, weight = leaves[0], leaves[1]
    assert hidden is not None and weight is not None
    logits = hidden @ weight.T
    for name, row in _rows("cross_entropy"):
        got = row(logits, labels.to(labels_dtype))
        torch.testing.assert_close(got, F.cross_entropy(logits, labels),
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_no_tokens_give_a_zero_weight_gradient_from_the_chunked_row() -> None:
    """Deterministic mode fills fresh memory with NaN: a gradient left unwritten shows."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for reduction in ("mean", "sum"):
            hidden = torch.randn(0, 4, requires_grad=True)
            weight = torch.randn(6, 4, requires_grad=True)
            bias = torch.randn(6, requires_grad=True)
            loss = lce.chunked_linear_cross_entropy(hidden, weight,
                                                    torch.zeros(0, dtype=torch.long), bias,
                                                    reduction=reduction)
            gh, gw, gb = torch.autograd.grad(loss, (hidden, weight, bias))
            assert gh.shape == (0, 4)
            assert torch.equal(gw, torch.zeros(6, 4)) and torch.equal(gb, torch.zeros(6))
    finally:
        torch.use_deterministic_algorithms(before)


def _head(seed: int) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return (torch.nn.Parameter(torch.randn(16, 8, generator=g)),
            torch.nn.Parameter(torch.randn(16, generator=g)))


@pytest.mark.parametrize("name", [None, "chunked", "torch", "reference"])
def test_a_fully_masked_batch_leaves_the_weights_as_they_were(name: str | None) -> None:
    """Through the facade, 512 tokens (the table's default there is ``chunked``): a batch
    whose labels are all ignored has the NaN mean loss torch gives, zero gradients, and
    an SGD step leaves the head unchanged; the next batch trains it as usual."""
    weight, bias = _head(0)
    opt = torch.optim.SGD([weight, bias], lr=0.1)
    hidden = torch.randn(512, 8, requires_grad=True)
    masked = torch.full((512,), -100)
    if name is None:
        ctx = ops.context("linear_cross_entropy", hidden, weight, masked, bias)
        assert d.resolve("linear_cross_entropy", ctx).name == "chunked"
    with d.op_backend(linear_cross_entropy=name) if name else _nothing():
        before = (weight.detach().clone(), bias.detach().clone())
        loss = ops.linear_cross_entropy(hidden, weight, masked, bias)
        assert torch.isnan(loss)  # as F.cross_entropy gives: 0 / 0
        loss.backward()
        for t in (hidden, weight, bias):
            assert t.grad is not None and not bool(t.grad.any()), t.shape
        opt.step()
        opt.zero_grad()
        assert torch.equal(weight, before[0]) and torch.equal(bias, before[1])
        labels = torch.randint(0, 16, (512,), generator=torch.Generator().manual_seed(1))
        loss = ops.linear_cross_entropy(hidden, weight, labels, bias)
        loss.backward()
        opt.step()
        assert bool(torch.isfinite(loss)) and bool(torch.isfinite(weight).all())
        assert not torch.equal(weight, before[0])


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def test_the_chunked_row_makes_no_gradient_where_autograd_does_not_record() -> None:
    hidden = torch.randn(40, 6, requires_grad=True)
    weight = torch.randn(9, 6, requires_grad=True)
    labels = torch.randint(0, 9, (40,))
    with torch.no_grad(), torch.autograd.profiler.profile() as prof:
        loss = lce.chunked_linear_cross_entropy(hidden, weight, labels)
    assert not loss.requires_grad
    assert "aten::scatter_add_" not in {e.name for e in prof.function_events}
    torch.testing.assert_close(loss, F.cross_entropy(hidden @ weight.T, labels))


def test_a_second_derivative_through_the_chunked_row_is_an_error() -> None:
    """A gradient penalty: the first derivatives made differentiable (the loss's
    cotangent needs a gradient), then differentiated again. The row's gradients do not
    depend on ``hidden`` and ``weight`` in the graph: that raises, where it would leave
    their part of the penalty's gradient out."""
    hidden = torch.randn(6, 4, requires_grad=True)
    weight = torch.randn(5, 4, requires_grad=True)
    scale = torch.tensor(2.0, requires_grad=True)
    loss = lce.chunked_linear_cross_entropy(hidden, weight, torch.randint(0, 5, (6,)))
    (gh,) = torch.autograd.grad(loss, hidden, scale, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gh.square().sum().backward()
