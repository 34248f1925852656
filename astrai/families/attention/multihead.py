"""Multi-head attention layers that compute attention themselves with batched matrix
products (XGLM, TrOCR, MVP), served by ``ops.attention``.

Such a layer projects q (times its ``scaling``), k and v with four linears
(``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``), keys and values from
``key_value_states`` when it attends across (to an encoder's output) and from its own
input otherwise. It keeps them in the call's ``cache``: an encoder-decoder cache holds
a self-attention and a cross-attention part, and a cross-attention layer computes its
keys once and reads them back on later steps. MVP's layers take prompt keys and values
(``attn_prompt``) put before their own, which every query may attend to. The scores
(``q @ k.T`` per head) get the model's additive mask, the softmax, dropout while
training, and multiply v; the heads are merged and projected out. The layer returns
``(output, weights)``, the weights always (XGLM) or when asked (``output_attentions``).

``multihead_form(module)`` recognises such a layer by what it computes: a copy holding
random weights on the CPU is run through its class's ``forward`` and through
``multihead_attention_forward``, attending to itself and across, with prompts where it
takes them. The layer is routed when both agree. A call that needs gradients or runs under
autocast with a query row that has no key left to attend to (left padding) stays the
layer's own: its softmax spreads such a row over the masked keys and sends them
gradients, which astrai's kernels do not (``unattended_row``).
"""

from __future__ import annotations

__all__ = ["MultiheadForm", "multihead_attention_forward", "multihead_form"]

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from astrai.families.attention.transformers import (
    layer_attention,
    unattended_row,
    watch_collector,
)
from astrai.recognition.probe import random_copy

#: What a layer must hold for ``multihead_attention_forward`` to read it.
_NEEDS = ("q_proj", "k_proj", "v_proj", "out_proj", "num_heads", "head_dim", "scaling")

#: The arguments a layer's forward may take beyond these: anything else (a head mask,
#: a position bias) is computed by its own code.
_TAKES = frozenset({"self", "hidden_states", "key_value_states", "cache", "past_key_values",
                    "attention_mask", "attn_prompt", "output_attentions", "kwargs"})

@dataclass(frozen=True)
class MultiheadForm:
    """How such a layer is served: whether it returns its weights on every call."""

    always_weights: bool


