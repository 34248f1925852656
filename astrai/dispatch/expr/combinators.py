"""The forms a spec is made of: each a small frozen, slotted ``Spec`` subclass.

``always``/``never``, a Python callable (opaque to analysis), the axis tests (a bool axis
alone, ``axis <op> value``, ``axis <op> other_axis``, ``axis [not] in {...}``), a named
part (a predicate or a table's definition), ``not``, and the flattening ``and`` / ``or``.
Each form evaluates itself, explains its failure, prints itself, writes its generated
expression and its plain encoding, and is equal and hashed by its fields. ``Build`` is
the one way they are made (the parser, the decoder and ``Spec``'s constructors all go
through it); importing this module installs it (``spec.install``).
"""

from __future__ import annotations

__all__ = ["Build"]

import operator
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from astrai.dispatch.axes import Axis, format_value
from astrai.dispatch.expr.encoding import Plain, encode_value
from astrai.dispatch.expr.matcher import Source
from astrai.dispatch.expr.spec import (
    BIND_AND,
    BIND_NOT,
    BIND_OR,
    AxisTest,
    Spec,
    call_values,
    install,
)

if TYPE_CHECKING:
    from astrai.dispatch.axes import CallContext

_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}


class _Frozen(Spec):
    """Base for combinators: immutable, equal and hashable by their ``_key``."""

    __slots__ = ()

    def _key(self) -> tuple[Any, ...]:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._key() == self._key()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._key()))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Spec is immutable")

    def _set(self, **fields: Any) -> None:
        for name, value in fields.items():
            object.__setattr__(self, name, value)


class _Const(_Frozen):
    """``always`` or ``never``."""

    __slots__ = ("value",)
    kind = "const"
    value: bool

    def __init__(self, value: bool) -> None:
        self._set(value=value)

    def matches(self, ctx: CallContext) -> bool:
        return self.value

    def _source(self, out: Source) -> str:
        return "True" if self.value else "False"

    @property
    def description(self) -> str:
        return "always" if self.value else "never"

    def encode(self) -> Plain:
        return ["const", self.value]

    def _key(self) -> tuple[Any, ...]:
        return (self.value,)


_ALWAYS = _Const(True)
_NEVER = _Const(False)


class _Fn(_Frozen):
    """An arbitrary callable (``Spec.of``): opaque to analysis, with no plain form."""

    __slots__ = ("desc", "fn")
    kind = "opaque"
    fn: Callable[[CallContext], bool]
    desc: str

    def __init__(self, fn: Callable[[CallContext], bool], desc: str) -> None:
        self._set(fn=fn, desc=desc)

    def matches(self, ctx: CallContext) -> bool:
        return bool(self.fn(ctx))

    def _source(self, out: Source) -> str:
        return f"{out.const(self.fn)}(ctx)"

    def _reason(self, ctx: CallContext) -> str:
        return self.desc

    @property
    def description(self) -> str:
        return self.desc

    def _key(self) -> tuple[Any, ...]:
        return (self.fn, self.desc)


class _Atom(_Frozen):
    """A test of one axis; ``_get`` reads the axis off a call."""

    __slots__ = ("_get", "axis")
    axis: Axis
    _get: Callable[[Any], Any]

    def __init__(self, axis: Axis) -> None:
        self._set(axis=axis, _get=axis.getter)

    def _reason(self, ctx: CallContext) -> str:
        if self.axis.machine:
            whose = "stated" if self.axis.name in ctx.extra else "this machine has"
            return f"{self.description} ({whose} {format_value(self._get(ctx))})"
        return f"{self.description} (call has {format_value(self._get(ctx))})"

    def axes(self) -> frozenset[str]:
        return frozenset({self.axis.name})

    @property
    def test(self) -> AxisTest:
        return AxisTest(self.axis, ())


class _Compare(_Atom):
    """``axis <op> value``. An ordering test on a ``None`` value is false."""

    __slots__ = ("_fn", "op", "value")
    op: str
    value: Any
    _fn: Callable[[Any, Any], bool]

    def __init__(self, axis: Axis, op: str, value: Any) -> None:
        if op not in _OPS:
            raise ValueError(f"unknown comparison operator {op!r}; expected one of {list(_OPS)}")
        super().__init__(axis)
        if axis.kind == "level" and isinstance(value, str):  # read back from plain data
            value = axis.parse(value)
        self._set(op=op, value=value, _fn=_OPS[op])

    def matches(self, ctx: CallContext) -> bool:
        got = self._get(ctx)
        if self.op not in ("==", "!=") and (got is None or self.value is None):
            return False
        return self._fn(got, self.value)

    def _source(self, out: Source) -> str:
        value = out.const(self.value)
        if self.op in ("==", "!="):
            return f"({out.read(self.axis)} {self.op} {value})"
        if self.value is None:
            return "False"
        got = out.temp()
        return f"(({got} := {out.read(self.axis)}) is not None and {got} {self.op} {value})"

    @property
    def test(self) -> AxisTest:
        return AxisTest(self.axis, (self.value,), ordering=self.op not in ("==", "!="),
                        op=self.op)

    @property
    def description(self) -> str:
        return f"{self.axis.name} {self.op} {format_value(self.value)}"

    def encode(self) -> Plain:
        return ["cmp", self.axis.name, self.op, encode_value(self.value)]

    def _key(self) -> tuple[Any, ...]:
        return (self.axis.name, self.op, self.value)


