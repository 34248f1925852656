"""The op facades: every call is described, resolved against its table, counted and run.

Each facade is its family's signature and call line; everything between - input
validation, the decision (baked in at trace time under ``torch.compile``, else
cached), the usage count - is the one hot path ``astrai.ops._facade.route`` builds.
Where the compiled hot path is loaded (``astrai.native``), a facade first asks it,
inline (a function call more would cost what it saves), for the decision its route
already took for the call in the world in force; on ``None`` the route serves the call.
``backend=`` is the explicit selection of contract §3 (a row name or an implementation
object): strict, it raises rather than fall back.
"""

from __future__ import annotations

__all__ = ["AttentionFeatures", "apply_rotary", "apply_rotary_half", "attention", "call",
           "context", "linear", "rms_norm", "rms_norm_form"]

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, TypedDict, overload

import torch

if TYPE_CHECKING:
    from typing_extensions import Unpack

from astrai import native
from astrai.dispatch import state as process
from astrai.dispatch.axes import CallContext
from astrai.dispatch.env import RECORD_ENV
from astrai.dispatch.keying import key_plan, signature_key
from astrai.dispatch.registry import current
from astrai.dispatch.resolution import decide, same_context
from astrai.dispatch.torch_compile import compiling, decision_name, representatives
from astrai.dispatch.world import in_force, world_now
from astrai.ops._contexts import generic_context
from astrai.ops._facade import FamilyCall, Route, keep, recording, route
from astrai.ops._families import (
    ATTENTION_ASKS,
    ATTENTION_FEATURES,
    ATTENTION_READS,
    ATTENTION_SHAPE,
    LINEAR_READS,
    LINEAR_SHAPE,
    RMS_NORM_ASKS,
    RMS_NORM_FEATURES,
    RMS_NORM_READS,
    RMS_NORM_SHAPE,
    ROTARY_HALF_READS,
    ROTARY_HALF_SHAPE,
    ROTARY_READS,
    ROTARY_SHAPE,
    attention_features,
    describe_attention,
    describe_linear,
    describe_rms_norm,
    describe_rotary,
    describe_rotary_half,
    rms_norm_features,
)


class AttentionFeatures(TypedDict, total=False):
    """What an attention call may ask for beyond plain softmax attention (each is a
    feature axis: only rows that declare it serve a call asking for it)."""

    scale: float | None  # softmax scale; None or head_dim ** -0.5 is the default
    softcap: float | None  # logits become softcap * tanh(logits / softcap); None/0: off
    dropout_p: float  # dropout on the probabilities; 0: off
    window: int | None  # each query sees its last `window` keys (itself included)
    sinks: torch.Tensor | None  # [heads]: a sink logit per head joins each softmax


@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Any = ...,
              layer_id: int = ..., attn_mask: torch.Tensor | None = ..., is_causal: bool = ...,
              fwd: str | None = ..., backend: Any = ..., *, return_weights: Literal[False] = ...,
              **features: Unpack[AttentionFeatures]) -> torch.Tensor: ...
