"""Resolution: the one evaluator, the decision cache in front of it, and ``resolve``.

``evaluate`` hands one call, in one world (``world.World``: snapshot, scope,
environment, read once), to the sources of ``precedence.PRECEDENCE``; ``decide`` is the hot path
behind every facade, ``ops.call`` and ``resolve``: it keys the snapshot's decision cache
on the call's values and the world, and evaluates on a miss. ``explain`` (module
``explain``) runs the same evaluator. The lock in force (``ASTR_LOCK``) has its say
through one narrow interface (``LockInForce``), loaded by name: the core imports no
workflow.
"""

from __future__ import annotations

__all__ = [
    "Decision",
    "Drift",
    "LockInForce",
    "NoImplementationError",
    "Resolution",
    "decide",
    "evaluate",
    "resolve",
    "resolve_plan",
    "same_context",
    "set_max_decisions",
    "settle",
]

import inspect
import itertools
from collections.abc import Callable, Mapping
from types import FunctionType, MethodType
from typing import Any, Protocol

from astrai.dispatch import state as process
from astrai.dispatch.axes import CallContext
from astrai.dispatch.environment import EnvSettings, env_for
from astrai.dispatch.keying import PLAIN, identity_or_base, signature_key
from astrai.dispatch.log import warn_once
from astrai.dispatch.precedence import answer
from astrai.dispatch.registry import Registry, current
from astrai.dispatch.scopes import (
    UNCACHEABLE,
    active_profiles,
    active_view,
    current_scope,
    handle_key,
)
from astrai.dispatch.stats import MISSES, QUIET, UNCACHED, counter
from astrai.dispatch.tables.model import ImplRecord, View
from astrai.dispatch.verdicts import Resolution, resolved, serve_problem
from astrai.dispatch.world import World, world_now
from astrai.env import LOCK_KEY, OPS_KEY, environ_get
from astrai.errors import NoImplementationError

# -- the lock's say: the one interface through which a workflow joins a decision -------


class Drift(Protocol):
    """A live decision that differs from the lock in force."""

    @property
    def fatal(self) -> bool:
        """Whether the lock's mode makes the drift an error (else a warning)."""

    def message(self) -> str:
        """The drift in words."""

    def error(self) -> Exception:
        """The error a fatal drift raises."""


class LockInForce(Protocol):
    """The lock ``ASTR_LOCK`` names, as the core asks it about one decision."""

    def judge(self, state: Registry, family: str, explicit: Any, ctx: CallContext,
              row: str, can_serve: Callable[[ImplRecord], str | None]
              ) -> tuple[ImplRecord | None, Drift | None]:
        """The row the lock pins instead of ``row`` (or ``None``), and the drift."""


#: The module that enforces ``ASTR_LOCK`` (``lock_in_force() -> LockInForce | None``): a
#: workflow above the core, loaded by name and only while a lock is in force, so the
#: core imports no workflow.
LOCK_ENFORCER = "astrai.lock.enforce"


def _lock_in_force() -> LockInForce | None:
    import importlib

    got: LockInForce | None = importlib.import_module(LOCK_ENFORCER).lock_in_force()
    return got


# -- the evaluator ---------------------------------------------------------


def evaluate(family: str, ctx: CallContext, explicit: Any = None, *,
             state: Registry | None = None, notes: list[str] | None = None,
             world: World | None = None) -> Resolution:
    """Decide which row serves ``ctx``: the sources of ``PRECEDENCE``, in order
    (``precedence.answer``). The single evaluator.

    ``world`` is the decision's world (read now, on ``state`` or the snapshot in force,
    when not given); ``notes`` (when given) collects what explain prints besides the row
    verdicts.
    """
    if world is None:
        world = world_now(state or current(), family)
    state, scope = world.snapshot, world.scope
    key = (family, *world.key)
    seen = state.worlds.get(key)
    if seen is None:
        seen = _world_view(world, family, key)
    return answer(state, seen[1], family, ctx, explicit, seen[0], scope, notes)


_MAX_WORLDS = 256


def _world_view(world: World, family: str, key: tuple[Any, ...]
                ) -> tuple[EnvSettings, View]:
    """What the environment of ``world`` asks of ``family`` and the family's view under
    the profiles in force there, remembered on the snapshot under ``key`` (bounded) for
    the next decision in the same world."""
    state, scope = world.snapshot, world.scope
    env = env_for(state, world.ops, family, world.alias)
    # (a family not loaded: UnknownFamilyError, a KeyError naming the known families)
    got = env, state.view(family, active_profiles(state, env, scope))
    worlds = state.worlds
    if len(worlds) >= _MAX_WORLDS:
        worlds.clear()
    worlds[key] = got
    return got


# -- resolve, with its decision cache -----------------------------------------


def set_max_decisions(n: int) -> None:
    """Bound the decision cache of each table snapshot to ``n`` entries (default 65 536)."""
    if n < 1:
        raise ValueError(f"the decision cache needs room for at least 1 entry, got {n}")
    process.max_decisions = n


