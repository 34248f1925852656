"""The facade factory: one definition of the hot path, built per facade.

A ``FamilyCall`` says what a family's facade call is: its parameters, which of
them a row takes positionally, the base axes the call fills and the function that
validates a call and reads them (``describe``), the lazy (shape and hardware)
axes, each with its reader (``readers``), and its common calls as data for the
compiled hot path (``reading``). ``route`` turns it into the function every
call goes through: validate and read the base axes once, read a lazy one only when a
loaded table compares it (as cut-point intervals, ``astrai.dispatch.keying``),
take the decision (baked in at trace time under ``torch.compile``, else from the
decision cache), count it, and hand back the object to call.

``facade(call)`` makes a ``Facade``: the call, its route and last world, and
the hot path's ``lookup`` - the compiled one's, or where the extension is not in use the
Python one's (``astrai.dispatch.python_hot``), ``None`` while a recording is in force.
A facade function reads them off its ``Facade`` on every call::

    def scale(x, factor, backend=None):
        f = SCALE
        if backend is None and not compiling() and f.lookup is not None:
            d = f.lookup(f.last, x, factor)
            if d is not None:
                next(d.counter)
                return d.call(x, factor)
        return f.route(backend, (x, factor))(x, factor)

    SCALE = facade(FamilyCall.of(scale, describe_scale, READS, READERS, positional=2))

``compiling()`` is asked before ``lookup`` is read: a traced facade never reads it, so a
compiled graph is not guarded on the hot path's state (which changes as eager calls make
plans).
"""

from __future__ import annotations

__all__ = [
    "DEVICE_OPS",
    "FACADES",
    "FIRST_TENSOR_READING",
    "HOT",
    "NO_WORLD",
    "Facade",
    "FamilyCall",
    "Keyer",
    "LastWorld",
    "Note",
    "adopt",
    "compiled_path",
    "device_axes",
    "extended_keyer",
    "facade",
    "hot_plan",
    "interval_keyer",
    "keep",
    "leading_rows",
    "number",
    "python_path",
    "read_device",
    "read_sm",
    "recording",
    "require_tensors",
    "route",
    "rows",
    "shape_reader",
    "size_of",
]

import inspect
import sys
from bisect import bisect_right
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from math import prod
from typing import Any, NamedTuple

import torch

from astrai.dispatch import hot_native as native
from astrai.dispatch import python_hot
from astrai.dispatch import state as process
from astrai.dispatch.autocasting import Autocast, autocasted
from astrai.dispatch.axes import CallContext
from astrai.dispatch.keying import key_plan
from astrai.dispatch.reading import Case, Layout, Op, Reading, encode, unreadable
from astrai.dispatch.registry import Registry, current
from astrai.dispatch.resolution import decide
from astrai.dispatch.scopes import current_scope
from astrai.dispatch.torch_compile import (
    compiling,
    constant_result,
    decision_name,
    representatives,
)
from astrai.dispatch.world import World, same_world, world_now
from astrai.env import OPS_KEY, environ_get


def shape_reader(readers: Mapping[str, Callable[..., Any]]) -> Callable[..., tuple[Any, ...]]:
    """Every lazy axis of a call (given as the facade's full argument tuple), in the
    order of ``readers``, read in one call."""
    reads = tuple(readers.values())

    def shape(*args: Any) -> tuple[Any, ...]:
        return tuple([read(*args) for read in reads])

    return shape


#: ``keyer(*args) -> (key, base_values)``: what the facade looks a call up by, and the
#: base axis values ``describe`` gave (for the decision's context on a miss).
Keyer = Callable[..., tuple[tuple[Any, ...], tuple[Any, ...]]]


