"""Hugging Face transformers plug-in: ``attn_implementation="astrai"``.

After ``register()``, any model whose attention layers go through transformers'
``AttentionInterface`` (Llama, Mistral, Qwen2, ... - transformers >= 4.48) can be
built with ``attn_implementation="astrai"``; every attention call is then sent to
``astrai.ops.attention``, so it is resolved against ``tables/attention.yaml``,
counted in ``astrai.dispatch.stats()``, explainable with ``explain`` and
overridable with ``ASTR_OPS``, ``op_backend`` and profiles::

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

The adapter translates transformers' call (``[batch, heads, seq, head_dim]``
tensors, fewer K/V heads for GQA, its 4-d mask, ``is_causal``) to the facade's
dense layout (``[batch, seq, heads, head_dim]``) and back, following the
semantics of transformers' own ``sdpa_attention_forward`` exactly. What the
facade cannot express is refused with ``UnsupportedFeatureError`` - never
computed differently: a softmax scale other than ``head_dim ** -0.5``, attention
dropout, logit soft-capping, attention sinks, position biases, ``BlockMask``
masks, and a sliding window without a mask.

``output_attentions=True`` (where transformers' sdpa warns and returns no
weights) is served by a row that really computes them: one whose implementation
object has a ``with_weights`` method (in the shipped table, ``math``; see
``astrai.backends.attention.math``). The adapter then returns
``(attn_output, attn_weights)`` like transformers' eager attention:
``attn_weights`` is ``[batch, heads, q_len, kv_len]`` (one matrix per query head
under GQA) in the query's dtype, the softmax taken in float32, so the model's
``attentions`` equal eager's. One difference: a query row that may see no key at
all (a left-padding position) gets zero weights, where eager's additive mask
spreads them evenly over every key. The call still goes through the dispatch
engine - resolved, cached, counted in ``stats()`` under the row that served it:

- if the row that resolution picks (an ``op_backend`` scope, ``ASTR_OPS``, a
  profile, the chain) returns weights, it serves, with its usual origin;
- if the chain picked a row without weights, the first row in table order that
  returns weights and can serve the call (disabled, non-faithful and explicit-only rows skipped,
  as in the chain; then the fallback) is selected by name, as ``backend="math"``
  would: counted with origin ``explicit``; ``explain_call(...,
  output_attentions=True)`` shows the decision and why;
- a row without weights forced by a *strict* source (an ``op_backend`` scope) is
  an ``ExplicitSelectionError`` naming the row and the reason;
- a row without weights asked for by a *soft* source (``ASTR_OPS`` /
  ``ASTR_BACKEND``, a profile's ``force``) is not honoured for these calls - the
  row chosen as above serves them - and a warning is logged once;
- when no row that returns weights can serve the call, it is refused with
  ``UnsupportedFeatureError``.
"""

from __future__ import annotations

__all__ = [
    "ATTN_IMPLEMENTATION",
    "UnsupportedFeatureError",
    "astrai_attention_forward",
    "call_context",
    "explain_call",
    "is_registered",
    "register",
    "run_transformers_demo",
]

import copy
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from astrai.backends.attention.math import WEIGHTS_METHOD
from astrai.dispatch import (
    OPS_ENV,
    PRECEDENCE,
    CallContext,
    ImplRecord,
    Resolution,
    current,
)
from astrai.dispatch.log import warn_once
from astrai.dispatch.registry import Registry
from astrai.dispatch.resolution import (
    MATCH,
    Decision,
    decide,
    evaluate,
    explanation,
    row_verdict,
    same_context,
)
from astrai.dispatch.sources import active_view
from astrai.dispatch.stats import QUIET
from astrai.errors import ExplicitSelectionError, UnsupportedFeatureError
from astrai.ops import attention
from astrai.ops import context as facade_context

#: The ``attn_implementation`` name that ``register()`` installs.
ATTN_IMPLEMENTATION = "astrai"

_INSTALL_HINT = (
    "the transformers integration needs transformers >= 4.48 (pip install 'astrai[transformers]')"
)

# Keyword arguments some architectures pass that the facade cannot honour, with why.
_REFUSED_KWARGS: dict[str, str] = {
    "softcap": "attention logit soft-capping (e.g. Gemma 2)",
    "s_aux": "attention sinks (e.g. gpt-oss)",
    "sinks": "attention sinks",
    "position_bias": "an additive position bias (e.g. T5 / ALiBi style)",
}


def _refuse(feature: str, value: Any, hint: str | None = None) -> UnsupportedFeatureError:
    return UnsupportedFeatureError(
        feature,
        value,
        hint or "astrai.ops.attention cannot compute it; use attn_implementation='sdpa' or "
        "'eager' for this model",
    )