@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Any = ...,
              layer_id: int = ..., attn_mask: torch.Tensor | None = ..., is_causal: bool = ...,
              fwd: str | None = ..., backend: Any = ..., *, return_weights: Literal[True],
              **features: Unpack[AttentionFeatures]) -> tuple[torch.Tensor, torch.Tensor]: ...
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
    *,
    return_weights: bool = False,
    **features: Unpack[AttentionFeatures],
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention through the ``attention`` table.

    Dense ``[batch, seq, heads, head_dim]`` (training / no cache), or packed
    ``[tokens, heads, head_dim]`` with a paged ``kv_cache`` for ``fwd="prefill"`` /
    ``"decode"``. K/V may have fewer heads (GQA). Returns ``[..., heads*head_dim]``;
    with ``return_weights=True``, ``(output, weights [batch, heads, q_len, k_len])``.
    The features (``scale``, ``softcap``, ``dropout_p``, ``window``, ``sinks``,
    ``return_weights``) a call asks for are served only by rows that declare them.
    """
    if not (features or return_weights):  # the common call: no feature keywords to pass
        if backend is None and _hot is not None and not compiling():
            d = _hot.attention(_LAST["attention"], q, k, v, kv_cache, attn_mask, fwd)
            if d is not None:
                next(d.counter)
                return d.call(q, k, v, kv_cache=kv_cache, layer_id=layer_id,  # type: ignore[no-any-return]
                              attn_mask=attn_mask, is_causal=is_causal, fwd=fwd)
        return _attention(backend, (q, k, v, kv_cache, layer_id, attn_mask, is_causal, fwd,  # type: ignore[no-any-return]
                                    _NO_FEATURES))(
            q, k, v, kv_cache=kv_cache, layer_id=layer_id, attn_mask=attn_mask,
            is_causal=is_causal, fwd=fwd)
    given: dict[str, Any] = {**features, "return_weights": return_weights}
    asked = attention_features(q, is_causal, kv_cache, given)
    return _attention(backend, (q, k, v, kv_cache, layer_id, attn_mask, is_causal, fwd, asked))(  # type: ignore[no-any-return]
        q, k, v, kv_cache=kv_cache, layer_id=layer_id, attn_mask=attn_mask,
        is_causal=is_causal, fwd=fwd, **asked)


_NO_FEATURES: dict[str, Any] = {}


def apply_rotary(x: torch.Tensor, freqs_cis: torch.Tensor, backend: Any = None) -> torch.Tensor:
    """Rotate adjacent pairs ``(2i, 2i+1)`` of ``x`` by ``freqs_cis`` (cos, sin) per pair."""
    if backend is None and _hot is not None and not compiling():
        d = _hot.rotary(_LAST["rotary"], x, freqs_cis)
        if d is not None:
            next(d.counter)
            return d.call(x, freqs_cis)  # type: ignore[no-any-return]
    return _rotary(backend, (x, freqs_cis))(x, freqs_cis)  # type: ignore[no-any-return]


def apply_rotary_half(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      unsqueeze_dim: int = 1,
                      backend: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb`` through the ``rotary`` table (``layout ==
    half``): q and k ``[batch, heads, seq, head_dim]`` (heads at ``unsqueeze_dim``),
    ``cos``/``sin`` ``[batch or 1, seq, head_dim]``; element ``i`` turns with
    ``i + head_dim/2``. Returns ``(q_out, k_out)``, computed as
    ``x * cos + rotate_half(x) * sin``. Only rows declaring the ``layout`` feature serve it."""
    if backend is None and _hot is not None and not compiling():
        d = _hot.rotary_half(_LAST["rotary_half"], q, k, cos, sin, unsqueeze_dim)
        if d is not None:
            next(d.counter)
            return d.call(q, k, cos, sin, unsqueeze_dim)  # type: ignore[no-any-return]
    return _rotary_half(backend, (q, k, cos, sin, unsqueeze_dim))(  # type: ignore[no-any-return]
        q, k, cos, sin, unsqueeze_dim)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
             backend: Any = None, *, weight_offset: float = 0.0,
             cast_before_weight: bool = False) -> torch.Tensor:
    """RMS normalisation over the last dimension, scaled by ``weight``.

    The forms models define are features, served only by rows that declare them:
    ``weight_offset=1.0`` applies the weight as ``1 + weight`` (Gemma);
    ``cast_before_weight=True`` normalises in float32, casts back to ``x``'s dtype and
    then multiplies by the weight, the output taking the dtype of ``weight * x``
    (``LlamaRMSNorm``).
    """
    if not (weight_offset or cast_before_weight):  # the common call: no feature keywords
        if backend is None and _hot is not None and not compiling():
            d = _hot.rms_norm(_LAST["rms_norm"], x, weight, eps)
            if d is not None:
                next(d.counter)
                return d.call(x, weight, eps)  # type: ignore[no-any-return]
        return _rms_norm(backend, (x, weight, eps, _NO_FEATURES))(x, weight, eps)  # type: ignore[no-any-return]
    asked = rms_norm_features({"weight_offset": weight_offset,
                               "cast_before_weight": cast_before_weight})
    return _rms_norm(backend, (x, weight, eps, asked))(x, weight, eps, **asked)  # type: ignore[no-any-return]