def multihead_attention_forward(form: MultiheadForm) -> Callable[..., Any]:
    """Such a layer's forward through ``ops.attention``."""

    def multihead_attention_forward(self: nn.Module, hidden_states: torch.Tensor,
                                    key_value_states: torch.Tensor | None = None,
                                    cache: Any = None,
                                    attention_mask: torch.Tensor | None = None,
                                    attn_prompt: Any = None, output_attentions: bool = False,
                                    **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        if unattended_row(self, hidden_states, attention_mask):
            own: dict[str, Any] = {"attention_mask": attention_mask, **kwargs}
            if key_value_states is not None:
                own["key_value_states"] = key_value_states
            if cache is not None:
                own["cache"] = cache
            if attn_prompt is not None:
                own["attn_prompt"] = attn_prompt
            if output_attentions:
                own["output_attentions"] = output_attentions
            return type(self).forward(self, hidden_states, **own)  # type: ignore[no-any-return]
        return _attend(self, hidden_states, key_value_states, cache, attention_mask,
                       attn_prompt, output_attentions or form.always_weights, kwargs)

    return multihead_attention_forward


def _heads(x: torch.Tensor, heads: int, size: int) -> torch.Tensor:
    """``[batch, seq, heads * size]`` as ``[batch, heads, seq, size]``."""
    return x.view(x.shape[0], x.shape[1], heads, size).transpose(1, 2)


def _keys(self: nn.Module, source: torch.Tensor, cross: bool, cache: Any,
          kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The call's keys and values, heads first, from ``source`` and the cache as the
    layer keeps them (module docstring)."""
    heads, size, index = int(self.num_heads), int(self.head_dim), self.layer_idx  # type: ignore[arg-type]
    store, stored = cache, False
    split = hasattr(cache, "self_attention_cache") and hasattr(cache, "is_updated")
    if split:
        stored = bool(cache.is_updated.get(index))
        store = cache.cross_attention_cache if cross else cache.self_attention_cache
    if cross and cache is not None and stored:
        layer = store.layers[index]
        return layer.keys, layer.values
    k = _heads(self.k_proj(source), heads, size)  # type: ignore[operator]
    v = _heads(self.v_proj(source), heads, size)  # type: ignore[operator]
    if cache is not None:
        k, v = store.update(k, v, index, kwargs=kwargs)
        if cross and split:
            cache.is_updated[index] = True
    return k, v


def _attend(self: nn.Module, hidden_states: torch.Tensor,
            key_value_states: torch.Tensor | None, cache: Any,
            attention_mask: torch.Tensor | None, attn_prompt: Any, weights: bool,
            kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    heads, size = int(self.num_heads), int(self.head_dim)  # type: ignore[arg-type]
    batch, q_len = hidden_states.shape[:2]
    source = hidden_states if key_value_states is None else key_value_states
    q = _heads(self.q_proj(hidden_states), heads, size)  # type: ignore[operator]
    k, v = _keys(self, source, key_value_states is not None, cache, kwargs)
    if attn_prompt is not None:  # prompt keys first, open to every query
        k = torch.cat([attn_prompt[0].expand(batch, -1, -1, -1), k], dim=2)
        v = torch.cat([attn_prompt[1].expand(batch, -1, -1, -1), v], dim=2)
        if attention_mask is not None:
            open_ = attention_mask.new_zeros(batch, 1, q_len, attn_prompt[0].shape[-2])
            attention_mask = torch.cat([open_, attention_mask], dim=-1)
    dropout = getattr(self, "dropout", 0.0)
    out, got = layer_attention(
        self, q, k, v, None, attention_mask, scale=float(self.scaling),  # type: ignore[arg-type]
        dropout=dropout if isinstance(dropout, float) else 0.0, asked=weights)
    out = self.out_proj(out.reshape(batch, q_len, heads * size))  # type: ignore[operator]
    return out, got


def multihead_form(module: nn.Module) -> MultiheadForm | str | None:
    """How ``module`` is served when it is such a layer (module docstring), the reason
    when it is one (it holds what that forward reads and its forward takes
    ``key_value_states``) but computes something else, ``None`` otherwise."""
    try:
        params = inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return None
    if "key_value_states" not in params or any(not hasattr(module, n) for n in _NEEDS):
        return None
    if not all(isinstance(getattr(module, n), nn.Linear)
               for n in ("q_proj", "k_proj", "v_proj", "out_proj")):
        return None
    beyond = sorted(set(params) - _TAKES)
    if beyond:
        return (f"its forward takes {', '.join(beyond)}, which astrai's forward for it "
                f"would not apply")
    if module.q_proj.weight.is_meta:  # type: ignore[union-attr]
        return "its weights hold no values yet (the meta device): nothing to check"
    found = _probe(module, params)
    if isinstance(found, str):
        return found
    watch_collector()
    return found


def _probe(module: nn.Module, params: Any) -> MultiheadForm | str:
    """How the layer is served, from its own forward and ``_attend`` on random calls (a
    CPU copy with random weights), or why it is not."""
    g = torch.Generator().manual_seed(23)
    probe = random_copy(module, g)
    heads, size = int(probe.num_heads), int(probe.head_dim)  # type: ignore[arg-type]
    width = int(probe.q_proj.in_features)  # type: ignore[union-attr,arg-type]
    x = torch.randn(2, 5, width, generator=g)
    low = torch.finfo(torch.float32).min
    causal = torch.full((5, 5), low).triu(1).expand(2, 1, 5, 5).clone()
    causal[1, :, :, 0] = low  # a padded first token: row 0 of the second has no key
    across = torch.randn(2, 4, int(probe.k_proj.in_features), generator=g)  # type: ignore[union-attr,arg-type]
    padded = torch.zeros(2, 1, 5, 4)
    padded[1, :, :, -1] = low
    prompt = None
    if "attn_prompt" in params:
        prompt = torch.randn(2, heads, 3, size, generator=g)
    asks = "output_attentions" in params
    always = not asks
    cases: list[tuple[torch.Tensor, torch.Tensor | None]] = [(padded, across)]
    if probe.k_proj.in_features == width:  # type: ignore[union-attr]
        cases.insert(0, (causal, None))  # (else it only attends across)
    for mask, kv in cases:
        keywords: dict[str, Any] = {"attention_mask": mask}
        if kv is not None:
            keywords["key_value_states"] = kv
        if prompt is not None:
            keywords["attn_prompt"] = prompt
        if asks:
            keywords["output_attentions"] = True
        with torch.no_grad():
            try:
                want = type(module).forward(probe, x, **keywords)
            except Exception as exc:
                return f"called on a random input it raised {type(exc).__name__}: {exc}"
            if not (isinstance(want, tuple) and len(want) == 2
                    and all(isinstance(t, torch.Tensor) for t in want)):
                return "it does not return (output, attention weights)"
            got = _attend(probe, x, kv, None, mask, prompt, True, {})
        if got[1] is None or got[0].shape != want[0].shape or got[1].shape != want[1].shape:
            return "it does not return (output, attention weights) as such a layer does"
        apart = max(float((want[0] - got[0]).abs().max()),
                    float((want[1] - got[1]).abs().max()))
        if apart > 1e-5:
            where = "across" if kv is not None else "to itself"
            return (f"it does not compute multi-head attention as astrai serves it "
                    f"(attending {where}, it differs by {apart:.2g} on random inputs)")
    return MultiheadForm(always)
