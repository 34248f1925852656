"""The ``rms_norm`` family: RMS normalisation over the last dimension, scaled by a weight.

Its declaration: the facade ``rms_norm(x, weight, eps, backend=None, *, weight_offset,
cast_before_weight)`` (and ``rms_norm_form``, the same call with a form fixed), how a
call is validated and read into its axes (``dtype``, ``device_cuda``, ``ndim``,
``grad_enabled``, the feature axes of the forms it asks for; lazily ``device``, ``sm``
and ``tokens`` - the rows normalised), the common calls as data for the compiled hot
path, and its model recognition (``astrai.families.rms_norm.model``).
"""

from __future__ import annotations

__all__ = ["FAMILY", "RMS_NORM", "RMS_NORM_ASKS", "RMS_NORM_FEATURES", "RMS_NORM_READING",
           "RMS_NORM_READS", "RMS_NORM_SHAPE", "describe_rms_norm", "rms_norm",
           "rms_norm_features", "rms_norm_form"]

import math as _math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from astrai.dispatch.facade import (
    DEVICE_OPS,
    FamilyCall,
    facade,
    leading_rows,
    number,
    read_device,
    read_sm,
    require_tensors,
)
from astrai.dispatch.reading import Case, Op, Reading
from astrai.dispatch.torch_compile import compiling
from astrai.families import Family, declare

_grad = torch.is_grad_enabled
_NONE: dict[str, Any] = {}

RMS_NORM_READS = ("dtype", "device_cuda", "ndim", "grad_enabled")


#: The rms_norm facade's feature keywords, and the feature axis each one sets.
RMS_NORM_FEATURES: dict[str, str] = {"weight_offset": "weight_offset",
                                     "cast_before_weight": "cast_before_weight"}
#: The feature axes, in the order ``describe_rms_norm`` appends them.
RMS_NORM_ASKS = tuple(RMS_NORM_FEATURES.values())


def rms_norm_features(features: dict[str, Any]) -> dict[str, Any]:
    """The forms an rms_norm call asks for, checked, with those at their default (an
    offset of 0, the weight applied in float32) left out."""
    asked: dict[str, Any] = {}
    for name, value in features.items():
        if name == "weight_offset":
            if not _math.isfinite(number("rms_norm", name, value)):
                raise ValueError(f"rms_norm: weight_offset must be a finite number, "
                                 f"got {value!r}")
            if value:
                asked[name] = value
        elif name == "cast_before_weight":
            if value.__class__ is not bool:
                raise TypeError(f"rms_norm: cast_before_weight must be a bool, got {value!r}")
            if value:
                asked[name] = True
        else:
            raise TypeError(f"rms_norm got an unexpected keyword argument {name!r}; "
                            f"features: {', '.join(RMS_NORM_FEATURES)}")
    return asked


def describe_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                      features: dict[str, Any] = _NONE) -> tuple[Any, ...]:
    """``weight`` is ``[x.shape[-1]]`` or ``None`` (no scaling: Llama 4's QK norm); ``eps``
    is a non-negative number. ``features`` (checked by ``rms_norm_features``) add
    ``RMS_NORM_ASKS`` when there are any; a weightless call takes none."""
    if isinstance(x, Tensor) and isinstance(weight, Tensor):
        shape, ws = x.shape, weight.shape
        if (len(ws) == 1 and shape and ws[0] == shape[-1] and eps.__class__ is float
                and eps >= 0):  # the common call: nothing but integer comparisons
            if features:
                return _forms(x.dtype, x.is_cuda, len(shape), features)
            return (x.dtype, x.is_cuda, len(shape), _grad())
    if weight is None:
        return _weightless(x, eps, features)
    require_tensors("rms_norm", x=x, weight=weight)
    if len(x.shape) < 1 or tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"rms_norm expects x [..., features] and weight [features]; got x "
                         f"{tuple(x.shape)}, weight {tuple(weight.shape)}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"rms_norm eps must be a number >= 0, got {eps!r}")
    if features:
        return _forms(x.dtype, x.is_cuda, len(x.shape), features)
    return (x.dtype, x.is_cuda, len(x.shape), _grad())


