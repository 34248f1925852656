"""``CallContext``: the snapshot of one call that specs are evaluated against."""

from __future__ import annotations

__all__ = ["EMPTY", "CallContext"]

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

EMPTY: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True)
class CallContext:
    """What a spec may know about a call.

    ``fwd`` is ``None`` for training / a plain forward, else ``"prefill"`` or
    ``"decode"``. ``extra`` carries the values of axes a family declares in its
    table. ``raw`` / ``raw_kwargs`` are the original call, so an unregistered
    implementation object can be probed through its own ``supports_call``;
    they take no part in equality or hashing.
    """

    family: str
    fwd: str | None = None
    dtype: torch.dtype | None = None
    device_cuda: bool = False
    ndim: int | None = None
    head_dim: int | None = None
    has_cache: bool = False
    has_mask: bool = False
    grad_enabled: bool = True
    extra: Mapping[str, Any] = field(default_factory=lambda: EMPTY, hash=False)
    raw: tuple[Any, ...] = field(default=(), compare=False, repr=False)
    raw_kwargs: Mapping[str, Any] = field(default_factory=lambda: EMPTY, compare=False, repr=False)

    def evolve(self, **changes: Any) -> CallContext:
        """A copy with the given fields changed."""
        return dataclasses.replace(self, **changes)

    def signature(self) -> tuple[Any, ...]:
        """The hashable identity of the call's axes (``raw`` excluded); computed once."""
        got = self.__dict__.get("_signature")
        if got is not None:
            return got  # type: ignore[no-any-return]
        extra = tuple(sorted(self.extra.items())) if self.extra else ()
        got = (
            self.family,
            self.fwd,
            self.dtype,
            self.device_cuda,
            self.ndim,
            self.head_dim,
            self.has_cache,
            self.has_mask,
            self.grad_enabled,
            extra,
        )
        object.__setattr__(self, "_signature", got)
        return got
