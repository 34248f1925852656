"""The op facades: every call is described, resolved against its table, counted and run.

Under ``torch.compile`` the decision is taken once at trace time and baked into
the graph (see ``astrai.dispatch.compiled``); compiled calls are not counted.

``backend=`` is the explicit selection of SPEC §3 (a row name or an
implementation object): strict, it raises rather than fall back.
"""

from __future__ import annotations

__all__ = ["apply_rotary", "attention", "call", "linear", "rms_norm"]

from typing import Any

import torch

from astrai.dispatch import compiled
from astrai.dispatch import registry as _registry
from astrai.dispatch.compiled import IMPLS, decision_name
from astrai.dispatch.env import ENVIRON_DATA, OPS_KEY, raw_get
from astrai.dispatch.overrides import _scope
from astrai.dispatch.registry import current
from astrai.dispatch.resolution import decide
from astrai.dispatch.stats import SLOW
from astrai.ops._checks import check_attention, check_linear, check_rms_norm, check_rotary
from astrai.ops._contexts import (
    attention_context,
    generic_context,
    linear_context,
    rms_norm_context,
    rotary_context,
)

_NO_EXTRA = ()
_grad = torch.is_grad_enabled
# Dynamo folds this to True while tracing (it cannot trace the ContextVar read below);
# eagerly it is a one-line ``return False``. Non-strict export runs the eager path.
_compiling = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)
_scope_get = _scope.get
_env = raw_get if ENVIRON_DATA is None else ENVIRON_DATA.get

# Each facade builds its decision-cache key inline: the call's signature (equal to
# ``CallContext.signature()``, read straight off the tensors) followed by what
# ``resolution.cache_key`` appends. ``decide`` runs only on a miss, when no table is
# loaded yet, or when ``backend`` is an object; it counts, evaluates and fills the cache.
_SIG = 10  # the signature's length within the key
# A cache hit counts only the row's usage counter; ``stats`` derives the hit count
# from those and ``SLOW`` (facade calls that went through ``decide``, which counts them).


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: Any = None,
    layer_id: int = 0,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    fwd: str | None = None,
    backend: Any = None,
) -> torch.Tensor:
    """Scaled dot-product attention through the ``attention`` table.

    Dense ``[batch, seq, heads, head_dim]`` (training / no cache), or packed
    ``[tokens, heads, head_dim]`` with a paged ``kv_cache`` for ``fwd="prefill"`` /
    ``"decode"``. K/V may have fewer heads (GQA). Returns ``[..., heads*head_dim]``.
    """
    check_attention(q, k, v, kv_cache, layer_id, attn_mask, fwd)
    if _compiling():  # before anything dynamo cannot trace (ContextVar.get)
        sig = ("attention", fwd, q.dtype, q.is_cuda, q.dim(), q.shape[-1],
               kv_cache is not None, attn_mask is not None, _grad(), _NO_EXTRA)
        return IMPLS[decision_name("attention", sig, backend, compiled.KEY)](  # type: ignore[no-any-return]
            q, k, v, kv_cache=kv_cache, layer_id=layer_id, attn_mask=attn_mask,
            is_causal=is_causal, fwd=fwd)
    state = _registry._state
    qs = q.shape
    key = ("attention", fwd, q.dtype, q.is_cuda, len(qs), qs[-1], kv_cache is not None,
           attn_mask is not None, _grad(), _NO_EXTRA, backend, _scope_get().cache_token,
           _env(OPS_KEY), _env(state and state.alias_keys.get("attention")))
    d = (state.decisions.get(key)
         if state is not None and (backend is None or backend.__class__ is str) else None)
    if d is None:
        d = decide("attention", key[:_SIG], backend, attention_context,
                   (q, k, v, kv_cache, layer_id, attn_mask, is_causal, fwd))
        next(SLOW)
    next(d.counter)
    return d.call(  # type: ignore[no-any-return]
        q, k, v, kv_cache=kv_cache, layer_id=layer_id, attn_mask=attn_mask,
        is_causal=is_causal, fwd=fwd)