def _check_supported(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: Any,
    dropout: float,
    scaling: float | None,
    kwargs: dict[str, Any],
) -> None:
    """Raise ``UnsupportedFeatureError`` for anything the facade would compute differently."""
    if dropout:
        raise _refuse(
            "attention dropout", dropout,
            "set config.attention_dropout = 0.0 to train, or call model.eval()",
        )
    head_dim = query.shape[-1]
    if scaling is not None and not math.isclose(scaling, head_dim**-0.5, rel_tol=1e-6):
        raise _refuse(
            f"a softmax scale other than head_dim ** -0.5 = {head_dim**-0.5:.6g}", scaling,
            "the facade always scales by 1 / sqrt(head_dim) (e.g. Gemma's "
            "query_pre_attn_scalar changes it); use attn_implementation='sdpa' or 'eager'",
        )
    for name, feature in _REFUSED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise _refuse(feature, _summary(kwargs[name]))
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        raise _refuse(
            "an attention mask that is not a tensor", type(attention_mask).__name__,
            "pass a boolean or additive 4-d tensor mask (flex_attention's BlockMask is "
            "for attn_implementation='flex_attention')",
        )
    window = kwargs.get("sliding_window")
    if attention_mask is None and window is not None and key.shape[2] > window:
        raise _refuse(
            "a sliding window without a materialised mask", window,
            "transformers built no mask for this call; call register() before building the "
            "model so the 'astrai' mask builder is installed",
        )


def _summary(value: Any) -> Any:
    """A short stand-in for a tensor in an error message."""
    if isinstance(value, torch.Tensor):
        return f"tensor of shape {tuple(value.shape)}"
    return value


def _facade_arguments(
    module: torch.nn.Module | None,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    is_causal: bool | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, bool]:
    """The facade's ``(q, k, v, attn_mask, is_causal)`` for one transformers call.

    Follows ``transformers.integrations.sdpa_attention.sdpa_attention_forward``:
    causality comes from the mask when there is one; without a mask, the call is
    causal (if the module or the caller says so) only for more than one query.
    transformers leaves out the mask of a causal prefill into an empty static
    cache, where the keys past ``q_len`` are unwritten slots and the causal rule is
    top-left aligned; the facade's rule is bottom-right aligned, so - exactly like
    sdpa - those slots are cut off, which makes both alignments coincide.
    """
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal) and attention_mask is None and q_len > 1
    if causal and kv_len > q_len:
        key, value = key[:, :, :q_len], value[:, :, :q_len]
        kv_len = q_len
    if attention_mask is not None and attention_mask.shape[-1] > kv_len:
        # transformers < 4.53 hands static-cache masks sized to the cache; its sdpa slices.
        attention_mask = attention_mask[..., :kv_len]
    return (
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        attention_mask,
        causal,
    )


_FAMILY = "attention"
_WEIGHTS_FEATURE = "returning attention weights (output_attentions=True)"
_STRICT = frozenset(source.origin for source in PRECEDENCE if source.strict)


def _returns_weights(obj: Any) -> bool:
    """Whether an implementation object can hand back the attention probabilities."""
    return callable(getattr(obj, WEIGHTS_METHOD, None))


def _weights_rows(state: Registry) -> list[ImplRecord]:
    """The rows of the active view that return weights, in table order (fallback last)."""
    view = active_view(state, _FAMILY)
    rows = [rec for rec in view.rows if _returns_weights(rec.obj)]
    if view.fallback not in view.rows and _returns_weights(view.fallback.obj):
        rows.append(view.fallback)
    return rows


def _weights_row(state: Registry, ctx: CallContext) -> ImplRecord:
    """The row an ``output_attentions`` call goes to when resolution picked one without weights.

    Chain semantics restricted to the rows that return weights: the first in table
    order that is enabled, available, faithful (or enabled by a profile) and whose
    ``when`` matches; then the fallback row, if it returns weights and can serve.
    Refused (``UnsupportedFeatureError``) when none can, with every reason.
    """
    view = active_view(state, _FAMILY)
    reasons: list[str] = []
    for rec in view.rows:
        if not _returns_weights(rec.obj):
            continue
        verdict, detail = row_verdict(state, view, rec, ctx)
        if verdict == MATCH:
            return rec
        reasons.append(f"{rec.name}: {verdict} ({detail})" if detail else f"{rec.name}: {verdict}")
    fallback = view.fallback
    if _returns_weights(fallback.obj):
        verdict, detail = row_verdict(state, view, fallback, ctx, implicit=False)
        if verdict == MATCH:
            return fallback
        if fallback not in view.rows:
            reasons.append(f"{fallback.name}: {verdict} ({detail})")
    if not reasons:
        reasons.append(f"no row of the {_FAMILY} table has a {WEIGHTS_METHOD}() method")
    raise _refuse(
        _WEIGHTS_FEATURE, True,
        f"no {_FAMILY} row that returns them can serve this call ({'; '.join(reasons)}); "
        "use attn_implementation='eager' for this model",
    )


