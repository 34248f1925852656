"""``DeferredLogits``, the logits a routed model's head returns in training while the
fused loss takes its input and weight: read whenever, they are the values of the forward
that made them - after an optimizer step, after any in-place change or ``.data`` write
of the head's weight or input - or a clear error, never values the forward did not
compute; a loss on them and the fused loss reach the live parameters as the plain
model's do."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from astrai.families.cross_entropy.deferred import DeferredLogits
from astrai.integrations.transformers import dispatch_model
from tests import _zoo


def _pair(name: str) -> tuple[Any, Any]:
    plain = _zoo.build(name)
    routed = copy.deepcopy(plain)
    dispatch_model(routed)
    return plain.train(), routed.train()


def _forward(model: nn.Module, ids: torch.Tensor, **kwargs: Any) -> Any:
    torch.manual_seed(0)  # dropout draws the same on both sides
    return model(input_ids=ids, labels=ids, **kwargs)


def _needs(name: str) -> Any:
    return pytest.mark.skipif(not _zoo.available(name), reason=f"transformers without {name}")


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _same_grads(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, grad in got.items():
        torch.testing.assert_close(grad, want[name], atol=1e-6, rtol=1e-5, msg=name)


# -- a routed model in training ----------------------------------------------------------


@pytest.mark.parametrize("name", [pytest.param(n, marks=_needs(n))
                                  for n in ("llama", "gpt2", "gemma2", "cohere")])
def test_logits_read_after_optimizer_steps_are_those_of_their_forward(name: str) -> None:
    plain, routed = _pair(name)  # gpt2: the head is the embedding; gemma2, cohere: capped, scaled
    ids = _zoo.inputs(plain)["input_ids"]
    outs: dict[str, list[Any]] = {"plain": [], "routed": []}
    opts = {"plain": torch.optim.AdamW(plain.parameters(), lr=1e-2),
            "routed": torch.optim.AdamW(routed.parameters(), lr=1e-2)}
    for _ in range(3):
        routed.load_state_dict(plain.state_dict())  # each step from the same weights
        for label, model in (("plain", plain), ("routed", routed)):
            out = _forward(model, ids)
            out.loss.backward()
            opts[label].step()
            opts[label].zero_grad()
            outs[label].append(out)  # read below, after every later step
    for got, want in zip(outs["routed"], outs["plain"], strict=True):
        torch.testing.assert_close(got.loss, want.loss, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.logits.detach() * 1.0, want.logits.detach(),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not _zoo.available("llama"), reason="transformers without Llama")
def test_logits_read_after_a_step_under_gradient_checkpointing_are_the_forward_s() -> None:
    plain, routed = _pair("llama")
    ids = _zoo.inputs(plain)["input_ids"]
    got_want = []
    for model in (plain, routed):
        enable = (getattr(model, "activation_checkpointing_enable", None)
                  or model.gradient_checkpointing_enable)
        enable()
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        out = _forward(model, ids)
        out.loss.backward()
        grads = _grads(model)
        opt.step()
        got_want.append((out, grads))
    (want, want_grads), (got, grads) = got_want
    assert isinstance(got.logits, DeferredLogits)
    _same_grads(grads, want_grads)
    torch.testing.assert_close(got.logits * 1.0, want.logits, atol=1e-5, rtol=1e-5)


def _mul(w: nn.Parameter) -> None:
    with torch.no_grad():
        w.mul_(3.0)


def _data_mul(w: nn.Parameter) -> None:
    w.data.mul_(3.0)


def _data_copy(w: nn.Parameter) -> None:
    w.data.copy_(torch.randn_like(w))


def _data_swap(w: nn.Parameter) -> None:
    w.data = torch.randn_like(w)


CHANGES: dict[str, Callable[[nn.Parameter], None]] = {
    "mul_": _mul, "data.mul_": _data_mul, "data.copy_": _data_copy, "data = new": _data_swap}


@pytest.mark.parametrize("name", [pytest.param(n, marks=_needs(n)) for n in ("llama", "gpt2")])
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_of_the_head_s_weight_after_the_forward_changes_nothing_read(
        name: str, change: str) -> None:
    plain, routed = _pair(name)
    ids = _zoo.inputs(plain)["input_ids"]
    want = _forward(plain, ids).logits.detach()
    out = _forward(routed, ids)
    assert isinstance(out.logits, DeferredLogits) and not out.logits.computed
    weight = routed.get_output_embeddings().weight
    before = weight.detach().clone()
    CHANGES[change](weight)
    assert not torch.equal(weight.detach(), before)  # the change took
    torch.testing.assert_close(out.logits.detach() * 1.0, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logits.detach().softmax(-1), want.softmax(-1))  # cached


@pytest.mark.skipif(not _zoo.available("llama"), reason="transformers without Llama")
def test_a_change_of_the_head_s_input_after_the_forward_changes_nothing_read() -> None:
    plain, routed = _pair("llama")
    ids = _zoo.inputs(plain)["input_ids"]
    want = _forward(plain, ids).logits.detach()
    out = _forward(routed, ids, output_hidden_states=True)
    out.hidden_states[-1].mul_(0.0)  # the last hidden state is the head's input
    out.hidden_states[-1].data.add_(1.0)
    torch.testing.assert_close(out.logits.detach() * 1.0, want, atol=1e-5, rtol=1e-5)


def _distilled(model: nn.Module, ids: torch.Tensor, teacher: torch.Tensor,
               peek: Callable[[Any], Any] | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A step on the loss plus a KL term on the logits; ``peek`` reads them first."""
    model.zero_grad()
    out = _forward(model, ids)
    if peek is not None:
        peek(out)
    kl = F.kl_div(out.logits.log_softmax(-1), teacher, reduction="batchmean")
    (out.loss + kl).backward()
    return out.loss.detach() + kl.detach(), _grads(model)