def _weightless(x: Any, eps: Any, features: dict[str, Any]) -> tuple[Any, ...]:
    """A call without a weight: ``x [..., f]``, ``eps`` a number >= 0, no form."""
    if (isinstance(x, Tensor) and len(x.shape) and eps.__class__ is float and eps >= 0
            and not features):
        return (x.dtype, x.is_cuda, len(x.shape), _grad())  # the common weightless call
    require_tensors("rms_norm", x=x)
    if len(x.shape) < 1:
        raise ValueError(f"rms_norm expects x [..., features]; got x {tuple(x.shape)}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"rms_norm eps must be a number >= 0, got {eps!r}")
    if features:
        raise ValueError(f"rms_norm without a weight takes no {' or '.join(features)} (they "
                         f"are forms of applying the weight)")
    return (x.dtype, x.is_cuda, len(x.shape), _grad())


def _forms(dtype: torch.dtype, cuda: bool, ndim: int,
           features: dict[str, Any]) -> tuple[Any, ...]:
    """An rms_norm call's base axes and its ``RMS_NORM_ASKS``."""
    return (dtype, cuda, ndim, _grad(), "weight_offset" in features,
            "cast_before_weight" in features)



#: RMS norm: ``tokens`` are the rows normalised.
RMS_NORM_SHAPE: dict[str, Callable[..., Any]] = {
    "device": read_device, "sm": read_sm,
    "tokens": leading_rows(0, 1)}

#: ``rms_norm(x, weight, eps, weight_offset asked, cast_before_weight asked)``: x [..., f],
#: weight [f] (or None, without a form), eps an exact float >= 0; the feature axes when
#: either form is asked.
_RMS_SHAPE: tuple[Op, ...] = (("tensor", 0), ("tensor", 1), ("ndim", 1, 1), ("ndim_ge", 0, 1),
                              ("size_eq", 1, 0, 0, -1), ("float_ge0", 2))
_RMS_BASE: tuple[Op, ...] = (("dtype", 0), ("cuda", 0), ("ndim", 0), ("grad",))
_RMS_LAZY: dict[str, Op] = {**DEVICE_OPS, "tokens": ("rows", 0, 1)}
RMS_NORM_READING = Reading(5, (
    Case((("is", 3, 2), ("is", 4, 2), *_RMS_SHAPE), _RMS_BASE, _RMS_LAZY),
    Case((("is", 1, 0), ("is", 3, 2), ("is", 4, 2), ("tensor", 0), ("ndim_ge", 0, 1),
          ("float_ge0", 2)), _RMS_BASE, _RMS_LAZY),
    Case((("bool", 3), ("bool", 4), *_RMS_SHAPE), (*_RMS_BASE, ("arg", 3), ("arg", 4)),
         _RMS_LAZY),
))


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6,
             backend: Any = None, *, weight_offset: float = 0.0,
             cast_before_weight: bool = False) -> torch.Tensor:
    """RMS normalisation over the last dimension, scaled by ``weight`` (``None``: not
    scaled, as Llama 4's QK norm).

    The forms models define are features, served only by rows that declare them:
    ``weight_offset=1.0`` applies the weight as ``1 + weight`` (Gemma);
    ``cast_before_weight=True`` normalises in float32, casts back to ``x``'s dtype and
    then multiplies by the weight, the output taking the dtype of ``weight * x``
    (``LlamaRMSNorm``).
    """
    f = RMS_NORM
    if not (weight_offset or cast_before_weight):  # the common call: no feature keywords
        if backend is None and not compiling() and f.lookup is not None:
            d = f.lookup(f.last, x, weight, eps, False, False)
            if d is not None:
                next(d.counter)
                return d.call(x, weight, eps)  # type: ignore[no-any-return]
        return f.route(backend, (x, weight, eps, _NONE))(x, weight, eps)  # type: ignore[no-any-return]
    asked = rms_norm_features({"weight_offset": weight_offset,
                               "cast_before_weight": cast_before_weight})
    return f.route(backend, (x, weight, eps, asked))(x, weight, eps, **asked)  # type: ignore[no-any-return]


def rms_norm_form(*, weight_offset: float = 0.0, cast_before_weight: bool = False
                  ) -> Callable[[torch.Tensor, torch.Tensor | None, float], torch.Tensor]:
    """``rms_norm(x, weight, eps)`` with the form's features fixed and checked once: the
    call a model's norm module makes on every forward, without building and checking
    its keywords each time (``dispatch_model`` serves each norm module with one)."""
    asked = rms_norm_features({"weight_offset": weight_offset,
                               "cast_before_weight": cast_before_weight})
    if not asked:
        def plain(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
            f = RMS_NORM
            if not compiling() and f.lookup is not None:
                d = f.lookup(f.last, x, weight, eps, False, False)
                if d is not None:
                    next(d.counter)
                    return d.call(x, weight, eps)  # type: ignore[no-any-return]
            return f.route(None, (x, weight, eps, _NONE))(x, weight, eps)  # type: ignore[no-any-return]

        return plain

    offset, cast = "weight_offset" in asked, "cast_before_weight" in asked

    def form(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        f = RMS_NORM
        if not compiling() and f.lookup is not None:
            d = f.lookup(f.last, x, weight, eps, offset, cast)
            if d is not None:
                next(d.counter)
                return d.call(x, weight, eps, **asked)  # type: ignore[no-any-return]
        return f.route(None, (x, weight, eps, asked))(x, weight, eps, **asked)  # type: ignore[no-any-return]

    return form


RMS_NORM = facade(FamilyCall.of(rms_norm, describe_rms_norm, RMS_NORM_READS, RMS_NORM_SHAPE,
                                positional=3, keywords=tuple(RMS_NORM_FEATURES),
                                asks=RMS_NORM_ASKS,
                                check=lambda full, asked: rms_norm_features(asked),
                                reading=RMS_NORM_READING))
FAMILY = declare(Family("rms_norm", (RMS_NORM,),
                        model="astrai.families.rms_norm.model:RECOGNITION"))