def _source(state: Registry, res: Resolution) -> str:
    """Who asked for ``res``'s row, for a message."""
    if res.origin == "context":
        return "an op_backend scope"
    if res.origin == "env":
        alias = state.aliases.get(_FAMILY)
        names = f"{OPS_ENV} or {alias}" if alias else OPS_ENV
        return f"the environment ({names})"
    if res.origin == "profile":
        forced = active_view(state, _FAMILY).forced
        return f"profile {forced[1]}" if forced else "a profile"
    return next((s.label for s in PRECEDENCE if s.origin == res.origin), res.origin)


def _weights_handle(state: Registry, res: Resolution, ctx: CallContext) -> tuple[Any, str]:
    """What to select for an ``output_attentions`` call that ordinary resolution gave ``res``.

    Returns ``(None, "")`` when ``res``'s row returns weights; else the handle (a
    row name, or the object of a fallback outside the chain) of the row that will,
    and a sentence saying why. Raises when a strict source forced a row without
    weights (``ExplicitSelectionError``) or when no row can (``UnsupportedFeatureError``).
    """
    if _returns_weights(res.obj):
        return None, ""
    if res.origin in _STRICT:
        raise ExplicitSelectionError(
            f"{_FAMILY} implementation {res.name!r} selected by {_source(state, res)} cannot "
            f"serve this call: it does not return attention weights, which "
            f"output_attentions=True needs (rows that do: "
            f"{', '.join(r.name for r in _weights_rows(state)) or 'none'}); "
            "select one of those in the scope, or leave output_attentions off",
            family=_FAMILY, row=res.name)
    rec = _weights_row(state, ctx)
    handle: Any = rec.name if active_view(state, _FAMILY).row(rec.name) is rec else rec.obj
    if res.origin in ("chain", "fallback"):
        return handle, (f"output_attentions=True: {res.name} does not return attention "
                        f"weights; {rec.name}, the first row that does, serves (selected "
                        "explicitly)")
    return handle, (f"{_FAMILY}={res.name} from {_source(state, res)} is not honoured for "
                    f"output_attentions=True calls: {res.name} does not return attention "
                    f"weights; {rec.name} serves them instead")


def _weights_decision(ctx: CallContext) -> Decision:
    """The cached decision for an ``output_attentions`` call: a row that returns weights."""
    sig = ctx.signature()
    decision = decide(_FAMILY, sig, None, same_context, (ctx,))
    if _returns_weights(decision.obj):
        return decision
    next(QUIET)  # that lookup serves no call: the one below does
    handle, why = _weights_handle(current(), decision.resolution, ctx)
    if decision.resolution.origin not in ("chain", "fallback"):
        warn_once(why)  # a soft choice of the user's is set aside for this call: say so
    return decide(_FAMILY, sig, handle, same_context, (ctx,))


def _attention_with_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(output, weights)`` of a facade-layout call, through the dispatch engine.

    Resolved, cached and counted like a facade call (``stats()`` shows the row
    that served it); the row's ``with_weights`` computes both.
    """
    ctx = facade_context("attention", q, k, v, attn_mask=mask, is_causal=causal)
    decision = _weights_decision(ctx)
    next(decision.counter)
    with_weights = getattr(decision.obj, WEIGHTS_METHOD)
    out, weights = with_weights(q, k, v, attn_mask=mask, is_causal=causal)
    return out, weights


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
    dtype, computed by a row that returns weights (see the module docstring).
    Unsupported features raise ``UnsupportedFeatureError``.
    """
    _check_supported(query, key, attention_mask, dropout, scaling, kwargs)
    q, k, v, mask, causal = _facade_arguments(module, query, key, value, attention_mask, is_causal)
    batch, heads, q_len = query.shape[0], query.shape[1], query.shape[2]
    if not kwargs.get("output_attentions"):
        out = attention(q, k, v, attn_mask=mask, is_causal=causal)
        return out.view(batch, q_len, heads, -1), None
    out, weights = _attention_with_weights(q, k, v, mask, causal)
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
) -> CallContext:
    """The ``CallContext`` the facade sees for this transformers-layout call.

    Feed it to ``astrai.dispatch.explain("attention", ...)`` to see which row
    would serve the call and why the others would not (``explain_call`` does
    both, and knows about ``output_attentions``).
    """
    q, k, v, mask, causal = _facade_arguments(None, query, key, value, attention_mask, is_causal)
    return facade_context("attention", q, k, v, attn_mask=mask, is_causal=causal)


