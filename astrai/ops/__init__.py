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
           "compiled_path", "context", "linear", "rms_norm", "rms_norm_form"]

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
from astrai.dispatch.reading import Layout, unreadable
from astrai.dispatch.registry import current
from astrai.dispatch.resolution import decide, same_context
from astrai.dispatch.torch_compile import compiling, decision_name, representatives
from astrai.dispatch.world import in_force, world_now
from astrai.ops._contexts import generic_context
from astrai.ops._facade import (
    NO_WORLD,
    FamilyCall,
    LastWorld,
    Route,
    hot_plan,
    keep,
    recording,
    route,
)
from astrai.ops._families import (
    ATTENTION_ASKS,
    ATTENTION_FEATURES,
    ATTENTION_READING,
    ATTENTION_READS,
    ATTENTION_SHAPE,
    FIRST_TENSOR_READING,
    LINEAR_READING,
    LINEAR_READS,
    LINEAR_SHAPE,
    RMS_NORM_ASKS,
    RMS_NORM_FEATURES,
    RMS_NORM_READING,
    RMS_NORM_READS,
    RMS_NORM_SHAPE,
    ROTARY_HALF_READING,
    ROTARY_HALF_READS,
    ROTARY_HALF_SHAPE,
    ROTARY_READING,
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
        if backend is None and _lookup is not None and not compiling():
            d = _lookup(_LAST["attention"], q, k, v, kv_cache, attn_mask, fwd)
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
    if backend is None and _lookup is not None and not compiling():
        d = _lookup(_LAST["rotary"], x, freqs_cis)
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
    if backend is None and _lookup is not None and not compiling():
        d = _lookup(_LAST["rotary_half"], q, k, cos, sin, unsqueeze_dim)
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
        if backend is None and _lookup is not None and not compiling():
            d = _lookup(_LAST["rms_norm"], x, weight, eps, False, False)
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
            if _lookup is not None and not compiling():
                d = _lookup(_LAST["rms_norm"], x, weight, eps, False, False)
                if d is not None:
                    next(d.counter)
                    return d.call(x, weight, eps)  # type: ignore[no-any-return]
            return _rms_norm(None, (x, weight, eps, _NO_FEATURES))(x, weight, eps)  # type: ignore[no-any-return]

        return plain

    offset, cast = "weight_offset" in asked, "cast_before_weight" in asked

    def form(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if _lookup is not None and not compiling():
            d = _lookup(_LAST["rms_norm"], x, weight, eps, offset, cast)
            if d is not None:
                next(d.counter)
                return d.call(x, weight, eps, **asked)  # type: ignore[no-any-return]
        return _rms_norm(None, (x, weight, eps, asked))(x, weight, eps, **asked)  # type: ignore[no-any-return]

    return form


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           backend: Any = None) -> torch.Tensor:
    """``x @ weight.T + bias`` through the ``linear`` table."""
    if backend is None and _lookup is not None and not compiling():
        d = _lookup(_LAST["linear"], x, weight, bias)
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
                      incidental=("layer_id",), reading=ATTENTION_READING),
        FamilyCall.of(apply_rotary, describe_rotary, ROTARY_READS, ROTARY_SHAPE,
                      positional=2, reading=ROTARY_READING),
        FamilyCall.of(rms_norm, describe_rms_norm, RMS_NORM_READS, RMS_NORM_SHAPE,
                      positional=3, keywords=tuple(RMS_NORM_FEATURES), asks=RMS_NORM_ASKS,
                      check=lambda full, asked: rms_norm_features(asked),
                      reading=RMS_NORM_READING),
        FamilyCall.of(linear, describe_linear, LINEAR_READS, LINEAR_SHAPE, positional=3,
                      reading=LINEAR_READING),
    )
}
#: The rotary family's second call: the half layout (``apply_rotary_half``).
ROTARY_HALF_CALL = FamilyCall.of(apply_rotary_half, describe_rotary_half, ROTARY_HALF_READS,
                                 ROTARY_HALF_SHAPE, positional=5,
                                 reading=ROTARY_HALF_READING, family="rotary")
#: Every facade call, by facade name.
_CALLS: dict[str, FamilyCall] = {**{fc.family: fc for fc in FAMILY_CALLS.values()},
                                 "rotary_half": ROTARY_HALF_CALL}
_FACADES: dict[str, Any] = {"attention": attention, "rotary": apply_rotary,
                            "rotary_half": apply_rotary_half, "rms_norm": rms_norm,
                            "linear": linear}
#: Each facade's route: ``route`` itself, or while a recording is in force (and only
#: then, so that nothing else costs anything) the same route feeding the recordings.
#: Each facade's last world (``route``), shared with the compiled hot path.
_LAST: dict[str, list[LastWorld]] = {name: [] for name in _CALLS}
_PLAIN: dict[str, Route] = {name: route(fc, _LAST[name], name) for name, fc in _CALLS.items()}


def _lookup_first(last: list[LastWorld], *args: Any) -> Any:
    """The compiled hot path while ``ASTR_NATIVE=on`` and nothing is built: importing
    never compiles, so the first call through any facade (or ``ops.call``) makes the
    process's decision (building the extension) and adopts what it gave; this call then
    takes its route (its world has no plan yet)."""
    _adopt(native.load())
    return None


