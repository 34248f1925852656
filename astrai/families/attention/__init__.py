"""The ``attention`` family: scaled dot-product attention, dense or over a paged cache.

Its declaration: the facade ``attention(q, k, v, kv_cache, layer_id, attn_mask,
is_causal, fwd, backend, *, return_weights, **features)``, how a call is validated and
read into its axes (``fwd``, ``dtype``, ``device_cuda``, ``ndim``, ``head_dim``,
``has_cache``, ``has_mask``, ``grad_enabled``, the feature axes of what it asks for;
lazily ``device``, ``sm``, ``batch``, ``q_len``, ``kv_len``, ``heads`` and ``kv_heads``),
the common calls as data for the compiled hot path, and its model recognition
(``astrai.families.attention.model``; transformers' attention-function protocol is
served by ``astrai.families.attention.transformers``).
"""

from __future__ import annotations

__all__ = ["ATTENTION", "ATTENTION_ASKS", "ATTENTION_FEATURES", "ATTENTION_HEADS_FIRST",
           "ATTENTION_HEADS_FIRST_READING", "ATTENTION_HEADS_FIRST_SHAPE", "ATTENTION_READING",
           "ATTENTION_READS", "ATTENTION_SHAPE", "FAMILY", "AttentionFeatures", "attention",
           "attention_features", "attention_heads_first", "describe_attention",
           "describe_attention_heads_first"]

import math as _math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, TypedDict, overload

import torch
from torch import Tensor

if TYPE_CHECKING:
    from typing_extensions import Unpack

from astrai.backends.attention.dense import PAGED_MODES, check_dense
from astrai.backends.attention.paged import check_paged
from astrai.dispatch import state as process
from astrai.dispatch.autocasting import Autocast, autocasting
from astrai.dispatch.facade import (
    DEVICE_OPS,
    FamilyCall,
    facade,
    number,
    read_device,
    read_sm,
    require_tensors,
    size_of,
)
from astrai.dispatch.reading import Case, Op, Reading
from astrai.dispatch.torch_compile import compiling
from astrai.families import Family, declare

_grad = torch.is_grad_enabled
_NONE: dict[str, Any] = {}

ATTENTION_READS = ("fwd", "dtype", "device_cuda", "ndim", "head_dim", "has_cache", "has_mask",
                   "grad_enabled")


#: The attention facade's feature keywords, and the feature axis each one sets.
ATTENTION_FEATURES: dict[str, str] = {"scale": "scale", "softcap": "softcap",
                                      "dropout_p": "dropout", "window": "window",
                                      "sinks": "sinks", "return_weights": "return_weights"}
#: The feature axes, in the order ``describe_attention`` appends them.
ATTENTION_ASKS = tuple(ATTENTION_FEATURES.values())


def _number(name: str, value: Any) -> float:
    return number("attention", name, value)


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
    require_tensors("attention", q=q, k=k, v=v)
    if attn_mask is not None:
        require_tensors("attention", attn_mask=attn_mask)
    if kv_cache is None:
        check_dense(q, k, v, attn_mask)
    else:
        check_paged(q, k, v, kv_cache, layer_id, fwd, attn_mask)
    if q.shape[-1] < 1 or k.shape[-2] < 1:
        raise ValueError(f"attention needs head_dim >= 1 and at least one k/v head; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}")
    if v.shape[-1] < 1:
        raise ValueError(f"attention needs v's head_dim >= 1; got v {tuple(v.shape)}")


