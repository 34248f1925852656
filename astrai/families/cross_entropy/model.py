"""A language model's loss, told by what it computes, served through astrai: the logits'
cross-entropy through ``ops.cross_entropy`` and, in training, the head and the loss as
one fused ``ops.linear_cross_entropy`` call, so that the whole logits never exist.

A module is served when its class's ``forward`` calls ``self.loss_function`` (every
transformers LM head model does) and that function computes one of the two forms, run
on random logits and compared:

- **causal** (``ForCausalLMLoss``): the labels shifted by one (token ``i`` predicts label
  ``i + 1``; the last predicts nothing), ``shift_labels`` taken as they are when given;
- **masked** (``ForMaskedLMLoss``): each token its own label;

``ignore_index`` tokens left out, the mean over the tokens counted - or, given
``num_items_in_batch``, the sum divided by it (transformers' gradient accumulation).

The module's forward becomes one that, for the length of each call, gives the model
astrai's loss function in place of its own and - when labels are given and autograd
records - has the head (``get_output_embeddings()``, which must compute ``x @ W.T + b``)
return ``DeferredLogits``: the loss takes them whole into the fused call. Whatever
else uses the logits (soft-capping, scaling, a user reading ``outputs.logits``) computes
them as the head would have on first use, from the values of that forward: when the
forward returns, logits not yet computed keep copies of the head's input and parameters
(an optimizer step or an in-place change afterwards changes nothing read). Inside a
user's ``torch.compile`` the model computes its own loss (traced with the rest).
"""

from __future__ import annotations

__all__ = ["RECOGNITION", "LossForm", "loss_form"]

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from astrai.dispatch.torch_compile import compiling
from astrai.families.cross_entropy import cross_entropy
from astrai.families.cross_entropy.deferred import DeferredLogits
from astrai.families.linear_cross_entropy import linear_cross_entropy
from astrai.families.recognition import Installed, ModelRecognition
from astrai.recognition.probe import gap

_MISSING = object()


@dataclass(frozen=True)
class LossForm:
    """How the model's loss is served: ``shift`` (causal) or not (masked), and whether
    its head computes a plain linear (then training fuses the head and the loss)."""

    shift: bool
    fused: bool

    def describe(self) -> str:
        """The form in words, for the report."""
        what = "causal-LM loss (labels shifted)" if self.shift else "masked-LM loss"
        how = ("; in training the head and the loss fused (linear_cross_entropy)"
               if self.fused else "; the head is no plain linear: the logits are always made")
        return f"{what}: cross_entropy of the logits{how}"


def _calls_loss_function(module: nn.Module) -> bool:
    forward = inspect.unwrap(type(module).forward)
    code = getattr(forward, "__code__", None)
    return code is not None and "loss_function" in code.co_names


def _labels(labels: torch.Tensor, shift: bool, ignore_index: int,
            shift_labels: torch.Tensor | None) -> torch.Tensor:
    if shift_labels is not None:
        return shift_labels.reshape(-1)
    if shift:
        labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return labels.reshape(-1)


def _reduce(loss_sum_or_mean: torch.Tensor, num_items: Any) -> torch.Tensor:
    if torch.is_tensor(num_items):
        num_items = num_items.to(loss_sum_or_mean.device)
    return loss_sum_or_mean / num_items  # type: ignore[no-any-return]


def served_loss(form: LossForm) -> Callable[..., torch.Tensor]:
    """The loss function astrai gives the model: its own signature, its own result."""

    def loss_function(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                      num_items_in_batch: Any = None, ignore_index: int = -100,
                      shift_labels: torch.Tensor | None = None, **_: Any) -> torch.Tensor:
        target = _labels(labels, form.shift, ignore_index, shift_labels)
        reduction = "sum" if num_items_in_batch is not None else "mean"
        if isinstance(logits, DeferredLogits) and not logits.computed:
            hidden, weight, bias = logits.operands()
            hidden = hidden.reshape(-1, hidden.shape[-1])
            loss = linear_cross_entropy(hidden, weight, target.to(hidden.device), bias,
                                        ignore_index, reduction)
        else:
            flat = logits.reshape(-1, vocab_size)
            loss = cross_entropy(flat, target.to(flat.device), ignore_index, reduction)
        return loss if num_items_in_batch is None else _reduce(loss, num_items_in_batch)

    return loss_function


