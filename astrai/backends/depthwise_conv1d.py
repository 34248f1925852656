"""Depthwise 1-d convolutions: rows ``torch`` (``torch.nn.functional.conv1d``) and
``reference`` (the sum written out).

``depthwise_conv1d(x, weight, bias, padding)`` convolves each channel of ``x [batch,
channels, time]`` with its own kernel ``weight[c, 0, :]`` of ``k`` taps, after ``padding``
zeros on both sides of time, plus ``bias[c]``: ``out[b, c, t] = bias[c] + sum_j
weight[c, 0, j] * xpad[b, c, t + j]``, ``time + 2 * padding - k + 1`` steps. It is what
``nn.Conv1d(c, c, k, groups=c, padding=padding)`` computes: the causal convolution of
Mamba, Mamba-2, gated-delta-net and short-convolution mixers with ``padding = k - 1``
(the mixer keeps the first ``time`` steps).
"""

from __future__ import annotations

__all__ = ["reference_depthwise_conv1d", "torch_depthwise_conv1d"]

import torch
import torch.nn.functional as F


def torch_depthwise_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           padding: int) -> torch.Tensor:
    """``torch.nn.functional.conv1d`` with one group per channel, in ``x``'s dtype."""
    return F.conv1d(x, weight, bias, padding=padding, groups=x.shape[1])


def reference_depthwise_conv1d(x: torch.Tensor, weight: torch.Tensor,
                               bias: torch.Tensor | None, padding: int) -> torch.Tensor:
    """The sum over taps written out in float32 (float64 for float64), cast once."""
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = F.pad(x.to(wide), (padding, padding))
    taps = weight.to(wide)[:, 0, :]
    steps = h.shape[-1] - taps.shape[-1] + 1
    out = h[..., :steps] * taps[:, :1]
    for j in range(1, taps.shape[-1]):
        out = out + h[..., j:j + steps] * taps[:, j:j + 1]
    if bias is not None:
        out = out + bias.to(wide)[:, None]
    return out.to(x.dtype)