def apply_rotary(x: torch.Tensor, freqs_cis: torch.Tensor, backend: Any = None) -> torch.Tensor:
    """Rotate adjacent pairs ``(2i, 2i+1)`` of ``x`` by ``freqs_cis`` (cos, sin) per pair."""
    check_rotary(x, freqs_cis)
    if _compiling():  # before anything dynamo cannot trace (ContextVar.get)
        sig = ("rotary", None, x.dtype, x.is_cuda, x.dim(), x.shape[-1], False, False, _grad(),
               _NO_EXTRA)
        return IMPLS[decision_name("rotary", sig, backend, compiled.KEY)](  # type: ignore[no-any-return]
            x, freqs_cis)
    state = _registry._state
    key = ("rotary", None, x.dtype, x.is_cuda, x.dim(), x.shape[-1], False, False, _grad(),
           _NO_EXTRA, backend, _scope_get().cache_token, _env(OPS_KEY),
           _env(state and state.alias_keys.get("rotary")))
    d = (state.decisions.get(key)
         if state is not None and (backend is None or backend.__class__ is str) else None)
    if d is None:
        d = decide("rotary", key[:_SIG], backend, rotary_context, (x, freqs_cis))
        next(SLOW)
    next(d.counter)
    return d.call(x, freqs_cis)  # type: ignore[no-any-return]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
             backend: Any = None) -> torch.Tensor:
    """RMS normalisation over the last dimension, scaled by ``weight``."""
    check_rms_norm(x, weight, eps)
    if _compiling():  # before anything dynamo cannot trace (ContextVar.get)
        sig = ("rms_norm", None, x.dtype, x.is_cuda, x.dim(), None, False, False, _grad(),
               _NO_EXTRA)
        return IMPLS[decision_name("rms_norm", sig, backend, compiled.KEY)](  # type: ignore[no-any-return]
            x, weight, eps)
    state = _registry._state
    key = ("rms_norm", None, x.dtype, x.is_cuda, x.dim(), None, False, False, _grad(),
           _NO_EXTRA, backend, _scope_get().cache_token, _env(OPS_KEY),
           _env(state and state.alias_keys.get("rms_norm")))
    d = (state.decisions.get(key)
         if state is not None and (backend is None or backend.__class__ is str) else None)
    if d is None:
        d = decide("rms_norm", key[:_SIG], backend, rms_norm_context, (x, weight, eps))
        next(SLOW)
    next(d.counter)
    return d.call(x, weight, eps)  # type: ignore[no-any-return]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           backend: Any = None) -> torch.Tensor:
    """``x @ weight.T + bias`` through the ``linear`` table."""
    check_linear(x, weight, bias)
    if _compiling():  # before anything dynamo cannot trace (ContextVar.get)
        sig = ("linear", None, x.dtype, x.is_cuda, x.dim(), None, False, False, _grad(),
               _NO_EXTRA)
        return IMPLS[decision_name("linear", sig, backend, compiled.KEY)](  # type: ignore[no-any-return]
            x, weight, bias)
    state = _registry._state
    key = ("linear", None, x.dtype, x.is_cuda, x.dim(), None, False, False, _grad(),
           _NO_EXTRA, backend, _scope_get().cache_token, _env(OPS_KEY),
           _env(state and state.alias_keys.get("linear")))
    d = (state.decisions.get(key)
         if state is not None and (backend is None or backend.__class__ is str) else None)
    if d is None:
        d = decide("linear", key[:_SIG], backend, linear_context, (x, weight, bias))
        next(SLOW)
    next(d.counter)
    return d.call(x, weight, bias)  # type: ignore[no-any-return]


#: The families with a facade of their own; ``call`` hands their calls to it.
_FACADES: dict[str, Any] = {
    "attention": attention,
    "rotary": apply_rotary,
    "rms_norm": rms_norm,
    "linear": linear,
}


def call(family: str, *args: Any, backend: Any = None, **kwargs: Any) -> Any:
    """Call ``family`` (any loaded family, a user's own included) through its table.

    The chosen row is called as ``row(*args, **kwargs)``. Same decision cache, counters,
    ``explain`` and ``torch.compile`` behaviour as the built-in facades (a built-in
    family goes through its own facade, input checks included). The call's axes come
    from the first tensor argument (dtype, ndim, device, grad mode), or from the
    callable the table names as ``context:``, called with the same arguments.
    ``backend=`` selects a row (or an implementation object) strictly.
    """
    facade = _FACADES.get(family)
    if facade is not None:
        return facade(*args, backend=backend, **kwargs)
    state = _registry._state or current()
    table = state.family(family)  # UnknownFamilyError names the known families
    build = (family, table.context, tuple(table.axes), args, kwargs)
    if _compiling():
        sig = generic_context(*build).signature()
        return IMPLS[decision_name(family, sig, backend, compiled.KEY)](*args, **kwargs)
    ctx = generic_context(*build)
    key = (*ctx.signature(), backend, _scope_get().cache_token, _env(OPS_KEY),
           _env(state.alias_keys.get(family)))
    d = (state.decisions.get(key)
         if backend is None or backend.__class__ is str else None)
    if d is None:
        d = decide(family, key[:_SIG], backend, _same, (ctx,))
        next(SLOW)
    next(d.counter)
    return d.call(*args, **kwargs)


def _same(ctx: Any) -> Any:
    return ctx
