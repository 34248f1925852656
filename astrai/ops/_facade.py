"""The facade factory: one definition of the hot path, built per family.

A ``FamilyCall`` says what a family's facade call is: its parameters, which of
them a row takes positionally, the base axes the call fills and the function that
validates a call and reads them (``describe``), and the lazy (shape and hardware)
axes, each with its reader (``readers``). ``route`` turns it into the function every
call goes through: validate and read the base axes once, read a lazy one only when a
loaded table compares it (as cut-point intervals, ``astrai.dispatch.keying``),
take the decision (baked in at trace time under ``torch.compile``, else from the
decision cache), count it, and hand back the object to call.
"""

from __future__ import annotations

__all__ = ["NO_WORLD", "FamilyCall", "LastWorld", "Note", "hot_plan", "keep", "recording", "route"]

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from astrai.dispatch import state as process
from astrai.dispatch.axes import CallContext
from astrai.dispatch.env import OPS_KEY, environ_get
from astrai.dispatch.keying import key_plan
from astrai.dispatch.reading import Layout, Reading, encode, unreadable
from astrai.dispatch.registry import Registry, current
from astrai.dispatch.resolution import decide
from astrai.dispatch.scopes import current_scope
from astrai.dispatch.torch_compile import compiling, decision_name, representatives
from astrai.dispatch.world import World, same_world, world_now
from astrai.ops._families import Keyer, extended_keyer, interval_keyer, shape_reader

Route = Callable[[Any, tuple[Any, ...]], Callable[..., Any]]
#: ``note(ctx, backend, incidental)``: adds a call to the recordings in force (``record``).
Note = Callable[[CallContext, Any, tuple[str, ...]], None]


