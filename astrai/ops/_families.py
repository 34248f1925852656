"""The built-in families' calls: how each is validated and how its axes are read.

``describe_<family>`` takes a facade's arguments, makes sure the call is
well-formed, and returns the values of the base axes the family's calls fill
(``<FAMILY>_READS`` names them, in order). ``<FAMILY>_SHAPE`` maps each lazy
(shape and hardware) axis to its reader, called with the arguments of a call already
described: a reader runs only when a loaded table compares its axis, or to build the
full context that explain shows. A row's ``when`` decides *which*
implementation may serve a well-formed call; the checks make sure the call *is*
well-formed, so no row is ever handed shapes that disagree (a row might otherwise
broadcast them into a wrong result). A malformed call is a ``ValueError`` (or a
``TypeError`` for a non-tensor) naming the shapes. The common, well-formed case
costs a handful of integer comparisons: this runs on every call, once.
"""

from __future__ import annotations

__all__ = [
    "ATTENTION_ASKS",
    "ATTENTION_FEATURES",
    "ATTENTION_READING",
    "ATTENTION_READS",
    "ATTENTION_SHAPE",
    "FIRST_TENSOR_READING",
    "LINEAR_READING",
    "LINEAR_READS",
    "LINEAR_SHAPE",
    "RMS_NORM_ASKS",
    "RMS_NORM_FEATURES",
    "RMS_NORM_READING",
    "RMS_NORM_READS",
    "RMS_NORM_SHAPE",
    "ROTARY_HALF_READING",
    "ROTARY_HALF_READS",
    "ROTARY_HALF_SHAPE",
    "ROTARY_READING",
    "ROTARY_READS",
    "ROTARY_SHAPE",
    "Keyer",
    "attention_features",
    "describe_attention",
    "describe_linear",
    "describe_rms_norm",
    "describe_rotary",
    "describe_rotary_half",
    "device_axes",
    "extended_keyer",
    "interval_keyer",
    "rms_norm_features",
    "shape_reader",
]

import math as _math
from bisect import bisect_right
from collections.abc import Callable, Mapping
from math import prod
from typing import Any

import torch
from torch import Tensor

from astrai.backends.attention.dense import PAGED_MODES, check_dense
from astrai.backends.attention.paged import check_paged
from astrai.backends.rotary import check_rotary_call, check_rotary_half_call
from astrai.dispatch.reading import Case, Op, Reading
from astrai.dispatch.torch_compile import constant_result

_grad = torch.is_grad_enabled

ATTENTION_READS = ("fwd", "dtype", "device_cuda", "ndim", "head_dim", "has_cache", "has_mask",
                   "grad_enabled")
ROTARY_READS = ("dtype", "device_cuda", "ndim", "head_dim", "grad_enabled")
#: A half-layout rotary call: the same axes, and its layout.
ROTARY_HALF_READS = (*ROTARY_READS, "layout")
RMS_NORM_READS = ("dtype", "device_cuda", "ndim", "grad_enabled")
LINEAR_READS = RMS_NORM_READS

_capabilities: dict[int, int] = {}
_NONE: dict[str, Any] = {}
_CPU = ("cpu", None)


@constant_result
def _capability(index: int) -> int:
    """CUDA device ``index``'s compute capability as ``major * 10 + minor`` (asked once)."""
    got = _capabilities.get(index)
    if got is None:
        major, minor = torch.cuda.get_device_capability(index)
        got = _capabilities[index] = major * 10 + minor
    return got


def device_axes(t: torch.Tensor) -> tuple[str, int | None]:
    """The ``device`` and ``sm`` axes of a call whose main tensor is ``t``."""
    if t.is_cpu:  # the common case, without making a torch.device (a few hundred ns)
        return _CPU
    device = t.device
    if device.type != "cuda":
        return device.type, None
    index = device.index
    return "cuda", _capability(torch.cuda.current_device() if index is None else index)


def _tensors(family: str, **tensors: Any) -> None:
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{family}: {name} must be a torch.Tensor, got {type(t).__name__}")


#: The attention facade's feature keywords, and the feature axis each one sets.
ATTENTION_FEATURES: dict[str, str] = {"scale": "scale", "softcap": "softcap",
                                      "dropout_p": "dropout", "window": "window",
                                      "sinks": "sinks", "return_weights": "return_weights"}
#: The feature axes, in the order ``describe_attention`` appends them.
ATTENTION_ASKS = tuple(ATTENTION_FEATURES.values())


