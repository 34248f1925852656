"""How each family's facade describes a call: tensors in, ``CallContext`` out.

One function per family; the facades, the tests and ``explain`` all use these, so
the axes a row's ``when`` sees are exactly the ones computed here.
"""

from __future__ import annotations

__all__ = [
    "attention_context",
    "generic_context",
    "linear_context",
    "rms_norm_context",
    "rotary_context",
]

from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch

from astrai.dispatch.context import CallContext


def attention_context(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: Any = None,
    layer_id: int = 0,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    fwd: str | None = None,
    **kwargs: Any,
) -> CallContext:
    """Context of an ``attention`` call: axes read from ``q`` and the call's options."""
    return CallContext(
        "attention",
        fwd=fwd,
        dtype=q.dtype,
        device_cuda=q.is_cuda,
        ndim=q.dim(),
        head_dim=q.shape[-1],
        has_cache=kv_cache is not None,
        has_mask=attn_mask is not None,
        grad_enabled=torch.is_grad_enabled(),
        raw=(q, k, v),
        raw_kwargs={
            "kv_cache": kv_cache,
            "layer_id": layer_id,
            "attn_mask": attn_mask,
            "is_causal": is_causal,
            "fwd": fwd,
            **kwargs,
        },
    )


def rotary_context(x: torch.Tensor, freqs_cis: torch.Tensor, **kwargs: Any) -> CallContext:
    """Context of an ``apply_rotary`` call: axes read from ``x``."""
    return CallContext(
        "rotary",
        dtype=x.dtype,
        device_cuda=x.is_cuda,
        ndim=x.dim(),
        head_dim=x.shape[-1],
        grad_enabled=torch.is_grad_enabled(),
        raw=(x, freqs_cis),
        raw_kwargs=kwargs,
    )


def rms_norm_context(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, **kwargs: Any
) -> CallContext:
    """Context of an ``rms_norm`` call: axes read from ``x``."""
    return CallContext(
        "rms_norm",
        dtype=x.dtype,
        device_cuda=x.is_cuda,
        ndim=x.dim(),
        grad_enabled=torch.is_grad_enabled(),
        raw=(x, weight, eps),
        raw_kwargs=kwargs,
    )


def linear_context(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, **kwargs: Any
) -> CallContext:
    """Context of a ``linear`` call: axes read from ``x``."""
    return CallContext(
        "linear",
        dtype=x.dtype,
        device_cuda=x.is_cuda,
        ndim=x.dim(),
        grad_enabled=torch.is_grad_enabled(),
        raw=(x, weight, bias),
        raw_kwargs=kwargs,
    )


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
    tensor argument: ``dtype``, ``ndim``, ``device_cuda``, and the grad mode.
    """
    if builder is None:
        t = _first_tensor(args, kwargs)
        if t is None:
            return CallContext(family, grad_enabled=torch.is_grad_enabled(), raw=args,
                               raw_kwargs=dict(kwargs))
        return CallContext(family, dtype=t.dtype, device_cuda=t.is_cuda, ndim=t.dim(),
                           grad_enabled=torch.is_grad_enabled(), raw=args,
                           raw_kwargs=dict(kwargs))
    values = builder(*args, **kwargs)
    if not isinstance(values, Mapping):
        raise TypeError(f"{family}: the table's context builder must return a mapping of axis "
                        f"values, got {type(values).__name__}")
    core: dict[str, Any] = {"grad_enabled": torch.is_grad_enabled()}
    extra: dict[str, Any] = {}
    for name, value in values.items():
        if name in _CORE_FIELDS:
            core[name] = value
        elif name in axes:
            extra[name] = value
        else:
            raise ValueError(f"{family}: the context builder gave unknown axis {name!r}; axes: "
                             f"{', '.join([*_CORE_FIELDS, *axes])}")
    return CallContext(family, **core, extra=extra, raw=args, raw_kwargs=dict(kwargs))


_CORE_FIELDS = ("fwd", "dtype", "device_cuda", "ndim", "head_dim", "has_cache", "has_mask",
                "grad_enabled")
