"""What a set of specs asks of a call, read off their structure (``Spec.kind``,
``parts``, ``test``): the named parts a spec is made of, the axes read, and the cut points
of each int axis - where some spec may change its answer. Keying uses the cut points to
decide calls alike by interval; lint and the table checks use the named parts.
"""

from __future__ import annotations

__all__ = ["Comparisons", "comparisons", "cut_points", "named_parts", "on_this_machine",
           "three_valued"]

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from astrai.dispatch.axes import CallContext
from astrai.dispatch.expr.spec import Spec


def named_parts(spec: Spec) -> list[Spec]:
    """The named specs (predicates, a table's definitions) that ``spec`` is made of, in
    order, the outermost only (not those inside a named one), each once."""
    found: list[Spec] = []
    todo = [spec]
    while todo:
        part = todo.pop()
        if part.kind == "named":
            found.append(part)
        else:
            todo.extend(reversed(part.parts))
    return list(dict.fromkeys(found))


#: Where a comparison ``x <op> c`` changes its answer, as offsets from ``c``.
_POINTS: dict[str, tuple[int, ...]] = {"<": (0,), ">=": (0,), "<=": (1,), ">": (1,)}


@dataclass(frozen=True)
class Comparisons:
    """What a set of specs asks of a call's axes (see ``comparisons``)."""

    axes: frozenset[str]  # every axis some spec reads
    points: Mapping[str, tuple[int, ...]]  # per int axis, its cut points
    pairs: frozenset[tuple[str, str]]  # int axes compared with each other
    opaque: bool  # a spec calls Python: it may read any axis, any way


def comparisons(specs: Iterable[Spec]) -> Comparisons:
    """Which axes ``specs`` read and how: per int axis, the points where some spec may
    change its answer (``x < c`` and ``x >= c`` change at ``c``, ``x <= c`` and ``x > c`` at
    ``c + 1``, ``x == c`` and membership at both), and the pairs of int axes compared with
    each other. Two calls whose int axes lie between the same neighbouring points, whose
    compared pairs order alike, and whose other read axes are equal satisfy every spec
    alike - unless a spec is opaque."""
    points: dict[str, set[int]] = {}
    pairs: set[tuple[str, str]] = set()
    axes: set[str] = set()
    opaque = False
    todo = list(specs)
    while todo:
        spec = todo.pop()
        if spec.kind == "opaque":
            opaque = True
        axes.update(spec.axes())
        todo.extend(spec.parts)
        test = spec.test
        if test is None or test.axis.kind != "int":
            continue
        if test.other is not None:
            pairs.add((test.axis.name, test.other.name))
            continue
        at = points.setdefault(test.axis.name, set())
        for value in test.values:
            if isinstance(value, int):
                at.update(value + shift for shift in _POINTS.get(test.op, (0, 1)))
    return Comparisons(frozenset(axes), {n: tuple(sorted(at)) for n, at in points.items()},
                       frozenset(pairs), opaque)


def cut_points(specs: Iterable[Spec]) -> dict[str, tuple[int, ...]] | None:
    """Per int axis, its cut points over ``specs`` (see ``comparisons``); ``None`` when no
    constant cuts settle every answer (a spec calls Python, or compares two int axes)."""
    found = comparisons(specs)
    if found.opaque or found.pairs:
        return None
    return dict(found.points)


def three_valued(spec: Spec, atom: Callable[[Spec], bool | None]) -> bool | None:
    """``spec`` in three-valued logic, each atom and constant answered by ``atom``
    (``None``: unknown), an opaque part unknown; ``and``/``or`` settle on a decisive
    part whatever the unknown ones say."""
    kind = spec.kind
    if kind in ("atom", "const"):
        return atom(spec)
    if kind == "named":
        return three_valued(spec.parts[0], atom)
    if kind == "not":
        got = three_valued(spec.parts[0], atom)
        return None if got is None else not got
    if kind in ("and", "or"):
        decisive = kind == "or"  # the value that settles the whole expression
        result: bool | None = not decisive
        for part in spec.parts:
            got = three_valued(part, atom)
            if got is decisive:
                return decisive
            if got is None:
                result = None
        return result
    return None


def on_this_machine(spec: Spec, ctx: CallContext | None = None) -> bool | None:
    """What ``spec`` says of every call on this machine, in three-valued logic: its tests
    of machine axes answered (by ``ctx``'s stated values, else this machine's), every other
    test unknown. ``False``: no call here satisfies it; ``True``: every call does;
    ``None``: it depends on the call (or on Python, for an opaque part)."""
    here = ctx if ctx is not None else CallContext("")

    def machine(part: Spec) -> bool | None:
        test = part.test
        if part.kind == "const" or (test is not None and test.axis.machine and (
                test.other is None or test.other.machine)):
            return part.matches(here)
        return None

    return three_valued(spec, machine)
