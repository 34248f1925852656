"""Multi-head attention layers that compute attention themselves with batched matrix
products (XGLM, TrOCR, MVP; Megatron-BERT, RemBERT), served by ``ops.attention``.

Such a layer projects q, k and v with three linears (``q_proj``, ``k_proj``,
``v_proj``, or BERT's ``query``, ``key``, ``value``), keys and values from what it
attends across to (``key_value_states``, or BERT's ``encoder_hidden_states``: an
encoder's output) when given and from its own input otherwise. It keeps them in the
call's ``cache``: an encoder-decoder cache holds a self-attention and a cross-attention
part, and a cross-attention layer computes its keys once and reads them back on later
steps. MVP's layers take prompt keys and values (``attn_prompt``) put before their own,
which every query may attend to. The scores (``q @ k.T`` per head, at the layer's
``scaling`` or ``head_size ** -0.5``) get the model's additive mask, the softmax,
dropout while training, and multiply v; the heads are merged and projected out by
``out_proj`` where the layer holds one (BERT's leave that to the next module). The layer
returns ``(output, weights)``, the weights always (XGLM, BERT's) or when asked
(``output_attentions``); routed, it returns them when asked or when transformers collects
them (``None`` else: the models read them only then). A training call with dropout that
returns weights stays the layer's own: some return them before their dropout, some after.

``multihead_form(module)`` recognises such a layer by what it computes: a copy holding
random weights on the CPU is run through its class's ``forward`` and through
``multihead_attention_forward``, attending to itself and across, with prompts where it
takes them. The layer is routed when both agree. A call that needs gradients, runs
under autocast or computes in float16, with a query row that has no key left to attend
to (left padding), stays the layer's own: its softmax spreads such a row over the masked
keys and sends them gradients, which astrai's kernels round otherwise and do not
(``unattended_row``).
"""

from __future__ import annotations

__all__ = ["MultiheadForm", "multihead_attention_forward", "multihead_form"]

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from astrai.dispatch.log import warn_once
from astrai.dispatch.stats import count_model_own
from astrai.dispatch.torch_compile import compiling
from astrai.families.attention.transformers import (
    interface_reads,
    layer_attention,
    unattended_row,
    watch_collector,
    weights_collected,
)
from astrai.recognition.probe import random_copy

#: The names a layer's three input projections go by (each a ``nn.Linear``).
_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"))

#: The argument by which a layer is given what it attends across to.
_ACROSS = ("key_value_states", "encoder_hidden_states")

#: The arguments a layer's forward may take: anything else (a head mask, a position
#: bias) is computed by its own code.
_TAKES = frozenset({"self", "hidden_states", *_ACROSS, "cache", "past_key_values",
                    "attention_mask", "attn_prompt", "output_attentions", "kwargs"})


@dataclass(frozen=True)
class MultiheadForm:
    """How such a layer is served: the names of its projections (``out`` ``None``: it
    returns the heads merged, unprojected), of its head count and size, its scale, the
    argument naming what it attends across to, the order of its positional arguments
    after ``hidden_states``, and whether its forward takes ``output_attentions``."""

    q: str
    k: str
    v: str
    out: str | None
    heads: str
    size: str
    scale: float
    across: str
    order: tuple[str, ...]
    asks: bool


