"""Gated RMS norms: rows ``transformers`` (the models' own order of operations),
``torch`` (``torch.rms_norm`` for the normalisation) and ``reference`` (the formula
written out).

``gated_rms_norm(x, weight, gate, eps, gate_first)`` normalises ``x [..., groups, size]``
over its last dimension by its root mean square, scales by ``weight [groups, size]`` and
gates by ``silu(gate)`` (``gate`` of ``x``'s shape, or ``None``: no gating):

- ``gate_first=False`` (Qwen3-Next, Qwen3.5, OLMo-Hybrid, Kimi-Linear: norm, then gate):
  ``weight * rms_normalise(x) * silu(gate)``;
- ``gate_first=True`` (Mamba-2, Bamba, Granite-4 hybrids, Nemotron-H, Zamba-2: gate, then
  norm): ``weight * rms_normalise(x * silu(gate))``.

A whole-feature norm has one group (``x`` viewed ``[..., 1, features]``). ``torch`` and
``reference`` compute in float32 (float64 for float64) and cast once to ``x``'s dtype;
``transformers`` rounds where transformers' ``RMSNormGated`` forwards do (normalised in
float32, cast to ``x``'s dtype before the weight; Qwen3-Next's gate in float32, then a
last cast), so it gives their very numbers.
"""

from __future__ import annotations

__all__ = ["reference_gated_rms_norm", "torch_gated_rms_norm", "transformers_gated_rms_norm"]

import torch
import torch.nn.functional as F


def _wide(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def transformers_gated_rms_norm(x: torch.Tensor, weight: torch.Tensor,
                                gate: torch.Tensor | None, eps: float, gate_first: bool
                                ) -> torch.Tensor:
    """transformers' order: Mamba-2's ``weight * rms_normalise(x * silu(gate)).to(dtype)``
    or Qwen3-Next's ``(weight * rms_normalise(x).to(dtype) * silu(gate)).to(dtype)``,
    normalised and gated in float32."""
    dtype = x.dtype
    h = x.to(torch.float32)
    if gate_first and gate is not None:
        h = h * F.silu(gate.to(torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    if gate_first or gate is None:
        return h
    return (h * F.silu(gate.to(torch.float32))).to(dtype)


def torch_gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor | None,
                         eps: float, gate_first: bool) -> torch.Tensor:
    """The gating in float32 around ``torch.rms_norm``'s fused normalisation, cast once."""
    wide = _wide(x)
    h = x.to(wide)
    g = None if gate is None else F.silu(gate.to(wide))
    if gate_first and g is not None:
        h = h * g
    if weight.shape[0] == 1:  # one group: the weight is fused into the norm
        h = torch.rms_norm(h, (h.shape[-1],), weight[0].to(wide), eps)
    else:
        h = torch.rms_norm(h, (h.shape[-1],), None, eps) * weight.to(wide)
    if not gate_first and g is not None:
        h = h * g
    return h.to(x.dtype)


def reference_gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor | None,
                             eps: float, gate_first: bool) -> torch.Tensor:
    """The formula written out in float32 (float64 for float64), cast once."""
    wide = _wide(x)
    h = x.to(wide)
    g = None if gate is None else gate.to(wide) * torch.sigmoid(gate.to(wide))
    if gate_first and g is not None:
        h = h * g
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.to(wide)
    if not gate_first and g is not None:
        h = h * g
    return h.to(x.dtype)
