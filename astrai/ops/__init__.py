"""The op facades: every call is described, resolved against its table, counted and run.

Each facade is its family's signature and call line; everything between - input
validation, the decision (baked in at trace time under ``torch.compile``, else
cached), the usage count - is the one hot path ``astrai.ops._facade.route`` builds.
``backend=`` is the explicit selection of SPEC §3 (a row name or an implementation
object): strict, it raises rather than fall back.
"""

from __future__ import annotations

__all__ = ["AttentionFeatures", "apply_rotary", "attention", "call", "context", "linear",
           "rms_norm"]

import os
from typing import TYPE_CHECKING, Any, Literal, TypedDict, overload

import torch

if TYPE_CHECKING:
    from typing_extensions import Unpack

from astrai.dispatch import state as process
from astrai.dispatch.axes import CallContext
from astrai.dispatch.keying import signature_key
from astrai.dispatch.registry import current
from astrai.dispatch.resolution import decide, same_context
from astrai.dispatch.torch_compile import compiling, decision_name, representatives
from astrai.ops._contexts import generic_context
from astrai.ops._facade import FamilyCall, Route, recording, route
from astrai.ops._families import (
    ATTENTION_ASKS,
    ATTENTION_FEATURES,
    ATTENTION_READS,
    ATTENTION_SHAPE,
    LINEAR_READS,
    LINEAR_SHAPE,
    RMS_NORM_READS,
    RMS_NORM_SHAPE,
    ROTARY_READS,
    ROTARY_SHAPE,
    attention_features,
    describe_attention,
    describe_linear,
    describe_rms_norm,
    describe_rotary,
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
    return _rotary(backend, (x, freqs_cis))(x, freqs_cis)  # type: ignore[no-any-return]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
             backend: Any = None) -> torch.Tensor:
    """RMS normalisation over the last dimension, scaled by ``weight``."""
    return _rms_norm(backend, (x, weight, eps))(x, weight, eps)  # type: ignore[no-any-return]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           backend: Any = None) -> torch.Tensor:
    """``x @ weight.T + bias`` through the ``linear`` table."""
    return _linear(backend, (x, weight, bias))(x, weight, bias)  # type: ignore[no-any-return]


#: The built-in families: how each facade's calls are validated and described.
FAMILY_CALLS: dict[str, FamilyCall] = {
    fc.family: fc for fc in (
        FamilyCall.of(attention, describe_attention, ATTENTION_READS, ATTENTION_SHAPE,
                      positional=3, keywords=tuple(ATTENTION_FEATURES),
                      asks=ATTENTION_ASKS,
                      check=lambda full, asked: attention_features(full[0], full[6], full[3],
                                                                   asked),
                      incidental=("layer_id",)),
        FamilyCall.of(apply_rotary, describe_rotary, ROTARY_READS, ROTARY_SHAPE,
                      positional=2),
        FamilyCall.of(rms_norm, describe_rms_norm, RMS_NORM_READS, RMS_NORM_SHAPE,
                      positional=3),
        FamilyCall.of(linear, describe_linear, LINEAR_READS, LINEAR_SHAPE, positional=3),
    )
}
_FACADES: dict[str, Any] = {"attention": attention, "rotary": apply_rotary,
                            "rms_norm": rms_norm, "linear": linear}
#: Each facade's route: ``route`` itself, or while a recording is in force (and only
#: then, so that nothing else costs anything) the same route feeding the recordings.
_PLAIN: dict[str, Route] = {family: route(fc) for family, fc in FAMILY_CALLS.items()}
_RECORDING: dict[str, Route] = {}
_attention, _rotary, _rms_norm, _linear = (
    _PLAIN["attention"], _PLAIN["rotary"], _PLAIN["rms_norm"], _PLAIN["linear"])


def _switch_routes(recording_now: bool) -> None:
    """Point the facades at their recording routes (``True``) or plain ones."""
    global _attention, _rotary, _rms_norm, _linear
    if recording_now and not _RECORDING:
        from astrai.dispatch.recording import note_call  # loaded by whoever started recording

        _RECORDING.update({family: recording(fc, _PLAIN[family], note_call)
                           for family, fc in FAMILY_CALLS.items()})
    routes = _RECORDING if recording_now else _PLAIN
    _attention, _rotary, _rms_norm, _linear = (
        routes["attention"], routes["rotary"], routes["rms_norm"], routes["linear"])


process.record_switches.append(_switch_routes)
if os.environ.get("ASTR_RECORD", "").strip():  # record this whole process, written at exit
    from astrai.dispatch.recording import record_process

    record_process(os.environ["ASTR_RECORD"])
elif process.recordings:
    _switch_routes(True)


def context(family: str, *args: Any, **kwargs: Any) -> CallContext:
    """The ``CallContext`` a call of ``family`` with these arguments is resolved with
    (validated as the facade validates it): what ``explain`` and ``resolve`` need to
    reason about a real call."""
    fc = FAMILY_CALLS.get(family)
    if fc is not None:
        return fc.context(*fc.bind(args, kwargs))
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
    facade = _FACADES.get(family)
    if facade is not None:
        return facade(*args, backend=backend, **kwargs)
    table = (process.snapshot or current()).family(family)  # names the known families
    ctx = generic_context(family, table.context, tuple(table.axes), args, kwargs)
    if compiling():
        names, values = ctx.named_values()
        values = representatives(family, names, values)
        return process.impls[decision_name(family, names, values, backend,
                                           process.compile_key)](*args, **kwargs)
    state = process.snapshot or current()
    d = decide(family, signature_key(state, ctx), backend, same_context, (ctx,), state)
    next(d.counter)
    if process.recordings:
        from astrai.dispatch.recording import note_call  # loaded by whoever started recording

        note_call(ctx, backend)
    return d.call(*args, **kwargs)
