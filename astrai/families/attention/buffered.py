"""Attention layers that compute attention themselves and mask it with a causal buffer of
their own (GPT-Neo), served by ``ops.attention``.

Such a layer projects q, k and v with three linears, splits heads (``_split_heads``),
appends to its cache (``layer_past.update``), and in its ``_attn`` takes ``q @ k.T``
(unscaled, in float32), keeps what its boolean ``bias`` buffer allows for the last
``q_len`` of ``kv_len`` positions (a causal triangle, or a sliding window in a local
layer, however long), adds the model's additive mask, takes the softmax and multiplies
by v; then it merges heads and projects out. ``buffered_form(module)``
recognises such a layer by what it computes: a copy holding random weights on the CPU is
run through its class's ``forward`` and through ``buffered_attention_forward`` at each
scale the layer may use, and the layer is routed at the scale where both agree.
"""

from __future__ import annotations

__all__ = ["buffered_attention_forward", "buffered_form"]

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from astrai.families.attention.transformers import (
    layer_attention,
    unattended_row,
    watch_collector,
)
from astrai.recognition.probe import random_copy

#: What a layer must hold for ``buffered_attention_forward`` to read it.
_NEEDS = ("q_proj", "k_proj", "v_proj", "out_proj", "_split_heads", "_attn", "num_heads",
          "head_dim", "bias")


def buffered_attention_forward(scale: float) -> Callable[..., Any]:
    """Such a layer's forward through ``ops.attention`` at ``scale``."""

    def buffered_attention_forward(self: nn.Module, hidden_states: torch.Tensor,
                                   attention_mask: torch.Tensor | None = None,
                                   layer_past: Any = None, use_cache: bool = False,
                                   output_attentions: bool = False, **kwargs: Any
                                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if unattended_row(self, hidden_states, attention_mask,
                          functools.partial(_allowed, self)):
            return type(self).forward(  # type: ignore[no-any-return]
                self, hidden_states, attention_mask=attention_mask, layer_past=layer_past,
                use_cache=use_cache, output_attentions=output_attentions, **kwargs)
        return _attend(self, hidden_states, attention_mask, layer_past, output_attentions,
                       scale)

    return buffered_attention_forward


def _allowed(self: nn.Module, q_len: int, kv_len: int) -> torch.Tensor:
    """The keys the layer's causal buffer allows each of the last ``q_len`` of ``kv_len``
    positions."""
    return self.bias[:, :, kv_len - q_len:kv_len, :kv_len]  # type: ignore[index,no-any-return]


def _attend(self: nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
            layer_past: Any, output_attentions: bool, scale: float
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(out, weights)``, the weights when asked for (``output_attentions``, or
    transformers collecting them)."""
    heads, size = int(self.num_heads), int(self.head_dim)  # type: ignore[arg-type]
    split = self._split_heads
    q = split(self.q_proj(hidden_states), heads, size)  # type: ignore[operator]
    k = split(self.k_proj(hidden_states), heads, size)  # type: ignore[operator]
    v = split(self.v_proj(hidden_states), heads, size)  # type: ignore[operator]
    if layer_past is not None:
        k, v = layer_past.update(k, v, getattr(self, "layer_id", getattr(self, "layer_idx", 0)))
    q_len, kv_len = q.shape[-2], k.shape[-2]
    allowed = _allowed(self, q_len, kv_len)
    # the layer computes its scores in float32: so does the routed call
    mask = torch.zeros(allowed.shape, dtype=torch.float32, device=q.device).masked_fill(
        ~allowed, torch.finfo(torch.float32).min)
    dtype = v.dtype
    out, weights = layer_attention(
        self, q.float(), k.float(), v.float(), mask, attention_mask, scale=scale,
        dropout=getattr(getattr(self, "attn_dropout", None), "p", 0.0),
        asked=output_attentions)
    out = out.reshape(q.shape[0], q_len, heads * size).to(dtype)
    out = self.out_proj(out)  # type: ignore[operator]
    resid = getattr(self, "resid_dropout", None)
    if isinstance(resid, nn.Module):
        out = resid(out)
    return out, None if weights is None else weights.to(dtype)


def buffered_form(module: nn.Module) -> Callable[..., Any] | str | None:
    """The forward serving ``module`` when it is such a layer (module docstring), the
    reason when it is one (its forward takes ``layer_past`` and it holds what that forward
    reads) but computes something else, ``None`` otherwise."""
    try:
        params = inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return None
    if "layer_past" not in params or any(not hasattr(module, n) for n in _NEEDS):
        return None
    if "head_mask" in params:
        return "its forward takes head_mask, which astrai's forward for it would not apply"
    bias = module.bias
    if not (isinstance(bias, torch.Tensor) and bias.dtype == torch.bool and bias.dim() == 4):
        return None
    if bias.is_meta:
        return "its causal buffer holds no values yet (the meta device): nothing to check"
    found = _scale(module)
    if isinstance(found, str):
        return found
    watch_collector()
    return buffered_attention_forward(found)


def _scale(module: nn.Module) -> float | str:
    """The scale at which ``buffered_attention_forward`` computes what the layer's own
    forward does on a random call (a CPU copy with random weights), or why none does."""
    g = torch.Generator().manual_seed(17)
    probe = random_copy(module, g)  # its causal buffer kept
    with torch.no_grad():
        hidden = int(probe.num_heads) * int(probe.head_dim)  # type: ignore[arg-type]
        x = torch.randn(2, 5, hidden, generator=g)
        mask = torch.zeros(2, 1, 5, 5)
        mask[1, :, :, 0] = torch.finfo(torch.float32).min  # a padded first token
        try:
            want = type(module).forward(probe, x, attention_mask=mask, output_attentions=True)
        except Exception as exc:
            return f"called on a random input it raised {type(exc).__name__}: {exc}"
        if not (isinstance(want, tuple) and len(want) >= 2
                and all(isinstance(t, torch.Tensor) for t in want[:2])):
            return "it does not return (output, attention weights)"
        gaps = []
        for scale in (1.0, float(probe.head_dim) ** -0.5):  # type: ignore[arg-type]
            got = _attend(probe, x, mask, None, True, scale)
            if got[1] is None or got[0].shape != want[0].shape or (
                    got[1].shape != want[1].shape):
                return "it does not return (output, attention weights) as such a layer does"
            gaps.append(max(float((want[0] - got[0]).abs().max()),
                            float((want[1] - got[1]).abs().max())))
            if gaps[-1] <= 1e-5:
                return scale
    return (f"it does not compute attention masked by its causal buffer as astrai serves "
            f"it (differs by {min(gaps):.2g} on random inputs)")
