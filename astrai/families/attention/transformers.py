"""transformers' attention through astrai: ``attn_implementation="astrai"``.

After ``register()``, any model whose attention layers go through transformers'
``AttentionInterface`` (Llama, Mistral, Qwen2, Gemma 2, gpt-oss, ... - transformers
>= 4.51, which added it) can be built with ``attn_implementation="astrai"``; every attention call is
then sent to ``astrai.ops.attention``, so it is resolved against
``tables/attention.yaml``, counted in ``astrai.dispatch.stats()``, explainable with
``explain`` and overridable with ``ASTR_OPS``, ``op_backend`` and profiles::

    from astrai.integrations.transformers import register
    register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="astrai")

What ``register()`` installs, under the name ``"astrai"``:

- ``AttentionInterface.register("astrai", astrai_attention_forward)`` - the
  adapter below;
- where transformers has an ``AttentionMaskInterface`` (>= 4.53), the mask builder
  that ``"sdpa"`` uses: a boolean ``[batch, 1, q_len, kv_len]`` mask (``True`` =
  may attend) carrying causality, padding, sliding windows and packed sequences,
  or ``None`` when a plain causal mask suffices. Without this second registration
  transformers would build *no mask at all* for an unknown implementation name.

The adapter follows the semantics of transformers' own ``sdpa_attention_forward``.
A plain call (no feature below: a decode step or a prefill of most models) goes to
``ops.attention_heads_first`` with transformers' ``[batch, heads, seq, head_dim]``
tensors untouched - decided exactly as the same call given seq-first, and passed
as it is to rows that take that layout (SDPA's). A call asking for more is
translated to the facade's dense layout (``[batch, seq, heads, head_dim]``) and
back, and what the model asks for beyond plain attention is handed to the facade as
features, so the call runs on the first row of the table that declares them all:

==================================  ==============================================
transformers passes                 the facade gets
==================================  ==============================================
``scaling`` (e.g. Gemma's           ``scale`` (left out when it is
``query_pre_attn_scalar``)          ``head_dim ** -0.5``)
``softcap`` (Gemma 2)               ``softcap``
``dropout`` (training)              ``dropout_p``
``sliding_window`` (Mistral,        ``window``, when no mask came with the call and
Gemma 2, gpt-oss)                   the window cuts keys off; a mask transformers
                                    built already carries the window (as for sdpa)
``s_aux`` / ``sinks`` (gpt-oss),    ``sinks``
one logit per head
``output_attentions=True``          ``return_weights=True``
==================================  ==============================================

With ``output_attentions=True`` (where transformers' sdpa warns and returns no
weights) the adapter returns ``(attn_output, attn_weights)`` like transformers'
eager attention: ``attn_weights`` is ``[batch, heads, q_len, kv_len]`` (one matrix
per query head under GQA) in the query's dtype, the softmax taken in float32, so
the model's ``attentions`` equal eager's. One difference: a query row that may see
no key at all (a left-padding position) gets zero weights, where eager's additive
mask spreads them evenly over every key. Which row serves such a call is ordinary
resolution: the chain skips rows that do not declare ``return_weights``, an
``op_backend`` scope forcing one is an ``ExplicitSelectionError``, an ``ASTR_OPS``
entry naming one warns once and falls through - as for every feature.

An additive position bias (T5's ``position_bias``) becomes part of a float mask: the
bias where the call may attend, the lowest value elsewhere (transformers' sdpa path
does the same), and the call is served like any masked one.

What the facade cannot express is refused with ``UnsupportedFeatureError`` - never
computed differently: ``BlockMask`` masks, sinks that are not one
logit per head, and a sliding window on a non-causal layer without a mask.
"""

from __future__ import annotations

__all__ = [
    "ATTN_IMPLEMENTATION",
    "UnsupportedFeatureError",
    "astrai_attention_forward",
    "call_context",
    "explain_call",
    "is_registered",
    "layer_attention",
    "register",
]

import math as _math
from collections.abc import Callable
from typing import Any

import torch

from astrai.dispatch import CallContext, explain
from astrai.dispatch.log import warn_once
from astrai.dispatch.stats import count_model_own
from astrai.dispatch.torch_compile import compiling
from astrai.errors import UnsupportedFeatureError
from astrai.families.attention import ATTENTION, attention, attention_heads_first
from astrai.recognition.rebind import global_names

#: The ``attn_implementation`` name that ``register()`` installs.
ATTN_IMPLEMENTATION = "astrai"

_INSTALL_HINT = (
    "attn_implementation='astrai' needs transformers >= 4.51, whose AttentionInterface it "
    "registers with (pip install 'astrai[transformers]'); dispatch_model works from 4.48"
)