def _no_grad_peek(out: Any) -> None:
    with torch.no_grad():
        out.logits.argmax(-1)


def _inference_peek(out: Any) -> None:
    with torch.inference_mode():
        out.logits.max()


@pytest.mark.parametrize("name", [pytest.param(n, marks=_needs(n)) for n in ("llama", "gpt2")])
@pytest.mark.parametrize("peek", [None, _no_grad_peek, _inference_peek],
                         ids=["no-peek", "no_grad-peek", "inference_mode-peek"])
def test_a_loss_on_the_logits_reaches_the_parameters_as_the_plain_model_s(
        name: str, peek: Callable[[Any], Any] | None) -> None:
    plain, routed = _pair(name)
    ids = _zoo.inputs(plain)["input_ids"]
    teacher = torch.randn(*ids.shape, 128, generator=torch.Generator().manual_seed(2)
                          ).softmax(-1)
    want, want_grads = _distilled(plain, ids, teacher, peek)
    got, grads = _distilled(routed, ids, teacher, peek)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    _same_grads(grads, want_grads)


# -- DeferredLogits itself ---------------------------------------------------------------


def _head(bias: bool = True) -> tuple[torch.Tensor, nn.Linear]:
    torch.manual_seed(3)
    head = nn.Linear(8, 11, bias=bias)
    return torch.randn(2, 5, 8, requires_grad=True), head


@pytest.mark.parametrize("sealed", [True, False])
def test_the_values_are_those_made_whatever_changes_after_the_seal(sealed: bool) -> None:
    hidden, head = _head()
    want = F.linear(hidden, head.weight, head.bias).detach()
    logits = DeferredLogits(hidden, head.weight, head.bias, sealed=sealed)
    assert logits.shape == (2, 5, 11) and logits.requires_grad and not logits.computed
    if not sealed:
        logits.seal()  # the end of the forward
    with torch.no_grad():
        hidden.mul_(2.0)
        head.weight.add_(1.0)
    head.bias.data.mul_(5.0)
    head.weight.data = torch.zeros_like(head.weight)
    torch.testing.assert_close((logits * 1.0).detach(), want)
    assert logits.computed


def test_read_before_the_seal_the_logits_use_the_live_tensors_and_keep_no_copy() -> None:
    hidden, head = _head()
    logits = DeferredLogits(hidden, head.weight, head.bias, sealed=False)
    got: torch.Tensor = logits * 1.0  # as a soft-capping model uses them in its forward
    logits.seal()
    assert logits.hidden is None and logits.weight is None and logits.bias is None
    torch.autograd.backward(got.sum())
    torch.testing.assert_close(head.bias.grad, torch.full((11,), 10.0))
    assert hidden.grad is not None and head.weight.grad is not None