def _common_dense(q: Any, k: Any, v: Any, heads: int) -> tuple[Any, bool, int] | None:
    """``(dtype, is_cuda, head_dim)`` of the common dense call - 4-d q, k and v alike, one
    batch, head_dim and dtype, k's heads (at dim ``heads``) > 0 dividing q's - read with
    integer comparisons only; ``None`` for any other call (the full check says why). The
    compiled hot path reads the same call by ``_dense_case``."""
    try:
        qs, ks = q.shape, k.shape
        same = v.shape == ks
    except AttributeError:
        return None  # not tensors
    if same and len(qs) == 4 and len(ks) == 4:
        d, h, kh = qs[3], qs[heads], ks[heads]
        dt = q.dtype
        if (qs[0] == ks[0] and d == ks[3] and d > 0 < kh and not h % kh and k.dtype is dt
                and v.dtype is dt):
            return dt, q.is_cuda, d
    return None


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
        common = _common_dense(q, k, v, 2)
        if common is not None:
            return (fwd, common[0], common[1], 4, common[2], False, False, _grad())
    _attention_slow(q, k, v, kv_cache, layer_id, attn_mask, fwd)
    return (fwd, q.dtype, q.is_cuda, len(q.shape), q.shape[-1], kv_cache is not None,
            attn_mask is not None, _grad())



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
    "device": read_device, "sm": read_sm, "batch": _batch, "q_len": _q_len, "kv_len": _kv_len,
    "heads": size_of(0, -2), "kv_heads": size_of(1, -2)}

def _dense_case(seq: int, heads: int, guards: tuple[Op, ...], fwd: Op) -> Case:
    """The reading of the common dense call with q, k and v its first three arguments,
    their sequence at dim ``seq`` and heads at dim ``heads``: 4-d, k = v, one batch,
    head_dim > 0 and dtype, k's heads > 0 dividing q's; after ``guards`` (what the other
    arguments must be), with ``fwd`` the value of the ``fwd`` axis. ``describe_attention``
    and ``describe_attention_heads_first`` state the same rule (``_common_dense``)."""
    return Case((*guards, ("tensor", 0), ("tensor", 1), ("tensor", 2),
                 ("ndim", 0, 4), ("ndim", 1, 4), ("shape_eq", 2, 1), ("size_eq", 0, 0, 1, 0),
                 ("size_eq", 0, 3, 1, 3), ("size_ge", 0, 3, 1), ("size_div", 0, heads, 1, heads),
                 ("dtype_eq", 1, 0), ("dtype_eq", 2, 0)),
                (fwd, ("dtype", 0), ("cuda", 0), ("ndim", 0), ("size", 0, 3), ("const", 2),
                 ("const", 2), ("grad",)),
                {**DEVICE_OPS, "batch": ("size", 0, 0), "q_len": ("size", 0, seq),
                 "kv_len": ("size", 1, seq), "heads": ("size", 0, heads),
                 "kv_heads": ("size", 1, heads)})


#: ``attention(q, k, v, kv_cache, attn_mask, fwd)`` without features: the dense call
#: without a cache or a mask (fwd ``None``, ``"prefill"`` or ``"decode"``); q [b, s, h, d],
#: k = v [b, skv, kh, d] (kh > 0 dividing h, d > 0), one dtype.
ATTENTION_READING = Reading(6, (
    _dense_case(1, 2, (("is", 3, 0), ("is", 4, 0),
                       ("any", (("is", 5, 0),), (("is", 5, 3),), (("is", 5, 4),))),
                ("arg", 5)),
), consts=(None, True, False, "prefill", "decode"))


class AttentionFeatures(TypedDict, total=False):
    """What an attention call may ask for beyond plain softmax attention (each is a
    feature axis: only rows that declare it serve a call asking for it)."""

    scale: float | None  # softmax scale; None or head_dim ** -0.5 is the default
    softcap: float | None  # logits become softcap * tanh(logits / softcap); None/0: off
    dropout_p: float  # dropout on the probabilities; 0: off
    window: int | None  # each query sees its last `window` keys (itself included)
    sinks: torch.Tensor | None  # [heads]: a sink logit per head joins each softmax


#: Autocast casts query, key, value and a floating mask, as it casts
#: ``F.scaled_dot_product_attention``'s.
ATTENTION_AUTOCAST = Autocast(("q", "k", "v", "attn_mask"))


@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Any = ...,
              layer_id: int = ..., attn_mask: torch.Tensor | None = ..., is_causal: bool = ...,
              fwd: str | None = ..., backend: Any = ..., *, return_weights: Literal[False] = ...,
              **features: Unpack[AttentionFeatures]) -> torch.Tensor: ...
