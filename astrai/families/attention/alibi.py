"""Attention layers that compute ALiBi attention themselves (Bloom), served by
``ops.attention`` with the ALiBi bias as an additive float mask.

Such a layer calls no attention function astrai could stand in for: it projects q, k
and v through one fused linear, adds ``beta * alibi`` to ``inv_norm_factor * q @ k.T``
(``baddbmm``), adds the model's additive mask, takes the softmax, multiplies by v and
projects out, then adds the residual. ``alibi_form(module)`` recognises such a layer
by what it computes: a copy holding random weights on the CPU is run through its
class's ``forward`` and through ``alibi_attention_forward`` (which reuses the layer's
own projections and head split), and the layer is routed only when both agree.
"""

from __future__ import annotations

__all__ = ["alibi_attention_forward", "alibi_form"]

import inspect
from typing import Any

import torch
from torch import nn

from astrai.families.attention.transformers import (
    layer_attention,
    unattended_row,
    watch_collector,
)
from astrai.recognition.probe import random_copy

#: What an ALiBi layer must hold for ``alibi_attention_forward`` to read it.
_NEEDS = ("query_key_value", "dense", "_reshape", "num_heads", "head_dim", "inv_norm_factor",
          "beta")


def alibi_attention_forward(self: nn.Module, hidden_states: torch.Tensor,
                            residual: torch.Tensor, alibi: torch.Tensor,
                            attention_mask: torch.Tensor | None, layer_past: Any = None,
                            use_cache: bool = False, output_attentions: bool = False,
                            **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An ALiBi layer's forward through ``ops.attention``: returns ``(out, weights)``,
    the weights when asked for (``output_attentions``, or transformers collecting them)."""
    if unattended_row(self, hidden_states, attention_mask):
        return type(self).forward(  # type: ignore[no-any-return]
            self, hidden_states, residual, alibi, attention_mask, layer_past=layer_past,
            use_cache=use_cache, output_attentions=output_attentions, **kwargs)
    batch, _q_len, _ = hidden_states.shape
    q, k, v = self._reshape(self.query_key_value(hidden_states))  # type: ignore[operator]
    if layer_past is not None:
        k, v = layer_past.update(k, v, self.layer_idx)
    heads, kv_len = q.shape[1], k.shape[2]
    mask = alibi.view(batch, heads, 1, -1)[..., :kv_len]
    beta = float(self.beta)  # type: ignore[arg-type]
    if beta != 1.0:
        mask = mask * beta
    out, weights = layer_attention(
        self, q, k, v, mask, attention_mask,
        scale=float(self.inv_norm_factor),  # type: ignore[arg-type]
        dropout=getattr(getattr(self, "attention_dropout", None), "p", 0.0),
        asked=output_attentions)
    out = self.dense(out.reshape(batch, q.shape[2], -1))  # type: ignore[operator]
    out = torch.nn.functional.dropout(out, p=float(getattr(self, "hidden_dropout", 0.0)),
                                      training=self.training)
    return residual + out, weights


def alibi_form(module: nn.Module) -> bool | str | None:
    """``True`` when ``module`` is an ALiBi attention layer ``alibi_attention_forward``
    computes, the reason when it is one (its forward takes ``alibi`` and it holds what
    that forward reads) but computes something else, ``None`` otherwise."""
    try:
        params = inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return None
    if "alibi" not in params:
        return None
    if any(not hasattr(module, n) for n in _NEEDS):
        # it passes alibi on (a decoder block), or is a layer of another make, which the
        # report names as an attention layer that computes attention itself
        return None
    if getattr(module, "pretraining_tp", 1) > 1 and getattr(module, "slow_but_exact", False):
        return "it splits its output projection (pretraining_tp with slow_but_exact)"
    gap = _alibi_gap(module)
    if isinstance(gap, str):
        return gap
    if not gap <= 1e-5:
        return (f"it does not compute ALiBi attention as astrai serves it (differs by "
                f"{gap:.2g} on random inputs)")
    watch_collector()
    return True


def _alibi_gap(module: nn.Module) -> float | str:
    """How far the layer's own forward is from ``alibi_attention_forward`` on a random
    call (a CPU copy with random weights), or why they could not be compared."""
    g = torch.Generator().manual_seed(13)
    probe = random_copy(module, g)
    with torch.no_grad():
        heads = int(probe.num_heads)  # type: ignore[arg-type]
        hidden = int(heads * probe.head_dim)  # type: ignore[operator]
        x = torch.randn(2, 5, hidden, generator=g)
        residual = torch.randn(2, 5, hidden, generator=g)
        alibi = torch.randn(2 * heads, 1, 5, generator=g)
        allowed = torch.ones(5, 5, dtype=torch.bool).tril()
        mask = torch.zeros(2, 1, 5, 5).masked_fill(~allowed, torch.finfo(torch.float32).min)
        args = (x, residual, alibi, mask)
        try:
            want = type(module).forward(probe, *args, output_attentions=True)
        except Exception as exc:
            return f"called on a random input it raised {type(exc).__name__}: {exc}"
        got = alibi_attention_forward(probe, *args, output_attentions=True)
    if not (isinstance(want, tuple) and len(want) >= 2 and isinstance(want[0], torch.Tensor)
            and isinstance(want[1], torch.Tensor) and got[1] is not None
            and want[0].shape == got[0].shape and want[1].shape == got[1].shape):
        return "it does not return (output, attention weights) as an ALiBi layer does"
    return max(float((want[0] - got[0]).abs().max()), float((want[1] - got[1]).abs().max()))