def _number(name: str, value: Any, family: str = "attention") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise TypeError(f"{family}: {name} must be a number, got {value!r}")
    return float(value)


def attention_features(q: torch.Tensor, is_causal: bool, kv_cache: Any,
                       features: dict[str, Any]) -> dict[str, Any]:
    """The features an attention call asks for, checked, with those at their default
    left out (a scale of ``head_dim ** -0.5``, no cap, ``dropout_p=0``, no window, no
    sinks, no weights): a row receives exactly the keywords of what it must honour."""
    asked: dict[str, Any] = {}
    for name, value in features.items():
        if name not in ATTENTION_FEATURES:
            raise TypeError(f"attention got an unexpected keyword argument {name!r}; "
                            f"features: {', '.join(ATTENTION_FEATURES)}")
        if value is None:
            continue
        if name == "scale":
            if _number(name, value) <= 0:
                raise ValueError(f"attention: scale must be > 0, got {value!r}")
            if not _math.isclose(value, q.shape[-1] ** -0.5, rel_tol=1e-6):
                asked[name] = value
        elif name == "softcap":
            if _number(name, value) < 0:
                raise ValueError(f"attention: softcap must be >= 0, got {value!r}")
            if value:
                asked[name] = value
        elif name == "dropout_p":
            if not 0 <= _number(name, value) < 1:
                raise ValueError(f"attention: dropout_p must be in [0, 1), got {value!r}")
            if value:
                asked[name] = value
        elif name == "window":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"attention: window must be an int >= 1, got {value!r}")
            if not is_causal and kv_cache is None:
                raise ValueError("attention: a sliding window needs is_causal=True (or the "
                                 "paged path, causal per request)")
            asked[name] = value
        elif name == "sinks":
            if not isinstance(value, Tensor) or tuple(value.shape) != (q.shape[-2],) or (
                    not value.is_floating_point()):
                raise ValueError(f"attention: sinks must be a float tensor [heads] = "
                                 f"[{q.shape[-2]}], got "
                                 f"{tuple(value.shape) if isinstance(value, Tensor) else value!r}")
            asked[name] = value
        elif value is not False:  # return_weights
            if value is not True:
                raise TypeError(f"attention: return_weights must be a bool, got {value!r}")
            asked[name] = True
    return asked


def _attention_slow(q: Any, k: Any, v: Any, kv_cache: Any, layer_id: int, attn_mask: Any,
                    fwd: str | None) -> None:
    _tensors("attention", q=q, k=k, v=v)
    if attn_mask is not None:
        _tensors("attention", attn_mask=attn_mask)
    if kv_cache is None:
        check_dense(q, k, v, attn_mask)
    else:
        check_paged(q, k, v, kv_cache, layer_id, fwd, attn_mask)
    if q.shape[-1] < 1 or k.shape[-2] < 1:
        raise ValueError(f"attention needs head_dim >= 1 and at least one k/v head; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}")
    if v.shape[-1] < 1:
        raise ValueError(f"attention needs v's head_dim >= 1; got v {tuple(v.shape)}")


def describe_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Any,
                       layer_id: int, attn_mask: torch.Tensor | None, is_causal: bool,
                       fwd: str | None, features: dict[str, Any]) -> tuple[Any, ...]:
    """Dense ``[batch, seq, heads, head_dim]`` q/k/v that agree (GQA allowed), or a
    packed ``[tokens, heads, head_dim]`` call that fits its paged batch. ``features``
    (checked by ``attention_features``) add ``ATTENTION_ASKS`` when there are any."""
    if fwd is not None and fwd not in PAGED_MODES:
        raise ValueError(f"fwd must be one of None, 'prefill', 'decode'; got {fwd!r}")
    if features:
        return (*describe_attention(q, k, v, kv_cache, layer_id, attn_mask, is_causal, fwd,
                                    _NONE),
                "scale" in features, "softcap" in features, "dropout_p" in features,
                features.get("window"), "sinks" in features, "return_weights" in features)
    if kv_cache is None and attn_mask is None:
        try:  # the common dense call: k and v alike, then integer comparisons with q
            qs, ks = q.shape, k.shape
            same = v.shape == ks
        except AttributeError:
            same = False  # not tensors: the full check says which
        if same and len(qs) == 4 and len(ks) == 4:
            b, _, h, d = qs
            kb, _, kh, kd = ks
            dt = q.dtype
            if (b == kb and d == kd and d > 0 < kh and not h % kh and k.dtype is dt
                    and v.dtype is dt):
                return (fwd, dt, q.is_cuda, 4, d, False, False, _grad())
    _attention_slow(q, k, v, kv_cache, layer_id, attn_mask, fwd)
    return (fwd, q.dtype, q.is_cuda, len(q.shape), q.shape[-1], kv_cache is not None,
            attn_mask is not None, _grad())