def multihead_attention_forward(form: MultiheadForm) -> Callable[..., Any]:
    """Such a layer's forward through ``ops.attention``."""

    def multihead_attention_forward(self: nn.Module, hidden_states: torch.Tensor, *args: Any,
                                    **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        given = dict(zip(form.order, args, strict=False))
        given.update(kwargs)
        mask = given.pop("attention_mask", None)
        asked = bool(given.pop("output_attentions", False))
        if unattended_row(self, hidden_states, mask) or _dropped_weights(self, asked):
            return type(self).forward(self, hidden_states, *args, **kwargs)  # type: ignore[no-any-return]
        cache = given.pop("cache", None)
        old = given.pop("past_key_values", None)
        return _attend(self, form, hidden_states, given.pop(form.across, None),
                       old if cache is None else cache, mask, given.pop("attn_prompt", None),
                       asked, given)

    return multihead_attention_forward


def _dropout(self: nn.Module) -> float:
    """The probability with which the layer drops attention weights while training."""
    dropout = getattr(self, "dropout", 0.0)
    if isinstance(dropout, nn.Dropout):
        dropout = dropout.p
    return float(dropout) if isinstance(dropout, (int, float)) else 0.0


def _dropped_weights(self: nn.Module, asked: bool) -> bool:
    """Whether a call returning weights drops attention while training: some such layers
    return the weights before their dropout (XGLM, TrOCR, MVP), others after it (BERT's),
    and astrai's rows return them after; so the layer's own code computes the call,
    warned once and counted under origin ``model``."""
    if not (self.training and _dropout(self) > 0.0):
        return False
    if not (asked or weights_collected(self, eager=True)):
        return False
    if not compiling():
        warn_once(f"astrai: {type(self).__name__} runs its own attention on a training call "
                  f"that returns attention weights with dropout: such layers return them "
                  f"before or after their dropout, and a random call cannot tell which")
        count_model_own("attention")
    return True


def _heads(x: torch.Tensor, heads: int, size: int) -> torch.Tensor:
    """``[batch, seq, heads * size]`` as ``[batch, heads, seq, size]``."""
    return x.view(x.shape[0], x.shape[1], heads, size).transpose(1, 2)


def _keys(self: nn.Module, form: MultiheadForm, source: torch.Tensor, cross: bool,
          cache: Any, kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The call's keys and values, heads first, from ``source`` and the cache as the
    layer keeps them (module docstring)."""
    heads, size = int(getattr(self, form.heads)), int(getattr(self, form.size))
    index = self.layer_idx
    store, stored = cache, False
    split = hasattr(cache, "self_attention_cache") and hasattr(cache, "is_updated")
    if split:
        stored = bool(cache.is_updated.get(index))
        store = cache.cross_attention_cache if cross else cache.self_attention_cache
    if cross and cache is not None and stored:
        layer = store.layers[index]
        return layer.keys, layer.values
    k = _heads(getattr(self, form.k)(source), heads, size)
    v = _heads(getattr(self, form.v)(source), heads, size)
    if cache is not None:
        k, v = store.update(k, v, index, kwargs=kwargs)
        if cross and split:
            cache.is_updated[index] = True
    return k, v


def _attend(self: nn.Module, form: MultiheadForm, hidden_states: torch.Tensor,
            across: torch.Tensor | None, cache: Any, attention_mask: torch.Tensor | None,
            attn_prompt: Any, weights: bool, kwargs: dict[str, Any]
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    heads, size = int(getattr(self, form.heads)), int(getattr(self, form.size))
    batch, q_len = hidden_states.shape[:2]
    source = hidden_states if across is None else across
    q = _heads(getattr(self, form.q)(hidden_states), heads, size)
    k, v = _keys(self, form, source, across is not None, cache, kwargs)
    if attn_prompt is not None:  # prompt keys first, open to every query
        k = torch.cat([attn_prompt[0].expand(batch, -1, -1, -1), k], dim=2)
        v = torch.cat([attn_prompt[1].expand(batch, -1, -1, -1), v], dim=2)
        if attention_mask is not None:
            open_ = attention_mask.new_zeros(batch, 1, q_len, attn_prompt[0].shape[-2])
            attention_mask = torch.cat([open_, attention_mask], dim=-1)
    out, got = layer_attention(self, q, k, v, None, attention_mask, scale=form.scale,
                               dropout=_dropout(self), asked=weights)
    out = out.reshape(batch, q_len, heads * size)
    if form.out is not None:
        out = getattr(self, form.out)(out)
    return out, got


def multihead_form(module: nn.Module) -> MultiheadForm | str | None:
    """How ``module`` is served when it is such a layer (module docstring), the reason
    when it is one (it holds three input projections, a head count and size, and its
    forward takes what it may attend across to) but computes something else, ``None``
    otherwise."""
    try:
        params = inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return None
    across = next((name for name in _ACROSS if name in params), None)
    names = next((p for p in _PROJECTIONS if all(
        isinstance(getattr(module, n, None), nn.Linear) for n in p)), None)
    heads = next((n for n in ("num_heads", "num_attention_heads")
                  if isinstance(getattr(module, n, None), int)), None)
    size = next((n for n in ("head_dim", "attention_head_size")
                 if isinstance(getattr(module, n, None), int)), None)
    if across is None or names is None or heads is None or size is None or (
            not hasattr(module, "layer_idx")):
        return None
    if interface_reads(type(module).forward):
        return None  # BART's: it finds its attention function in transformers' interface
    beyond = sorted(set(params) - _TAKES)
    if beyond:
        return (f"its forward takes {', '.join(beyond)}, which astrai's forward for it "
                f"would not apply")
    if getattr(module, names[0]).weight.is_meta:
        return "its weights hold no values yet (the meta device): nothing to check"
    out = "out_proj" if isinstance(getattr(module, "out_proj", None), nn.Linear) else None
    scaling = getattr(module, "scaling", None)
    order = tuple(n for n in params if n not in ("self", "hidden_states")
                  and params[n].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)
    found = _probe(module, params, MultiheadForm(
        *names, out, heads, size,
        float(scaling) if isinstance(scaling, float) else int(getattr(module, size)) ** -0.5,
        across, order, "output_attentions" in params))
    if isinstance(found, str):
        return found
    watch_collector()
    return found


def _probe(module: nn.Module, params: Any, form: MultiheadForm) -> MultiheadForm | str:
    """``form`` when the layer's own forward and ``_attend`` agree on random calls (a
    CPU copy with random weights), attending to itself and across, or why they do not."""
    g = torch.Generator().manual_seed(23)
    probe = random_copy(module, g)
    heads, size = int(getattr(probe, form.heads)), int(getattr(probe, form.size))
    width = int(getattr(probe, form.q).in_features)
    x = torch.randn(2, 5, width, generator=g)
    low = torch.finfo(torch.float32).min
    causal = torch.full((5, 5), low).triu(1).expand(2, 1, 5, 5).clone()
    causal[1, :, :, 0] = low  # a padded first token: row 0 of the second has no key
    across = torch.randn(2, 5, int(getattr(probe, form.k).in_features), generator=g)
    padded = torch.zeros(2, 1, 5, 5)
    padded[1, :, :, -1] = low
    prompt = None
    if "attn_prompt" in params:
        prompt = torch.randn(2, heads, 3, size, generator=g)
    cases: list[tuple[torch.Tensor, torch.Tensor | None]] = [(padded, across)]
    if getattr(probe, form.k).in_features == width:
        cases.insert(0, (causal, None))  # (else it only attends across)
    for mask, kv in cases:
        keywords: dict[str, Any] = {"attention_mask": mask}
        if kv is not None:
            keywords[form.across] = kv
        if prompt is not None:
            keywords["attn_prompt"] = prompt
        if form.asks:
            keywords["output_attentions"] = True
        with torch.no_grad():
            try:
                want = type(module).forward(probe, x, **keywords)
            except Exception as exc:
                return f"called on a random input it raised {type(exc).__name__}: {exc}"
            if not (isinstance(want, tuple) and len(want) == 2
                    and all(isinstance(t, torch.Tensor) for t in want)):
                return "it does not return (output, attention weights)"
            got = _attend(probe, form, x, kv, None, mask, prompt, True, {})
        if got[1] is None or got[0].shape != want[0].shape or got[1].shape != want[1].shape:
            return "it does not return (output, attention weights) as such a layer does"
        apart = max(float((want[0] - got[0]).abs().max()),
                    float((want[1] - got[1]).abs().max()))
        if apart > 1e-5:
            where = "across" if kv is not None else "to itself"
            return (f"it does not compute multi-head attention as astrai serves it "
                    f"(attending {where}, it differs by {apart:.2g} on random inputs)")
    return form
