"""Weights declared frozen, and what rows derive from them.

A row may keep something derived from a weight (the linear row ``transposed`` keeps a
contiguous ``[in, out]`` copy) only where the weight's owner has declared it frozen:
``dispatch_model(model, mode="inference")`` declares every parameter of the model, and
``restore_model`` (or ``dispatch_model(model, mode="train")``) withdraws it. Nothing
cheap can tell a derived copy from a stale one after a write through ``weight.data``
or a NumPy view (such writes move no version counter), so a weight not declared has no
derived copy at all and its calls read the weight itself.

The registry is weak: a tensor freed leaves it with everything derived from it.
Withdrawing a declaration drops what was derived at once. Rows that serve frozen weights
only are available while any weight is declared (``any_frozen``): the first declaration
and the last withdrawal refresh the tables' availability probes.
"""

from __future__ import annotations

__all__ = ["any_frozen", "derived", "derived_stores", "freeze", "is_frozen", "thaw"]

import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from astrai.dispatch.registry import refresh

#: Each frozen tensor (by identity) and what rows derived from it, by the row's key.
_FROZEN: Any = WeakIdKeyDictionary()  # (untyped in torch)
_LOCK = threading.Lock()


def _tensors(tensors: Iterable[torch.Tensor], caller: str) -> list[torch.Tensor]:
    got = list(tensors)
    for t in got:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{caller} takes tensors, got {type(t).__name__}")
    return got


def freeze(tensors: Iterable[torch.Tensor]) -> int:
    """Declare ``tensors`` frozen: their owner promises that their values change only
    in ways a tensor shows (an in-place write through the tensor itself, which moves
    its version; a new ``.data``, which moves its storage) - never by a write through
    ``.data`` or a NumPy view (an inference tensor keeps no version: declared frozen, it
    is not written at all). Rows may then keep copies derived from them. Returns how
    many were not declared before."""
    return _declare(_tensors(tensors, "freeze"), True)


def thaw(tensors: Iterable[torch.Tensor]) -> int:
    """Withdraw the declaration of ``tensors`` and drop what rows derived from them;
    returns how many were declared."""
    return _declare(_tensors(tensors, "thaw"), False)


def _declare(tensors: list[torch.Tensor], frozen: bool) -> int:
    """Declare (``frozen``) or withdraw ``tensors``; how many changed. The first
    declaration and the last withdrawal refresh the tables' availability probes: rows
    serving frozen weights only become available, or unavailable again."""
    changed = 0
    with _LOCK:
        before = bool(_FROZEN)
        for t in tensors:
            if frozen and t not in _FROZEN:
                _FROZEN[t] = {}
                changed += 1
            elif not frozen and _FROZEN.pop(t, None) is not None:
                changed += 1
        flipped = bool(_FROZEN) != before
    if flipped:
        refresh()
    return changed


def any_frozen() -> bool:
    """Whether any tensor is declared frozen in this process."""
    return bool(_FROZEN)


def is_frozen(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (this very object) is declared frozen."""
    return tensor in _FROZEN  # type: ignore[no-any-return]


def derived(tensor: torch.Tensor) -> dict[str, Any] | None:
    """Where rows keep what they derive from ``tensor`` (a dictionary by the row's key),
    or ``None`` when ``tensor`` is not declared frozen: then nothing may be kept."""
    return _FROZEN.get(tensor)  # type: ignore[no-any-return]


def derived_stores() -> Iterator[dict[str, Any]]:
    """Every frozen tensor's store of derived values (a snapshot of the list)."""
    with _LOCK:
        stores = list(_FROZEN.values())
    return iter(stores)
