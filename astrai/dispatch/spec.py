"""``Spec``: composable, self-describing predicates over a ``CallContext``.

Each combinator is a small frozen, slotted class. ``a & b``, ``a | b`` and ``~a``
compose them; nested ands and ors flatten. The ``description`` of a spec built
from the grammar (or from the axis constructors) is the canonical expression
text, and parses back to an equivalent spec. ``failure(ctx)`` says which clause
rejected a call and what value the call had — this is what ``explain`` prints.
"""

from __future__ import annotations

__all__ = ["Spec", "parse_spec"]

import operator
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from astrai.dispatch.axes import AXES, PREDICATES, Axis, format_value

if TYPE_CHECKING:
    from astrai.dispatch.axes import CallContext, Vocabulary

_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}

# Binding strength, for deciding where parentheses go when printing.
_OR, _AND, _NOT, _ATOM = 1, 2, 3, 4


class Spec:
    """A predicate over a call context. Subclasses are frozen and hashable."""

    __slots__ = ()
    precedence: ClassVar[int] = _ATOM

    # -- evaluation -----------------------------------------------------
    def matches(self, ctx: CallContext) -> bool:
        """Whether the call described by ``ctx`` satisfies this spec."""
        raise NotImplementedError

    def __call__(self, ctx: CallContext) -> bool:
        return self.matches(ctx)

    def failure(self, ctx: CallContext) -> str | None:
        """``None`` when ``ctx`` matches, else the clause that failed and the call's value."""
        if self.matches(ctx):
            return None
        return self._reason(ctx)

    def _reason(self, ctx: CallContext) -> str:
        axes = self.axes()
        if not axes:
            return self.description
        values = ", ".join(f"{a}={format_value(_read(a, ctx))}" for a in sorted(axes))
        return f"{self.description} (call has {values})"

    def axes(self) -> frozenset[str]:
        """The names of the axes this spec reads."""
        return frozenset()

    # -- text -----------------------------------------------------------
    @property
    def description(self) -> str:
        """Canonical text of this spec."""
        raise NotImplementedError

    def _wrapped(self, outer: int) -> str:
        text = self.description
        return f"({text})" if self.precedence < outer else text

    def __repr__(self) -> str:
        return f"Spec({self.description!r})"

    def __str__(self) -> str:
        return self.description

    # -- composition ----------------------------------------------------
    def __and__(self, other: Spec) -> Spec:
        return _And.of((self, other))

    def __or__(self, other: Spec) -> Spec:
        return _Or.of((self, other))

    def __invert__(self) -> Spec:
        return _Not(self)

    # -- constructors ---------------------------------------------------
    @staticmethod
    def always() -> Spec:
        """Matches every call."""
        return _ALWAYS

    @staticmethod
    def never() -> Spec:
        """Matches no call."""
        return _NEVER

    @staticmethod
    def of(fn: Callable[[CallContext], bool], desc: str) -> Spec:
        """Wrap an arbitrary callable; ``desc`` is what ``explain`` shows."""
        return _Fn(fn, desc)

    @staticmethod
    def compare(axis: str, op: str, value: Any) -> Spec:
        """``axis <op> value`` for a known core axis."""
        return _Compare(AXES[axis], op, value)

    @staticmethod
    def dtype_in(*dtypes: torch.dtype) -> Spec:
        """The call's dtype is one of ``dtypes``."""
        return _Member(AXES["dtype"], tuple(dtypes))

    @staticmethod
    def ndim(n: int) -> Spec:
        """The main input has rank ``n``."""
        return _Compare(AXES["ndim"], "==", n)

    @staticmethod
    def head_dim_in(*dims: int) -> Spec:
        """The head size is one of ``dims``."""
        return _Member(AXES["head_dim"], tuple(dims))

    @staticmethod
    def fwd_in(*modes: str | None) -> Spec:
        """The forward mode is one of ``modes`` (``None`` = training)."""
        return _Member(AXES["fwd"], tuple(modes))

    @staticmethod
    def inference() -> Spec:
        """``fwd`` is not ``None`` (prefill or decode)."""
        return predicate("inference")

    @staticmethod
    def training() -> Spec:
        """``fwd`` is ``None``."""
        return predicate("training")

    @staticmethod
    def no_grad() -> Spec:
        """Autograd is not recording."""
        return predicate("no_grad")

    @staticmethod
    def has_cache() -> Spec:
        """A KV cache is passed."""
        return _Flag(AXES["has_cache"])

    @staticmethod
    def mask_free() -> Spec:
        """No attention mask is passed."""
        return predicate("mask_free")

    @staticmethod
    def cuda_device() -> Spec:
        """The call's tensors are on a CUDA device."""
        return predicate("cuda_device")

    @staticmethod
    def parse(text: str, vocabulary: Vocabulary | None = None) -> Spec:
        """Parse a spec expression (SPEC §4)."""
        return parse_spec(text, vocabulary)


