"""Rotary position embedding: rows ``complex``, ``torch``, ``inductor`` and ``reference``.

Layout (contract §9): ``x`` is ``[batch, seq, heads, head_dim]`` or packed
``[tokens, heads, head_dim]``; ``freqs_cis`` is ``[batch or 1, seq, head_dim/2, 2]``
(a ``[seq, head_dim/2, 2]`` table is also accepted for dense ``x``) or, packed,
``[tokens, head_dim/2, 2]``, holding ``(cos, sin)`` of each pair's angle. Pairs
are adjacent elements ``(2i, 2i+1)`` (the RoFormer / original LLaMA layout):

    out[2i]   = x[2i] * cos - x[2i+1] * sin
    out[2i+1] = x[2i] * sin + x[2i+1] * cos

The output keeps ``x``'s shape and dtype. ``rotary_freqs`` builds the table.

The half layout (``layout == half``, the GPT-NeoX / transformers layout that Llama,
Mistral, Qwen2 and Gemma use) turns element ``i`` with element ``i + head_dim/2``, as
transformers' ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` does, on q and
k at once: ``cos`` and ``sin`` are ``[batch or 1, seq, head_dim]`` and gain an axis at
``unsqueeze_dim`` (where q and k have their heads), and

    out = x * cos + rotate_half(x) * sin,    rotate_half(x) = cat(-x[h:], x[:h])

in torch's type promotion of x and cos (transformers casts cos to x's dtype first). A row
that serves this layout declares the feature ``layout`` in its table and is called
``row(q, k, cos, sin, unsqueeze_dim)``, returning ``(q_out, k_out)``; the shipped rows
but ``complex`` serve both layouts. ``reference`` writes transformers' formula out op
for op; ``torch`` computes the same products and sums in another order of memory
passes, so both equal transformers' result bit for bit.

Rows are plain functions: ``tables/rotary.yaml``'s ``when`` decides which calls
each serves, and the facade (``astrai.ops.apply_rotary``) validates the call with
``check_rotary_call`` before any row runs, so a row does neither. Each row gives
``freqs_cis`` a broadcast axis for the heads (``unsqueeze(-3)``), which lines it up
with ``x`` viewed as pairs ``[..., heads, head_dim/2, 2]`` for every accepted layout.

``inductor`` is ``reference_rotary`` compiled by ``torch.compile`` with dynamic
shapes, on its first call per (dtypes, device, ranks of x and the table): lengths and
batch sizes share its graphs. The tensors go in as they are (reshaping them first
cost more per call than the graphs it saves). Inside a user's ``torch.compile`` it is
the reference math, which the user's compile compiles with the rest of the graph.
"""

from __future__ import annotations

__all__ = [
    "check_rotary_call",
    "check_rotary_half_call",
    "complex_rotary",
    "inductor_rotary",
    "reference_rotary",
    "reference_rotary_half",
    "rotary_freqs",
    "torch_rotary",
    "torch_rotary_half",
]

import operator
from typing import Any

import torch

from astrai.backends.inductor import Compiled
from astrai.dispatch.torch_compile import compiling

_COMPLEX_DTYPES = (torch.float32, torch.float64)


def rotary_freqs(
    positions: torch.Tensor | int, head_dim: int, theta: float = 10000.0
) -> torch.Tensor:
    """The ``(cos, sin)`` table ``[*positions.shape, head_dim/2, 2]`` (float32).

    Pair ``i`` turns by ``position * theta ** (-2i / head_dim)``. An int
    ``positions`` means ``arange(positions)``; pass ``[1, seq]`` positions for the
    dense layout and ``[tokens]`` for the packed one.
    """
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim must be even and >= 2, got {head_dim}")
    if isinstance(positions, int):
        positions = torch.arange(positions)
    inv_freq = theta ** (
        -torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim
    )
    angles = positions.to(torch.float64).unsqueeze(-1) * inv_freq
    return torch.stack((angles.cos(), angles.sin()), dim=-1).to(torch.float32)


