"""The hot path in Python: each key plan compiled into one generated function.

Where astrai's native extension is not in use, the facades still look a call up before
taking their route. A route's plan (``astrai.dispatch.reading.encode`` of its family's
``Reading`` under the snapshot's key layout) becomes the source of one Python function,
compiled once per plan, that checks the call's guards, reads its base and lazy values
and makes its key in one frame (each tensor's shape read once, no reader called per
axis); ``lookup``, one function for every plan, then finds the decision the route keeps
for that key in its last world and checks that this world is still in force.

This module has the native extension's hot-path interface (``plan``, ``lookup``,
``key``) and the meaning of ``reading.read``: the same key, and a call no case reads is
declined (the route then validates and keys it). What it saves is the route's work on
the pure-Python path - the family's ``describe``, then one reader per lazy axis and the
key plan's ``extend``, each a call of its own.
"""

from __future__ import annotations

__all__ = ["key", "lookup", "plan", "planner", "source"]

from math import prod
from typing import Any

import torch

from astrai.dispatch import state as process
from astrai.dispatch.autocasting import autocasting
from astrai.dispatch.reading import GUARDS, ITEMS, VALUES
from astrai.dispatch.scopes import current_scope
from astrai.env import OPS_KEY, environ_get


class _Case:
    """One case of a plan being written: what its code has read so far where every later
    expression sees it (``settled``: outside an ``any``) - each argument's shape into
    ``s<i>`` and dtype into ``t<i>`` - and each argument's rank as far as its guards tell
    (exact or at least), so that sizes known to exist are read without a range check."""

    def __init__(self) -> None:
        self.read: set[str] = set()
        self.rank: dict[int, tuple[int, bool]] = {}  # argument -> (rank, exact)
        self.tensors: set[int] = set()  # arguments a settled guard found plain tensors

    def _once(self, name: str, expr: str, settled: bool) -> str:
        if name in self.read:
            return name
        if settled:
            self.read.add(name)
        return f"({name} := {expr})"

    def shape(self, i: int, settled: bool) -> str:
        """Argument ``i``'s shape."""
        return self._once(f"s{i}", f"a{i}.shape", settled)

    def dtype(self, i: int, settled: bool) -> str:
        """Argument ``i``'s dtype."""
        return self._once(f"t{i}", f"a{i}.dtype", settled)

    def ranked(self, i: int, n: int, exact: bool) -> None:
        """A settled guard told argument ``i``'s rank: ``n``, or at least ``n``."""
        self.rank[i] = (n, exact) if exact or i not in self.rank else max(
            self.rank[i], (n, False))

    def at(self, i: int, shape: str, dim: int) -> tuple[str, bool]:
        """Size ``dim`` of argument ``i`` (its shape named ``shape``), and whether it may
        be ``None`` (out of range)."""
        n, _ = self.rank.get(i, (0, False))
        if (0 <= dim < n) or (-n <= dim < 0):
            return f"{shape}[{dim}]", False
        if dim >= 0:
            return f"({shape}[{dim}] if len({shape}) > {dim} else None)", True
        return f"({shape}[{dim}] if len({shape}) >= {-dim} else None)", True


def _tensor(i: int) -> str:
    a = f"a{i}"
    return f"(type({a}) in _PLAIN and {a}.layout is _strided and not {a}.is_nested)"