def parse_spec(text: str, vocabulary: Vocabulary | None = None) -> Spec:
    """Parse a spec expression (SPEC §4) into a ``Spec``; raises ``SpecSyntaxError``."""
    from astrai.dispatch.grammar import compile_expression

    return compile_expression(text, vocabulary)


def _read(axis: str, ctx: CallContext) -> Any:
    known = AXES.get(axis)
    if known is not None:
        return known.getter(ctx)
    return ctx.extra.get(axis)


class _Const(Spec):
    __slots__ = ("_value",)
    _value: bool

    def __init__(self, value: bool) -> None:
        object.__setattr__(self, "_value", value)

    def matches(self, ctx: CallContext) -> bool:
        return bool(self._value)

    @property
    def description(self) -> str:
        return "always" if self._value else "never"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Const) and other._value == self._value

    def __hash__(self) -> int:
        return hash(("const", self._value))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Spec is immutable")


_ALWAYS = _Const(True)
_NEVER = _Const(False)


class _Frozen(Spec):
    """Base for combinators: immutable, equal and hashable by their fields."""

    __slots__ = ()

    def _key(self) -> tuple[Any, ...]:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._key() == self._key()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._key()))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Spec is immutable")


class _Fn(_Frozen):
    __slots__ = ("desc", "fn")
    fn: Callable[[CallContext], bool]
    desc: str

    def __init__(self, fn: Callable[[CallContext], bool], desc: str) -> None:
        object.__setattr__(self, "fn", fn)
        object.__setattr__(self, "desc", desc)

    def matches(self, ctx: CallContext) -> bool:
        return bool(self.fn(ctx))

    def _reason(self, ctx: CallContext) -> str:
        return self.desc

    @property
    def description(self) -> str:
        return self.desc

    def _key(self) -> tuple[Any, ...]:
        return (self.fn, self.desc)


class _Compare(_Frozen):
    """``axis <op> value``. An ordering test on a ``None`` value is false."""

    __slots__ = ("_fn", "_get", "axis", "op", "value")
    axis: Axis
    op: str
    value: Any
    _get: Callable[[Any], Any]
    _fn: Callable[[Any, Any], bool]

    def __init__(self, axis: Axis, op: str, value: Any) -> None:
        if op not in _OPS:
            raise ValueError(f"unknown comparison operator {op!r}; expected one of {list(_OPS)}")
        object.__setattr__(self, "axis", axis)
        object.__setattr__(self, "op", op)
        object.__setattr__(self, "value", value)
        object.__setattr__(self, "_get", axis.getter)
        object.__setattr__(self, "_fn", _OPS[op])

    def matches(self, ctx: CallContext) -> bool:
        got = self._get(ctx)
        if self.op in ("==", "!="):
            return self._fn(got, self.value)  # type: ignore[no-any-return]
        if got is None or self.value is None:
            return False
        return self._fn(got, self.value)  # type: ignore[no-any-return]

    def _reason(self, ctx: CallContext) -> str:
        return f"{self.description} (call has {format_value(self._get(ctx))})"

    def axes(self) -> frozenset[str]:
        return frozenset({self.axis.name})

    @property
    def description(self) -> str:
        return f"{self.axis.name} {self.op} {format_value(self.value)}"

    def _key(self) -> tuple[Any, ...]:
        return (self.axis.name, self.op, self.value)


class _Member(_Frozen):
    """``axis in {v, ...}`` or ``axis not in {v, ...}``."""

    __slots__ = ("_get", "_set", "axis", "negated", "values")
    axis: Axis
    values: tuple[Any, ...]
    negated: bool
    _get: Callable[[Any], Any]
    _set: frozenset[Any]

    def __init__(self, axis: Axis, values: Iterable[Any], negated: bool = False) -> None:
        vals = tuple(dict.fromkeys(values))
        object.__setattr__(self, "axis", axis)
        object.__setattr__(self, "values", vals)
        object.__setattr__(self, "negated", negated)
        object.__setattr__(self, "_get", axis.getter)
        object.__setattr__(self, "_set", frozenset(vals))

    def matches(self, ctx: CallContext) -> bool:
        return (self._get(ctx) in self._set) != self.negated

    def _reason(self, ctx: CallContext) -> str:
        return f"{self.description} (call has {format_value(self._get(ctx))})"

    def axes(self) -> frozenset[str]:
        return frozenset({self.axis.name})

    @property
    def description(self) -> str:
        word = "not in" if self.negated else "in"
        inner = ", ".join(format_value(v) for v in self.values)
        return f"{self.axis.name} {word} {{{inner}}}"

    def _key(self) -> tuple[Any, ...]:
        return (self.axis.name, self._set, self.negated)


