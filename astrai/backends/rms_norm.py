"""RMS norm: rows ``torch`` (``F.rms_norm``) and ``reference`` (explicit float32).

``rms_norm(x, weight, eps) = x / sqrt(mean(x**2, -1) + eps) * weight`` over the
last dimension; ``weight`` is ``[x.shape[-1]]``. The output has ``x``'s shape and
dtype.
"""

from __future__ import annotations

__all__ = [
    "ReferenceRmsNorm",
    "TorchRmsNorm",
    "reference_rms_norm",
    "torch_rms_norm",
    "torch_rms_norm_available",
]

import torch
import torch.nn.functional as F

from astrai.dispatch.tables.model import Unavailable

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def torch_rms_norm_available() -> bool | Unavailable:
    """``True`` when this torch has ``torch.nn.functional.rms_norm`` (torch >= 2.4)."""
    if hasattr(F, "rms_norm"):
        return True
    return Unavailable(
        f"torch.nn.functional.rms_norm needs torch >= 2.4; this is torch {torch.__version__}"
    )


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() < 1:
        raise ValueError("rms_norm needs x with at least one dimension")
    if tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(
            f"rms_norm weight must have shape ({x.shape[-1]},) to match x's last "
            f"dimension; got {tuple(weight.shape)}"
        )


class _RmsNorm:
    """Shared ``supports_call``: floating ``x`` of rank >= 1."""

    def supports_call(self, x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> bool:
        """Whether this row accepts ``x`` (floating dtype, rank >= 1)."""
        return x.dim() >= 1 and x.dtype in _FLOAT_DTYPES

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class TorchRmsNorm(_RmsNorm):
    """PyTorch's fused ``F.rms_norm``; the weight is cast to ``x``'s dtype."""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
        """Normalised ``x``, same shape and dtype."""
        if not hasattr(F, "rms_norm"):
            raise RuntimeError(f"the torch rms_norm row cannot run: {torch_rms_norm_available()}")
        _check(x, weight)
        return F.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), eps)


class ReferenceRmsNorm(_RmsNorm):
    """The fallback: mean of squares, ``rsqrt`` and weight, all in float32."""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
        """Normalised ``x``, same shape and dtype."""
        _check(x, weight)
        compute = torch.promote_types(x.dtype, torch.float32)
        xw = x.to(compute)
        inv_rms = torch.rsqrt(xw.pow(2).mean(dim=-1, keepdim=True) + eps)
        return (xw * inv_rms * weight.to(compute)).to(x.dtype)


#: The ``torch`` row of ``tables/rms_norm.yaml``.
torch_rms_norm = TorchRmsNorm()
#: The ``reference`` row (fallback) of ``tables/rms_norm.yaml``.
reference_rms_norm = ReferenceRmsNorm()
