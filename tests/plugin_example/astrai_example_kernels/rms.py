"""The package's kernel: RMS normalisation compiled by ``torch.compile`` (inductor).

The row's implementation is a plain callable with the family's call signature
(``x, weight, eps``); astrai calls it as is. Keep the module's import light: astrai
imports it when its tables load, in every process.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from astrai.backends.inductor import inductor_available


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (h * weight.float()).to(x.dtype)


_compiled: Callable[..., torch.Tensor] | None = None


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x`` normalised over its last dimension and scaled by ``weight``, in one kernel.

    ``torch.compile`` is called on the first call, not at import: astrai imports this
    module when its tables load, and ``torch.compile`` imports dynamo (about a second).
    """
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_rms_norm, dynamic=True, fullgraph=True)
    return _compiled(x, weight, eps)


def available() -> object:
    """The row's probe: inductor needs a C++ compiler here (astrai's own probe says why
    not, when it cannot run)."""
    return inductor_available()