# Keyword arguments some architectures pass that the facade cannot honour, with why.
_REFUSED_KWARGS: dict[str, str] = {}


#: The global through which transformers' attention layers find their attention function.
ATTENTION_INTERFACE = "ALL_ATTENTION_FUNCTIONS"
#: The eager attention function older layers call directly for ``"eager"``.
EAGER_ATTENTION = "eager_attention_forward"


def interface_reads(forward: Any) -> list[tuple[str, dict[str, Any]]]:
    """``(name, globals)`` for each of ``ATTENTION_INTERFACE`` and ``EAGER_ATTENTION``
    that ``forward`` reads: a layer finding its attention function through transformers'
    interface (none: it computes attention itself, or none at all)."""
    return [(n, g) for n, g in global_names(forward) if n in (ATTENTION_INTERFACE,
                                                              EAGER_ATTENTION)]


def _plain(kwargs: dict[str, Any]) -> bool:
    """Whether transformers' keywords ask for nothing beyond plain attention."""
    get = kwargs.get
    return (get("softcap") is None and get("s_aux") is None and get("sinks") is None
            and get("sliding_window") is None and not get("output_attentions")
            and get("position_bias") is None)


def _refuse(feature: str, value: Any, hint: str | None = None) -> UnsupportedFeatureError:
    return UnsupportedFeatureError(
        feature,
        value,
        hint or "astrai.ops.attention cannot compute it; use attn_implementation='sdpa' or "
        "'eager' for this model",
    )


def _check_supported(attention_mask: Any, kwargs: dict[str, Any]) -> None:
    """Raise ``UnsupportedFeatureError`` for anything the facade cannot express."""
    for name, feature in _REFUSED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise _refuse(feature, _summary(kwargs[name]))
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        raise _refuse(
            "an attention mask that is not a tensor", type(attention_mask).__name__,
            "pass a boolean or additive 4-d tensor mask (flex_attention's BlockMask is "
            "for attn_implementation='flex_attention')",
        )


def _summary(value: Any) -> Any:
    """A short stand-in for a tensor in an error message."""
    if isinstance(value, torch.Tensor):
        return f"tensor of shape {tuple(value.shape)}"
    return value


def _heads_first_arguments(
    module: torch.nn.Module | None,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    is_causal: bool | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, bool]:
    """``(q, k, v, attn_mask, is_causal)`` of ``attention_heads_first`` for one
    transformers call: its own tensors, with the causal rule of ``sdpa_attention_forward``
    (see ``_facade_arguments``) and the static cache's unwritten slots cut off."""
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = (bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
              and attention_mask is None and q_len > 1)
    if causal and kv_len > q_len:
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    elif attention_mask is not None and attention_mask.shape[-1] > kv_len:
        # transformers < 4.53 hands static-cache masks sized to the cache; its sdpa slices.
        attention_mask = attention_mask[..., :kv_len]
    return query, key, value, attention_mask, causal


def _facade_arguments(
    module: torch.nn.Module | None,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    is_causal: bool | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, bool, bool]:
    """The facade's ``(q, k, v, attn_mask, is_causal)`` for one transformers call, and
    whether the layer is causal at all.

    Follows ``transformers.integrations.sdpa_attention.sdpa_attention_forward``:
    causality comes from the mask when there is one; without a mask, the call is
    causal (if the module or the caller says so) only for more than one query.
    transformers leaves out the mask of a causal prefill into an empty static
    cache, where the keys past ``q_len`` are unwritten slots and the causal rule is
    top-left aligned; the facade's rule is bottom-right aligned, so - exactly like
    sdpa - those slots are cut off, which makes both alignments coincide.
    """
    layer_causal = bool(is_causal if is_causal is not None
                        else getattr(module, "is_causal", True))
    query, key, value, attention_mask, causal = _heads_first_arguments(
        module, query, key, value, attention_mask, layer_causal)
    return (
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        attention_mask,
        causal,
        layer_causal,
    )


def _collector() -> Any:
    """transformers' collector of layer outputs (>= 5: ``output_attentions`` from the
    call or the config is served by hooks on the attention layers, which record what
    the layer returns), or ``None`` where transformers has none."""
    try:
        from transformers.utils import output_capturing
    except ImportError:
        return None
    return getattr(output_capturing, "_active_collector", None)


#: transformers' collector, read once by ``watch_collector`` (``register`` and
#: ``dispatch_model`` call it): then an eager layer's attention weights are returned
#: whenever the collector asks for them.
_COLLECTOR: Any = None