class Decision:
    """A cached decision: the resolution, the object to call, and its usage counter.

    ``call`` is ``obj`` itself, or for an instance of a Python class its bound
    ``__call__``: calling that with keyword arguments skips the slot wrapper that
    ``obj(...)`` goes through (a few hundred ns per call).
    """

    __slots__ = ("call", "counter", "obj", "resolution")

    def __init__(self, resolution: Resolution) -> None:
        self.resolution = resolution
        self.obj = obj = resolution.record.obj
        # The function in the class, as written: a staticmethod is not bound to obj.
        method = inspect.getattr_static(type(obj), "__call__", None)
        self.call = (MethodType(method, obj) if isinstance(method, FunctionType)
                     else obj if callable(obj) else _uncallable(resolution))
        self.counter = counter(resolution.record.family, resolution.record.name,
                               resolution.origin)


def _uncallable(resolution: Resolution) -> Callable[..., Any]:
    """What a call of a selected object that cannot be called runs: a ``TypeError``
    saying so (resolving names such an object, as the seed does; serving needs a call)."""
    rec = resolution.record

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"the {rec.family} backend {type(rec.obj).__name__} {rec.obj!r} "
                        f"(selected: {resolution.origin}) cannot serve a call: it is not "
                        f"callable; a backend is a row name or a callable implementation")
    return refuse


def decide(family: str, sig: Any, explicit: Any, build: Callable[..., CallContext],
           args: tuple[Any, ...], world: World | None = None) -> Decision:
    """The decision for a call of ``family`` whose axis values are ``sig``: the one hot
    path behind every facade, ``ops.call`` and ``resolve``.

    The cache key holds everything a decision depends on besides the snapshot (which
    owns the cache): the family and ``sig``, the explicit handle, and the world's scope
    and raw ``ASTR_OPS`` and alias values. A hit is a few lookups; on a miss
    ``build(*args)`` makes the full ``CallContext`` and the evaluator runs in the same
    world the key was made from. Calls under a handle whose verdict depends on the raw
    call (an object with ``supports_call``) are never cached. A caller that does not
    then count a served call bumps ``stats.QUIET``. ``world`` is the decision's world
    (read now, on the snapshot in force, when not given).
    """
    if world is None:
        world = world_now(process.snapshot or current(), family)
    state, scope = world.snapshot, world.scope
    if explicit is None or explicit.__class__ is str:
        ekey = explicit
    else:
        ekey = handle_key(explicit)
        if ekey is UNCACHEABLE:
            return _uncached(world, family, explicit, build(*args))
    if scope.uncacheable and family in scope.uncacheable:
        return _uncached(world, family, explicit, build(*args))
    key = (family, sig, ekey, *world.key)
    got = state.decisions.get(key)
    if got is None:
        return miss(world, key, family, explicit, build(*args))
    return got  # type: ignore[no-any-return]


def _uncached(world: World, family: str, explicit: Any, ctx: CallContext) -> Decision:
    next(UNCACHED)
    return Decision(_evaluate_counted(world, family, ctx, explicit))


def _evaluate_counted(world: World, family: str, ctx: CallContext,
                      explicit: Any) -> Resolution:
    """``evaluate`` in ``world``, then the lock in force (``ASTR_LOCK``) has its say; a
    lookup that raises serves no call, so it counts as ``QUIET``."""
    try:
        res = evaluate(family, ctx, explicit, world=world)
        if environ_get(LOCK_KEY) is not None:
            res = settle(world.snapshot, family, explicit, ctx, res)[0]
        return res
    except BaseException:
        next(QUIET)
        raise


def settle(state: Registry, family: str, explicit: Any, ctx: CallContext, res: Resolution,
           *, enforce: bool = True) -> tuple[Resolution, Drift | None]:
    """``res`` as the lock in force (``ASTR_LOCK``, ``astrai.lock.enforce``) has
    it: the locked row instead (origin ``lock``) in ``pin`` mode, and the drift from the
    lock, if any. With ``enforce`` a drift warns once, or raises ``LockDriftError`` when
    the lock's mode makes it fatal."""
    if environ_get(LOCK_KEY) is None:
        return res, None
    active = _lock_in_force()
    if active is None:
        return res, None
    view = active_view(state, family)
    pinned, drift = active.judge(state, family, explicit, ctx, res.name,
                                 lambda rec: serve_problem(state, view, rec, ctx))
    if pinned is not None:
        res = resolved(state, pinned, "lock")
    if drift is not None and enforce:
        if drift.fatal:
            raise drift.error()
        warn_once(drift.message())
    return res, drift


def miss(world: World, key: tuple[Any, ...], family: str, explicit: Any,
         ctx: CallContext) -> Decision:
    """Evaluate ``ctx`` in ``world`` and remember the decision under ``key`` (bounded)."""
    next(MISSES)
    state = world.snapshot
    got = _decision(state, _evaluate_counted(world, family, ctx, explicit))
    decisions = state.decisions
    if len(decisions) >= process.max_decisions:
        _evict(decisions)
    decisions[key] = got
    return got