def _guard(op: tuple[Any, ...], case: _Case, settled: bool) -> str:
    """One guard as an expression (``settled``: not inside an ``any``)."""
    name = GUARDS[op[0]]
    if name == "any":
        # The shapes its groups read of arguments known to be plain tensors: read once,
        # before it, so that no group reads them again (nor does what follows).
        first = [f"(s{i} := a{i}.shape) is not None and " for i in sorted(
            case.tensors & _shapes_read(op)) if settled and f"s{i}" not in case.read]
        if settled:
            case.read.update(f"s{i}" for i in case.tensors & _shapes_read(op))
        groups = [" and ".join(_guard(g, case, False) for g in group) or "True"
                  for group in op[1:]]
        tail = "(" + " or ".join(f"({g})" for g in groups) + ")" if groups else "False"
        return f"({''.join(first)}{tail})" if first else tail
    i, a = int(op[1]), f"a{op[1]}"
    if name == "tensor":
        if settled:
            case.tensors.add(i)
        return _tensor(i)
    if name == "tensor_or_none":
        return f"({a} is None or {_tensor(i)})"
    if name == "is":
        return f"({a} is _c{int(op[2])})"
    if name == "float_ge0":
        return f"(type({a}) is float and {a} >= 0)"
    if name == "float":
        return f"(type({a}) is float)"
    if name == "float_gt0":
        return f"(type({a}) is float and {a} > 0)"
    if name == "int_eq":
        return f"(type({a}) is int and {a} == {int(op[2])})"
    if name == "bool":
        return f"(type({a}) is bool)"
    if name == "floating":
        return f"{case.dtype(i, settled)}.is_floating_point"
    if name == "dtype_eq":
        return f"({case.dtype(i, settled)} == {case.dtype(int(op[2]), settled)})"
    s = case.shape(i, settled)
    if name in ("ndim", "ndim_ge"):
        out = f"(len({s}) {'==' if name == 'ndim' else '>='} {int(op[2])})"
        if settled:
            case.ranked(i, int(op[2]), name == "ndim")
        return out
    if name == "shape_eq":
        return f"({s} == {case.shape(int(op[2]), settled)})"
    mine, maybe = case.at(i, s, int(op[2]))
    if name in ("size_is", "size_ge", "size_even"):
        test = "% 2 == 0" if name == "size_even" else (
            f"{'==' if name == 'size_is' else '>='} {int(op[3])}")
        if name == "size_is" or not maybe:  # None == n is False, as out of range
            return f"({mine} {test})"
        return f"((v := {mine}) is not None and v {test})"
    j = int(op[3])
    other, maybe_other = case.at(j, case.shape(j, settled) if j != i else s, int(op[4]))
    if name == "size_eq":
        if maybe or maybe_other:
            return f"_eq({mine}, {other})"
        return f"({mine} == {other})"
    if name == "size_div":
        return f"_div({mine}, {other})"
    if name == "size_twice":
        return f"_twice({mine}, {other})"
    raise ValueError(f"unknown guard opcode {op[0]!r}")


_NO_SHAPE = ("tensor", "tensor_or_none", "is", "float", "float_ge0", "float_gt0", "int_eq",
             "bool", "floating", "dtype_eq")


def _shapes_read(op: tuple[Any, ...]) -> set[int]:
    """The arguments whose shape guard ``op`` reads."""
    name = GUARDS[op[0]]
    if name == "any":
        return {i for group in op[1:] for g in group for i in _shapes_read(g)}
    if name in _NO_SHAPE:
        return set()
    if name in ("size_eq", "size_div", "size_twice"):
        return {int(op[1]), int(op[3])}
    if name == "shape_eq":
        return {int(op[1]), int(op[2])}
    return {int(op[1])}


def _value(op: tuple[Any, ...], case: _Case) -> tuple[str, bool]:
    """One base or lazy value as an expression (raising ``_Declined`` where ``read``
    declines), and whether it may be ``None``."""
    name = VALUES[op[0]]
    if name == "grad":
        return "_grad()", False
    if name == "const":
        return f"_c{int(op[1])}", True
    i, a = int(op[1]), f"a{op[1]}"
    if name == "arg":
        return a, True
    if name == "dtype":
        return case.dtype(i, True), False
    if name == "cuda":
        return f"{a}.is_cuda", False
    if name == "device":
        return f"('cpu' if {a}.is_cpu else {a}.device.type)", False
    if name == "sm":
        return f"(_declined() if {a}.is_cuda else None)", True
    s = case.shape(i, True)
    if name == "ndim":
        return f"len({s})", False
    if name == "size":
        return f"{s}[{int(op[2])}]", False
    if name == "rows":
        n, exact = case.rank.get(i, (0, False))
        k = int(op[2])
        if exact and n - k >= 1:
            return "(" + " * ".join(f"{s}[{d}]" for d in range(n - k)) + ")", False
        # the common ranks written out, ``_rows`` for the others
        return (f"({s}[0] if len({s}) == {k + 1} else {s}[0] * {s}[1] if len({s}) == "
                f"{k + 2} else _rows({s}, {k}))"), False
    if name == "prod":
        j = int(op[3])
        other = s if j == i else case.shape(j, True)
        return f"({s}[{int(op[2])}] * {other}[{int(op[4])}])", False
    raise ValueError(f"unknown value opcode {op[0]!r}")


