"""How a family's common call is read, as data: the key plan the compiled hot path runs.

A family declares, beside its Python ``describe``, a ``Reading`` of the call its facade
sees most: which arguments must be plain tensors (or ``None``, a float, a bool...), the
shape checks that make such a call well-formed, which metadata each base axis reads, and
how each lazy axis is read. The compiled hot path (``astrai.native``) runs that data - it
knows no family - and ``read`` below is its meaning in Python, which the tests hold both
the compiled path and each family's ``describe`` to. A call is read by the first of the
reading's cases whose guards all pass; a call no case reads is declined (the Python
route then validates and keys it).

Operands are argument indexes (the facade's arguments after ``last``) and dimension
indexes (negative from the end). A guard is ``(op, *operands)``:

``tensor i`` / ``tensor_or_none i`` / ``is i c`` (``args[i] is consts[c]``) /
``float i`` (an exact float) / ``float_ge0 i`` (an exact float >= 0) / ``float_gt0 i`` (an
exact float > 0) / ``int_eq i n`` (an exact int equal to ``n``) /
``bool i`` (an exact bool) / ``ndim i n`` / ``ndim_ge i n`` / ``size_eq i a j b`` /
``size_is i a n`` / ``size_ge i a n`` / ``size_even i a`` / ``size_div i a j b``
(``size(j, b) > 0`` divides ``size(i, a)``) / ``size_twice i a j b`` (``size(i, a)`` is
twice ``size(j, b)``) / ``shape_eq i j`` / ``dtype_eq i j`` /
``floating i`` / ``any g1 g2 ...`` (each ``g`` a tuple of guards: one group passes).

A value is ``(op, *operands)``:

``dtype i`` / ``cuda i`` / ``ndim i`` / ``size i a`` / ``grad`` (autograd on) /
``const c`` / ``arg i`` (the argument itself) / ``rows i k`` (the product of all sizes
but the last ``k``) / ``prod i a j b`` / ``device i`` (the device type's name) / ``sm i``
(``None`` off CUDA; a CUDA tensor's compute capability is not read: declined).

The key a snapshot asks for (``Layout``) is the base values followed by one item per
lazy axis its specs compare - the index of the value's interval between cut points
(``interval``), or the value itself (``raw``) - and one per compared pair (the sign of
their difference, ``sign``), exactly as ``astrai.dispatch.keying`` keys the call.
"""

from __future__ import annotations

__all__ = ["GUARDS", "ITEMS", "VALUES", "Case", "Layout", "Reading", "encode", "layout", "read"]

from bisect import bisect_right
from collections.abc import Mapping
from dataclasses import dataclass, field
from math import prod
from typing import Any

import torch

#: Every guard, in the order of the compiled path's opcodes.
GUARDS = ("tensor", "tensor_or_none", "is", "float_ge0", "int_eq", "bool", "ndim", "ndim_ge",
          "size_eq", "size_is", "size_ge", "size_even", "size_div", "size_twice", "shape_eq",
          "dtype_eq", "floating", "any", "float", "float_gt0")
#: Every value, in the order of the compiled path's opcodes.
VALUES = ("dtype", "cuda", "ndim", "size", "grad", "const", "arg", "rows", "prod", "device",
          "sm")

Op = tuple[Any, ...]


@dataclass(frozen=True)
class Case:
    """One shape of call a reading reads: its guards, its base values (in the family's
    axis order, feature axes included when the case has them), and its lazy values (by
    lazy axis name; an axis left out cannot be read here)."""

    guards: tuple[Op, ...]
    base: tuple[Op, ...]
    lazy: Mapping[str, Op] = field(default_factory=dict)


@dataclass(frozen=True)
class Reading:
    """A facade's common calls, read as data (module docstring): ``arity`` arguments,
    the ``cases`` tried in order, and the constants ``is`` and ``const`` name."""

    arity: int
    cases: tuple[Case, ...]
    consts: tuple[Any, ...] = (None, True, False)

    def lazy_axes(self) -> tuple[str, ...]:
        """Every lazy axis some case reads, in a fixed order."""
        seen: dict[str, None] = {}
        for case in self.cases:
            seen.update(dict.fromkeys(case.lazy))
        return tuple(seen)