def watch_collector() -> None:
    """Look transformers' output collector up (once; transformers is imported by now)."""
    global _COLLECTOR
    if _COLLECTOR is None:
        _COLLECTOR = _collector()


def weights_collected(module: torch.nn.Module | None, *, eager: bool = False) -> bool:
    """Whether transformers is collecting this eager-attention layer's weights now: the
    layer would return them unrouted, so the adapter must too. ``eager``: the layer
    computes attention itself, whatever its config (if any) names."""
    if _COLLECTOR is None:
        return False
    # Traced, transformers' collector answers as a global once a traced forward set it
    # (a context variable's ``get`` cannot be traced); before that nothing collects.
    if compiling() and not getattr(_COLLECTOR, "compiling", False):
        return False
    collected = _COLLECTOR.get()
    if not isinstance(collected, dict) or not (
            "attentions" in collected or "cross_attentions" in collected):
        return False
    config = getattr(module, "config", None)
    return eager or getattr(config, "_attn_implementation", None) == "eager"


def layer_attention(module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, mask: torch.Tensor | None,
                    attention_mask: torch.Tensor | None, *, scale: float, dropout: float,
                    asked: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``ops.attention`` for a layer that computes attention itself (``q``, ``k``, ``v``
    heads first): ``mask`` the layer's own additive mask (if any), the model's
    ``attention_mask`` applied on it (boolean, ``True`` where allowed, or additive),
    ``dropout`` while the layer trains, and the weights returned when ``asked`` or
    transformers collects them (else ``None``)."""
    if attention_mask is not None:
        if mask is None:
            mask = attention_mask
        else:
            mask = (mask.masked_fill(~attention_mask, torch.finfo(mask.dtype).min)
                    if attention_mask.dtype == torch.bool else mask + attention_mask)
    keywords: dict[str, Any] = {"attn_mask": mask, "is_causal": False, "scale": scale}
    if module.training and dropout:
        keywords["dropout_p"] = dropout
    wanted = asked or weights_collected(module, eager=True)
    if wanted:
        keywords["return_weights"] = True
    got = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **keywords)
    return got if wanted else (got, None)


def unattended_row(module: torch.nn.Module, hidden_states: torch.Tensor,
                   attention_mask: torch.Tensor | None,
                   allowed: Callable[[int, int], torch.Tensor] | None = None) -> bool:
    """Whether a layer computing attention itself must compute this call with its own code
    because a query row has no key left to attend to: no key that both the layer's own
    mask (if any: ``allowed(q_len, kv_len)``, boolean, the keys it allows each of the
    last ``q_len`` of ``kv_len`` positions, read only when the rows are) and the model's
    4-d ``attention_mask`` allow (a left-padded position). Such a row's softmax spreads
    over masked keys: the layer's own code sends those keys gradients, which astrai's
    kernels do not, and rounds the row otherwise under autocast and in float16 (where
    the lowest value the mask adds swallows the scores). So only a call that needs
    gradients (its input's, or any parameter of the layer's, an adapter's too), runs
    under autocast or computes in float16 is asked about. Under ``torch.compile`` and
    ``torch.export``, where the rows cannot be read without a graph break, every such
    call with a mask that needs gradients or runs under autocast is the layer's own, and
    a float16 inference call is astrai's (those rows' outputs, which no real position
    reads, may differ). A call found to be the layer's own is warned about once and
    counted under origin ``model``."""
    if attention_mask is None or attention_mask.dim() != 4:
        return False
    grads = torch.is_grad_enabled() and (hidden_states.requires_grad or any(
        p.requires_grad for p in module.parameters()))
    rounded = grads or torch.is_autocast_enabled(hidden_states.device.type)
    if not (rounded or hidden_states.dtype == torch.float16):
        return False
    if compiling() or torch.compiler.is_exporting():  # (such calls are not counted)
        return rounded
    kept = attention_mask if attention_mask.dtype == torch.bool else (
        attention_mask > torch.finfo(attention_mask.dtype).min / 2)
    if allowed is not None:
        kept = kept & allowed(hidden_states.shape[-2], attention_mask.shape[-1])
    if bool(kept.any(-1).all()):
        return False
    warn_once(f"astrai: {type(module).__name__} runs its own attention on a call that "
              f"trains, runs under autocast or computes in float16 with a query row whose "
              f"every key is masked (left padding): on such a row the layer's own softmax "
              f"spreads over masked keys, which astrai's kernels round otherwise and send "
              f"no gradient")
    count_model_own("attention")
    return True


def _with_position_bias(
    module: torch.nn.Module | None,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    is_causal: bool | None,
    bias: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(key, value, mask)`` for a call with an additive position bias (T5's relative
    bias, ``[batch or 1, heads, q_len, kv_len]``): one float mask that adds the bias
    where the call may attend and the lowest value elsewhere, as transformers' sdpa
    path builds it; the call is then not causal (the mask says it all)."""
    if not isinstance(bias, torch.Tensor) or not bias.is_floating_point() or bias.dim() != 4:
        raise _refuse("a position bias that is not a 4-d float tensor", _summary(bias))
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        _check_supported(attention_mask, {})
    q_len, kv_len = query.shape[2], key.shape[2]
    layer_causal = bool(is_causal if is_causal is not None
                        else getattr(module, "is_causal", True))
    causal = layer_causal and attention_mask is None and q_len > 1
    if causal and kv_len > q_len:  # prefill into an empty static cache: its slots cut off
        key, value, kv_len = key[:, :, :q_len], value[:, :, :q_len], q_len
    bias = bias[..., :kv_len]
    if attention_mask is not None and attention_mask.shape[-1] > kv_len:
        attention_mask = attention_mask[..., :kv_len]
    low = max(torch.finfo(key.dtype).min, torch.finfo(bias.dtype).min)
    if attention_mask is None:
        if not causal:
            return key, value, bias
        allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=bias.device).tril(
            kv_len - q_len)
        return key, value, bias.masked_fill(~allowed, low)
    if attention_mask.dtype == torch.bool:
        return key, value, bias.masked_fill(~attention_mask, low)
    return key, value, bias + attention_mask