@pytest.mark.parametrize("what", ["hidden", "weight", "bias"])
@pytest.mark.parametrize("how", ["in place", "swapped"])
def test_a_live_operand_changed_before_the_seal_makes_every_use_raise(what: str,
                                                                      how: str) -> None:
    hidden, head = _head()
    logits = DeferredLogits(hidden, head.weight, head.bias, sealed=False)
    tensor = {"hidden": hidden, "weight": head.weight, "bias": head.bias}[what]
    if how == "in place":
        with torch.no_grad():
            tensor.add_(1.0)
    else:
        tensor.data = torch.randn(tensor.shape)
    with pytest.raises(RuntimeError, match=f"the head's {'input' if what == 'hidden' else what}"
                       " changed in place, was swapped or was released"):
        logits.operands()  # what the fused loss takes
    logits.seal()  # never raises: the forward is unwinding
    with pytest.raises(RuntimeError, match="the deferred logits cannot be computed"):
        logits * 1.0


def test_a_loss_on_the_logits_reaches_the_live_parameters_through_the_copies() -> None:
    hidden, head = _head()
    want = F.linear(hidden, head.weight, head.bias).square().sum()
    want_grads = torch.autograd.grad(want, (hidden, head.weight, head.bias))
    logits = DeferredLogits(hidden, head.weight, head.bias)
    with torch.no_grad():  # a read without autograd computes them as the forward would
        logits.max()
    got_grads = torch.autograd.grad(logits.square().sum(), (hidden, head.weight, head.bias))
    for got, expected in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got, expected)


def test_the_forward_s_autocast_makes_the_logits_wherever_they_are_read() -> None:
    hidden, head = _head()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.linear(hidden, head.weight, head.bias)
        logits = DeferredLogits(hidden, head.weight, head.bias)
    assert logits.dtype == torch.bfloat16
    got = logits * 1.0
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)
    plain = DeferredLogits(hidden, head.weight, head.bias)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # none in force when made: none read
        assert (plain * 1.0).dtype == torch.float32


def test_a_head_that_cannot_take_the_input_is_refused() -> None:
    _, head = _head()
    with pytest.raises(ValueError, match=r"a head of weight \(11, 8\) cannot take an input "
                                         r"of shape \(2, 5, 9\)"):
        DeferredLogits(torch.randn(2, 5, 9), head.weight)


def test_a_wrapper_s_reads_of_every_output_leave_the_logits_deferred() -> None:
    """What FSDP2 does to each output of a module - reads ``_base``, registers a
    gradient hook - computes nothing; a kept hook joins the logits when they are
    computed, and its handle removes it."""
    hidden, head = _head()
    logits = DeferredLogits(hidden, head.weight, head.bias)
    assert logits._base is None and not logits.computed
    fired: list[torch.Size] = []
    handle = logits.register_hook(lambda g: fired.append(g.shape))
    removed = logits.register_hook(lambda g: fired.append(torch.Size([-1])))
    removed.remove()
    assert not logits.computed
    (logits * 2).sum().backward()
    assert fired == [logits.shape]
    handle.remove()
    no_grad = DeferredLogits(hidden.detach(), head.weight.detach())
    with pytest.raises(RuntimeError, match="doesn't require gradient"):
        no_grad.register_hook(lambda g: g)


@_needs("llama")
def test_under_fsdp2_the_loss_stays_fused(one_rank: Any) -> None:
    """A model dispatched, then sharded by FSDP2: the head and the loss stay one fused
    call (the logits are never made unless read), with the plain sharded model's loss
    and gradients; read later, the logits are the plain model's."""
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)")
    fully_shard = fsdp.fully_shard

    plain, routed = _pair("llama")
    for model in (plain, routed):
        for layer in model.model.layers:
            fully_shard(layer, mesh=one_rank)
        fully_shard(model, mesh=one_rank)
    ids = _zoo.inputs(plain)["input_ids"]
    outs = []
    for model in (plain, routed):
        out = _forward(model, ids)
        out.loss.backward()
        outs.append(out)
    want, got = outs
    assert isinstance(got.logits, DeferredLogits) and not got.logits.computed
    assert got.loss.item() == pytest.approx(want.loss.item(), rel=1e-6)
    for (name, p), q in zip(routed.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad.full_tensor(),
                                   atol=1e-5, rtol=1e-4, msg=name)
    torch.testing.assert_close(got.logits.detach().clone(), want.logits.detach())
