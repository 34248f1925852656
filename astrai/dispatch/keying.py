"""How a call's axis values become its decision-cache key: cut points, not raw shapes.

A facade reads its family's base axes (dtype, ndim, flags...) on every call, and they
enter the key as they are. The lazy axes (shape and hardware, ``Axis.lazy``) are read
off a call only when some spec of the family - its table's rows and fallback, and every
loaded profile's overlay of it - reads them. Then an int axis enters the key as the
index of the interval between its cut points that its value falls in (a table that
compares ``q_len`` with 1 and 1024 only gives three intervals, whatever the lengths),
each pair of int axes compared with each other adds how the two order (-1, 0, +1), and
any other lazy axis (``device``) enters as it is. Two calls with the same key satisfy
every spec alike, so one decision serves both, and the number of decisions is bounded
by the tables' intervals, not by the distinct shapes of the calls.

A family with an opaque spec (one that calls Python, ``Spec.of``) may read anything:
its lazy axes enter the key raw. The plan belongs to a table snapshot (``Registry.keys``),
so a reload or a profile change recomputes it.
"""

from __future__ import annotations

__all__ = ["PLAIN", "Extend", "KeyPlan", "LazyKey", "family_specs", "identity_or_base", "key_plan",
           "signature_key"]

from bisect import bisect_right
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from astrai.dispatch.axes import AXES, BASE_AXES, LAZY_AXES, CallContext
from astrai.dispatch.expr.analysis import Comparisons, comparisons
from astrai.dispatch.expr.spec import Spec
from astrai.dispatch.reading import Layout, layout

if TYPE_CHECKING:
    from astrai.dispatch.registry import Registry

#: ``extend(base_values, lazy_values)``: what the lazy axes add to a call's key.
Extend = Callable[[tuple[Any, ...], tuple[Any, ...]], tuple[Any, ...]]
#: ``lazy_key(base_values, args)``: the same, read off a facade call's arguments.
LazyKey = Callable[[tuple[Any, ...], tuple[Any, ...]], tuple[Any, ...]]


def family_specs(state: Registry, family: str) -> list[Spec]:
    """Every spec that may decide a call of ``family`` on ``state``: its table's rows and
    fallback, and each loaded profile's conditions and added rows for it."""
    table = state.family(family)
    specs = [r.spec for r in table.rows]
    if table.outside_fallback is not None:
        specs.append(table.outside_fallback.spec)
    for prof in state.profiles.values():
        for ov in prof.for_family(family):
            specs += [*ov.when.values(), *ov.chain_when.values(), *(a.spec for a in ov.add)]
    return specs