def _sinks(value: Any, heads: int) -> torch.Tensor:
    """The facade's ``sinks`` from transformers' ``s_aux`` / ``sinks``: one logit per head."""
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.shape[0] != heads:
        raise _refuse(
            f"attention sinks other than one logit per head ([{heads}])", _summary(value),
            "the facade's sinks are a [heads] tensor (gpt-oss's s_aux); use "
            "attn_implementation='eager' for this model",
        )
    return value


def _features(
    query: torch.Tensor,
    k: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    layer_causal: bool,
    dropout: float,
    scaling: float | None,
    kwargs: dict[str, Any],
) -> tuple[bool, dict[str, Any]]:
    """The facade's ``is_causal`` and feature keywords for one transformers call.

    A sliding window becomes ``window`` only when no mask carries it and it cuts
    keys off (the last query of a causal call sees every key; more than ``window``
    of them is when it matters); a one-query call is then made causal, which for one
    query changes nothing else. The facade checks the values and drops those at
    their default.
    """
    features: dict[str, Any] = {}
    if scaling is not None:
        features["scale"] = scaling
    if kwargs.get("softcap") is not None:
        features["softcap"] = kwargs["softcap"]
    if dropout:
        features["dropout_p"] = dropout
    for name in ("s_aux", "sinks"):
        if kwargs.get(name) is not None:
            features["sinks"] = _sinks(kwargs[name], query.shape[1])
    window = kwargs.get("sliding_window")
    if window is not None and mask is None and k.shape[1] > window:
        if not layer_causal:
            raise _refuse(
                "a sliding window on a non-causal layer without a mask", window,
                "the facade's window is causal (each query sees its last keys); call "
                "register() before building the model so transformers builds the mask",
            )
        causal = True
        features["window"] = window
    if kwargs.get("output_attentions"):
        features["return_weights"] = True
    return causal, features


def _translate(
    module: torch.nn.Module | None,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float,
    scaling: float | None,
    is_causal: bool | None,
    kwargs: dict[str, Any],
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], dict[str, Any]]:
    """The facade call for one transformers call: ``((q, k, v), keywords)``."""
    _check_supported(attention_mask, kwargs)
    q, k, v, mask, causal, layer_causal = _facade_arguments(
        module, query, key, value, attention_mask, is_causal)
    causal, features = _features(query, k, mask, causal, layer_causal, dropout, scaling, kwargs)
    return (q, k, v), {"attn_mask": mask, "is_causal": causal, **features}


