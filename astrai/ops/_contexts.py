"""How ``ops.call`` describes a call of a family without a facade of its own: the
table's ``context:`` builder, or the first tensor argument."""

from __future__ import annotations

__all__ = ["generic_context"]

from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch

from astrai.dispatch.axes import AXES, CallContext
from astrai.dispatch.facade import device_axes


def _first_tensor(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> torch.Tensor | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


def generic_context(family: str, builder: Callable[..., Any] | None, axes: Collection[str],
                    args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> CallContext:
    """Context of an ``ops.call`` for a family without a facade of its own.

    With a ``context:`` builder named by the family's table, the builder is called with
    the call's arguments and returns the axis values (a mapping of axis name to value:
    core axes and the family's declared ones). Without one, the axes come from the first
    tensor argument: ``dtype``, ``ndim``, ``device_cuda``, ``device``, ``sm``, and the
    grad mode.
    """
    if builder is None:
        t = _first_tensor(args, kwargs)
        if t is None:
            return CallContext(family, grad_enabled=torch.is_grad_enabled(), raw=args,
                               raw_kwargs=dict(kwargs))
        device, sm = device_axes(t)
        return CallContext(family, dtype=t.dtype, device_cuda=t.is_cuda, ndim=t.dim(),
                           grad_enabled=torch.is_grad_enabled(), device=device, sm=sm,
                           raw=args, raw_kwargs=dict(kwargs))
    values = builder(*args, **kwargs)
    if not isinstance(values, Mapping):
        raise TypeError(f"{family}: the table's context builder must return a mapping of axis "
                        f"values, got {type(values).__name__}")
    core: dict[str, Any] = {"grad_enabled": torch.is_grad_enabled()}
    extra: dict[str, Any] = {}
    for name, value in values.items():
        if name in AXES:
            core[name] = value
        elif name in axes:
            extra[name] = value
        else:
            raise ValueError(f"{family}: the context builder gave unknown axis {name!r}; axes: "
                             f"{', '.join([*AXES, *axes])}")
    return CallContext(family, **core, extra=extra, raw=args, raw_kwargs=dict(kwargs))