class _CompareAxes(_Atom):
    """``axis <op> other``: two axes of one type (``heads == kv_heads``). An ordering test
    with a ``None`` side is false."""

    __slots__ = ("_fn", "_get_other", "op", "other")
    op: str
    other: Axis
    _fn: Callable[[Any, Any], bool]
    _get_other: Callable[[Any], Any]

    def __init__(self, axis: Axis, op: str, other: Axis) -> None:
        if op not in _OPS:
            raise ValueError(f"unknown comparison operator {op!r}; expected one of {list(_OPS)}")
        super().__init__(axis)
        self._set(op=op, other=other, _fn=_OPS[op], _get_other=other.getter)

    def matches(self, ctx: CallContext) -> bool:
        left, right = self._get(ctx), self._get_other(ctx)
        if self.op not in ("==", "!=") and (left is None or right is None):
            return False
        return self._fn(left, right)

    def _source(self, out: Source) -> str:
        left, right = out.read(self.axis), out.read(self.other)
        if self.op in ("==", "!="):
            return f"({left} {self.op} {right})"
        a, b = out.temp(), out.temp()
        return (f"(({a} := {left}) is not None and ({b} := {right}) is not None "
                f"and {a} {self.op} {b})")

    def _reason(self, ctx: CallContext) -> str:
        return (f"{self.description} (call has {format_value(self._get(ctx))} and "
                f"{format_value(self._get_other(ctx))})")

    def axes(self) -> frozenset[str]:
        return frozenset({self.axis.name, self.other.name})

    @property
    def test(self) -> AxisTest:
        return AxisTest(self.axis, (), ordering=self.op not in ("==", "!="), op=self.op,
                        other=self.other)

    @property
    def description(self) -> str:
        return f"{self.axis.name} {self.op} {self.other.name}"

    def encode(self) -> Plain:
        return ["cmpaxes", self.axis.name, self.op, self.other.name]

    def _key(self) -> tuple[Any, ...]:
        return (self.axis.name, self.op, "axis", self.other.name)


class _Member(_Atom):
    """``axis in {v, ...}`` or ``axis not in {v, ...}``."""

    __slots__ = ("_values", "negated", "values")
    values: tuple[Any, ...]
    negated: bool
    _values: frozenset[Any]

    def __init__(self, axis: Axis, values: Iterable[Any], negated: bool = False) -> None:
        unique = tuple(dict.fromkeys(values))
        super().__init__(axis)
        self._set(values=unique, negated=negated, _values=frozenset(unique))

    def matches(self, ctx: CallContext) -> bool:
        return (self._get(ctx) in self._values) != self.negated

    def _source(self, out: Source) -> str:
        word = "not in" if self.negated else "in"
        return f"({out.read(self.axis)} {word} {out.const(self._values)})"

    @property
    def test(self) -> AxisTest:
        return AxisTest(self.axis, self.values)

    @property
    def description(self) -> str:
        word = "not in" if self.negated else "in"
        inner = ", ".join(format_value(v) for v in self.values)
        return f"{self.axis.name} {word} {{{inner}}}"

    def encode(self) -> Plain:
        return ["in", self.axis.name, [encode_value(v) for v in self.values], self.negated]

    def _key(self) -> tuple[Any, ...]:
        return (self.axis.name, self._values, self.negated)


class _Flag(_Atom):
    """A bool axis standing alone: ``has_cache``."""

    __slots__ = ()
    _reason = Spec._reason  # "has_cache (call has has_cache=false)"

    def matches(self, ctx: CallContext) -> bool:
        return bool(self._get(ctx))

    def _source(self, out: Source) -> str:
        return out.read(self.axis)

    @property
    def description(self) -> str:
        return self.axis.name

    def encode(self) -> Plain:
        return ["axis", self.axis.name]

    def _key(self) -> tuple[Any, ...]:
        return (self.axis.name,)