@dataclass(frozen=True)
class FamilyCall:
    """One built-in family's facade call (see the module docstring)."""

    family: str
    params: tuple[str, ...]  # the facade's parameters, ``backend`` left out
    defaults: tuple[Any, ...]  # their defaults (``inspect.Parameter.empty`` where none)
    positional: int  # the first ``positional`` are passed to a row positionally
    reads: tuple[str, ...]  # the base axes ``describe`` returns, in order
    describe: Callable[..., tuple[Any, ...]]
    # The lazy axes, in order, each with its reader (given the full argument tuple).
    readers: Mapping[str, Callable[..., Any]]
    # A facade taking feature keywords: their names, the feature axes ``describe`` then
    # appends (in order), and the check that keeps the features a call really asks for
    # (given the full positional tuple and the keywords). The features travel as one
    # more, last, element of the argument tuple: a dict of keyword -> value.
    keywords: tuple[str, ...] = ()
    asks: tuple[str, ...] = ()
    check: Callable[[tuple[Any, ...], dict[str, Any]], dict[str, Any]] | None = None
    # Parameters that do not make recorded calls distinct (an attention layer's index).
    incidental: tuple[str, ...] = ()
    # The common calls as data, for the compiled hot path (``astrai.dispatch.reading``).
    reading: Reading | None = None
    #: Every lazy axis of a call given as the full argument tuple, in order.
    shape: Callable[..., tuple[Any, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", shape_reader(self.readers))

    @classmethod
    def of(cls, facade: Callable[..., Any], describe: Callable[..., tuple[Any, ...]],
           reads: tuple[str, ...], readers: Mapping[str, Callable[..., Any]], *,
           positional: int, keywords: tuple[str, ...] = (),
           asks: tuple[str, ...] = (),
           check: Callable[[tuple[Any, ...], dict[str, Any]], dict[str, Any]] | None = None,
           incidental: tuple[str, ...] = (), reading: Reading | None = None,
           family: str | None = None) -> FamilyCall:
        """The ``FamilyCall`` of ``facade`` (its parameters read off its signature; the
        feature keywords, ``**features``, are given as ``keywords``); its family is the
        facade's name without ``apply_`` unless given."""
        params = [p for p in inspect.signature(facade).parameters.values()
                  if p.name != "backend" and p.kind is not p.VAR_KEYWORD
                  and p.name not in keywords]
        return cls(family or facade.__name__.removeprefix("apply_"),
                   tuple(p.name for p in params),
                   tuple(p.default for p in params), positional, reads, describe, readers,
                   keywords, asks, check, incidental, reading)

    @property
    def lazy(self) -> tuple[str, ...]:
        """The lazy axes, in order."""
        return tuple(self.readers)

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """The facade's full argument tuple for ``facade(*args, **kwargs)``."""
        if len(args) > len(self.params):
            raise TypeError(f"{self.family} takes at most {len(self.params)} arguments "
                            f"({', '.join(self.params)}), got {len(args)}")
        full = list(args) + list(self.defaults[len(args):])
        features = {n: kwargs.pop(n) for n in self.keywords if n in kwargs}
        for name, value in kwargs.items():
            if name not in self.params[len(args):]:
                raise TypeError(f"{self.family} got an unexpected or repeated argument "
                                f"{name!r}; parameters: {', '.join(self.params)}")
            full[self.params.index(name)] = value
        missing = [n for n, v in zip(self.params, full, strict=True)
                   if v is inspect.Parameter.empty]
        if missing:
            raise TypeError(f"{self.family} is missing {', '.join(missing)}")
        if self.check is not None:
            full.append(self.check(tuple(full), features) if features else features)
        return tuple(full)

    def names(self, values: tuple[Any, ...]) -> tuple[str, ...]:
        """The axes of ``describe``'s ``values`` (the feature axes when it appended them)."""
        return self.reads if len(values) == len(self.reads) else (*self.reads, *self.asks)

    def context(self, *args: Any) -> CallContext:
        """The ``CallContext`` of a call given as the full argument tuple."""
        return self.context_of(self.describe(*args), args)

    def context_of(self, values: tuple[Any, ...], args: tuple[Any, ...]) -> CallContext:
        """The ``CallContext`` of a call whose base values ``describe`` gave already."""
        cut, n = self.positional, len(self.params)
        raw_kwargs = dict(zip(self.params[cut:], args[cut:n], strict=True))
        if self.check is not None:
            raw_kwargs.update(args[n])
        return CallContext.of(self.family, (*self.names(values), *self.lazy),
                              (*values, *self.shape(*args)), raw=args[:cut],
                              raw_kwargs=raw_kwargs)


class LastWorld(NamedTuple):
    """A route's last world: the world its kept decisions were taken in, those decisions
    by key, how that world's snapshot keys a call (``None``: the base values are the
    key), and the compiled hot path's plan there (``None``: it reads no call). The
    compiled path reads it by position, in this order."""

    world: World | None
    decisions: dict[Any, Any]
    keyer: Keyer | None
    plan: Any


#: A route before its first decision.
NO_WORLD = LastWorld(None, {}, None, None)


def keep(last: list[LastWorld], now: World, key: Any, d: Any, keyer: Keyer | None,
         plan: Any) -> None:
    """Keep decision ``d`` for ``key`` in the world it was decided in, ``now`` (a new last
    world if the last one is another or full), so that it serves only calls made in that
    world."""
    world, decisions = last[0].world, last[0].decisions
    if (world is None or not same_world(world, now) or last[0].plan is not plan
            or len(decisions) >= process.max_decisions):
        decisions = {}
        last[0] = LastWorld(now, decisions, keyer, plan)
    decisions[key] = d


def hot_plan(name: str, reading: Reading | None, shape: Layout) -> Any:
    """The compiled hot path's plan for facade ``name``'s calls under ``shape`` (``None``
    where it reads none), noting why not in ``state.hot_status``."""
    why: str | None
    planner = process.hot_planner
    if planner is None:
        why, plan = "astrai's native extension is not in use", None
    elif reading is None:
        why, plan = "the family declares no reading of its calls", None
    else:
        why = unreadable(reading, shape)
        plan = None if why else planner(*encode(reading, shape))
    process.hot_status[name] = why
    return plan


def route(fc: FamilyCall, last: list[LastWorld] | None = None, name: str | None = None
          ) -> Route:
    """The hot path of ``fc``'s facade: ``route(backend, args)`` is the object to call.

    In front of the decision cache sits this family's *last world* (``world.World``:
    the snapshot, the scope, the raw ``ASTR_OPS`` and alias values - everything
    ``decide``'s key holds besides the call's values and the absent ``backend=``), with
    the decisions already taken in it, by the call's values. A call in the same world
    (nearly every call) is looked up there by its values alone; any change of world
    misses it, and ``decide`` answers in the world read once for that call. ``name`` is
    the facade's (the family's unless given), as ``state.hot_status`` names it.
    """
    name = name or fc.family
    family, reads, describe, context_of = fc.family, fc.reads, fc.describe, fc.context_of
    lazy, shape, names, readers = fc.lazy, fc.shape, fc.names, fc.readers
    if last is None:
        last = [NO_WORLD]
    else:
        last[:] = [NO_WORLD]
    # This route's entry in each snapshot's ``facade_keys``: its keyer reads the call with
    # this route's own ``describe`` and readers (a token that lives as long as the route).
    slot = (family, object())

    def pick(backend: Any, args: tuple[Any, ...]) -> Callable[..., Any]:
        if compiling():  # before anything dynamo cannot trace (ContextVar.get)
            values = describe(*args)
            every = (*names(values), *lazy)
            values = representatives(family, every, (*values, *shape(*args)))
            return process.impls[decision_name(family, every, values, backend,  # type: ignore[no-any-return]
                                               process.compile_key)]
        seen = last[0]
        world: Any = seen[0]  # read by position: the hot path of every call
        state = process.snapshot
        same_snapshot = world is not None and world[0] is state
        if same_snapshot:
            keyer, hot = seen[2], seen[3]  # the last world's snapshot: its key plan
        else:
            state = state or current()
            got = state.facade_keys.get(slot)
            if got is None:
                got = state.facade_keys[slot] = _keyer(state)
            keyer, hot = got
        if keyer is None:
            key = values = describe(*args)
        else:
            key, values = keyer(*args)
        # ``world.in_force(world)``, inlined: the hot path of every call.
        if (same_snapshot and backend is None and world[1] is current_scope()
                and world[2] is environ_get(OPS_KEY)
                and (world[3] is None or world[4] is environ_get(world[3]))):
            d = seen[1].get(key)
            if d is not None:
                next(d.counter)
                return d.call  # type: ignore[no-any-return]
        now = world_now(state, family)
        d = decide(family, key, backend, context_of, (values, args), now)
        if backend is None and family not in now.scope.uncacheable:
            keep(last, now, key, d, keyer, hot)
        next(d.counter)
        return d.call  # type: ignore[no-any-return]

    def _keyer(state: Registry) -> tuple[Keyer | None, Any]:
        """How this family's calls are read into their key on ``state`` - ``None`` when
        its specs compare no lazy axis (the base values are the key) - and the compiled
        hot path's plan for them there (``hot_plan``)."""
        plan = key_plan(state, family)
        hot = hot_plan(name, fc.reading, plan.layout(reads, lazy))
        single = plan.interval(reads, readers)
        if single is not None:
            read, points = single
            return interval_keyer(describe, read, points), hot
        lazy_key = plan.reader(reads, readers)
        if lazy_key is None:
            return None, hot
        return extended_keyer(describe, lazy_key), hot

    return pick


def recording(fc: FamilyCall, plain: Route, note: Note) -> Route:
    """``plain`` (``fc``'s route) that also hands each call it served to ``note``: the
    route a facade takes while a recording is in force (``astrai.record.recording``)."""
    context, incidental = fc.context, fc.incidental

    def pick(backend: Any, args: tuple[Any, ...]) -> Callable[..., Any]:
        call = plain(backend, args)
        if not compiling():
            note(context(*args), backend, incidental)
        return call

    return pick
