"""Logits not computed yet: what a model's head returns while astrai serves the model's
loss in training, so that the head and the loss can run as one fused call.

A ``DeferredLogits`` is a tensor of the logits' shape, dtype and device holding the
head's input and parameters, and no values: the logits are ``F.linear(hidden, weight,
bias)``, what the head was found to compute. The loss astrai serves takes them whole
(the fused ``linear_cross_entropy`` call, on ``operands()``). Anything else done to them
- a model soft-capping or scaling its logits, a user reading ``outputs.logits``,
``.float()`` by a mixed-precision wrapper - computes the logits then, once, as the
forward would have (autograd recording as it did, its autocast in force), and proceeds
on them: only the memory saving is lost. (``.contiguous()``, which models call on their
logits, waits: the logits will be contiguous. So do what a wrapper does to every output
of a module - FSDP2's: ``_base`` is ``None``, as for any tensor not a view, and a hook
given to ``register_hook`` is kept and joins the logits if they are ever computed - so the
fused loss stays fused under such a wrapper.)

The values are those of the forward that made them, however late they are read. Once
sealed, a ``DeferredLogits`` holds copies of its operands (``clone()``, recorded by
autograd, so a loss on the logits still reaches the live parameters and the model): an
optimizer step, an in-place change, a write through ``.data`` or a ``.data`` swap of
the head's weight or input afterwards changes nothing read. Made with ``sealed=False``
(as the model's forward makes them), it uses the live tensors until ``seal()`` - the end
of that forward - and copies then only what is still to compute, so logits the forward
itself uses (soft-capping, scaling) cost no copy. A change to a live operand before the
seal that the tensor shows (its version, storage or shape) makes every later use of the
logits raise ``RuntimeError``: nothing is computed from a changed tensor.
"""

from __future__ import annotations

__all__ = ["DeferredLogits"]

from contextlib import ExitStack
from typing import Any

import torch
import torch.nn.functional as F

# Reading these computes nothing: they are answered from the placeholder itself.
_METADATA = frozenset({
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,  # type: ignore[attr-defined]
    torch.Tensor.requires_grad.__get__, torch.Tensor.ndim.__get__,  # type: ignore[attr-defined]
    torch.Tensor.is_cuda.__get__, torch.Tensor.layout.__get__,  # type: ignore[attr-defined]
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel,
})

_BASE = torch.Tensor._base.__get__  # type: ignore[attr-defined,union-attr]
_NAMES = ("the head's input", "the head's weight", "the head's bias")


class _KeptHook:
    """The handle of a gradient hook a ``DeferredLogits`` keeps until its logits are
    computed (then the hook is registered on them)."""

    def __init__(self, owner: DeferredLogits, hook: Any) -> None:
        self.owner, self.hook, self.handle = owner, hook, None

    def remove(self) -> None:
        if self in self.owner._hooks:
            self.owner._hooks.remove(self)
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


def _state(t: torch.Tensor | None) -> tuple[Any, ...] | None:
    """What an in-place change, a ``.data`` swap or a release of ``t`` alters."""
    if t is None:
        return None
    try:
        pointer: int | None = t.data_ptr()
    except RuntimeError:  # a tensor without storage of its own: its version tells
        pointer = None
    return (t._version, pointer, tuple(t.shape), t.stride())


def _autocast_in_force(device: str) -> tuple[bool, torch.dtype | None]:
    """Whether autocast is in force for ``device`` and its dtype."""
    try:
        if torch.is_autocast_enabled(device):
            return True, torch.get_autocast_dtype(device)
    except RuntimeError:  # a device type autocast does not know
        pass
    return False, None


