"""Layer norm: rows ``torch`` (``torch.nn.functional.layer_norm``) and ``reference``.

``layer_norm(x, weight, bias, eps) = (x - mean) / sqrt(var + eps) * weight + bias`` over
the last dimension (the variance biased, as ``nn.LayerNorm`` has it); ``weight`` and
``bias`` are ``[x.shape[-1]]`` or ``None`` (OLMo's weightless norm has neither, Cohere's
no bias). The output has ``x``'s shape and dtype. The facade (``astrai.ops.layer_norm``)
validates the call before any row runs: ``weight`` and ``bias`` have ``x``'s dtype, or
float32 with a float16/bfloat16 ``x`` (what torch's kernel takes).

The forms models write - ``nn.LayerNorm`` in the input's dtype, the same computed in
float32 and cast back (OLMo, Cohere, the "float32 upcast" layer norms) - are one
computation up to a rounding: torch's kernel accumulates a half-type call in float32,
applies the weight and bias there and rounds once. The reference writes that out: the
statistics, the normalisation, the weight and the bias in float32 (float64 for a float64
call), then one cast to ``x``'s dtype.
"""

from __future__ import annotations

__all__ = ["reference_layer_norm", "torch_layer_norm"]

import torch
import torch.nn.functional as F


def reference_layer_norm(x: torch.Tensor, weight: torch.Tensor | None = None,
                         bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """The normalisation written out in float32 (float64 for float64 ``x``), cast once."""
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = x.to(wide)
    mean = h.mean(-1, keepdim=True)
    centred = h - mean
    var = (centred * centred).mean(-1, keepdim=True)
    out = centred * torch.rsqrt(var + eps)
    if weight is not None:
        out = out * weight.to(wide)
    if bias is not None:
        out = out + bias.to(wide)
    return out.to(x.dtype)


def torch_layer_norm(x: torch.Tensor, weight: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """``torch.nn.functional.layer_norm`` over the last dimension."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