def check_rotary_call(x: torch.Tensor, freqs_cis: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``x`` and ``freqs_cis`` form a valid rotary call."""
    if x.dim() not in (3, 4):
        raise ValueError(
            "rotary expects x as [batch, seq, heads, head_dim] or [tokens, heads, head_dim]; "
            f"got shape {tuple(x.shape)}"
        )
    dim = x.shape[-1]
    if dim % 2 or dim < 2:
        raise ValueError(f"rotary needs an even head_dim >= 2 to form pairs; x has {dim}")
    table = freqs_cis
    if x.dim() == 4 and table.dim() == 3:
        table = table.unsqueeze(0)
    if x.dim() == 4:
        want = f"[{x.shape[0]} or 1, {x.shape[1]}, {dim // 2}, 2]"
        ok = table.dim() == 4 and table.shape[0] in (1, x.shape[0]) and table.shape[1] == x.shape[1]
    else:
        want = f"[{x.shape[0]}, {dim // 2}, 2]"
        ok = table.dim() == 3 and table.shape[0] == x.shape[0]
    if not ok or tuple(table.shape[-2:]) != (dim // 2, 2):
        raise ValueError(
            f"freqs_cis of shape {tuple(freqs_cis.shape)} does not fit x of shape "
            f"{tuple(x.shape)}; expected {want}"
        )
    if not table.is_floating_point():
        raise ValueError(f"freqs_cis must be floating point, got {table.dtype}")


def check_rotary_half_call(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor, unsqueeze_dim: int) -> None:
    """Raise ``ValueError`` (``TypeError`` for a non-tensor or a non-int dim) unless the
    arguments form a valid half-layout call (see the module docstring)."""
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"rotary: {name} must be a torch.Tensor, got {type(t).__name__}")
    if isinstance(unsqueeze_dim, bool) or not isinstance(unsqueeze_dim, int):
        raise TypeError(f"rotary: unsqueeze_dim must be an int, got {unsqueeze_dim!r}")
    n = q.dim()
    if n not in (3, 4) or k.dim() != n:
        raise ValueError(f"rotary (half layout) expects q and k of 3 or 4 dimensions alike; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if not -n <= unsqueeze_dim < n:
        raise ValueError(f"rotary: unsqueeze_dim {unsqueeze_dim} is out of range for "
                         f"{n}-d q and k")
    heads = unsqueeze_dim % n
    if heads == n - 1:
        raise ValueError("rotary: unsqueeze_dim names head_dim, the axis that is rotated")
    dim = q.shape[-1]
    if dim % 2 or dim < 2:
        raise ValueError(f"rotary needs an even head_dim >= 2 to split in halves; q has {dim}")
    if q.dtype != k.dtype:
        raise ValueError(f"rotary expects q and k of one dtype; got q {q.dtype}, k {k.dtype}")
    if [s for i, s in enumerate(q.shape) if i != heads] != [
            s for i, s in enumerate(k.shape) if i != heads]:
        raise ValueError(f"rotary: q {tuple(q.shape)} and k {tuple(k.shape)} may differ only "
                         f"in their heads (dim {heads})")
    want = [s for i, s in enumerate(q.shape) if i != heads]
    for name, t in (("cos", cos), ("sin", sin)):
        got = list(t.shape)
        if (len(got) != n - 1 or got[-1] != dim
                or any(g not in (1, w) for g, w in zip(got, want, strict=True))):
            raise ValueError(
                f"rotary: {name} of shape {tuple(t.shape)} does not fit q of shape "
                f"{tuple(q.shape)} with unsqueeze_dim={unsqueeze_dim}; expected "
                f"{want} (each dimension or 1), the whole head_dim {dim} included")
        if not t.is_floating_point():
            raise ValueError(f"rotary: {name} must be floating point, got {t.dtype}")
    if cos.shape != sin.shape:
        raise ValueError(f"rotary: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def reference_rotary_half(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor, unsqueeze_dim: int = 1
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' formula, op for op: ``x * cos + rotate_half(x) * sin`` on q, then k."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


#: Up to this many elements in q and k together, ``torch_rotary_half`` rotates them as one
#: tensor (fewer, smaller ops: a decode step); above it, in place by halves (fewer passes
#: over memory than the concatenation ``rotate_half`` makes).
_HALF_JOINED_MAX = 1 << 15


def torch_rotary_half(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The half layout with the products and sums of ``reference_rotary_half`` (so the
    same result, bit for bit) in fewer operations: small calls rotate q and k joined
    along their heads, large ones each by halves, the second product added in place.
    Traced (``torch.compile``), it is the reference's formula: pure elementwise operations,
    which inductor fuses into one pass per tensor (slices written in place would stop it)."""
    if compiling():
        return reference_rotary_half(q, k, cos, sin, unsqueeze_dim)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    if q.numel() + k.numel() <= _HALF_JOINED_MAX:
        heads = unsqueeze_dim % q.dim()
        qk = torch.cat((q, k), heads)
        out = qk * cos + _rotate_half(qk) * sin
        q_out, k_out = torch.split(out, [q.shape[heads], k.shape[heads]], heads)
        return q_out, k_out
    h = q.shape[-1] // 2
    s1, s2 = sin[..., :h], sin[..., h:]
    outs = []
    for x in (q, k):
        out = x * cos
        x1, x2 = x[..., :h], x[..., h:]
        out[..., :h] -= x2 * s1  # == x1 c1 + (-x2) s1: negation is exact
        out[..., h:] += x1 * s2
        outs.append(out)
    return outs[0], outs[1]


def torch_rotary(x: torch.Tensor, freqs_cis: torch.Tensor, *half: Any) -> Any:
    """Real arithmetic per pair, ``(x0 c - x1 s, x0 s + x1 c)``, on whole tensors.

    Computes in ``x``'s dtype for float32/float64, in float32 for half types. A
    half-layout call (``torch_rotary(q, k, cos, sin, unsqueeze_dim)``) is
    ``torch_rotary_half``'s.
    """
    if half:
        return torch_rotary_half(x, freqs_cis, *half)
    dtype = x.dtype
    compute = dtype if dtype in _COMPLEX_DTYPES else torch.float32
    if dtype is not compute:
        x = x.to(compute)
    if freqs_cis.dtype is not compute:
        freqs_cis = freqs_cis.to(compute)
    x0, x1 = torch.unflatten(x, -1, (-1, 2)).unbind(-1)
    cos, sin = freqs_cis.unsqueeze(-3).unbind(-1)  # a broadcast axis for the heads
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), -1).flatten(-2)
    return out if dtype is compute else out.to(dtype)