class _Named(_Frozen):
    """A named predicate (``inference``, ``no_grad``...) or a table's definition
    (``define:``), standing for what it abbreviates; equal only with the same name *and*
    meaning (two tables may define one name differently)."""

    __slots__ = ("_hash", "inner", "name")
    kind = "named"
    name: str
    inner: Spec
    _hash: int

    def __init__(self, name: str, inner: Spec) -> None:
        # The hash is kept: definitions share their specs, and hashing one must not walk
        # every use of a definition inside it again.
        self._set(name=name, inner=inner, _hash=hash(("_Named", name, inner)))

    def __hash__(self) -> int:
        return self._hash

    def matches(self, ctx: CallContext) -> bool:
        return self.inner.matches(ctx)

    def _source(self, out: Source) -> str:
        return self.inner._source(out)

    def _reason(self, ctx: CallContext) -> str:
        """``name (call has ...)`` when the whole of it fails (``mask_free (call has
        has_mask=true)``); else the clause inside that failed first: ``dense (ndim == 4
        fails; call has ndim=3)``, or a definition's own reason nested in this one."""
        inner = self.inner
        clause = inner
        if inner.kind == "and":
            clause = next(p for p in inner.parts if not p.matches(ctx))
        if clause is inner:
            return Spec._reason(self, ctx)
        if clause.kind == "named":
            return f"{self.name} ({clause.failure(ctx)})"
        values = call_values(clause, ctx)
        has = f"; call has {values}" if values else ""
        return f"{self.name} ({clause.description} fails{has})"

    def axes(self) -> frozenset[str]:
        return self.inner.axes()

    @property
    def parts(self) -> tuple[Spec, ...]:
        return (self.inner,)

    @property
    def description(self) -> str:
        return self.name

    def encode(self) -> Plain:
        return ["pred", self.name, self.inner.encode()]

    def _key(self) -> tuple[Any, ...]:
        return (self.name, self.inner)


class _Not(_Frozen):
    __slots__ = ("part",)
    precedence = BIND_NOT
    kind = "not"
    part: Spec

    def __init__(self, part: Spec) -> None:
        self._set(part=part)

    def matches(self, ctx: CallContext) -> bool:
        return not self.part.matches(ctx)

    def _source(self, out: Source) -> str:
        return f"(not {self.part._source(out)})"

    def axes(self) -> frozenset[str]:
        return self.part.axes()

    @property
    def parts(self) -> tuple[Spec, ...]:
        return (self.part,)

    @property
    def description(self) -> str:
        return f"not {self.part._wrapped(BIND_NOT)}"

    def encode(self) -> Plain:
        return ["not", self.part.encode()]

    def _key(self) -> tuple[Any, ...]:
        return (self.part,)


class _Junction(_Frozen):
    """``and`` / ``or`` of two or more specs; a nested one of the same kind is spliced in."""

    __slots__ = ("_parts",)
    word: ClassVar[str]
    _parts: tuple[Spec, ...]

    def __init__(self, parts: tuple[Spec, ...]) -> None:
        self._set(_parts=parts)

    @classmethod
    def join(cls, parts: Iterable[Spec]) -> Spec:
        flat: list[Spec] = []
        for p in parts:
            flat.extend(p.parts if type(p) is cls else (p,))
        return flat[0] if len(flat) == 1 else cls(tuple(flat))

    @property
    def parts(self) -> tuple[Spec, ...]:
        return self._parts

    def axes(self) -> frozenset[str]:
        return frozenset().union(*(p.axes() for p in self._parts))

    @property
    def description(self) -> str:
        return f" {self.word} ".join(p._wrapped(self.precedence + 1) for p in self._parts)

    def encode(self) -> Plain:
        return [self.word, [p.encode() for p in self._parts]]

    def _source(self, out: Source) -> str:
        return "(" + f" {self.word} ".join(p._source(out) for p in self._parts) + ")"

    def _key(self) -> tuple[Any, ...]:
        return self._parts


class _And(_Junction):
    __slots__ = ()
    precedence = BIND_AND
    kind = "and"
    word = "and"

    def matches(self, ctx: CallContext) -> bool:
        for p in self._parts:
            if not p.matches(ctx):
                return False
        return True

    def _reason(self, ctx: CallContext) -> str:
        # The first failing clause is the one to blame.
        for p in self._parts:
            why = p.failure(ctx)
            if why is not None:
                return why
        return self.description  # pragma: no cover - only reached if matches() was false


class _Or(_Junction):
    __slots__ = ()
    precedence = BIND_OR
    kind = "or"
    word = "or"

    def matches(self, ctx: CallContext) -> bool:
        for p in self._parts:
            if p.matches(ctx):
                return True
        return False


class Build:
    """The ``Builder`` the parser drives: one constructor per form of the grammar."""

    def const(self, value: bool) -> Spec:
        return _ALWAYS if value else _NEVER

    def flag(self, axis: Axis) -> Spec:
        return _Flag(axis)

    def compare(self, axis: Axis, op: str, value: Any) -> Spec:
        return _Compare(axis, op, value)

    def member(self, axis: Axis, values: tuple[Any, ...], negated: bool) -> Spec:
        return _Member(axis, values, negated)

    def compare_axes(self, axis: Axis, op: str, other: Axis) -> Spec:
        return _CompareAxes(axis, op, other)

    def named(self, name: str, inner: Spec) -> Spec:
        return _Named(name, inner)

    def negate(self, item: Spec) -> Spec:
        return _Not(item)

    def all_of(self, items: list[Spec]) -> Spec:
        return _And.join(items)

    def any_of(self, items: list[Spec]) -> Spec:
        return _Or.join(items)

    def opaque(self, fn: Callable[[CallContext], bool], desc: str) -> Spec:
        return _Fn(fn, desc)




install(Build())