@dataclass(frozen=True)
class Layout:
    """What a snapshot's specs add to the base values of a key: ``items``, each
    ``("interval", axis, points)``, ``("raw", axis)`` or ``("sign", a, b)`` with each side
    ``("lazy", axis)`` or ``("base", index)``."""

    items: tuple[tuple[Any, ...], ...] = ()

    @property
    def axes(self) -> tuple[str, ...]:
        """The lazy axes the items read."""
        out: dict[str, None] = {}
        for item in self.items:
            if item[0] in ("interval", "raw"):
                out[item[1]] = None
            else:
                for side in item[1:]:
                    if side[0] == "lazy":
                        out[side[1]] = None
        return tuple(out)


def layout(steps: list[tuple[str, tuple[int, ...] | None]],
           pairs: list[tuple[tuple[str, Any], tuple[str, Any]]]) -> Layout:
    """The ``Layout`` of a key plan's steps (a lazy axis and its cut points, or ``None``
    for one entering raw) and compared pairs (each side ``("lazy", axis)`` or
    ``("base", index)``)."""
    items: list[tuple[Any, ...]] = [("raw", axis) if points is None
                                    else ("interval", axis, tuple(points))
                                    for axis, points in steps]
    items += [("sign", a, b) for a, b in pairs]
    return Layout(tuple(items))


# -- the meaning, in Python ---------------------------------------------------------


def _size(t: torch.Tensor, a: int) -> int | None:
    s = t.shape
    return s[a] if -len(s) <= a < len(s) else None


def _plain(x: Any) -> bool:
    return type(x) in (torch.Tensor, torch.nn.Parameter) and x.layout is torch.strided \
        and not x.is_nested


def _guard(op: Op, args: tuple[Any, ...], consts: tuple[Any, ...]) -> bool:
    name = op[0]
    if name == "any":
        return any(all(_guard(g, args, consts) for g in group) for group in op[1:])
    i = op[1]
    x = args[i]
    if name == "tensor":
        return _plain(x)
    if name == "tensor_or_none":
        return x is None or _plain(x)
    if name == "is":
        return x is consts[op[2]]
    if name == "float_ge0":
        return type(x) is float and x >= 0
    if name == "float":
        return type(x) is float
    if name == "float_gt0":
        return type(x) is float and x > 0
    if name == "int_eq":
        return type(x) is int and x == op[2]
    if name == "bool":
        return type(x) is bool
    if name == "ndim":
        return bool(len(x.shape) == op[2])
    if name == "ndim_ge":
        return bool(len(x.shape) >= op[2])
    if name == "size_eq":
        a, b = _size(x, op[2]), _size(args[op[3]], op[4])
        return a is not None and a == b
    if name == "size_is":
        return bool(_size(x, op[2]) == op[3])
    if name == "size_ge":
        got = _size(x, op[2])
        return got is not None and got >= op[3]
    if name == "size_even":
        got = _size(x, op[2])
        return got is not None and got % 2 == 0
    if name == "size_div":
        a, b = _size(x, op[2]), _size(args[op[3]], op[4])
        return a is not None and b is not None and b > 0 and a % b == 0
    if name == "size_twice":
        a, b = _size(x, op[2]), _size(args[op[3]], op[4])
        return a is not None and b is not None and a == 2 * b
    if name == "shape_eq":
        return bool(x.shape == args[op[2]].shape)
    if name == "dtype_eq":
        return bool(x.dtype == args[op[2]].dtype)
    if name == "floating":
        return bool(x.dtype.is_floating_point)
    raise ValueError(f"unknown guard {name!r}; guards: {', '.join(GUARDS)}")


