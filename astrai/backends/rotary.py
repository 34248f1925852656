"""Rotary position embedding: rows ``complex``, ``torch``, ``inductor`` and ``reference``.

Layout (SPEC §9): ``x`` is ``[batch, seq, heads, head_dim]`` or packed
``[tokens, heads, head_dim]``; ``freqs_cis`` is ``[batch or 1, seq, head_dim/2, 2]``
(a ``[seq, head_dim/2, 2]`` table is also accepted for dense ``x``) or, packed,
``[tokens, head_dim/2, 2]``, holding ``(cos, sin)`` of each pair's angle. Pairs
are adjacent elements ``(2i, 2i+1)`` (the RoFormer / original LLaMA layout):

    out[2i]   = x[2i] * cos - x[2i+1] * sin
    out[2i+1] = x[2i] * sin + x[2i+1] * cos

The output keeps ``x``'s shape and dtype. ``rotary_freqs`` builds the table.

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
    "complex_rotary",
    "inductor_rotary",
    "reference_rotary",
    "rotary_freqs",
    "torch_rotary",
]

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


def torch_rotary(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Real arithmetic per pair, ``(x0 c - x1 s, x0 s + x1 c)``, on whole tensors.

    Computes in ``x``'s dtype for float32/float64, in float32 for half types.
    """
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


def reference_rotary(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """The fallback: each pair rotated explicitly in float32 (float64 for float64 input)."""
    compute = torch.promote_types(x.dtype, torch.float32)
    table = freqs_cis.unsqueeze(-3).to(compute)
    cos, sin = table[..., 0], table[..., 1]
    xw = x.to(compute)
    even, odd = xw[..., 0::2], xw[..., 1::2]
    out = torch.empty_like(xw)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out.to(x.dtype)


_compiled = Compiled(reference_rotary, dynamic=True)


def inductor_rotary(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """``reference_rotary`` compiled by inductor (dynamic shapes, compiled lazily)."""
    if compiling():
        return reference_rotary(x, freqs_cis)
    key = (x.dtype, freqs_cis.dtype, x.device, x.dim(), freqs_cis.dim())
    return _compiled(key, x, freqs_cis)  # type: ignore[no-any-return]
