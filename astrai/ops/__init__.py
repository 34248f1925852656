"""The op facades: every call is described, resolved against its table, counted and run.

Each family's facade is declared with its family (``astrai.families``): its signature
and call line; everything between - input validation, the decision (baked in at trace
time under ``torch.compile``, else cached), the usage count - is the one hot path
``astrai.dispatch.facade.route`` builds. Where the compiled hot path is loaded
(``astrai.native``), a facade first asks it, inline, for the decision its route already
took for the call in the world in force; on ``None`` the route serves the call.
``backend=`` is the explicit selection of contract §3 (a row name or an implementation
object): strict, it raises rather than fall back. ``call`` reaches any family - a
declared one through its facade, any other through its table alone. A built-in family
declared by its package alone is reached as ``ops.<its facade>`` all the same.
"""

from __future__ import annotations

__all__ = ["AttentionFeatures", "activation", "apply_rotary", "apply_rotary_half", "attention",
           "attention_heads_first", "call", "compiled_path", "context", "cross_entropy",
           "gated_activation", "layer_norm", "linear", "linear_cross_entropy", "moe_experts",
           "moe_router", "rms_norm", "rms_norm_form"]

import os
from typing import Any

import torch

from astrai.dispatch import state as process
from astrai.dispatch.axes import CallContext
from astrai.dispatch.facade import (
    FIRST_TENSOR_READING,
    HOT,
    NO_WORLD,
    LastWorld,
    call_lookup_python,
    compiled_path,
    hot_plan,
    keep,
)
from astrai.dispatch.keying import key_plan, signature_key
from astrai.dispatch.reading import Layout
from astrai.dispatch.registry import current
from astrai.dispatch.resolution import decide, same_context
from astrai.dispatch.torch_compile import compiling, decision_name, representatives
from astrai.dispatch.world import in_force, world_now
from astrai.env import RECORD_ENV
from astrai.families import every_family, facade_for

# The public facades of the built-in families (each declared in its own package).
from astrai.families.activation import activation
from astrai.families.attention import AttentionFeatures, attention, attention_heads_first
from astrai.families.cross_entropy import cross_entropy
from astrai.families.gated_activation import gated_activation
from astrai.families.layer_norm import layer_norm
from astrai.families.linear import linear
from astrai.families.linear_cross_entropy import linear_cross_entropy
from astrai.families.moe_experts import moe_experts
from astrai.families.moe_router import moe_router
from astrai.families.rms_norm import rms_norm, rms_norm_form
from astrai.families.rotary import apply_rotary, apply_rotary_half
from astrai.ops._contexts import generic_context


def _python_call_hot(last: list[LastWorld], t: Any) -> Any:
    """``ops.call``'s hot path in Python: the decision kept for a call's first tensor in
    the family's last world, if that world is in force (the compiled path does the
    same from ``FIRST_TENSOR_READING``)."""
    world, decisions = last[0][0], last[0][1]
    if world is None or not in_force(world) or not isinstance(t, torch.Tensor):
        return None
    return decisions.get((t.dtype, t.is_cuda, t.dim(), torch.is_grad_enabled()))


def __getattr__(name: str) -> Any:
    """A built-in family's facade that no line above imports (a family declared by its
    package alone: ``ops.depthwise_conv1d``)."""
    from astrai.dispatch.facade import FACADES
    found = FACADES.get(name)
    if found is not None and getattr(found.function, "__module__", "").startswith(
            "astrai.families."):
        return found.function
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


call_lookup_python(_python_call_hot)
# Every built-in family declared now: a first ``ops.call`` of a user's family inside a
# traced function would otherwise list this package's files there.
every_family()

if os.environ.get(RECORD_ENV, "").strip():  # record this whole process, written at exit
    from astrai.record.recording import record_process

    record_process(os.environ[RECORD_ENV])


def context(family: str, *args: Any, **kwargs: Any) -> CallContext:
    """The ``CallContext`` a call of ``family`` with these arguments is resolved with
    (validated as the facade validates it): what ``explain`` and ``resolve`` need to
    reason about a real call."""
    f = facade_for(family, args, kwargs)
    if f is not None:
        fc = f.call
        return fc.context(*fc.bind(args, dict(kwargs)))
    table = (process.snapshot or current()).family(family)
    return generic_context(family, table.context, tuple(table.axes), args, kwargs)


def call(family: str, *args: Any, backend: Any = None, **kwargs: Any) -> Any:
    """Call ``family`` (any loaded family, a user's own included) through its table.

    The chosen row is called as ``row(*args, **kwargs)``. Same decision cache, counters,
    ``explain`` and ``torch.compile`` behaviour as the facades (a declared family goes
    through its own facade, input checks included). The call's axes come
    from the first tensor argument (dtype, ndim, device, grad mode), or from the
    callable the table names as ``context:``, called with the same arguments.
    ``backend=`` selects a row (or an implementation object) strictly.
    """
    if backend is None and args and not compiling():
        last = _CALL_LAST.get(family)
        hot = HOT.call_lookup
        if last is not None and hot is not None:
            d = hot(last, args[0])
            if d is not None:
                next(d.counter)
                return d.call(*args, **kwargs)
    f = facade_for(family, args, kwargs)
    if f is not None:
        return f.function(*args, backend=backend, **kwargs)
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


#: ``ops.call``'s plan for first-tensor calls, made once per planner: ``[(planner, plan)]``.
_CALL_PLAN: list[tuple[Any, Any]] = []


def _call_plan() -> Any:
    """The compiled path's plan for ``ops.call``'s first-tensor calls (``None`` when the
    extension is not in use)."""
    planner = process.hot_planner
    if not _CALL_PLAN or _CALL_PLAN[0][0] is not planner:
        _CALL_PLAN[:] = [(planner, hot_plan("call", FIRST_TENSOR_READING, Layout()))]
    return _CALL_PLAN[0][1]