def _head(module: nn.Module) -> nn.Module | None:
    get = getattr(module, "get_output_embeddings", None)
    try:
        head = get() if callable(get) else None
    except Exception:  # a model without a head says so by raising
        return None
    return head if isinstance(head, nn.Module) else None


def _plain_linear(head: nn.Module) -> bool:
    """Whether ``head``'s class computes ``x @ W.T + b`` with its ``weight`` [V, H] (and
    ``bias`` [V] or none): run on two random tokens and compared."""
    weight = head._parameters.get("weight")
    bias = head._parameters.get("bias")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.is_meta:
        return False
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        return False
    x = torch.randn(2, weight.shape[1], generator=torch.Generator().manual_seed(41))
    x = x.to(dtype=weight.dtype, device=weight.device)
    try:
        with torch.no_grad():
            got = type(head).forward(head, x)
            want = F.linear(x, weight, bias)
    except Exception:
        return False
    return gap(got, want) <= 1e-3


def _computes(fn: Any, shift: bool) -> bool:
    g = torch.Generator().manual_seed(43)
    logits = torch.randn(2, 6, 11, generator=g)
    labels = torch.randint(0, 11, (2, 6), generator=g)
    labels[0, 2] = labels[1, 4] = -100
    target = _labels(labels, shift, -100, None)
    flat = logits.reshape(-1, 11)
    try:
        mean = fn(logits, labels, vocab_size=11)
        total = fn(logits, labels, vocab_size=11, num_items_in_batch=7)
    except Exception:
        return False
    want_mean = F.cross_entropy(flat, target, ignore_index=-100)
    want_total = F.cross_entropy(flat, target, ignore_index=-100, reduction="sum") / 7
    return (isinstance(mean, torch.Tensor) and isinstance(total, torch.Tensor)
            and bool(torch.allclose(mean, want_mean, atol=1e-6))
            and bool(torch.allclose(total, want_total, atol=1e-6)))


def loss_form(module: nn.Module) -> LossForm | str | None:
    """``module``'s ``LossForm``; why its loss cannot be served; or ``None`` when it
    computes no loss through ``loss_function``."""
    if not _calls_loss_function(module):
        return None
    try:
        fn = module.loss_function
    except Exception as exc:
        return f"its loss_function could not be read ({type(exc).__name__})"
    if not callable(fn):
        return None
    for shift in (True, False):
        if _computes(fn, shift):
            head = _head(module)
            return LossForm(shift, head is not None and _plain_linear(head))
    return ("its loss_function computes neither a causal nor a masked LM's cross-entropy "
            "(shifted or not, ignore_index -100, mean or sum / num_items_in_batch)")


def _loss_forward(form: LossForm) -> Callable[..., Any]:
    loss_function = served_loss(form)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if compiling():  # traced: the model's own loss, which inductor compiles with it
            return type(self).forward(self, *args, **kwargs)
        head = _head(self) if form.fused and _wants_fused(kwargs) else None
        before_loss = self.__dict__.get("_loss_function", _MISSING)
        before_head = _MISSING if head is None else head.__dict__.get("forward", _MISSING)
        self.__dict__["_loss_function"] = loss_function
        made: list[DeferredLogits] = []
        if head is not None:
            params = head._parameters

            def deferred(hidden: torch.Tensor) -> torch.Tensor:
                # the live parameters until this forward returns, copies from then on
                logits = DeferredLogits(hidden, params["weight"], params.get("bias"),  # type: ignore[arg-type]
                                        sealed=False)
                made.append(logits)
                return logits

            head.__dict__["forward"] = deferred
        try:
            return type(self).forward(self, *args, **kwargs)
        finally:
            for logits in made:
                logits.seal()
            for owner, name, value in ((self, "_loss_function", before_loss),
                                       (head, "forward", before_head)):
                if owner is None:
                    continue
                if value is _MISSING:
                    owner.__dict__.pop(name, None)
                else:
                    owner.__dict__[name] = value

    return forward


def _serves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Only a call with labels reaches it: the model computes its loss then."""
    return kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None


def _wants_fused(kwargs: dict[str, Any]) -> bool:
    """Whether a call computes its loss with autograd recording (then the head defers)."""
    return _serves((), kwargs) and torch.is_grad_enabled()


def _route(module: nn.Module) -> Installed | str | None:
    form = loss_form(module)
    if form is None or isinstance(form, str):
        return form
    return Installed(_loss_forward(form), form.describe(), form, serves=_serves)


#: The loss of LM head models: the whole model's forward (the loss computed in it).
RECOGNITION = ModelRecognition(layer=_route)