def explain_call(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    is_causal: bool | None = True,
    output_attentions: bool = False,
) -> str:
    """``explain`` of the decision the adapter takes for this transformers-layout call.

    Without ``output_attentions`` this is ``explain("attention", call_context(...))``.
    With it, the decision is the one the adapter takes for a call that must return
    the attention weights; a note says when that differs from ordinary resolution,
    and a call the adapter would refuse ends in ``=> ERROR: ...``.
    """
    ctx = call_context(query, key, value, attention_mask, is_causal)
    if not output_attentions:
        return explanation(_FAMILY, ctx).render()
    state = current()
    try:
        handle, why = _weights_handle(state, evaluate(_FAMILY, ctx, state=state), ctx)
    except (ValueError, RuntimeError, NotImplementedError) as exc:
        plain = explanation(_FAMILY, ctx)
        return dataclasses.replace(plain, row=None, origin=None, error=str(exc)).render()
    explained = explanation(_FAMILY, ctx, handle)
    if why:
        explained = dataclasses.replace(explained, notes=(*explained.notes, why))
    return explained.render()


def _interfaces() -> tuple[Any, Any, Callable[..., Any] | None]:
    """``(AttentionInterface, AttentionMaskInterface or None, sdpa's mask builder or None)``."""
    try:
        from transformers import AttentionInterface
    except ImportError as exc:  # transformers missing, or older than 4.48
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


def run_transformers_demo(seed: int = 0, max_new_tokens: int = 8) -> str:
    """Build a tiny random Llama, run it through ``attn_implementation="astrai"``, report.

    The model (GQA: 4 query heads, 2 key/value heads) gets random weights from its
    config - nothing is downloaded. Runs a forward pass (compared with ``"sdpa"``)
    and a short greedy ``generate``, then returns a printable report with the
    dispatch ``stats()`` table and ``explain`` of a prefill-shaped call.
    """
    try:
        import transformers
        from transformers import AutoModelForCausalLM, LlamaConfig
    except ImportError as exc:
        raise ImportError(_INSTALL_HINT) from exc

    from astrai.dispatch import explain, op_backend, reset_stats, stats

    register()
    layers, heads, kv_heads, head_dim, prompt = 2, 4, 2, 16, 10
    config = LlamaConfig(
        vocab_size=128, hidden_size=heads * head_dim, intermediate_size=128,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(seed)
    # Each model gets its own config: the attention implementation is stored on it.
    model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        copy.deepcopy(config), attn_implementation=ATTN_IMPLEMENTATION
    ).eval()
    reference = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        copy.deepcopy(config), attn_implementation="sdpa"
    ).eval()
    reference.load_state_dict(model.state_dict())

    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 128, (2, prompt), generator=generator)
    reset_stats()
    with torch.no_grad():
        expected = reference(input_ids).logits
        logits = model(input_ids).logits
        with op_backend(attention="math"):
            logits_math = model(input_ids).logits
        tokens = model.generate(
            input_ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=0,
        )
        q = torch.zeros(2, heads, prompt, head_dim)
        kv = torch.zeros(2, kv_heads, prompt, head_dim)
        decision = explain("attention", call_context(q, kv, kv))
    usage = stats()

    def gap(got: torch.Tensor) -> str:
        return f"{(got - expected).abs().max().item():.2e}"

    lines = [
        f"astrai x transformers {transformers.__version__} (torch {torch.__version__})",
        f"model: LlamaForCausalLM, random weights, {layers} layers, {heads} heads / "
        f"{kv_heads} kv heads (GQA), head_dim {head_dim}, "
        f"attn_implementation={model.config._attn_implementation!r}",
        f"forward: logits {tuple(logits.shape)}; max |astrai - sdpa| = {gap(logits)}, "
        f"with op_backend(attention='math') = {gap(logits_math)}",
        f"generate (greedy, {max_new_tokens} new tokens): "
        f"{tokens[0, prompt:].tolist()}",
        "",
        "dispatch stats:",
        usage.table(),
        "",
        "explain (a prefill-shaped call of this model, as generate makes it):",
        decision,
    ]
    return "\n".join(lines)