def describe_rotary(x: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[Any, ...]:
    """``x`` 3-d or 4-d with an even head_dim, and a ``(cos, sin)`` table that fits it:
    ``[batch or 1, seq, head_dim/2, 2]`` (or ``[seq, ...]``) for 4-d x, ``[tokens, ...]``
    for packed x."""
    try:  # the common call: shape unpacking and integer comparisons only
        xs, ts = x.shape, freqs_cis.shape
        n, d = len(xs), xs[-1]
        if n == 4:
            fits = ((len(ts) == 4 and ts[1] == xs[1] and (ts[0] == 1 or ts[0] == xs[0]))
                    or (len(ts) == 3 and ts[0] == xs[1]))
        else:
            fits = n == 3 and len(ts) == 3 and ts[0] == xs[0]
        if (fits and d >= 2 and not d % 2 and ts[-2] == d >> 1 and ts[-1] == 2
                and freqs_cis.dtype.is_floating_point):
            return (x.dtype, x.is_cuda, n, d, _grad())
    except (AttributeError, IndexError, TypeError):
        pass  # not tensors, or 0-d: the full check says which
    _tensors("rotary", x=x, freqs_cis=freqs_cis)
    check_rotary_call(x, freqs_cis)  # raises, naming the shapes
    raise AssertionError(f"rotary: call not described: {tuple(x.shape)}, "
                         f"{tuple(freqs_cis.shape)}")  # pragma: no cover


def describe_rotary_half(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, unsqueeze_dim: int) -> tuple[Any, ...]:
    """A half-layout call: q and k alike but for their heads (at ``unsqueeze_dim``), one
    dtype, and ``cos``/``sin`` that fit them once given an axis there."""
    try:  # the common call: transformers' [batch, heads, seq, head_dim], cos [b or 1, s, d]
        qs, ks, cs = q.shape, k.shape, cos.shape
        if (unsqueeze_dim == 1 and len(qs) == 4 and len(ks) == 4 and len(cs) == 3
                and sin.shape == cs):
            b, _, n, d = qs
            if (ks[0] == b and ks[2] == n and ks[3] == d and cs[2] == d and cs[1] == n
                    and (cs[0] == b or cs[0] == 1) and d >= 2 and not d % 2
                    and k.dtype is q.dtype and cos.dtype.is_floating_point
                    and sin.dtype.is_floating_point and unsqueeze_dim.__class__ is int):
                return (q.dtype, q.is_cuda, 4, d, _grad(), "half")
    except (AttributeError, IndexError, TypeError, ValueError):
        pass  # not tensors, or other ranks: the full check says which
    check_rotary_half_call(q, k, cos, sin, unsqueeze_dim)  # raises, naming the shapes
    return (q.dtype, q.is_cuda, len(q.shape), q.shape[-1], _grad(), "half")


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
            if not _math.isfinite(_number(name, value, "rms_norm")):
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


def describe_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                      features: dict[str, Any] = _NONE) -> tuple[Any, ...]:
    """``weight`` is ``[x.shape[-1]]``; ``eps`` is a non-negative number. ``features``
    (checked by ``rms_norm_features``) add ``RMS_NORM_ASKS`` when there are any."""
    if isinstance(x, Tensor) and isinstance(weight, Tensor):
        shape, ws = x.shape, weight.shape
        if (len(ws) == 1 and shape and ws[0] == shape[-1] and eps.__class__ is float
                and eps >= 0):  # the common call: nothing but integer comparisons
            if features:
                return _forms(x.dtype, x.is_cuda, len(shape), features)
            return (x.dtype, x.is_cuda, len(shape), _grad())
    _tensors("rms_norm", x=x, weight=weight)
    if len(x.shape) < 1 or tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"rms_norm expects x [..., features] and weight [features]; got x "
                         f"{tuple(x.shape)}, weight {tuple(weight.shape)}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"rms_norm eps must be a number >= 0, got {eps!r}")
    if features:
        return _forms(x.dtype, x.is_cuda, len(x.shape), features)
    return (x.dtype, x.is_cuda, len(x.shape), _grad())