def _evict(decisions: dict[Any, Any]) -> None:
    """Drop the oldest eighth of a full decision cache (at least one entry). In batches:
    a dict finds its first live entry by walking past the ones deleted before it, so
    dropping one entry per miss would cost a walk over every earlier eviction."""
    try:  # another thread may be evicting too
        for key in list(itertools.islice(decisions, max(1, len(decisions) >> 3))):
            decisions.pop(key, None)
    except RuntimeError:  # pragma: no cover - the dict changed size under the iteration
        pass


def _decision(state: Registry, res: Resolution) -> Decision:
    """The ``Decision`` of a resolution: one object per (row, origin) and snapshot,
    shared by every cache entry that reaches it."""
    key = (id(res.record), res.origin)
    made = state.made
    got = made.get(key)
    if got is None or got.resolution.record is not res.record:
        if len(made) >= process.max_decisions:  # ad hoc objects make new records
            made.clear()
        got = made[key] = Decision(res)
    return got  # type: ignore[no-any-return]


def same_context(ctx: CallContext) -> CallContext:
    """The ``build`` of ``decide`` for a call whose context is already made."""
    return ctx


def resolve(family: str, ctx: CallContext, explicit: Any = None) -> Resolution:
    """Which row serves ``ctx`` and why. Cached per call signature; the same ``ctx``
    object asked about again (a third time) while nothing changed is answered from what
    the second answer left on it, by identity checks alone (in C++ where the compiled hot
    path is in use)."""
    memo = ctx._resolved
    if memo is not None:
        hot = process.hot_resolved
        if hot is not None:
            got = hot(memo, family, explicit, QUIET)  # counts its hit
            if got is not None:
                return got  # type: ignore[no-any-return]
        else:
            # ``in_force`` of the remembered world, inlined (a call into world.py would be a
            # third of this path's cost), on its fields kept flat beside the answer.
            snapshot, scope, ops, alias_key, alias, asked, how, got = memo
            if (asked is family and how is explicit and snapshot is process.snapshot
                    and scope is current_scope() and ops is environ_get(OPS_KEY)
                    and (alias_key is None or alias is environ_get(alias_key))):
                next(QUIET)  # a hit that serves no call
                return got  # type: ignore[no-any-return]
    if not _hot_path_decided:
        _decide_hot_path()
    state, fields = process.snapshot, ctx.__dict__
    again = "_signature" in fields  # resolved before: worth remembering on the object
    sig = ctx.signature()
    if sig[0] != family:
        raise ValueError(f"resolve({family!r}, ...) got a context for {ctx.family!r}")
    state = state or current()
    if len(sig) != PLAIN or state.signature_keys.get(family) is not identity_or_base:
        sig = signature_key(state, ctx)  # else the signature is the key (the common case)
    world = world_now(state, family)
    got = decide(family, sig, explicit, same_context, (ctx,), world).resolution
    next(QUIET)  # a lookup that serves no call (a failed one counted itself)
    if again and family not in world.scope.uncacheable and (
            explicit is None or explicit.__class__ is str
            or handle_key(explicit) is not UNCACHEABLE):
        # The world the answer was decided in, checked by identity on the next ask: the
        # snapshot (a reload, refresh() or reset() puts a new one in force, its decision
        # cache empty), the scope and the variables.
        object.__setattr__(ctx, _MEMO, (world.snapshot, world.scope, world.ops, world.alias_key,
                                        world.alias, family, explicit, got))
    return got


#: Whether this process took up its hot path (``_decide_hot_path``) yet.
_hot_path_decided = False


def _decide_hot_path() -> None:
    """At ``resolve``'s first miss, where the facades have not taken up a hot path yet
    (``astrai.dispatch.facade.adopt``): the extension, where it is built already (never
    building it), so a process using ``resolve`` alone answers its repeated asks in C++
    as well."""
    global _hot_path_decided
    _hot_path_decided = True
    from astrai.dispatch import hot_native as native

    if process.hot_planner is not None or native.pending():
        return
    module = native.load()
    if module is not None:
        process.hot_resolved = getattr(module, "resolved", None)


#: Where ``resolve`` leaves its answer on a ``CallContext`` (``CallContext.__getstate__``
#: leaves it out of copies and pickles).
_MEMO = "_resolved"


def resolve_plan(ctxs: Mapping[str, CallContext],
                 explicit: Mapping[str, Any] | None = None) -> dict[str, Resolution]:
    """Resolve several families against one snapshot of tables, profiles and environment."""
    state = current()
    explicit = explicit or {}
    for fam, ctx in ctxs.items():
        if ctx.family != fam:
            raise ValueError(f"resolve_plan: the context under {fam!r} is for {ctx.family!r}")
    return {fam: evaluate(fam, ctx, explicit.get(fam), state=state) for fam, ctx in ctxs.items()}