@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Any = ...,
              layer_id: int = ..., attn_mask: torch.Tensor | None = ..., is_causal: bool = ...,
              fwd: str | None = ..., backend: Any = ..., *, return_weights: Literal[True],
              **features: Unpack[AttentionFeatures]) -> tuple[torch.Tensor, torch.Tensor]: ...
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: Any = None,
    layer_id: int = 0,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    fwd: str | None = None,
    backend: Any = None,
    *,
    return_weights: bool = False,
    **features: Unpack[AttentionFeatures],
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention through the ``attention`` table.

    Dense ``[batch, seq, heads, head_dim]`` (training / no cache), or packed
    ``[tokens, heads, head_dim]`` with a paged ``kv_cache`` for ``fwd="prefill"`` /
    ``"decode"``. K/V may have fewer heads (GQA). Returns ``[..., heads*head_dim]``;
    with ``return_weights=True``, ``(output, weights [batch, heads, q_len, k_len])``.
    The features (``scale``, ``softcap``, ``dropout_p``, ``window``, ``sinks``,
    ``return_weights``) a call asks for are served only by rows that declare them.
    """
    f = ATTENTION
    if not (features or return_weights):  # the common call: no feature keywords to pass
        if backend is None and not compiling() and f.lookup is not None:
            d = f.lookup(f.last, q, k, v, kv_cache, attn_mask, fwd)
            if d is not None:
                next(d.counter)
                return d.call(q, k, v, kv_cache=kv_cache, layer_id=layer_id,  # type: ignore[no-any-return]
                              attn_mask=attn_mask, is_causal=is_causal, fwd=fwd)
        if autocasting():
            return f.autocasted((q, k, v, kv_cache, layer_id, attn_mask, is_causal, fwd),  # type: ignore[no-any-return]
                                {"backend": backend})
        return f.route(backend, (q, k, v, kv_cache, layer_id, attn_mask, is_causal, fwd,  # type: ignore[no-any-return]
                                 _NONE))(
            q, k, v, kv_cache=kv_cache, layer_id=layer_id, attn_mask=attn_mask,
            is_causal=is_causal, fwd=fwd)
    if autocasting():
        return f.autocasted((q, k, v, kv_cache, layer_id, attn_mask, is_causal, fwd),  # type: ignore[no-any-return]
                            {"backend": backend, "return_weights": return_weights, **features})
    given: dict[str, Any] = {**features, "return_weights": return_weights}
    asked = attention_features(q, is_causal, kv_cache, given)
    return f.route(backend, (q, k, v, kv_cache, layer_id, attn_mask, is_causal, fwd, asked))(  # type: ignore[no-any-return]
        q, k, v, kv_cache=kv_cache, layer_id=layer_id, attn_mask=attn_mask,
        is_causal=is_causal, fwd=fwd, **asked)


ATTENTION = facade(FamilyCall.of(
    attention, describe_attention, ATTENTION_READS, ATTENTION_SHAPE, positional=3,
    keywords=tuple(ATTENTION_FEATURES), asks=ATTENTION_ASKS,
    check=lambda full, asked: attention_features(full[0], full[6], full[3], asked),
    incidental=("layer_id",), reading=ATTENTION_READING, autocast=ATTENTION_AUTOCAST))


# -- the heads-first layout ------------------------------------------------------------


def _heads_first_slow(q: Any, k: Any, v: Any, attn_mask: Any) -> None:
    require_tensors("attention", q=q, k=k, v=v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"heads-first attention expects {name} as [batch, heads, seq, "
                             f"head_dim]; got shape {tuple(t.shape)}")
    if attn_mask is not None:
        require_tensors("attention", attn_mask=attn_mask)
    # The dense rules, on the seq-first views of the same call.
    check_dense(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask)
    if q.shape[-1] < 1 or k.shape[1] < 1 or v.shape[-1] < 1:
        raise ValueError(f"attention needs head_dim >= 1 and at least one k/v head; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")


def describe_attention_heads_first(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   attn_mask: torch.Tensor | None,
                                   is_causal: bool) -> tuple[Any, ...]:
    """A dense call given heads-first - q ``[batch, heads, seq, head_dim]``, k/v ``[batch,
    kv_heads, kv_seq, head_dim]`` - read into the very axis values of the same call given
    seq-first (``describe_attention``): the layout is no axis, so both decide alike."""
    if attn_mask is None:
        common = _common_dense(q, k, v, 1)
        if common is not None:
            return (None, common[0], common[1], 4, common[2], False, False, _grad())
    _heads_first_slow(q, k, v, attn_mask)
    return (None, q.dtype, q.is_cuda, 4, q.shape[-1], False, attn_mask is not None, _grad())


#: The lazy axes of a heads-first call: those of the same call given seq-first.
ATTENTION_HEADS_FIRST_SHAPE: dict[str, Callable[..., Any]] = {
    "device": read_device, "sm": read_sm, "batch": size_of(0, 0), "q_len": size_of(0, 2),
    "kv_len": size_of(1, 2), "heads": size_of(0, 1), "kv_heads": size_of(1, 1)}

#: ``attention_heads_first(q, k, v, attn_mask)`` without a mask: q [b, h, s, d], k = v
#: [b, kh, skv, d] (kh > 0 dividing h, d > 0), one dtype.
ATTENTION_HEADS_FIRST_READING = Reading(4, (_dense_case(2, 1, (("is", 3, 0),), ("const", 0)),))


def attention_heads_first(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                          backend: Any = None) -> torch.Tensor:
    """Dense attention given heads-first - q ``[batch, heads, seq, head_dim]``, k/v
    ``[batch, kv_heads, kv_seq, head_dim]``, transformers' and SDPA's layout - through
    the ``attention`` table; returns ``[batch, seq, heads, head_dim]`` (possibly a
    non-contiguous view).

    Decided exactly as ``attention`` decides the same call given seq-first (the layout
    is not an axis, so ``explain``, locks and tuning see one call). A row whose
    implementation takes heads-first calls (``takes_heads_first``) gets the tensors
    untouched; any other row gets the seq-first call as transposed views. A recording
    in force records the call seq-first, as ``attention`` makes it."""
    f = ATTENTION_HEADS_FIRST
    d = None
    if backend is None and not compiling() and f.lookup is not None:
        d = f.lookup(f.last, q, k, v, attn_mask)
    if d is not None:
        next(d.counter)
        call = d.call
    elif autocasting():
        return f.autocasted((q, k, v, attn_mask, is_causal), {"backend": backend})  # type: ignore[no-any-return]
    elif process.recordings and not compiling():  # recorded as the seq-first call
        out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                        attn_mask=attn_mask, is_causal=is_causal, backend=backend)
        return out.reshape(out.shape[0], out.shape[1], q.shape[1], -1)
    else:
        call = f.route(backend, (q, k, v, attn_mask, is_causal))
    if getattr(call, "takes_heads_first", False):
        return call(q, k, v, attn_mask=attn_mask, is_causal=is_causal,  # type: ignore[no-any-return]
                    heads_first=True)
    out = call(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask,
               is_causal=is_causal)
    return out.reshape(out.shape[0], out.shape[1], q.shape[1], -1)  # type: ignore[no-any-return]


#: The family's second call: the heads-first layout.
ATTENTION_HEADS_FIRST = facade(FamilyCall.of(
    attention_heads_first, describe_attention_heads_first, ATTENTION_READS,
    ATTENTION_HEADS_FIRST_SHAPE, positional=3, reading=ATTENTION_HEADS_FIRST_READING,
    family="attention", autocast=ATTENTION_AUTOCAST), name="attention_heads_first")
FAMILY = declare(Family("attention", (ATTENTION, ATTENTION_HEADS_FIRST),
                        model="astrai.families.attention.model:RECOGNITION"))