def _forms(dtype: torch.dtype, cuda: bool, ndim: int,
           features: dict[str, Any]) -> tuple[Any, ...]:
    """An rms_norm call's base axes and its ``RMS_NORM_ASKS``."""
    return (dtype, cuda, ndim, _grad(), "weight_offset" in features,
            "cast_before_weight" in features)


def describe_linear(x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> tuple[Any, ...]:
    """``x [..., in]``, ``weight [out, in]``, ``bias [out]`` or ``None``, one dtype."""
    if bias is None and isinstance(x, Tensor) and isinstance(weight, Tensor):
        shape, ws = x.shape, weight.shape
        dtype = x.dtype
        if len(ws) == 2 and shape and ws[1] == shape[-1] and weight.dtype == dtype:
            return (dtype, x.is_cuda, len(shape), _grad())  # the common call
    _tensors("linear", x=x, weight=weight)
    if len(x.shape) < 1 or len(weight.shape) != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"linear expects x [..., in_features] and weight [out_features, "
                         f"in_features]; got x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    if bias is not None:
        _tensors("linear", bias=bias)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"linear bias must have shape ({weight.shape[0]},) to match "
                             f"weight {tuple(weight.shape)}; got {tuple(bias.shape)}")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"linear expects x, weight and bias of one dtype; got x {x.dtype}, "
                         f"weight {weight.dtype}"
                         + ("" if bias is None else f", bias {bias.dtype}"))
    return (x.dtype, x.is_cuda, len(x.shape), _grad())


def _rows(s: torch.Size, features: int) -> int:
    """The product of ``s`` but its last ``features`` dimensions (without slicing a
    ``torch.Size``, which costs more than the product in the common ranks)."""
    n = len(s) - features
    if n == 1:
        return s[0]  # type: ignore[no-any-return]
    if n == 2:
        return s[0] * s[1]  # type: ignore[no-any-return]
    return prod(s[:n])


def _device(t: torch.Tensor, *_: Any) -> str | None:
    return device_axes(t)[0]


def _sm(t: torch.Tensor, *_: Any) -> int | None:
    return device_axes(t)[1]


def _batch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Any, *_: Any) -> int:
    return q.shape[0] if kv_cache is None else len(kv_cache.seq_lens_host)


def _q_len(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Any, *_: Any) -> int:
    return q.shape[1] if kv_cache is None else max(kv_cache.extend_lens_host, default=0)


def _kv_len(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Any, *_: Any) -> int:
    return k.shape[1] if kv_cache is None else max(kv_cache.seq_lens_host, default=0)


#: The lazy axes of an attention call, each with its reader (called with the facade's
#: full argument tuple): for a packed call over a paged batch, ``batch`` is its request
#: count and ``q_len`` / ``kv_len`` the longest request's.
ATTENTION_SHAPE: dict[str, Callable[..., Any]] = {
    "device": _device, "sm": _sm, "batch": _batch, "q_len": _q_len, "kv_len": _kv_len,
    "heads": lambda q, *_: q.shape[-2], "kv_heads": lambda q, k, *_: k.shape[-2]}
#: Rotary: ``tokens`` are the positions rotated (batch * seq, or packed).
ROTARY_SHAPE: dict[str, Callable[..., Any]] = {
    "device": _device, "sm": _sm,
    "tokens": lambda x, freqs_cis: _rows(x.shape, 2),
    "heads": lambda x, freqs_cis: x.shape[-2]}


def _half_heads(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                unsqueeze_dim: int) -> int:
    return q.shape[unsqueeze_dim % len(q.shape)]  # type: ignore[no-any-return]


def _half_tokens(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 unsqueeze_dim: int) -> int:
    s = q.shape
    heads = unsqueeze_dim % len(s)
    tokens = 1
    for i in range(len(s) - 1):  # a loop, not a generator: torch.compile traces it
        if i != heads:
            tokens *= s[i]
    return tokens  # type: ignore[no-any-return]


#: Rotary, half layout: ``tokens`` are the positions rotated (batch * seq), ``heads`` q's.
ROTARY_HALF_SHAPE: dict[str, Callable[..., Any]] = {
    "device": _device, "sm": _sm, "tokens": _half_tokens, "heads": _half_heads}
#: RMS norm: ``tokens`` are the rows normalised.
RMS_NORM_SHAPE: dict[str, Callable[..., Any]] = {
    "device": _device, "sm": _sm, "tokens": lambda x, weight, eps, *_: _rows(x.shape, 1)}