def _value(op: Op, args: tuple[Any, ...], consts: tuple[Any, ...]) -> Any:
    name = op[0]
    if name == "grad":
        return torch.is_grad_enabled()
    if name == "const":
        return consts[op[1]]
    x = args[op[1]]
    if name == "dtype":
        return x.dtype
    if name == "cuda":
        return x.is_cuda
    if name == "ndim":
        return len(x.shape)
    if name == "size":
        return x.shape[op[2]]
    if name == "arg":
        return x
    if name == "rows":
        s = x.shape
        return prod(s[:len(s) - op[2]])
    if name == "prod":
        return x.shape[op[2]] * args[op[3]].shape[op[4]]
    if name == "device":
        return x.device.type
    if name == "sm":
        if x.is_cuda:
            raise _Declined
        return None
    raise ValueError(f"unknown value {name!r}; values: {', '.join(VALUES)}")


class _Declined(Exception):
    """A value the compiled path does not read for this call."""


def _sign(a: Any, b: Any) -> int | None:
    if a is None or b is None:
        return None
    return (a > b) - (a < b)  # type: ignore[no-any-return]


def read(reading: Reading, shape: Layout, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The key of the call ``args`` as the compiled hot path reads it under ``shape``, or
    ``None`` where it declines (no case reads the call, or one reads it but not a lazy
    axis ``shape`` needs)."""
    if len(args) != reading.arity:
        return None
    consts = reading.consts
    for case in reading.cases:
        if not all(_guard(g, args, consts) for g in case.guards):
            continue
        if any(axis not in case.lazy for axis in shape.axes):
            return None
        try:
            base = tuple(_value(v, args, consts) for v in case.base)
            lazy = {axis: _value(case.lazy[axis], args, consts) for axis in shape.axes}
        except _Declined:
            return None
        out: list[Any] = []
        for item in shape.items:
            if item[0] == "interval":
                value = lazy[item[1]]
                out.append(None if value is None else bisect_right(item[2], value))
            elif item[0] == "raw":
                out.append(lazy[item[1]])
            else:
                a, b = ((lazy[s[1]] if s[0] == "lazy" else base[s[1]]) for s in item[1:])
                out.append(_sign(a, b))
        return (*base, *out)
    return None


# -- the data the compiled path is handed ------------------------------------------------

#: The key items, in the order of the compiled path's opcodes.
ITEMS = ("interval", "raw", "sign")


def _encode_op(op: Op, codes: tuple[str, ...], reading: Reading) -> tuple[Any, ...]:
    name = op[0]
    if name == "any":
        return (codes.index(name),
                *(tuple(_encode_op(g, codes, reading) for g in group) for group in op[1:]))
    return (codes.index(name), *(int(x) for x in op[1:]))


def encode(reading: Reading, shape: Layout) -> tuple[Any, ...]:
    """``(arity, cases, consts, items, slots)``: ``reading`` under ``shape`` as the
    compiled path's ``plan`` takes it (names become opcodes, lazy axes slots)."""
    slots = shape.axes
    cases = tuple(
        (tuple(_encode_op(g, GUARDS, reading) for g in case.guards),
         tuple(_encode_op(v, VALUES, reading) for v in case.base),
         tuple(_encode_op(case.lazy[a], VALUES, reading) if a in case.lazy else None
               for a in slots))
        for case in reading.cases)
    items: list[tuple[Any, ...]] = []
    for item in shape.items:
        if item[0] == "interval":
            items.append((0, slots.index(item[1]), tuple(int(p) for p in item[2])))
        elif item[0] == "raw":
            items.append((1, slots.index(item[1])))
        else:
            sides: list[int] = []
            for where, at in item[1:]:
                sides += [0, slots.index(at)] if where == "lazy" else [1, int(at)]
            items.append((2, *sides))
    return reading.arity, cases, tuple(reading.consts), tuple(items), len(slots)


def unreadable(reading: Reading, shape: Layout) -> str | None:
    """Why the compiled path reads no call under ``shape`` (a lazy axis the specs compare
    that no case of ``reading`` reads), or ``None``."""
    missing = [a for a in shape.axes if all(a not in case.lazy for case in reading.cases)]
    if missing:
        return (f"the specs compare {', '.join(missing)}, which the compiled path does not "
                f"read (the Python path serves these calls)")
    return None