def _python_call_hot(last: list[LastWorld], t: Any) -> Any:
    """``ops.call``'s hot path in Python: the decision kept for a call's first tensor in
    the family's last world, if that world is in force (the compiled path does the
    same from ``FIRST_TENSOR_READING``)."""
    world, decisions = last[0][0], last[0][1]
    if world is None or not in_force(world) or not isinstance(t, torch.Tensor):
        return None
    return decisions.get((t.dtype, t.is_cuda, t.dim(), torch.is_grad_enabled()))


#: The compiled hot path's ``lookup`` when the extension is in use, else ``None`` (every
#: facade call then takes its route); ``_lookup`` is it, or ``None`` while a recording
#: is in force. ``ops.call``'s hot path is the same, or ``_python_call_hot``.
_NATIVE: Any = None
_LOOKUP: Any = None
_CALL_HOT: Any = _python_call_hot
_lookup: Any = None
_call_hot: Any = _python_call_hot


def _adopt(module: Any) -> None:
    """Take ``module`` (the loaded extension, or ``None``) as the hot path from now on
    (a recording in force keeps its facades off it until it ends)."""
    global _NATIVE, _LOOKUP, _CALL_HOT, _lookup, _call_hot
    _NATIVE = module
    _LOOKUP = None if module is None else module.lookup
    _CALL_HOT = _python_call_hot if module is None else module.lookup
    process.hot_planner = None if module is None else module.plan
    if not process.recordings:
        _lookup, _call_hot = _LOOKUP, _CALL_HOT
    _CALL_PLAN.clear()


#: ``ops.call``'s plan for first-tensor calls, made once per planner: ``[(planner, plan)]``.
_CALL_PLAN: list[tuple[Any, Any]] = []


if native.pending():
    _LOOKUP = _CALL_HOT = _lookup = _call_hot = _lookup_first
else:
    _adopt(native.load())
_RECORDING: dict[str, Route] = {}
_attention, _rotary, _rotary_half, _rms_norm, _linear = (
    _PLAIN["attention"], _PLAIN["rotary"], _PLAIN["rotary_half"], _PLAIN["rms_norm"],
    _PLAIN["linear"])


def compiled_path(state: Any = None) -> dict[str, str | None]:
    """Per facade: ``None`` where the compiled hot path reads its common calls on
    ``state`` (the snapshot in force by default), else why it does not."""
    state = state or process.snapshot or current()
    out: dict[str, str | None] = {}
    for name, fc in _CALLS.items():
        if _LOOKUP is _lookup_first:
            why: str | None = ("astrai's native extension is not built yet "
                               "(ASTR_NATIVE=on builds it at the first facade call)")
        elif _LOOKUP is None:
            why = f"astrai's native extension is not in use ({native.status().reason})"
        elif process.recordings:
            why = "a recording is in force (it takes every call through its route)"
        elif fc.reading is None:
            why = "the family declares no reading of its calls"
        else:
            why = unreadable(fc.reading, key_plan(state, fc.family).layout(fc.reads, fc.lazy))
        out[name] = why
    return out


def _hot_notes(family: str, state: Any) -> list[str]:
    """``explain``'s notes on the compiled hot path for ``family``: only where it is in
    use and reads none of a facade's calls."""
    if _LOOKUP is None or _LOOKUP is _lookup_first:
        return []
    return [f"the compiled hot path reads no {name} call here: {why}"
            for name, why in compiled_path(state).items()
            if why is not None and _CALLS[name].family == family]


process.hot_notes = _hot_notes


def _switch_routes(recording_now: bool) -> None:
    """Point the facades at their recording routes (``True``) or plain ones."""
    global _attention, _rotary, _rotary_half, _rms_norm, _linear, _lookup, _call_hot
    _lookup = None if recording_now else _LOOKUP
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
#: alone (no ``context:`` builder, no lazy axis compared), a facade's ``LastWorld``, for
#: the same hot path.
_CALL_LAST: dict[str, list[LastWorld]] = {}


def _keep_call(family: str, state: Any, now: Any, ctx: CallContext, d: Any) -> None:
    """Keep ``d``, decided for a first-tensor call of ``family`` in world ``now``, for
    the next calls in that world (not when the family's specs read a lazy axis: its key
    is then more than the tensor's base axes)."""
    if family in now.scope.uncacheable or key_plan(state, family).compared:
        return
    last = _CALL_LAST.setdefault(family, [NO_WORLD])
    keep(last, now, (ctx.dtype, ctx.device_cuda, ctx.ndim, ctx.grad_enabled), d, None,
         _call_plan())


def _call_plan() -> Any:
    """The compiled path's plan for ``ops.call``'s first-tensor calls (``None`` when the
    extension is not in use)."""
    planner = process.hot_planner
    if not _CALL_PLAN or _CALL_PLAN[0][0] is not planner:
        _CALL_PLAN[:] = [(planner, hot_plan("call", FIRST_TENSOR_READING, Layout()))]
    return _CALL_PLAN[0][1]