#: Linear: ``tokens`` are the rows of ``x``; the features are ``weight``'s.
LINEAR_SHAPE: dict[str, Callable[..., Any]] = {
    "device": _device, "sm": _sm, "tokens": lambda x, weight, bias: _rows(x.shape, 1),
    "in_features": lambda x, weight, bias: weight.shape[1],
    "out_features": lambda x, weight, bias: weight.shape[0]}


def shape_reader(readers: Mapping[str, Callable[..., Any]]) -> Callable[..., tuple[Any, ...]]:
    """Every lazy axis of a call (given as the facade's full argument tuple), in the
    order of ``readers``, read in one call: the readers run here, beside their
    definitions, so building a call's full context passes through this module once."""
    reads = tuple(readers.values())

    def shape(*args: Any) -> tuple[Any, ...]:
        return tuple([read(*args) for read in reads])

    return shape


# -- a call's key in one step ------------------------------------------------------

#: ``keyer(*args) -> (key, base_values)``: what the facade looks a call up by, and the
#: base axis values ``describe`` gave (for the decision's context on a miss).
Keyer = Callable[..., tuple[tuple[Any, ...], tuple[Any, ...]]]


def interval_keyer(describe: Callable[..., tuple[Any, ...]], read: Callable[..., Any],
                   points: tuple[int, ...]) -> Keyer:
    """``describe`` and the interval of one lazy axis between its cut points, in one call:
    the key of a family whose tables compare one int axis with constants."""

    def keyer(*args: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        values = describe(*args)
        value = read(*args)
        return (*values, None if value is None else bisect_right(points, value)), values

    return keyer


def extended_keyer(describe: Callable[..., tuple[Any, ...]],
                   lazy_key: Callable[[tuple[Any, ...], tuple[Any, ...]], tuple[Any, ...]]
                   ) -> Keyer:
    """``describe``, then what the lazy axes add to the key (``keying``'s ``lazy_key``)."""

    def keyer(*args: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        values = describe(*args)
        return (*values, *lazy_key(values, args)), values

    return keyer


# -- the common calls as data, for the compiled hot path ------------------------------

_DEV: dict[str, Op] = {"device": ("device", 0), "sm": ("sm", 0)}
#: ``rms_norm(x, weight, eps, weight_offset asked, cast_before_weight asked)``: x [..., f],
#: weight [f], eps an exact float >= 0; the feature axes when either form is asked.
_RMS_SHAPE: tuple[Op, ...] = (("tensor", 0), ("tensor", 1), ("ndim", 1, 1), ("ndim_ge", 0, 1),
                              ("size_eq", 1, 0, 0, -1), ("float_ge0", 2))
_RMS_BASE: tuple[Op, ...] = (("dtype", 0), ("cuda", 0), ("ndim", 0), ("grad",))
_RMS_LAZY: dict[str, Op] = {**_DEV, "tokens": ("rows", 0, 1)}
RMS_NORM_READING = Reading(5, (
    Case((("is", 3, 2), ("is", 4, 2), *_RMS_SHAPE), _RMS_BASE, _RMS_LAZY),
    Case((("bool", 3), ("bool", 4), *_RMS_SHAPE), (*_RMS_BASE, ("arg", 3), ("arg", 4)),
         _RMS_LAZY),
))
#: ``linear(x, weight, bias)``: x [..., in], weight [out, in], bias [out] or None, one dtype.
_LINEAR_SHAPE: tuple[Op, ...] = (("tensor", 0), ("tensor", 1), ("ndim", 1, 2), ("ndim_ge", 0, 1),
                                 ("size_eq", 1, 1, 0, -1), ("dtype_eq", 1, 0))
_LINEAR_BASE: tuple[Op, ...] = (("dtype", 0), ("cuda", 0), ("ndim", 0), ("grad",))
_LINEAR_LAZY: dict[str, Op] = {**_DEV, "tokens": ("rows", 0, 1),
                               "in_features": ("size", 1, 1), "out_features": ("size", 1, 0)}
LINEAR_READING = Reading(3, (
    Case((("is", 2, 0), *_LINEAR_SHAPE), _LINEAR_BASE, _LINEAR_LAZY),
    Case((*_LINEAR_SHAPE, ("tensor", 2), ("ndim", 2, 1), ("size_eq", 2, 0, 1, 0),
          ("dtype_eq", 2, 0)), _LINEAR_BASE, _LINEAR_LAZY),
))
#: ``rotary(x, freqs_cis)``: x [b, s, h, d] with freqs [b or 1, s, d/2, 2] or [s, d/2, 2],
#: or packed x [t, h, d] with freqs [t, d/2, 2]; d even, freqs floating.
ROTARY_READING = Reading(2, (
    Case((("tensor", 0), ("tensor", 1),
          ("any", (("ndim", 0, 4), ("ndim", 1, 4), ("size_eq", 1, 1, 0, 1),
                   ("any", (("size_is", 1, 0, 1),), (("size_eq", 1, 0, 0, 0),))),
                  (("ndim", 0, 4), ("ndim", 1, 3), ("size_eq", 1, 0, 0, 1)),
                  (("ndim", 0, 3), ("ndim", 1, 3), ("size_eq", 1, 0, 0, 0))),
          ("size_ge", 0, -1, 2), ("size_even", 0, -1), ("size_twice", 0, -1, 1, -2),
          ("size_is", 1, -1, 2), ("floating", 1)),
         (("dtype", 0), ("cuda", 0), ("ndim", 0), ("size", 0, -1), ("grad",)),
         {**_DEV, "tokens": ("rows", 0, 2), "heads": ("size", 0, -2)}),
))
#: ``apply_rotary_half(q, k, cos, sin, unsqueeze_dim)``: q, k [b, h, s, d] (k's heads may
#: differ), cos = sin [b or 1, s, d], d even, q and k of one dtype, unsqueeze_dim the int 1.
ROTARY_HALF_READING = Reading(5, (
    Case((("int_eq", 4, 1), ("tensor", 0), ("tensor", 1), ("tensor", 2), ("tensor", 3),
          ("ndim", 0, 4), ("ndim", 1, 4), ("ndim", 2, 3), ("shape_eq", 3, 2),
          ("size_eq", 1, 0, 0, 0), ("size_eq", 1, 2, 0, 2), ("size_eq", 1, 3, 0, 3),
          ("size_eq", 2, 2, 0, 3), ("size_eq", 2, 1, 0, 2),
          ("any", (("size_is", 2, 0, 1),), (("size_eq", 2, 0, 0, 0),)),
          ("size_ge", 0, 3, 2), ("size_even", 0, 3), ("dtype_eq", 1, 0),
          ("floating", 2), ("floating", 3)),
         (("dtype", 0), ("cuda", 0), ("ndim", 0), ("size", 0, 3), ("grad",), ("const", 3)),
         {**_DEV, "tokens": ("prod", 0, 0, 0, 2), "heads": ("size", 0, 1)}),
), consts=(None, True, False, "half"))
#: ``attention(q, k, v, kv_cache, attn_mask, fwd)`` without features: the dense call
#: without a cache or a mask (fwd ``None``, ``"prefill"`` or ``"decode"``); q [b, s, h, d],
#: k = v [b, skv, kh, d] (kh > 0 dividing h, d > 0), one dtype.
ATTENTION_READING = Reading(6, (
    Case((("is", 3, 0), ("is", 4, 0),
          ("any", (("is", 5, 0),), (("is", 5, 3),), (("is", 5, 4),)),
          ("tensor", 0), ("tensor", 1), ("tensor", 2),
          ("ndim", 0, 4), ("ndim", 1, 4), ("shape_eq", 2, 1), ("size_eq", 0, 0, 1, 0),
          ("size_eq", 0, 3, 1, 3), ("size_ge", 0, 3, 1), ("size_div", 0, 2, 1, 2),
          ("dtype_eq", 1, 0), ("dtype_eq", 2, 0)),
         (("arg", 5), ("dtype", 0), ("cuda", 0), ("ndim", 0), ("size", 0, 3), ("const", 2),
          ("const", 2), ("grad",)),
         {**_DEV, "batch": ("size", 0, 0), "q_len": ("size", 0, 1),
          "kv_len": ("size", 1, 1), "heads": ("size", 0, -2), "kv_heads": ("size", 1, -2)}),
), consts=(None, True, False, "prefill", "decode"))
#: ``ops.call`` of a family keyed by its first tensor alone: dtype, device_cuda, ndim,
#: grad_enabled.
FIRST_TENSOR_READING = Reading(1, (
    Case((("tensor", 0),), (("dtype", 0), ("cuda", 0), ("ndim", 0), ("grad",))),
))
