"""RMS norm: rows ``torch`` (``torch.rms_norm``), ``inductor`` and ``reference`` (float32).

``rms_norm(x, weight, eps) = x / sqrt(mean(x**2, -1) + eps) * weight`` over the
last dimension; ``weight`` is ``[x.shape[-1]]``. The output has ``x``'s shape and
dtype. Rows are plain functions: the table's ``when`` decides which calls they
serve, and the facade (``astrai.ops.rms_norm``) validates shapes before any row
runs, so a row does neither.

``inductor`` is ``reference_rms_norm`` compiled by ``torch.compile`` with dynamic
shapes, on its first call per (dtype, weight dtype, device, rank of x): token counts
and feature sizes share one graph. Inside a user's ``torch.compile`` it is the
reference math, which the user's compile compiles with the rest of the graph.
"""

from __future__ import annotations

__all__ = [
    "inductor_rms_norm",
    "reference_rms_norm",
    "torch_rms_norm",
    "torch_rms_norm_available",
]

import torch
import torch.nn.functional as F

from astrai.backends.inductor import Compiled
from astrai.dispatch.tables.model import Unavailable
from astrai.dispatch.torch_compile import compiling


def torch_rms_norm_available() -> bool | Unavailable:
    """``True`` when this torch has ``torch.nn.functional.rms_norm`` (torch >= 2.4)."""
    if hasattr(F, "rms_norm"):
        return True
    return Unavailable(
        f"torch.nn.functional.rms_norm needs torch >= 2.4; this is torch {torch.__version__}"
    )


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """PyTorch's fused RMS norm; a weight of another dtype is cast to ``x``'s."""
    if weight.dtype is not x.dtype:
        weight = weight.to(x.dtype)
    # torch.rms_norm is what F.rms_norm calls, minus its __torch_function__ check;
    # weight.shape == (x.shape[-1],) was checked by the facade.
    return torch.rms_norm(x, weight.shape, weight, eps)


def reference_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """The fallback: mean of squares, ``rsqrt`` and weight, all in float32 (or float64)."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xw = x.to(compute)
    inv_rms = torch.rsqrt(xw.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xw * inv_rms * weight.to(compute)).to(x.dtype)


_compiled = Compiled(reference_rms_norm, dynamic=True)


def inductor_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``reference_rms_norm`` compiled by inductor (dynamic shapes, compiled lazily)."""
    if compiling():
        return reference_rms_norm(x, weight, eps)
    # Keyed by rank too: a copy per rank keeps each graph's guards to one kind of input.
    return _compiled((x.dtype, weight.dtype, x.device, x.dim()), x, weight, eps)  # type: ignore[no-any-return]