def complex_rotary(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Pairs viewed as complex numbers and multiplied by ``cos + i sin``.

    ``torch.view_as_complex`` needs float32 or float64 storage, so the table's
    ``when`` gives this row only those dtypes (no silent upcast of half types);
    ``freqs_cis``, whose last axis is ``(cos, sin)``, is itself viewed as complex.
    """
    if freqs_cis.dtype is not x.dtype:
        freqs_cis = freqs_cis.to(x.dtype)
    rot = torch.view_as_complex(freqs_cis.unsqueeze(-3).contiguous())  # [..., 1, d/2]
    xc = torch.view_as_complex(torch.unflatten(x, -1, (-1, 2)).contiguous())
    return torch.view_as_real(xc * rot).flatten(-2)


def reference_rotary(x: torch.Tensor, freqs_cis: torch.Tensor, *half: Any) -> Any:
    """The fallback: each pair rotated explicitly in float32 (float64 for float64 input);
    a half-layout call is ``reference_rotary_half``'s."""
    if half:
        return reference_rotary_half(x, freqs_cis, *half)
    return _reference_pairs(x, freqs_cis)


def _reference_pairs(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    compute = torch.promote_types(x.dtype, torch.float32)
    table = freqs_cis.unsqueeze(-3).to(compute)
    cos, sin = table[..., 0], table[..., 1]
    xw = x.to(compute)
    even, odd = xw[..., 0::2], xw[..., 1::2]
    out = torch.empty_like(xw)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out.to(x.dtype)


_compiled = Compiled(_reference_pairs, dynamic=True)
_compiled_half = Compiled(reference_rotary_half, dynamic=True,
                          options={"emulate_precision_casts": True})


def inductor_rotary(x: torch.Tensor, freqs_cis: torch.Tensor, *half: Any) -> Any:
    """``reference_rotary`` compiled by inductor (dynamic shapes, compiled lazily), for
    either layout."""
    if half:
        cos, sin, dim = half
        if compiling():
            return reference_rotary_half(x, freqs_cis, cos, sin, dim)
        dim = operator.index(dim)  # a Python int: a NumPy integer would reach the graph as a tensor
        key = (x.dtype, cos.dtype, x.device, x.dim(), dim % x.dim())
        return _compiled_half(key, x, freqs_cis, cos, sin, dim)
    if compiling():
        return _reference_pairs(x, freqs_cis)
    key = (x.dtype, freqs_cis.dtype, x.device, x.dim(), freqs_cis.dim())
    return _compiled(key, x, freqs_cis)  # type: ignore[no-any-return]
