"""The decision's world: everything a decision depends on besides the call, as one value.

A decision of a family depends on the call's axis values and explicit handle, and on
its *world*: the table snapshot in force, the ``op_backend`` / ``use_profile`` scope,
and the raw values of ``ASTR_OPS`` and of the family's legacy alias variable. The world
is read once per decision (``world_now``) and then only passed on: the decision-cache
key is made from it (``World.key``), the evaluator parses the environment from it (never from
``os.environ`` again), and the facades' last world and ``resolve``'s memo are checked
against it (``in_force``; the compiled hot path does the same checks in C++). A variable
changed by another thread while a decision is taken therefore cannot put a decision made
under one value into the cache under another.
"""

from __future__ import annotations

__all__ = ["World", "in_force", "same_world", "world_now"]

from typing import Any, NamedTuple

from astrai.dispatch import state as process
from astrai.dispatch.registry import Registry
from astrai.dispatch.scopes import Scope, current_scope
from astrai.env import OPS_KEY, environ_get


class World(NamedTuple):
    """One decision's world (module docstring). ``ops`` and ``alias`` are the raw values
    as ``os.environ`` stores them (``None`` when unset); ``alias_key`` is the family's
    legacy variable, pre-encoded (``None`` when the family has none). ``key`` is what
    every cache made in a world is keyed by besides the family and the call (the
    snapshot owns those caches): the scope's token and the raw values - the decision
    cache's key is ``(family, call key, handle key, *world.key)``, the snapshot's
    environment-and-view memo's ``(family, *world.key)``. The compiled hot path reads the
    first five fields by position."""

    snapshot: Registry
    scope: Scope
    ops: Any
    alias_key: Any
    alias: Any
    key: tuple[Any, ...]


def world_now(state: Registry, family: str) -> World:
    """The world of a decision of ``family`` taken now on ``state``: the one this family's
    last decision on ``state`` was taken in when it is still in force (the same objects:
    nothing is built), else a new one, remembered for the next."""
    scope, ops = current_scope(), environ_get(OPS_KEY)
    last = state.last_worlds.get(family)
    # ``in_force`` inlined on the values just read (a call costs every miss ~3%); the
    # snapshot is ``state`` itself, which owns ``last_worlds``
    if (last is not None and last.scope is scope and last.ops is ops
            and (last.alias_key is None or last.alias is environ_get(last.alias_key))):
        return last  # type: ignore[no-any-return]
    alias_key = state.alias_keys.get(family)
    alias = None if alias_key is None else environ_get(alias_key)
    world = World(state, scope, ops, alias_key, alias, (scope.cache_token, ops, alias))
    state.last_worlds[family] = world
    return world


def in_force(world: World) -> bool:
    """Whether ``world`` is still the world now, by identity alone (the hot-path check:
    an unchanged variable reads back as the very same object)."""
    return (world.snapshot is process.snapshot and world.scope is current_scope()
            and world.ops is environ_get(OPS_KEY)
            and (world.alias_key is None or world.alias is environ_get(world.alias_key)))


def same_world(a: World, b: World) -> bool:
    """Whether two worlds are the same objects, element by element (equal is not enough:
    a last world is checked by identity; ``key`` is made of the others)."""
    return (a.snapshot is b.snapshot and a.scope is b.scope and a.ops is b.ops
            and a.alias_key is b.alias_key and a.alias is b.alias)
