"""Logits not computed yet: what a model's head returns while astrai serves the model's
loss in training, so that the head and the loss can run as one fused call.

A ``DeferredLogits`` is a tensor of the logits' shape, dtype and device holding the
head's input and the head, and no values. The loss astrai serves takes it whole (the
fused ``linear_cross_entropy`` call, from the head's input and weight). Anything else
done to it - a model soft-capping or scaling its logits, a user reading
``outputs.logits``, ``.float()`` by a mixed-precision wrapper - computes the logits then,
through the head, once, with autograd recording as usual, and proceeds on them: the
result is always the model's own, and only the memory saving is lost. (``.contiguous()``,
which models call on their logits, waits: the logits will be contiguous.)
"""

from __future__ import annotations

__all__ = ["DeferredLogits"]

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# Reading these computes nothing: they are answered from the placeholder itself.
_METADATA = frozenset({
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,  # type: ignore[attr-defined]
    torch.Tensor.requires_grad.__get__, torch.Tensor.ndim.__get__,  # type: ignore[attr-defined]
    torch.Tensor.is_cuda.__get__, torch.Tensor.layout.__get__,  # type: ignore[attr-defined]
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel,
})


class DeferredLogits(torch.Tensor):
    """The logits ``head(hidden)``, computed on first use (see the module docstring)."""

    hidden: torch.Tensor
    head: nn.Module
    _compute: Callable[[torch.Tensor], torch.Tensor]
    _logits: torch.Tensor | None

    @staticmethod
    def __new__(cls, hidden: torch.Tensor, head: nn.Module,
                compute: Callable[[torch.Tensor], torch.Tensor], vocab: int
                ) -> DeferredLogits:
        weight = head.weight
        assert isinstance(weight, torch.Tensor)
        shape = (*hidden.shape[:-1], vocab)
        empty = torch.zeros((), dtype=hidden.dtype, device=hidden.device).expand(shape)
        grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
        self = torch.Tensor._make_subclass(cls, empty, grad)
        self.hidden, self.head, self._compute, self._logits = hidden, head, compute, None
        return self

    def logits(self) -> torch.Tensor:
        """The logits, computed through the head the first time they are asked for."""
        if self._logits is None:
            with torch._C.DisableTorchFunctionSubclass():
                self._logits = self._compute(self.hidden)
        return self._logits

    @property
    def computed(self) -> bool:
        """Whether the logits were computed (something other than the fused loss used
        them)."""
        return self._logits is not None

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.contiguous and not kwargs and len(args) == 1:
            return args[0]  # computed logits are contiguous: nothing to do yet
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)

        def real(value: Any) -> Any:
            if isinstance(value, DeferredLogits):
                return value.logits()
            if isinstance(value, (list, tuple)):
                return type(value)(real(v) for v in value)
            return value

        args = real(tuple(args))
        kwargs = {k: real(v) for k, v in kwargs.items()}
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