def _sign(a: Any, b: Any) -> int | None:
    if a is None or b is None:
        return None
    return (a > b) - (a < b)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class KeyPlan:
    """What a family's specs ask of the lazy axes, on one snapshot (module docstring)."""

    family: str
    found: Comparisons
    _made: dict[tuple[tuple[str, ...], tuple[str, ...]], Extend | None] = field(
        default_factory=dict, compare=False, repr=False)

    @property
    def compared(self) -> frozenset[str]:
        """The lazy axes some spec of the family reads (all of them for an opaque spec)."""
        if self.found.opaque:
            return frozenset(LAZY_AXES)
        return self.found.axes.intersection(LAZY_AXES)

    def extend(self, names: tuple[str, ...], lazy: tuple[str, ...]) -> Extend | None:
        """For calls whose base values are ``names`` and lazy values ``lazy``: the function
        giving what the lazy axes add to the key; ``None`` when the specs read none of
        ``lazy`` (the lazy axes then need not even be read)."""
        got = self._made.get((names, lazy), False)
        if got is False:
            got = self._made[(names, lazy)] = self._build(names, lazy)
        return got  # type: ignore[return-value]

    def reader(self, names: tuple[str, ...],
               readers: Mapping[str, Callable[..., Any]]) -> LazyKey | None:
        """For a facade whose calls' base values are ``names`` and whose lazy axes are
        read by ``readers`` (axis -> reader of the call's arguments): the function giving
        what a call's lazy axes add to its key, running only the readers of the axes the
        specs compare; ``None`` when they compare none."""
        needed = tuple(n for n in readers if n in self.compared)
        extend = self.extend(names, needed) if needed else None
        if extend is None:
            return None
        read = [readers[n] for n in needed]
        if len(read) > 1:
            return lambda base, args: extend(base, tuple([r(*args) for r in read]))
        (one,) = read
        steps, pairs = self._plan(names, needed)
        if pairs or self.found.opaque:
            return lambda base, args: extend(base, (one(*args),))
        points = steps[0][1]
        if points is None:
            return lambda base, args: (one(*args),)

        def interval(base: tuple[Any, ...], args: tuple[Any, ...]) -> tuple[Any, ...]:
            value = one(*args)
            return (None if value is None else bisect_right(points, value),)

        return interval

    def interval(self, names: tuple[str, ...], readers: Mapping[str, Callable[..., Any]]
                 ) -> tuple[Callable[..., Any], tuple[int, ...]] | None:
        """The common case of ``reader``, as data: when the specs compare exactly one of
        ``readers``' axes, an int axis compared with constants only, its reader and cut
        points (a call adds the index of its value's interval, or ``None`` for no value);
        else ``None``."""
        needed = tuple(n for n in readers if n in self.compared)
        if len(needed) != 1 or self.found.opaque or self.extend(names, needed) is None:
            return None
        steps, pairs = self._plan(names, needed)
        points = steps[0][1]
        if pairs or points is None:
            return None
        return readers[needed[0]], points

    def layout(self, names: tuple[str, ...], lazy: tuple[str, ...]) -> Layout:
        """What the specs add to the base values ``names`` of a call whose lazy axes are
        ``lazy`` (in the reader's order), as data for the compiled hot path: the same key
        ``reader`` makes."""
        needed = tuple(n for n in lazy if n in self.compared)
        if not needed or self.extend(names, needed) is None:
            return Layout()
        if self.found.opaque:
            return Layout(tuple(("raw", axis) for axis in needed))
        steps, pairs = self._plan(names, needed)
        return layout([(needed[i], points) for i, points in steps],
                      [tuple(("lazy", needed[i]) if in_lazy else ("base", i)  # type: ignore[misc]
                             for in_lazy, i in pair) for pair in pairs])

    def _plan(self, names: tuple[str, ...], lazy: tuple[str, ...]
              ) -> tuple[list[tuple[int, tuple[int, ...] | None]],
                         list[tuple[tuple[bool, int], tuple[bool, int]]]]:
        """The steps (per compared lazy axis: its index in ``lazy`` and its cut points, or
        ``None`` for an axis that enters as it is) and the compared pairs (each side: in
        ``lazy`` or not, and its index there or in ``names``)."""
        compared = self.compared
        steps: list[tuple[int, tuple[int, ...] | None]] = []
        for i, name in enumerate(lazy):
            if name in compared:
                ordered = AXES[name].kind == "int"
                steps.append((i, self.found.points.get(name, ()) if ordered else None))

        def where(axis: str) -> tuple[bool, int] | None:
            if axis in lazy:
                return True, lazy.index(axis)
            if axis in names:
                return False, names.index(axis)
            return None  # not read for this family: always None

        pairs = []
        for a, b in sorted(self.found.pairs):
            wa, wb = where(a), where(b)
            if (a in lazy or b in lazy) and wa is not None and wb is not None:
                pairs.append((wa, wb))
        return steps, pairs

    def _build(self, names: tuple[str, ...], lazy: tuple[str, ...]) -> Extend | None:
        if self.found.opaque:
            return _raw if lazy else None
        steps, pairs = self._plan(names, lazy)
        if not steps and not pairs:
            return None
        if not pairs and len(steps) == 1:  # the common case, without the loops
            return _one(*steps[0])

        def extend(base: tuple[Any, ...], values: tuple[Any, ...]) -> tuple[Any, ...]:
            out: list[Any] = []
            for i, points in steps:
                value = values[i]
                out.append(value if points is None or value is None
                           else bisect_right(points, value))
            for (la, ia), (lb, ib) in pairs:
                out.append(_sign((values if la else base)[ia], (values if lb else base)[ib]))
            return tuple(out)

        return extend


def _one(i: int, points: tuple[int, ...] | None) -> Extend:
    """``extend`` for one compared lazy axis and no pairs."""
    if points is None:
        return lambda base, values: (values[i],)

    def one(base: tuple[Any, ...], values: tuple[Any, ...]) -> tuple[Any, ...]:
        value = values[i]
        return (None if value is None else bisect_right(points, value),)

    return one


def _raw(base: tuple[Any, ...], values: tuple[Any, ...]) -> tuple[Any, ...]:
    return values


def key_plan(state: Registry, family: str) -> KeyPlan:
    """The ``KeyPlan`` of ``family`` on ``state`` (made once per snapshot)."""
    got = state.keys.get(family)
    if got is None:
        got = state.keys[family] = KeyPlan(family, comparisons(family_specs(state, family)))
    return got


#: A signature's length when the call fills no lazy axis.
PLAIN = len(BASE_AXES) + 2


def identity_or_base(sig: tuple[Any, ...]) -> tuple[Any, ...]:
    """The key of a family whose specs read no lazy axis: the signature without them."""
    return sig if len(sig) == PLAIN else sig[:-1]


def signature_key(state: Registry, ctx: CallContext) -> tuple[Any, ...]:
    """The decision-cache key of a whole ``CallContext`` (``resolve``): its signature
    (``CallContext.signature``) with the lazy values replaced by what they add to the key
    (nothing when no spec reads them)."""
    keyer = state.signature_keys.get(ctx.family)
    if keyer is None:
        keyer = state.signature_keys[ctx.family] = _signature_keyer(
            key_plan(state, ctx.family).extend(BASE_AXES, LAZY_AXES))
    return keyer(ctx.signature())  # type: ignore[no-any-return]


def _signature_keyer(extend: Extend | None) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    """``signature_key``'s work for one family on one snapshot."""
    if extend is None:
        return identity_or_base
    unfilled = (None,) * len(LAZY_AXES)

    def keyer(sig: tuple[Any, ...]) -> tuple[Any, ...]:
        lazy = sig[-1] if len(sig) > PLAIN else unfilled
        return (*sig[:PLAIN], extend(sig[1:PLAIN - 1], lazy))

    return keyer
