"""Rotary position embedding: rows ``torch``, ``complex`` and ``reference``.

Layout (SPEC §9): ``x`` is ``[batch, seq, heads, head_dim]`` or packed
``[tokens, heads, head_dim]``; ``freqs_cis`` is ``[batch or 1, seq, head_dim/2, 2]``
(a ``[seq, head_dim/2, 2]`` table is also accepted for dense ``x``) or, packed,
``[tokens, head_dim/2, 2]``, holding ``(cos, sin)`` of each pair's angle. Pairs
are adjacent elements ``(2i, 2i+1)`` (the RoFormer / original LLaMA layout):

    out[2i]   = x[2i] * cos - x[2i+1] * sin
    out[2i+1] = x[2i] * sin + x[2i+1] * cos

The output keeps ``x``'s shape and dtype. ``rotary_freqs`` builds the table.
"""

from __future__ import annotations

__all__ = [
    "ComplexRotary",
    "ReferenceRotary",
    "TorchRotary",
    "check_rotary_call",
    "complex_rotary",
    "reference_rotary",
    "rotary_freqs",
    "torch_rotary",
]

import torch

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
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


def _cos_sin(x: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a call; ``cos``/``sin`` shaped to broadcast against ``x``'s pair halves.

    The results are ``[b|1, seq, 1, head_dim/2]`` (dense) or ``[tokens, 1, head_dim/2]``
    (packed), in ``freqs_cis``'s dtype.
    """
    check_rotary_call(x, freqs_cis)
    table = freqs_cis
    if x.dim() == 4 and table.dim() == 3:
        table = table.unsqueeze(0)
    table = table.unsqueeze(-3)  # a broadcast axis for the heads
    return table[..., 0], table[..., 1]


class _Rotary:
    """Shared ``supports_call`` of the rotary rows: ``x`` 3-d or 4-d, of ``_dtypes``."""

    _dtypes: tuple[torch.dtype, ...] = _FLOAT_DTYPES

    def supports_call(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> bool:
        """Whether this row accepts ``x`` (rank 3 or 4, a dtype it computes in)."""
        return x.dim() in (3, 4) and x.dtype in self._dtypes

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class TorchRotary(_Rotary):
    """Real arithmetic on whole vectors: ``x * cos + swap_pairs(x) * (-sin, +sin)``.

    Computes in ``x``'s dtype for float32/float64, in float32 for half types.
    """

    def __call__(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        """``x`` rotated pairwise; same shape and dtype."""
        cos, sin = _cos_sin(x, freqs_cis)
        compute = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
        xc = x.to(compute)
        cos_full = cos.to(compute).repeat_interleave(2, dim=-1)
        sin = sin.to(compute)
        sin_signed = torch.stack((-sin, sin), dim=-1).flatten(-2)
        swapped = xc.reshape(*x.shape[:-1], -1, 2).flip(-1).flatten(-2)  # (x1, x0) per pair
        return torch.addcmul(xc * cos_full, swapped, sin_signed).to(x.dtype)


class ComplexRotary(_Rotary):
    """Pairs viewed as complex numbers and multiplied by ``cos + i sin``.

    ``torch.view_as_complex`` needs float32 or float64 storage, so this row takes
    only those dtypes (no silent upcast of half types).
    """

    _dtypes = _COMPLEX_DTYPES

    def __call__(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        """``x`` rotated pairwise; same shape and dtype."""
        if x.dtype not in _COMPLEX_DTYPES:
            raise ValueError(f"the complex rotary row takes float32/float64, got {x.dtype}")
        cos, sin = _cos_sin(x, freqs_cis)
        rot = torch.complex(cos.to(x.dtype), sin.to(x.dtype))
        xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(xc * rot).flatten(-2)


class ReferenceRotary(_Rotary):
    """The fallback: each pair rotated explicitly in float32 (float64 for float64 input)."""

    def __call__(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        """``x`` rotated pairwise; same shape and dtype."""
        cos, sin = _cos_sin(x, freqs_cis)
        compute = torch.promote_types(x.dtype, torch.float32)
        xw = x.to(compute)
        cos, sin = cos.to(compute), sin.to(compute)
        even, odd = xw[..., 0::2], xw[..., 1::2]
        out = torch.empty_like(xw)
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = even * sin + odd * cos
        return out.to(x.dtype)


#: The ``torch`` row of ``tables/rotary.yaml``.
torch_rotary = TorchRotary()
#: The ``complex`` row of ``tables/rotary.yaml``.
complex_rotary = ComplexRotary()
#: The ``reference`` row (fallback) of ``tables/rotary.yaml``.
reference_rotary = ReferenceRotary()