def _interval(points: tuple[int, ...], v: str, first: int = 0) -> str:
    """``bisect_right(points, v)`` as an expression (``first``: the index of ``points[0]``
    in the whole): a chain of comparisons, halving the points past four."""
    if len(points) > 4:
        mid = len(points) // 2
        return (f"({_interval(points[mid + 1:], v, first + mid + 1)} if {v} >= {points[mid]} "
                f"else {_interval(points[:mid], v, first)})")
    out = str(first + len(points))
    for n in range(len(points) - 1, -1, -1):
        out = f"{first + n} if {v} < {points[n]} else {out}"
    return f"({out})"


def _body(cases: tuple[Any, ...], items: tuple[Any, ...], found: str) -> list[str]:
    """The statements reading a call into ``key`` (then the lines of ``found``), or
    returning ``None`` where no case reads it, indented for a function body."""
    lines: list[str] = []
    for n, (guards, base, lazy) in enumerate(cases):
        case = _Case()
        test = " and ".join(_guard(g, case, True) for g in guards) or "True"
        lines.append(f"{'if' if n == 0 else 'elif'} {test}:")
        if any(v is None for v in lazy):  # the case does not read a lazy axis the key needs
            lines.append("    return None")
            continue
        body: list[str] = []
        parts: list[str] = []
        for j, v in enumerate(base):
            body.append(f"b{j} = {_value(v, case)[0]}")
            parts.append(f"b{j}")
        maybe: list[bool] = []
        for j, v in enumerate(lazy):
            expr, none = _value(v, case)
            body.append(f"l{j} = {expr}")
            maybe.append(none)
        for item in items:
            kind = ITEMS[item[0]]
            if kind == "interval":
                at = _interval(tuple(int(p) for p in item[2]), f"l{item[1]}")
                parts.append(f"(None if l{item[1]} is None else {at})" if maybe[item[1]]
                             else at)
            elif kind == "raw":
                parts.append(f"l{item[1]}")
            else:
                sides = [f"l{at}" if where == 0 else f"b{at}"
                         for where, at in (item[1:3], item[3:5])]
                parts.append(f"_sign({sides[0]}, {sides[1]})")
        body.append(f"key = ({', '.join(parts)}{',' if len(parts) == 1 else ''})")
        lines += [f"    {line}" for line in (*body, *found.splitlines())]
    lines.append("return None")
    return lines


def source(arity: int, cases: tuple[Any, ...], consts: tuple[Any, ...],
           items: tuple[Any, ...], slots: int) -> str:
    """The Python source of an encoded plan (``reading.encode``): ``_key(a0, ...)``, the
    call's key or ``None`` where no case reads it. Finding the decision kept for that key
    and checking its world is ``lookup``'s, one function for every plan: in a model the
    code each facade runs alone starts cold at each of its calls (the layers between
    two calls of a facade stream their weights through the caches), the code every
    facade shares far less so."""
    args = ", ".join(f"a{i}" for i in range(arity))
    out = [f"def _key({args}):", "    try:"]
    out += [f"        {line}" for line in _body(cases, items, "return key")]
    out += ["    except Exception:  # what it cannot read, the route keys or refuses",
            "        return None"]
    return "\n".join(out) + "\n"


class _Declined(Exception):
    """A value this path does not read for the call (``reading.read`` declines it)."""


def _declined() -> Any:
    raise _Declined