def astrai_attention_forward(
    module: torch.nn.Module | None,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention-function protocol, served by ``astrai.ops.attention``.

    ``query`` is ``[batch, heads, q_len, head_dim]``, ``key``/``value``
    ``[batch, kv_heads, kv_len, head_dim]`` (GQA when ``kv_heads < heads``),
    ``attention_mask`` a 4-d mask broadcastable to ``[batch, heads, q_len, kv_len]``
    (boolean, ``True`` = may attend, or additive float) or ``None``. Returns
    ``(attn_output [batch, q_len, heads, head_dim], None)`` like transformers' sdpa;
    with ``output_attentions=True``, ``(attn_output, attn_weights)`` like its eager
    attention, ``attn_weights`` ``[batch, heads, q_len, kv_len]`` in the query's
    dtype. ``scaling``, ``softcap``, ``dropout``, ``sliding_window`` and ``s_aux``
    become the facade's features (see the module docstring); what it cannot
    express raises ``UnsupportedFeatureError``.
    """
    batch, heads, q_len = query.shape[0], query.shape[1], query.shape[2]
    if _COLLECTOR and not kwargs.get("output_attentions") and weights_collected(module):
        kwargs["output_attentions"] = True
    bias = kwargs.pop("position_bias", None)
    if bias is not None:
        key, value, attention_mask = _with_position_bias(
            module, query, key, value, attention_mask, is_causal, bias)
        is_causal = False
    if (not dropout and (not kwargs or _plain(kwargs))
            and (scaling is None or _math.isclose(scaling, query.shape[-1] ** -0.5,
                                                  rel_tol=1e-6))
            and (attention_mask is None or isinstance(attention_mask, torch.Tensor))):
        # Plain attention (a decode step of most models): no feature to translate, and
        # transformers' heads-first tensors go to the table untouched.
        query, key, value, mask, causal = _heads_first_arguments(
            module, query, key, value, attention_mask, is_causal)
        return attention_heads_first(query, key, value, mask, causal).contiguous(), None
    (q, k, v), keywords = _translate(module, query, key, value, attention_mask, dropout,
                                     scaling, is_causal, kwargs)
    if not keywords.get("return_weights"):
        out = attention(q, k, v, **keywords)
        return out.view(batch, q_len, heads, -1), None
    out, weights = attention(q, k, v, **keywords)
    cut = key.shape[2] - k.shape[1]
    if cut:  # static-cache prefill: the unwritten slots that were cut off get zero weight
        weights = torch.nn.functional.pad(weights, (0, cut))
    return out.view(batch, q_len, heads, -1), weights


def call_context(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    is_causal: bool | None = True,
    *,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> CallContext:
    """The ``CallContext`` the facade sees for this transformers-layout call.

    Takes what the adapter takes (``scaling``, ``softcap``, ``sliding_window``,
    ``s_aux``, ``output_attentions``, ...), so the context carries the features the
    call asks for. Feed it to ``astrai.dispatch.explain("attention", ...)`` to see
    which row would serve the call and why the others would not (``explain_call``
    does both).
    """
    (q, k, v), keywords = _translate(None, query, key, value, attention_mask, dropout,
                                     scaling, is_causal, kwargs)
    call = ATTENTION.call
    return call.context(*call.bind((q, k, v), keywords))


def explain_call(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    is_causal: bool | None = True,
    **kwargs: Any,
) -> str:
    """``explain`` of the decision the adapter takes for this transformers-layout call
    (``explain("attention", call_context(...))``, with the same keywords)."""
    return explain("attention", call_context(query, key, value, attention_mask, is_causal,
                                             **kwargs))


def _interfaces() -> tuple[Any, Any, Callable[..., Any] | None]:
    """``(AttentionInterface, AttentionMaskInterface or None, sdpa's mask builder or None)``."""
    try:
        from transformers import AttentionInterface
    except ImportError as exc:  # transformers missing, or older than 4.51
        raise ImportError(_INSTALL_HINT) from exc
    try:
        from transformers.masking_utils import (
            ALL_MASK_ATTENTION_FUNCTIONS,
            AttentionMaskInterface,
        )
    except ImportError:  # < 4.53: models build an eager-style 4-d mask for custom names
        return AttentionInterface, None, None
    return AttentionInterface, AttentionMaskInterface, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]


def register() -> None:
    """Install ``attn_implementation="astrai"`` in transformers (idempotent).

    Registers ``astrai_attention_forward`` with ``AttentionInterface`` and, where
    transformers has an ``AttentionMaskInterface``, sdpa's boolean mask builder
    under the same name. Call it before building the model. Nothing is
    registered by importing this module.
    """
    attention_interface, mask_interface, sdpa_mask = _interfaces()
    watch_collector()
    attention_interface.register(ATTN_IMPLEMENTATION, astrai_attention_forward)
    if mask_interface is not None and sdpa_mask is not None:
        mask_interface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def is_registered() -> bool:
    """Whether ``"astrai"`` currently names this module's adapter in transformers."""
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        return False
    return ALL_ATTENTION_FUNCTIONS.get(ATTN_IMPLEMENTATION) is astrai_attention_forward