def rms_norm_form(*, weight_offset: float = 0.0, cast_before_weight: bool = False
                  ) -> Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]:
    """``rms_norm(x, weight, eps)`` with the form's features fixed and checked once: the
    call a model's norm module makes on every forward, without building and checking
    its keywords each time (``dispatch_model`` serves each norm module with one)."""
    asked = rms_norm_features({"weight_offset": weight_offset,
                               "cast_before_weight": cast_before_weight})
    if not asked:
        def plain(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
            if _hot is not None and not compiling():
                d = _hot.rms_norm(_LAST["rms_norm"], x, weight, eps)
                if d is not None:
                    next(d.counter)
                    return d.call(x, weight, eps)  # type: ignore[no-any-return]
            return _rms_norm(None, (x, weight, eps, _NO_FEATURES))(x, weight, eps)  # type: ignore[no-any-return]

        return plain

    offset, cast = "weight_offset" in asked, "cast_before_weight" in asked

    def form(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if _hot is not None and not compiling():
            d = _hot.rms_norm(_LAST["rms_norm"], x, weight, eps, offset, cast)
            if d is not None:
                next(d.counter)
                return d.call(x, weight, eps, **asked)  # type: ignore[no-any-return]
        return _rms_norm(None, (x, weight, eps, asked))(x, weight, eps, **asked)  # type: ignore[no-any-return]

    return form


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           backend: Any = None) -> torch.Tensor:
    """``x @ weight.T + bias`` through the ``linear`` table."""
    if backend is None and _hot is not None and not compiling():
        d = _hot.linear(_LAST["linear"], x, weight, bias)
        if d is not None:
            next(d.counter)
            return d.call(x, weight, bias)  # type: ignore[no-any-return]
    return _linear(backend, (x, weight, bias))(x, weight, bias)  # type: ignore[no-any-return]


#: The built-in families: how each facade's calls are validated and described.
FAMILY_CALLS: dict[str, FamilyCall] = {
    fc.family: fc for fc in (
        FamilyCall.of(attention, describe_attention, ATTENTION_READS, ATTENTION_SHAPE,
                      positional=3, keywords=tuple(ATTENTION_FEATURES),
                      asks=ATTENTION_ASKS,
                      check=lambda full, asked: attention_features(full[0], full[6], full[3],
                                                                   asked),
                      incidental=("layer_id",),
                      hot=("batch", "q_len", "kv_len", "heads", "kv_heads")),
        FamilyCall.of(apply_rotary, describe_rotary, ROTARY_READS, ROTARY_SHAPE,
                      positional=2, hot=("tokens", "heads")),
        FamilyCall.of(rms_norm, describe_rms_norm, RMS_NORM_READS, RMS_NORM_SHAPE,
                      positional=3, keywords=tuple(RMS_NORM_FEATURES), asks=RMS_NORM_ASKS,
                      check=lambda full, asked: rms_norm_features(asked), hot=("tokens",)),
        FamilyCall.of(linear, describe_linear, LINEAR_READS, LINEAR_SHAPE, positional=3,
                      hot=("tokens", "in_features", "out_features")),
    )
}
#: The rotary family's second call: the half layout (``apply_rotary_half``).
ROTARY_HALF_CALL = FamilyCall.of(apply_rotary_half, describe_rotary_half, ROTARY_HALF_READS,
                                 ROTARY_HALF_SHAPE, positional=5, hot=("tokens", "heads"),
                                 family="rotary")
#: Every facade call, by facade name.
_CALLS: dict[str, FamilyCall] = {**{fc.family: fc for fc in FAMILY_CALLS.values()},
                                 "rotary_half": ROTARY_HALF_CALL}
_FACADES: dict[str, Any] = {"attention": attention, "rotary": apply_rotary,
                            "rotary_half": apply_rotary_half, "rms_norm": rms_norm,
                            "linear": linear}
#: Each facade's route: ``route`` itself, or while a recording is in force (and only
#: then, so that nothing else costs anything) the same route feeding the recordings.
#: Each facade's last world (``route``), shared with the compiled hot path.
_LAST: dict[str, list[tuple[Any, ...]]] = {name: [] for name in _CALLS}
_PLAIN: dict[str, Route] = {name: route(fc, _LAST[name]) for name, fc in _CALLS.items()}


class _BuildOnFirstCall:
    """The hot path while ``ASTR_NATIVE=on`` and nothing is built: importing never
    compiles, so the first call through any facade makes the process's decision
    (building the extension), adopts what it gave, and is then answered by it."""

    def __getattr__(self, name: str) -> Any:
        _adopt(native.load())
        return getattr(_NATIVE, name) if _NATIVE is not None else _declined


def _declined(*args: Any) -> None:
    """A hot function that answers nothing: the call takes its route."""
    return None


#: The compiled hot path (``astrai.native``) when it is loaded and no recording is in
#: force, else ``None``: every call then takes its route.
_NATIVE: Any = _BuildOnFirstCall() if native.pending() else native.load()
_hot: Any = _NATIVE


def _python_call_hot(last: list[tuple[Any, ...]], t: Any) -> Any:
    """``ops.call``'s hot path in Python: the decision kept for a call's first tensor in
    the family's last world, if that world is in force (the compiled ``call`` does the
    same)."""
    world, decisions = last[0][0], last[0][1]
    if world is None or not in_force(world) or not isinstance(t, torch.Tensor):
        return None
    return decisions.get((t.dtype, t.is_cuda, t.dim(), torch.is_grad_enabled()))


#: ``ops.call``'s hot path: the compiled one or ``_python_call_hot``; ``_call_hot`` is it,
#: or ``None`` while a recording is in force (every call then takes the full path, and
#: is noted).
def _call_first(last: list[tuple[Any, ...]], t: Any) -> Any:
    """``ops.call``'s hot path until the process's native decision is made (see
    ``_BuildOnFirstCall``)."""
    _adopt(native.load())
    return _call_hot(last, t) if _call_hot is not None else None


_CALL_HOT: Any = (_python_call_hot if _NATIVE is None else
                  _call_first if isinstance(_NATIVE, _BuildOnFirstCall) else _NATIVE.call)
_call_hot: Any = _CALL_HOT


def _adopt(module: Any) -> None:
    """Take ``module`` (the loaded extension, or ``None``) as the hot path from now on;
    called outside recordings only (a recording's facades take no hot path)."""
    global _NATIVE, _hot, _CALL_HOT, _call_hot
    _NATIVE = _hot = module
    _CALL_HOT = _call_hot = _python_call_hot if module is None else module.call
_RECORDING: dict[str, Route] = {}
_attention, _rotary, _rotary_half, _rms_norm, _linear = (
    _PLAIN["attention"], _PLAIN["rotary"], _PLAIN["rotary_half"], _PLAIN["rms_norm"],
    _PLAIN["linear"])


def _switch_routes(recording_now: bool) -> None:
    """Point the facades at their recording routes (``True``) or plain ones."""
    global _attention, _rotary, _rotary_half, _rms_norm, _linear, _hot, _call_hot
    _hot = None if recording_now else _NATIVE
    _call_hot = None if recording_now else _CALL_HOT
    if recording_now and not _RECORDING:
        from astrai.record.recording import note_call  # loaded by whoever started recording

        _RECORDING.update({name: recording(fc, _PLAIN[name], note_call)
                           for name, fc in _CALLS.items()})
    routes = _RECORDING if recording_now else _PLAIN
    _attention, _rotary, _rotary_half, _rms_norm, _linear = (
        routes["attention"], routes["rotary"], routes["rotary_half"], routes["rms_norm"],
        routes["linear"])


def _facade_name(family: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The facade a call of ``family`` goes to (``None`` for a family without one): a
    rotary call of four or more arguments (q, k, cos, sin) is a half-layout call."""
    if family not in FAMILY_CALLS:
        return None
    if family == "rotary" and len(args) + len(kwargs) >= 4:
        return "rotary_half"
    return family


process.record_switches.append(_switch_routes)
if os.environ.get(RECORD_ENV, "").strip():  # record this whole process, written at exit
    from astrai.record.recording import record_process

    record_process(os.environ[RECORD_ENV])
elif process.recordings:
    _switch_routes(True)


def context(family: str, *args: Any, **kwargs: Any) -> CallContext:
    """The ``CallContext`` a call of ``family`` with these arguments is resolved with
    (validated as the facade validates it): what ``explain`` and ``resolve`` need to
    reason about a real call."""
    name = _facade_name(family, args, kwargs)
    if name is not None:
        fc = _CALLS[name]
        return fc.context(*fc.bind(args, dict(kwargs)))
    table = (process.snapshot or current()).family(family)
    return generic_context(family, table.context, tuple(table.axes), args, kwargs)


def call(family: str, *args: Any, backend: Any = None, **kwargs: Any) -> Any:
    """Call ``family`` (any loaded family, a user's own included) through its table.

    The chosen row is called as ``row(*args, **kwargs)``. Same decision cache, counters,
    ``explain`` and ``torch.compile`` behaviour as the built-in facades (a built-in
    family goes through its own facade, input checks included). The call's axes come
    from the first tensor argument (dtype, ndim, device, grad mode), or from the
    callable the table names as ``context:``, called with the same arguments.
    ``backend=`` selects a row (or an implementation object) strictly.
    """
    if backend is None and args and not compiling():
        last = _CALL_LAST.get(family)
        if last is not None and _call_hot is not None:
            d = _call_hot(last, args[0])
            if d is not None:
                next(d.counter)
                return d.call(*args, **kwargs)
    name = _facade_name(family, args, kwargs)
    if name is not None:
        return _FACADES[name](*args, backend=backend, **kwargs)
    table = (process.snapshot or current()).family(family)  # names the known families
    ctx = generic_context(family, table.context, tuple(table.axes), args, kwargs)
    if compiling():
        names, values = ctx.named_values()
        values = representatives(family, names, values)
        return process.impls[decision_name(family, names, values, backend,
                                           process.compile_key)](*args, **kwargs)
    state = process.snapshot or current()
    now = world_now(state, family)
    d = decide(family, signature_key(state, ctx), backend, same_context, (ctx,), now)
    if backend is None and table.context is None and args and isinstance(args[0], torch.Tensor):
        _keep_call(family, state, now, ctx, d)
    next(d.counter)
    if process.recordings:
        from astrai.record.recording import note_call  # loaded by whoever started recording

        note_call(ctx, backend)
    return d.call(*args, **kwargs)


#: ``ops.call``'s last world per family whose calls are keyed by their first tensor
#: alone (no ``context:`` builder, no lazy axis compared): ``(world, {key: Decision},
#: None, None)``, the shape of a facade's (``route``), for the same hot path.
_CALL_LAST: dict[str, list[tuple[Any, ...]]] = {}


def _keep_call(family: str, state: Any, now: Any, ctx: CallContext, d: Any) -> None:
    """Keep ``d``, decided for a first-tensor call of ``family`` in world ``now``, for
    the next calls in that world (not when the family's specs read a lazy axis: its key
    is then more than the tensor's base axes)."""
    if family in now.scope.uncacheable or key_plan(state, family).compared:
        return
    last = _CALL_LAST.setdefault(family, [(None, {}, None, None)])
    keep(last, now, (ctx.dtype, ctx.device_cuda, ctx.ndim, ctx.grad_enabled), d, None, None)