def _rows(s: Any, k: int) -> Any:
    n = len(s) - k
    if n == 1:
        return s[0]
    if n == 2:
        return s[0] * s[1]
    return prod(s[:n])


def _eq(a: Any, b: Any) -> bool:
    return a is not None and a == b


def _div(a: Any, b: Any) -> bool:
    return a is not None and b is not None and b > 0 and a % b == 0


def _twice(a: Any, b: Any) -> bool:
    return a is not None and b is not None and a == 2 * b


def _sign(a: Any, b: Any) -> int | None:
    if a is None or b is None:
        return None
    return (a > b) - (a < b)  # type: ignore[no-any-return]


_NAMES = {"_PLAIN": (torch.Tensor, torch.nn.Parameter),
          "_strided": torch.strided, "_grad": torch.is_grad_enabled,
          "_declined": _declined, "_rows": _rows, "_eq": _eq,
          "_div": _div, "_twice": _twice, "_sign": _sign}


class Plan:
    """A compiled plan: ``key(*args)`` (a call's key or ``None``), the number of
    arguments it reads and its source."""

    __slots__ = ("arity", "key", "text")

    def __init__(self, arity: int, key: Any, text: str) -> None:
        self.arity, self.key, self.text = arity, key, text

    def __repr__(self) -> str:
        return f"<astrai Python hot-path plan of {self.arity} argument(s)>"


def plan(arity: int, cases: tuple[Any, ...], consts: tuple[Any, ...],
         items: tuple[Any, ...], slots: int) -> Plan:
    """An encoded plan (``reading.encode``) compiled into its functions."""
    text = source(arity, cases, consts, items, slots)
    names: dict[str, Any] = {**_NAMES, **{f"_c{i}": c for i, c in enumerate(consts)},
                             "__name__": __name__}  # its frames are this module's
    exec(compile(text, "<astrai plan>", "exec"), names)  # our own source, from data
    return Plan(arity, names["_key"], text)


def planner(arity: int, cases: tuple[Any, ...], consts: tuple[Any, ...],
            items: tuple[Any, ...], slots: int) -> Plan:
    """The facades' planner on the pure-Python path: ``plan``'s, for every reading. In a
    model a call starts with the caches cold (a layer's weights streamed through them since
    the last call of that facade), and there what a call costs is mostly the code and data
    it touches: one generated function checking every guard of the reading touches less
    than the route's keying - the family's ``describe``, one reader per lazy axis, the key
    plan's ``extend``, each a call of its own - even where the route keys by ``describe``
    alone (a Llama decode step, hidden 512, 1 thread, routed rms_norm, rotary and gated
    activation calls keyed by their route: 130 to 175 us a step more than by their plans,
    of about 6 000 us)."""
    return plan(arity, cases, consts, items, slots)


def key(p: Any, *args: Any) -> Any:
    """The key ``lookup`` reads the call ``args`` by under plan ``p``, or ``None``."""
    if not isinstance(p, Plan):
        raise TypeError("key(plan, *args): plan is not a plan")
    return p.key(*args) if len(args) == p.arity else None


def lookup(last: list[Any], *args: Any) -> Any:
    """The decision the route whose last world ``last`` holds keeps for the call
    ``args``, or ``None`` (no plan, another arity, autocast in force, a call its plan
    declines, no decision kept, or a world no longer in force)."""
    seen = last[0]
    p = seen[3]
    if p.__class__ is not Plan or len(args) != p.arity or autocasting():
        return None
    key = p.key(*args)
    if key is None:
        return None
    try:
        d = seen[1].get(key)
    except Exception:  # a raw value that is no dictionary key: the route refuses or keys it
        return None
    if d is None:
        return None
    # The world it was taken in must be in force (checked last: Python code may have run
    # meanwhile - a collection, a finalizer).
    w = seen[0]
    if (w[0] is not process.snapshot or w[1] is not current_scope()
            or w[2] is not environ_get(OPS_KEY)
            or (w[3] is not None and w[4] is not environ_get(w[3]))):
        return None
    return d