class DeferredLogits(torch.Tensor):
    """The logits ``F.linear(hidden, weight, bias)`` as they are when made, computed on
    first use (see the module docstring)."""

    hidden: torch.Tensor | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    _logits: torch.Tensor | None
    _live: tuple[tuple[Any, ...] | None, ...] | None
    _records: bool
    _autocast: tuple[str, bool, torch.dtype | None]
    _broken: str | None
    _hooks: list[_KeptHook]

    @staticmethod
    def __new__(cls, hidden: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None, *, sealed: bool = True) -> DeferredLogits:
        if weight.dim() != 2 or tuple(hidden.shape[-1:]) != tuple(weight.shape[1:]):
            raise ValueError(f"a head of weight {tuple(weight.shape)} cannot take an input "
                             f"of shape {tuple(hidden.shape)}")
        autocast = _autocast_in_force(hidden.device.type)
        dtype = autocast[1] if autocast[0] and hidden.is_floating_point() else hidden.dtype
        assert dtype is not None
        shape = (*hidden.shape[:-1], weight.shape[0])
        empty = torch.zeros((), dtype=dtype, device=hidden.device).expand(shape)
        grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (hidden, weight, bias))
        self = torch.Tensor._make_subclass(cls, empty, grad)
        self.hidden, self.weight, self.bias = hidden, weight, bias
        self._logits, self._records, self._broken, self._hooks = None, grad, None, []
        self._autocast = (hidden.device.type, *autocast)
        self._live = tuple(_state(t) for t in (hidden, weight, bias))
        if sealed:
            self.seal()
        return self

    def _as_in_forward(self) -> ExitStack:
        """The forward's autograd and autocast state, for work done on its behalf."""
        stack = ExitStack()
        if torch.is_inference_mode_enabled():
            stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.set_grad_enabled(self._records))
        device, enabled, dtype = self._autocast
        if enabled or _autocast_in_force(device)[0]:
            stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
        return stack

    def _check_live(self) -> None:
        """Marks the logits broken where a live operand changed since they were made."""
        if self._live is None or self._broken is not None:
            return
        for name, t, was in zip(_NAMES, (self.hidden, self.weight, self.bias), self._live,
                                strict=True):
            if t is not None and _state(t) != was:
                self._broken = (f"{name} changed in place, was swapped or was released "
                                "after the head made them, before the model's forward "
                                "returned")
                return

    def operands(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(hidden, weight, bias)`` with the values the logits are made of (what the
        fused loss takes), while the logits are not computed; ``RuntimeError`` where
        those values are gone."""
        self._check_live()
        if self._broken is not None:
            raise RuntimeError(f"the deferred logits cannot be computed: {self._broken}; "
                               "the values the forward used are gone")
        if self.hidden is None or self.weight is None:
            raise RuntimeError("the deferred logits were computed: their operands are not "
                               "kept; use the logits")
        return self.hidden, self.weight, self.bias

    def logits(self) -> torch.Tensor:
        """The logits, computed the first time they are asked for."""
        if self._logits is None:
            hidden, weight, bias = self.operands()
            with torch._C.DisableTorchFunctionSubclass(), self._as_in_forward():
                self._logits = F.linear(hidden, weight, bias)
                for kept in self._hooks:
                    if self._logits.requires_grad:
                        kept.handle = self._logits.register_hook(kept.hook)  # type: ignore[no-untyped-call]
            if self._live is None:  # sealed: the copies have served their one use
                self.hidden = self.weight = self.bias = None
        return self._logits

    def seal(self) -> None:
        """Fixes the values from now on: copies what is still to compute and lets go of
        the live tensors. Never raises (it runs as the forward unwinds): a change found
        here makes later uses raise."""
        if self._live is None:
            return
        self._check_live()
        if self._logits is not None or self._broken is not None:
            self.hidden = self.weight = self.bias = None
        else:
            with torch._C.DisableTorchFunctionSubclass(), self._as_in_forward():
                self.hidden, self.weight, self.bias = (
                    None if t is None else t.clone() for t in (self.hidden, self.weight,
                                                                self.bias))
        self._live = None

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
        first = args[0] if args else None
        if isinstance(first, DeferredLogits) and first._logits is None:
            if func == _BASE:  # a method-wrapper: made anew at each read, equal
                return None  # no view of another tensor
            if func is torch.Tensor.register_hook and len(args) == 2 and not kwargs:
                if not first.requires_grad:
                    raise RuntimeError("cannot register a hook on a tensor that doesn't "
                                       "require gradient")
                kept = _KeptHook(first, args[1])
                first._hooks.append(kept)
                return kept

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