def interval_keyer(describe: Callable[..., tuple[Any, ...]], read: Callable[..., Any],
                   points: tuple[int, ...]) -> Keyer:
    """``describe`` and the interval of one lazy axis between its cut points, in one call:
    the key of a family whose tables compare one int axis with constants."""

    def keyer(*args: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        values = describe(*args)
        value = read(*args)
        return (*values, None if value is None else bisect_right(points, value)), values

    return keyer


def extended_keyer(describe: Callable[..., tuple[Any, ...]],
                   lazy_key: Callable[[tuple[Any, ...], tuple[Any, ...]], tuple[Any, ...]]
                   ) -> Keyer:
    """``describe``, then what the lazy axes add to the key (``keying``'s ``lazy_key``)."""

    def keyer(*args: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        values = describe(*args)
        return (*values, *lazy_key(values, args)), values

    return keyer

Route = Callable[[Any, tuple[Any, ...]], Callable[..., Any]]
#: ``note(ctx, backend, incidental)``: adds a call to the recordings in force (``record``).
Note = Callable[[CallContext, Any, tuple[str, ...]], None]


@dataclass(frozen=True)
class FamilyCall:
    """One family's facade call (see the module docstring)."""

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
    # The facade function itself (what ``ops.call`` of the family calls).
    function: Callable[..., Any] | None = field(default=None, repr=False, compare=False)
    # How torch's autocast changes the call (``astrai.dispatch.autocasting``): ``None``
    # where it changes nothing the family's rows would not see as torch's ops do.
    autocast: Autocast | None = None
    #: Every lazy axis of a call given as the full argument tuple, in order.
    shape: Callable[..., tuple[Any, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", shape_reader(self.readers))
        if self.autocast is not None:
            self.autocast.positions(self.params)  # names only the facade's parameters

    @classmethod
    def of(cls, facade: Callable[..., Any], describe: Callable[..., tuple[Any, ...]],
           reads: tuple[str, ...], readers: Mapping[str, Callable[..., Any]], *,
           positional: int, keywords: tuple[str, ...] = (),
           asks: tuple[str, ...] = (),
           check: Callable[[tuple[Any, ...], dict[str, Any]], dict[str, Any]] | None = None,
           incidental: tuple[str, ...] = (), reading: Reading | None = None,
           family: str | None = None, autocast: Autocast | None = None) -> FamilyCall:
        """The ``FamilyCall`` of ``facade`` (its parameters read off its signature; the
        feature keywords, ``**features``, are given as ``keywords``); its family is the
        facade's name without ``apply_`` unless given."""
        params = [p for p in inspect.signature(facade).parameters.values()
                  if p.name != "backend" and p.kind is not p.VAR_KEYWORD
                  and p.name not in keywords]
        return cls(family or facade.__name__.removeprefix("apply_"),
                   tuple(p.name for p in params),
                   tuple(p.default for p in params), positional, reads, describe, readers,
                   keywords, asks, check, incidental, reading, facade, autocast)

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
    """The hot path's plan (the compiled path's, or the Python one's where the extension
    is not in use) for facade ``name``'s calls under ``shape`` (``None`` where it reads
    none), noting why not in ``state.hot_status``."""
    why: str | None
    planner = process.hot_planner
    if planner is None:
        why, plan = "astrai's native extension is not built yet", None
    elif reading is None:
        why, plan = "the family declares no reading of its calls", None
    else:
        why = unreadable(reading, shape)
        plan = None if why else planner(*encode(reading, shape))
    process.hot_status[name] = why
    return plan


def route(fc: FamilyCall, last: list[LastWorld] | None = None, name: str | None = None,
          owner: Facade | None = None) -> Route:
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

    def traced(backend: Any, args: tuple[Any, ...]) -> Callable[..., Any]:
        """The decision for a traced call: on the representatives of its values."""
        values = describe(*args)
        every = (*names(values), *lazy)
        values = representatives(family, every, (*values, *shape(*args)))
        return process.impls[decision_name(family, every, values, backend,  # type: ignore[no-any-return]
                                           process.compile_key)]

    def pick(backend: Any, args: tuple[Any, ...]) -> Callable[..., Any]:
        if compiling():  # before anything dynamo cannot trace (ContextVar.get)
            return traced(backend, args)
        seen = last[0]
        world: Any = seen.world
        state = process.snapshot
        same_snapshot = world is not None and world.snapshot is state
        if same_snapshot:
            keyer, hot = seen.keyer, seen.plan  # the last world's snapshot: its key plan
        else:
            state = state or current()
            got = state.facade_keys.get(slot)
            if got is None:
                got = state.facade_keys[slot] = _keyer(state)
            keyer, hot = got
        if keyer is None:
            key = values = describe(*args)
        else:
            try:
                key, values = keyer(*args)
            except Exception as e:
                if not data_dependent(e):
                    raise
                # traced outside dynamo (torch.export's default) with a size the data
                # decides: no comparison of it can be made, so decided as when compiled
                return traced(backend, args)
        # ``world.in_force(world)``, inlined (a call into another module costs the hot path
        # of every call): the snapshot was checked above.
        if (same_snapshot and backend is None and world.scope is current_scope()
                and world.ops is environ_get(OPS_KEY)
                and (world.alias_key is None or world.alias is environ_get(world.alias_key))):
            d = seen.decisions.get(key)
            if d is not None:
                next(d.counter)
                return d.call  # type: ignore[no-any-return]
        now = world_now(state, family)
        d = decide(family, key, backend, context_of, (values, args), now)
        if backend is None and family not in now.scope.uncacheable:
            keep(last, now, key, d, keyer, hot)
            if owner is not None and process.hot_planner is python_hot.planner and (
                    not process.recordings):
                # The Python hot path where this world has a plan; else no lookup at all
                # (declining would cost a call before the route).
                owner.lookup = python_hot.lookup if hot is not None else None
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


def data_dependent(error: BaseException) -> bool:
    """Whether ``error`` is torch's refusal to compare a size the data decides (an
    unbacked symbol, met where a call is traced outside dynamo)."""
    shapes = sys.modules.get("torch.fx.experimental.symbolic_shapes")
    return shapes is not None and isinstance(error, shapes.GuardOnDataDependentSymNode)


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


# -- what declarations read a call with --------------------------------------------

_capabilities: dict[int, int] = {}
_CPU = ("cpu", None)


@constant_result
def _capability(index: int) -> int:
    """CUDA device ``index``'s compute capability as ``major * 10 + minor`` (asked once)."""
    got = _capabilities.get(index)
    if got is None:
        major, minor = torch.cuda.get_device_capability(index)
        got = _capabilities[index] = major * 10 + minor
    return got


def device_axes(t: torch.Tensor) -> tuple[str, int | None]:
    """The ``device`` and ``sm`` axes of a call whose main tensor is ``t``."""
    if t.is_cpu:  # the common case, without making a torch.device (a few hundred ns)
        return _CPU
    device = t.device
    if device.type != "cuda":
        return device.type, None
    index = device.index
    return "cuda", _capability(torch.cuda.current_device() if index is None else index)


def read_device(t: torch.Tensor, *_: Any) -> str | None:
    """The ``device`` axis of a call whose first argument is its main tensor."""
    return device_axes(t)[0]


def read_sm(t: torch.Tensor, *_: Any) -> int | None:
    """The ``sm`` axis of a call whose first argument is its main tensor."""
    return device_axes(t)[1]


def require_tensors(family: str, **tensors: Any) -> None:
    """``TypeError`` naming the first of ``tensors`` that is not a tensor."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{family}: {name} must be a torch.Tensor, got {type(t).__name__}")


def number(family: str, name: str, value: Any) -> float:
    """``value`` as a float, or ``TypeError`` when it is not an int or a float (a bool
    or NaN included)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise TypeError(f"{family}: {name} must be a number, got {value!r}")
    return float(value)


def leading_rows(arg: int, features: int) -> Callable[..., int | None]:
    """A lazy axis reader: the rows of argument ``arg`` (the product of its dimensions
    but the last ``features``), made here so that reading it stays in this module."""

    def read(*args: Any) -> int | None:
        return rows(args[arg].shape, features)

    return read


def size_of(arg: int, dim: int) -> Callable[..., int]:
    """A lazy axis reader: the size of argument ``arg`` at ``dim``."""

    def read(*args: Any) -> int:
        return args[arg].shape[dim]  # type: ignore[no-any-return]

    return read


def rows(s: torch.Size, features: int) -> int | None:
    """The product of ``s`` but its last ``features`` dimensions (without slicing a
    ``torch.Size``, which costs more than the product in the common ranks); ``None`` for
    a jagged nested tensor's, which is no number (no spec compares it, so the rows that
    ask for a count of tokens do not serve such a call)."""
    n = len(s) - features
    if n == 1:
        r = s[0]
    elif n == 2:
        r = s[0] * s[1]
    else:
        r = prod(s[:n])
    if r.__class__ is not int and not compiling() and _jagged(r):  # eager: a nested int
        return None
    return r  # type: ignore[no-any-return]


def _jagged(size: Any) -> bool:
    """Whether ``size`` is a jagged nested tensor's ragged size (a nested int)."""
    node = getattr(size, "node", None)
    return node is not None and bool(getattr(node, "is_nested_int", lambda: False)())


#: The compiled hot path's reading of the ``device`` and ``sm`` axes of a call whose
#: first argument is its main tensor.
DEVICE_OPS: dict[str, Op] = {"device": ("device", 0), "sm": ("sm", 0)}
#: A call keyed by its first tensor alone: dtype, device_cuda, ndim, grad_enabled
#: (``ops.call`` of a family without a facade or a ``context:`` builder).
FIRST_TENSOR_READING = Reading(1, (
    Case((("tensor", 0),), (("dtype", 0), ("cuda", 0), ("ndim", 0), ("grad",))),
))


# -- facades and the compiled hot path they ask first ----------------------------------


class _Hot:
    """The hot path as the process uses it: the loaded extension (or ``None``), the
    facades' ``lookup`` (the extension's, or ``python_hot``'s without it), and
    ``ops.call``'s hot lookup (the extension's, or the Python one ``ops`` gives), each
    ``None`` while a recording is in force."""

    __slots__ = ("call_lookup", "lookup", "native", "python_call")

    def __init__(self) -> None:
        self.native: Any = None
        self.lookup: Any = None
        self.call_lookup: Any = None
        self.python_call: Any = None


#: The process's compiled hot path (see ``_Hot``).
HOT = _Hot()


class Facade:
    """One facade of a family, as its function reads it on every call: ``call`` (its
    ``FamilyCall``), ``last`` (its route's last world, shared with the hot path),
    ``route`` (``route(backend, args)`` is the object to call: the plain route, or while
    a recording is in force the one feeding it) and ``lookup`` (the hot path's - the
    compiled or the Python one -, or ``None``: a recording is in force, or on the Python
    hot path the route's last world has no plan)."""

    __slots__ = ("call", "cast", "function", "last", "lookup", "name", "plain", "route")

    def __init__(self, call: FamilyCall, function: Callable[..., Any], name: str) -> None:
        self.call, self.function, self.name = call, function, name
        self.cast = None if call.autocast is None else call.autocast.positions(call.params)
        self.last: list[LastWorld] = [NO_WORLD]
        self.plain: Route = route(call, self.last, name, self)
        self.route: Route = self.plain
        self.lookup: Any = None if process.recordings else _hot_lookup(self)
        if process.recordings:
            self._record(True)

    def _record(self, now: bool) -> None:
        self.lookup = None if now else _hot_lookup(self)
        if now:
            assert process.note_call is not None  # set by the recording module, loaded
            self.route = recording(self.call, self.plain, process.note_call)
        else:
            self.route = self.plain

    def autocasted(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The facade's call ``function(*args, **kwargs)`` under autocast, made as torch
        makes the op the family stands for (``autocasting.autocasted``): the facade
        hands a call here where ``autocasting()`` says autocast is in force."""
        if self.cast is None:
            raise TypeError(f"facade {self.name!r} declares no autocast")
        return autocasted(self.function, self.cast, args, kwargs)

    def __repr__(self) -> str:
        return f"Facade({self.name!r} of family {self.call.family!r})"


def _hot_lookup(f: Facade) -> Any:
    """The hot lookup facade ``f`` takes: the process's, except on the Python hot path
    for a route whose last world has no plan (its calls go straight to the route)."""
    if HOT.lookup is python_hot.lookup:
        seen = f.last[0]
        if seen.world is not None and seen.plan is None:
            return None
    return HOT.lookup


#: Every facade made, by name (a family's first facade is named after the family).
FACADES: dict[str, Facade] = {}


def facade(call: FamilyCall, name: str | None = None) -> Facade:
    """The ``Facade`` of ``call`` (named ``name``, else after its family), made and
    registered; a facade of that name made before is replaced (a module reloaded)."""
    name = name or call.family
    if call.function is None:
        raise TypeError(f"facade {name!r}: its FamilyCall names no facade function "
                        f"(make it with FamilyCall.of(function, ...))")
    made = FACADES[name] = Facade(call, call.function, name)
    return made


def _lookup_first(last: list[LastWorld], *args: Any) -> Any:
    """The compiled hot path while nothing is built (or prebuilt) yet: importing
    never compiles, so the first call through any facade (or ``ops.call``) makes the
    process's decision (building the extension) and adopts what it gave; this call then
    takes its route (its world has no plan yet)."""
    adopt(native.load())
    return None


def adopt(module: Any) -> None:
    """Take ``module`` (the loaded extension, or ``None``: the Python hot path,
    ``astrai.dispatch.python_hot``) as the hot path from now on (a recording in force keeps
    the facades off it until it ends)."""
    HOT.native = module
    HOT.lookup = python_hot.lookup if module is None else module.lookup
    process.hot_planner = python_hot.planner if module is None else module.plan
    process.hot_resolved = None if module is None else getattr(module, "resolved", None)
    if not process.recordings:
        for f in FACADES.values():
            f.lookup = _hot_lookup(f)
    HOT.call_lookup = None if process.recordings else (
        HOT.python_call if module is None else module.lookup)


def _switch(recording_now: bool) -> None:
    """Point the facades at their recording routes (``True``) or plain ones."""
    for f in FACADES.values():
        f._record(recording_now)
    HOT.call_lookup = None if recording_now else (
        HOT.python_call if HOT.native is None else HOT.native.lookup)


def call_lookup_python(fn: Callable[..., Any]) -> None:
    """``ops.call``'s hot lookup where the compiled path is not in use."""
    HOT.python_call = fn
    if HOT.native is None and HOT.lookup is not _lookup_first and not process.recordings:
        HOT.call_lookup = fn


def compiled_path(state: Any = None) -> dict[str, str | None]:
    """Per facade: ``None`` where the compiled hot path reads its common calls on
    ``state`` (the snapshot in force by default), else why it does not."""
    state = state or process.snapshot or current()
    out: dict[str, str | None] = {}
    for name, f in FACADES.items():
        fc = f.call
        if HOT.lookup is _lookup_first:
            why: str | None = ("astrai's native extension is not built yet "
                               "(the first facade call builds it)")
        elif HOT.native is None:
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
    if HOT.native is None or HOT.lookup is _lookup_first:
        return []
    return [f"the compiled hot path reads no {name} call here: {why}"
            for name, why in compiled_path(state).items()
            if why is not None and FACADES[name].call.family == family]


process.hot_notes = _hot_notes
process.record_switches.append(_switch)
if native.pending():
    HOT.lookup = HOT.call_lookup = _lookup_first
else:
    adopt(native.load())


@contextmanager
def python_path() -> Iterator[None]:
    """Within: every facade, ``ops.call`` and ``resolve`` take the pure-Python path - the
    Python hot path (``astrai.dispatch.python_hot``) in front of the routes, the compiled
    one out of force - as without the extension; benchmarks compare the two with it. The routes'
    plans are made again on the way in and on the way out (each path reads its own)."""
    saved = [(f, f.lookup) for f in FACADES.values()]
    call_lookup, planner, resolved = HOT.call_lookup, process.hot_planner, process.hot_resolved
    _replan(python_hot.planner)
    for f, _ in saved:
        f.lookup = python_hot.lookup
    HOT.call_lookup, process.hot_resolved = HOT.python_call, None
    try:
        yield
    finally:
        _replan(planner)
        for f, lookup in saved:
            f.lookup = lookup
        HOT.call_lookup, process.hot_resolved = call_lookup, resolved


def _replan(planner: Any) -> None:
    """Plan with ``planner`` from now on: the snapshot's key plans and every route's last
    world (which holds the plan it was kept with) are dropped, to be made again."""
    process.hot_planner = planner
    if process.snapshot is not None:
        process.snapshot.facade_keys.clear()
    for f in FACADES.values():
        f.last[0] = NO_WORLD
