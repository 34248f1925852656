"""The ``rotary`` family: rotary position embeddings, in two calls.

Its declaration: the facades ``apply_rotary(x, freqs_cis)`` (adjacent pairs turned by a
``(cos, sin)`` table) and ``apply_rotary_half(q, k, cos, sin, unsqueeze_dim)``
(transformers' halves, ``layout == half``), how each call is validated and read into
its axes (``dtype``, ``device_cuda``, ``ndim``, ``head_dim``, ``grad_enabled``, and the
half call's ``layout``; lazily ``device``, ``sm``, ``tokens`` - the positions rotated -
and ``heads``), the common calls as data for the compiled hot path, which facade an
``ops.call("rotary", ...)`` goes to (four arguments or more: the half call), and its
model recognition (``astrai.families.rotary.model``).
"""

from __future__ import annotations

__all__ = ["FAMILY", "ROTARY", "ROTARY_HALF", "ROTARY_HALF_READING", "ROTARY_HALF_READS",
           "ROTARY_HALF_SHAPE", "ROTARY_READING", "ROTARY_READS", "ROTARY_SHAPE",
           "apply_rotary", "apply_rotary_half", "describe_rotary", "describe_rotary_half"]

from collections.abc import Callable, Mapping
from typing import Any

import torch

from astrai.backends.rotary import check_rotary_call, check_rotary_half_call
from astrai.dispatch.facade import (
    DEVICE_OPS,
    FamilyCall,
    facade,
    leading_rows,
    read_device,
    read_sm,
    require_tensors,
    size_of,
)
from astrai.dispatch.reading import Case, Reading
from astrai.dispatch.torch_compile import compiling
from astrai.families import Family, declare

_grad = torch.is_grad_enabled

ROTARY_READS = ("dtype", "device_cuda", "ndim", "head_dim", "grad_enabled")
#: A half-layout rotary call: the same axes, and its layout.
ROTARY_HALF_READS = (*ROTARY_READS, "layout")


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
    require_tensors("rotary", x=x, freqs_cis=freqs_cis)
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



#: Rotary: ``tokens`` are the positions rotated (batch * seq, or packed).
ROTARY_SHAPE: dict[str, Callable[..., Any]] = {
    "device": read_device, "sm": read_sm,
    "tokens": leading_rows(0, 2), "heads": size_of(0, -2)}


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
    "device": read_device, "sm": read_sm, "tokens": _half_tokens, "heads": _half_heads}

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
         {**DEVICE_OPS, "tokens": ("rows", 0, 2), "heads": ("size", 0, -2)}),
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
         {**DEVICE_OPS, "tokens": ("prod", 0, 0, 0, 2), "heads": ("size", 0, 1)}),
), consts=(None, True, False, "half"))


def apply_rotary(x: torch.Tensor, freqs_cis: torch.Tensor, backend: Any = None) -> torch.Tensor:
    """Rotate adjacent pairs ``(2i, 2i+1)`` of ``x`` by ``freqs_cis`` (cos, sin) per pair."""
    f = ROTARY
    if backend is None and not compiling() and f.lookup is not None:
        d = f.lookup(f.last, x, freqs_cis)
        if d is not None:
            next(d.counter)
            return d.call(x, freqs_cis)  # type: ignore[no-any-return]
    return f.route(backend, (x, freqs_cis))(x, freqs_cis)  # type: ignore[no-any-return]


def apply_rotary_half(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      unsqueeze_dim: int = 1,
                      backend: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb`` through the ``rotary`` table (``layout ==
    half``): q and k ``[batch, heads, seq, head_dim]`` (heads at ``unsqueeze_dim``),
    ``cos``/``sin`` ``[batch or 1, seq, head_dim]``; element ``i`` turns with
    ``i + head_dim/2``. Returns ``(q_out, k_out)``, computed as
    ``x * cos + rotate_half(x) * sin``. Only rows declaring the ``layout`` feature serve it."""
    f = ROTARY_HALF
    if backend is None and not compiling() and f.lookup is not None:
        d = f.lookup(f.last, q, k, cos, sin, unsqueeze_dim)
        if d is not None:
            next(d.counter)
            return d.call(q, k, cos, sin, unsqueeze_dim)  # type: ignore[no-any-return]
    return f.route(backend, (q, k, cos, sin, unsqueeze_dim))(  # type: ignore[no-any-return]
        q, k, cos, sin, unsqueeze_dim)


ROTARY = facade(FamilyCall.of(apply_rotary, describe_rotary, ROTARY_READS, ROTARY_SHAPE,
                              positional=2, reading=ROTARY_READING))
#: The family's second call: the half layout.
ROTARY_HALF = facade(FamilyCall.of(apply_rotary_half, describe_rotary_half, ROTARY_HALF_READS,
                                   ROTARY_HALF_SHAPE, positional=5,
                                   reading=ROTARY_HALF_READING, family="rotary"),
                     name="rotary_half")


def _choose(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    """A call of four arguments or more (q, k, cos, sin) is a half-layout call."""
    return 1 if len(args) + len(kwargs) >= 4 else 0


FAMILY = declare(Family("rotary", (ROTARY, ROTARY_HALF), _choose,
                        model="astrai.families.rotary.model:RECOGNITION"))