class _Flag(_Frozen):
    """A bool axis standing alone: ``has_cache``."""

    __slots__ = ("_get", "axis")
    axis: Axis
    _get: Callable[[Any], Any]

    def __init__(self, axis: Axis) -> None:
        object.__setattr__(self, "axis", axis)
        object.__setattr__(self, "_get", axis.getter)

    def matches(self, ctx: CallContext) -> bool:
        return bool(self._get(ctx))

    def axes(self) -> frozenset[str]:
        return frozenset({self.axis.name})

    @property
    def description(self) -> str:
        return self.axis.name

    def _key(self) -> tuple[Any, ...]:
        return (self.axis.name,)


class _Named(_Frozen):
    """A named predicate (``inference``, ``no_grad``...) abbreviating an expression."""

    __slots__ = ("inner", "name")
    name: str
    inner: Spec

    def __init__(self, name: str, inner: Spec) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "inner", inner)

    def matches(self, ctx: CallContext) -> bool:
        return self.inner.matches(ctx)

    def axes(self) -> frozenset[str]:
        return self.inner.axes()

    @property
    def description(self) -> str:
        return self.name

    def _key(self) -> tuple[Any, ...]:
        return (self.name,)


def predicate(name: str) -> Spec:
    """The named predicate ``name`` (one of ``PREDICATES``)."""
    expr, axis_name = PREDICATES[name]
    axis = AXES[axis_name]
    inner: Spec
    if expr.startswith("not "):
        inner = _Not(_Flag(axis))
    elif axis.kind == "bool":
        inner = _Flag(axis)
    else:
        _, op, _ = expr.split(" ")
        inner = _Compare(axis, op, None)
    return _Named(name, inner)


class _Not(_Frozen):
    __slots__ = ("part",)
    precedence = _NOT
    part: Spec

    def __init__(self, part: Spec) -> None:
        object.__setattr__(self, "part", part)

    def matches(self, ctx: CallContext) -> bool:
        return not self.part.matches(ctx)

    def axes(self) -> frozenset[str]:
        return self.part.axes()

    @property
    def description(self) -> str:
        return f"not {self.part._wrapped(_NOT)}"

    def _key(self) -> tuple[Any, ...]:
        return (self.part,)


class _And(_Frozen):
    __slots__ = ("parts",)
    precedence = _AND
    parts: tuple[Spec, ...]

    def __init__(self, parts: tuple[Spec, ...]) -> None:
        object.__setattr__(self, "parts", parts)

    @staticmethod
    def of(parts: Iterable[Spec]) -> Spec:  # type: ignore[override]
        flat: list[Spec] = []
        for p in parts:
            flat.extend(p.parts if isinstance(p, _And) else (p,))
        return flat[0] if len(flat) == 1 else _And(tuple(flat))

    def matches(self, ctx: CallContext) -> bool:
        for p in self.parts:
            if not p.matches(ctx):
                return False
        return True

    def _reason(self, ctx: CallContext) -> str:
        # The first failing clause is the one to blame.
        for p in self.parts:
            why = p.failure(ctx)
            if why is not None:
                return why
        return self.description  # pragma: no cover - only reached if matches() was false

    def axes(self) -> frozenset[str]:
        return frozenset().union(*(p.axes() for p in self.parts))

    @property
    def description(self) -> str:
        return " and ".join(p._wrapped(_AND + 1) for p in self.parts)

    def _key(self) -> tuple[Any, ...]:
        return self.parts


class _Or(_Frozen):
    __slots__ = ("parts",)
    precedence = _OR
    parts: tuple[Spec, ...]

    def __init__(self, parts: tuple[Spec, ...]) -> None:
        object.__setattr__(self, "parts", parts)

    @staticmethod
    def of(parts: Iterable[Spec]) -> Spec:  # type: ignore[override]
        flat: list[Spec] = []
        for p in parts:
            flat.extend(p.parts if isinstance(p, _Or) else (p,))
        return flat[0] if len(flat) == 1 else _Or(tuple(flat))

    def matches(self, ctx: CallContext) -> bool:
        for p in self.parts:
            if p.matches(ctx):
                return True
        return False

    def axes(self) -> frozenset[str]:
        return frozenset().union(*(p.axes() for p in self.parts))

    @property
    def description(self) -> str:
        return " or ".join(p._wrapped(_OR + 1) for p in self.parts)

    def _key(self) -> tuple[Any, ...]:
        return self.parts


# Public names for the combinator classes, for the grammar and for isinstance checks.
Const = _Const
Compare = _Compare
Member = _Member
Flag = _Flag
Named = _Named
Not = _Not
And = _And
Or = _Or
Fn = _Fn
