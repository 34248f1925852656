"""Families under torch's autocast: a call computed in the dtypes the plain op's would be.

Autocast changes what a call *is*: under ``torch.autocast("cpu", dtype=torch.bfloat16)``
``F.linear`` of float32 tensors multiplies bfloat16 copies of them, and
``F.scaled_dot_product_attention`` takes query, key and value of mixed dtypes and casts
them all. A family that stands for such an op declares it with an ``Autocast`` (its
``FamilyCall.autocast``): the facade parameters autocast casts to its lower-precision
dtype. Under autocast for their device, the facade hands the call to ``autocasted``,
which casts those operands as torch's own autocast does (every floating tensor but a
float64 one), turns autocast off, and makes the same facade call again, now an ordinary
call of one dtype: the table decides it, ``explain`` and the counts see it, the row runs
with autocast off as torch's own kernel does. A family without an ``Autocast``
(elementwise ops, norms, the router) computes as torch's ops do under autocast: its rows
run with it in force, on the dtypes the model gives them.

The hot path never answers a call under autocast (the compiled lookup and the Python one
decline it), so the facade asks ``autocasting()`` only where the call has left the hot
path.
"""

from __future__ import annotations

__all__ = ["Autocast", "autocasted", "autocasting", "cast_operand"]

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: ``True`` while autocast is in force for any device (one call, no arguments).
autocasting: Callable[[], bool] = torch._C._is_any_autocast_enabled


def _device_types() -> tuple[str, ...]:
    listed = getattr(torch._C, "_autocast_supported_devices", None)
    if listed is not None:
        return tuple(listed())
    return ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "ipu", "privateuseone")


#: The device types autocast knows, in this torch.
DEVICE_TYPES: tuple[str, ...] = _device_types()


@dataclass(frozen=True)
class Autocast:
    """How autocast changes a family's call: ``operands`` are the facade parameters
    autocast casts to its lower-precision dtype (those of them that are floating
    tensors, float64 excepted, as torch casts)."""

    operands: tuple[str, ...]

    def positions(self, params: Sequence[str]) -> tuple[int, ...]:
        """The positions of the operands among ``params`` (a ``ValueError`` naming the
        parameters where one is not among them)."""
        wrong = [n for n in self.operands if n not in params]
        if wrong:
            raise ValueError(f"autocast names {', '.join(map(repr, wrong))}, not a "
                             f"parameter of the facade ({', '.join(params)})")
        return tuple(params.index(n) for n in self.operands)


def cast_operand(value: Any, dtype: torch.dtype) -> Any:
    """``value`` as autocast hands it to a lower-precision op: a floating tensor (not
    float64) in ``dtype``, anything else unchanged."""
    if (isinstance(value, torch.Tensor) and value.is_floating_point()
            and value.dtype is not dtype and value.dtype is not torch.float64):
        return value.to(dtype)
    return value


def _enabled_devices() -> tuple[str, ...]:
    return tuple(t for t in DEVICE_TYPES if torch.is_autocast_enabled(t))


def _without(devices: tuple[str, ...], function: Callable[..., Any], args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
    """``function(*args, **kwargs)`` with autocast off for ``devices``."""
    if not devices:
        return function(*args, **kwargs)
    with torch.autocast(devices[0], enabled=False):
        return _without(devices[1:], function, args, kwargs)


def autocasted(function: Callable[..., Any], operands: tuple[int, ...],
               args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The facade call ``function(*args, **kwargs)`` made as autocast makes the op it
    stands for: where autocast is in force for the device of the first tensor operand,
    the ``operands`` (positions in ``args``) cast to its dtype; then the call, with
    autocast off."""
    device = next((a.device.type for i in operands if i < len(args)
                   for a in (args[i],) if isinstance(a, torch.Tensor)), None)
    if device is not None and torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        args = tuple(cast_operand(a, dtype) if i in operands else a
                     for i, a in enumerate(args))
    return _without(_enabled_devices(), function, args, kwargs)
