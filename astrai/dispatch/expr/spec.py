"""``Spec``: the one form of a spec expression - evaluated, printed, cached and encoded.

Each combinator is a small frozen, slotted class; ``a & b``, ``a | b`` and ``~a``
compose them and nested ands and ors flatten. The parser (``_parser``) builds these
combinators directly from text. This module owns:

- evaluation (``matches``) and, for ``explain``, ``failure(ctx)``: which clause
  rejected a call and the value the call had; ``matcher()``, the same test made into
  one generated Python function (attribute reads and comparisons inline), which the
  evaluator's chain walk calls;
- the one canonical printer, ``description``, which parses back to an equal spec
  (the only place operator precedence is stated for printing: ``precedence``);
- a plain, JSON-ready encoding (``encode`` / ``Spec.decode``) for the precompiled
  tables, so loading them needs no parser;
- a structural view for static analysis (``kind``, ``parts``, ``test``), so tools
  such as lint never reach into the combinator classes.
"""

from __future__ import annotations

__all__ = ["AxisTest", "Comparisons", "Spec", "comparisons", "cut_points", "named_parts",
           "parse_spec"]

import functools
import keyword
import operator
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch

from astrai.dispatch.axes import (
    AXES,
    CORE_VOCABULARY,
    DTYPES,
    Axis,
    Vocabulary,
    dtype_name,
    format_value,
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

# Binding strength, for deciding where parentheses go when printing.
_OR, _AND, _NOT, _ATOM = 1, 2, 3, 4

#: What a spec is, structurally (``Spec.kind``): an ``atom`` tests one axis
#: (see ``Spec.test``); ``opaque`` calls Python (``Spec.of``) and cannot be analysed.
Kind = Literal["const", "atom", "named", "not", "and", "or", "opaque"]

#: A spec's plain form (lists, so it survives JSON); see ``Spec.encode``.
Plain = list[Any]


@dataclass(frozen=True)
class AxisTest:
    """What an atom tests: its ``axis``, the ``values`` it names, and whether it orders
    them (``<``, ``<=``, ``>``, ``>=``)."""

    axis: Axis
    values: tuple[Any, ...]
    ordering: bool = False
    op: str = ""  # a comparison's operator; "" for membership and flags
    other: Axis | None = None  # the axis compared with, for ``axis <op> other``


class Spec:
    """A predicate over a call context. Subclasses are frozen and hashable."""

    __slots__ = ("_m",)
    precedence: ClassVar[int] = _ATOM
    kind: ClassVar[Kind] = "atom"
    #: ``matcher()``'s function once made (``None`` until then).
    _m: Callable[[CallContext], Any] | None

    def __new__(cls, *args: Any, **kwargs: Any) -> Spec:
        self = super().__new__(cls)
        object.__setattr__(self, "_m", None)
        return self

    # -- evaluation -----------------------------------------------------
    def matches(self, ctx: CallContext) -> bool:
        """Whether the call described by ``ctx`` satisfies this spec."""
        raise NotImplementedError

    def matcher(self) -> Callable[[CallContext], Any]:
        """``matches`` as one generated function, made on first use and kept: its result's
        truth is ``matches``'s answer. A spec that does not generate (too deep for the
        compiler, say) keeps its ``matches``."""
        got = self._m
        if got is None:
            got = _generate(self)
            object.__setattr__(self, "_m", got)
        return got

    def _source(self, out: _Source) -> str:
        """A Python expression over ``ctx`` true exactly when this spec matches (the
        generated ``matcher``); a spec without one calls its own ``matches``."""
        return f"{out.const(self.matches)}(ctx)"

    def __call__(self, ctx: CallContext) -> bool:
        return self.matches(ctx)

    def failure(self, ctx: CallContext) -> str | None:
        """``None`` when ``ctx`` matches, else the clause that failed and the call's value."""
        if self.matches(ctx):
            return None
        return self._reason(ctx)

    def _reason(self, ctx: CallContext) -> str:
        values = _call_values(self, ctx)
        return f"{self.description} (call has {values})" if values else self.description

    def axes(self) -> frozenset[str]:
        """The names of the axes this spec reads."""
        return frozenset()

    # -- structure ------------------------------------------------------
    @property
    def parts(self) -> tuple[Spec, ...]:
        """The specs this one is made of: a ``named`` spec's definition, a ``not``'s
        operand, an ``and``/``or``'s operands; ``()`` for the rest."""
        return ()

    @property
    def test(self) -> AxisTest | None:
        """For an ``atom``: the axis it reads and the values it names; else ``None``."""
        return None

    def encode(self) -> Plain:
        """This spec as plain JSON-ready data; ``Spec.decode`` reads it back.

        Forms: ``["const", bool]``, ``["axis", name]``, ``["pred", name, plain]`` (a
        predicate or a table's definition, with what it stands for),
        ``["cmp", axis, op, value]``, ``["cmpaxes", axis, op, other_axis]``,
        ``["in", axis, [value, ...], negated]``,
        ``["not", plain]``, ``["and", [plain, ...]]``, ``["or", [plain, ...]]``; a value
        is ``null``, a bool, an int, a str, or ``{"dtype": name}``.
        """
        raise TypeError(f"{self.description!r} calls Python and has no plain form")

    @staticmethod
    def decode(plain: Plain, vocabulary: Vocabulary = CORE_VOCABULARY) -> Spec:
        """The spec ``plain`` encodes (see ``encode``), its axes looked up in
        ``vocabulary``. Raises ``ValueError`` for data that is not such an encoding."""
        try:
            return _decode(plain, vocabulary)
        except (KeyError, IndexError, TypeError) as exc:
            raise ValueError(f"not an encoded spec: {plain!r} ({type(exc).__name__})") from None

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

    # -- copies: a spec is an immutable value, so a copy is the spec itself ----
    def __copy__(self) -> Spec:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Spec:
        return self

    def __str__(self) -> str:
        return self.description

    # -- composition ----------------------------------------------------
    def __and__(self, other: Spec) -> Spec:
        return _And.join((self, other))

    def __or__(self, other: Spec) -> Spec:
        return _Or.join((self, other))

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
    def named(name: str, inner: Spec) -> Spec:
        """``inner`` under the name ``name`` (a table's definition): printed as ``name``,
        evaluated as ``inner``."""
        return _Named(name, inner)

    @staticmethod
    def member(axis: str, values: Iterable[Any], negated: bool = False) -> Spec:
        """``axis in {values}`` (``negated``: ``not in``) for a known core axis."""
        return _Member(AXES[axis], values, negated)

    @staticmethod
    def parse(text: str, vocabulary: Vocabulary | None = None) -> Spec:
        """Parse a spec expression (contract §4)."""
        return parse_spec(text, vocabulary)


def parse_spec(text: str, vocabulary: Vocabulary | None = None) -> Spec:
    """Parse and type-check a spec expression (contract §4) against ``vocabulary`` (default:
    the core axes and predicates); cached per text and vocabulary. Raises
    ``SpecSyntaxError``."""
    if vocabulary is None or vocabulary is CORE_VOCABULARY:
        return _parse_cached(text, _CORE_KEY)
    try:
        key = _VocabularyKey(vocabulary)
    except TypeError:  # something unhashable in a custom vocabulary: skip the cache
        return _parse(text, vocabulary)
    return _parse_cached(text, key)


def predicate(name: str) -> Spec:
    """The core predicate ``name`` (``inference``, ``no_grad``...)."""
    return parse_spec(name)


def _parse(text: str, vocabulary: Vocabulary) -> Spec:
    # The parser is imported on first use: loading precompiled tables never parses.
    from astrai.dispatch.expr._parser import parse

    return parse(text, vocabulary, _BUILD)


class _VocabularyKey:
    """A hashable stand-in for a ``Vocabulary`` (whose mappings are not hashable)."""

    __slots__ = ("_hash", "_key", "vocabulary")

    def __init__(self, vocabulary: Vocabulary) -> None:
        self.vocabulary = vocabulary
        # The getter is compared by identity: equal axes may read differently.
        axes = tuple((name, axis, axis.getter) for name, axis in vocabulary.axes.items())
        self._key = (axes, tuple(vocabulary.predicates.items()),
                     tuple(vocabulary.definitions.items()))
        self._hash = hash(self._key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _VocabularyKey) and other._key == self._key

    def __hash__(self) -> int:
        return self._hash


_CORE_KEY = _VocabularyKey(CORE_VOCABULARY)


@functools.lru_cache(maxsize=4096)
def _parse_cached(text: str, key: _VocabularyKey) -> Spec:
    return _parse(text, key.vocabulary)


def _read(axis: str, ctx: CallContext) -> Any:
    known = AXES.get(axis)
    if known is not None:
        return known.getter(ctx)
    return ctx.extra.get(axis)


def _call_values(spec: Spec, ctx: CallContext) -> str:
    """The call's values of the axes ``spec`` reads: ``has_cache=false, ndim=3``."""
    return ", ".join(f"{a}={format_value(_read(a, ctx))}" for a in sorted(spec.axes()))


def _encode_value(value: Any) -> Any:
    return {"dtype": dtype_name(value)} if isinstance(value, torch.dtype) else value


def _decode_value(value: Any) -> Any:
    return DTYPES[value["dtype"]] if isinstance(value, dict) else value


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

    def _source(self, out: _Source) -> str:
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

    def _source(self, out: _Source) -> str:
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
        self._set(op=op, value=value, _fn=_OPS[op])

    def matches(self, ctx: CallContext) -> bool:
        got = self._get(ctx)
        if self.op not in ("==", "!=") and (got is None or self.value is None):
            return False
        return self._fn(got, self.value)

    def _source(self, out: _Source) -> str:
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
        return ["cmp", self.axis.name, self.op, _encode_value(self.value)]

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

    def _source(self, out: _Source) -> str:
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

    def _source(self, out: _Source) -> str:
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
        return ["in", self.axis.name, [_encode_value(v) for v in self.values], self.negated]

    def _key(self) -> tuple[Any, ...]:
        return (self.axis.name, self._values, self.negated)


class _Flag(_Atom):
    """A bool axis standing alone: ``has_cache``."""

    __slots__ = ()
    _reason = Spec._reason  # "has_cache (call has has_cache=false)"

    def matches(self, ctx: CallContext) -> bool:
        return bool(self._get(ctx))

    def _source(self, out: _Source) -> str:
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

    def _source(self, out: _Source) -> str:
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
        values = _call_values(clause, ctx)
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
    precedence = _NOT
    kind = "not"
    part: Spec

    def __init__(self, part: Spec) -> None:
        self._set(part=part)

    def matches(self, ctx: CallContext) -> bool:
        return not self.part.matches(ctx)

    def _source(self, out: _Source) -> str:
        return f"(not {self.part._source(out)})"

    def axes(self) -> frozenset[str]:
        return self.part.axes()

    @property
    def parts(self) -> tuple[Spec, ...]:
        return (self.part,)

    @property
    def description(self) -> str:
        return f"not {self.part._wrapped(_NOT)}"

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

    def _source(self, out: _Source) -> str:
        return "(" + f" {self.word} ".join(p._source(out) for p in self._parts) + ")"

    def _key(self) -> tuple[Any, ...]:
        return self._parts


class _And(_Junction):
    __slots__ = ()
    precedence = _AND
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
    precedence = _OR
    kind = "or"
    word = "or"

    def matches(self, ctx: CallContext) -> bool:
        for p in self._parts:
            if p.matches(ctx):
                return True
        return False


class _Source:
    """What a generated matcher is made of: its constants by name, and fresh names."""

    def __init__(self) -> None:
        self.names: dict[str, Any] = {}
        self.temps = 0

    def const(self, value: Any) -> str:
        """A name the generated code reads ``value`` by (values never enter the text)."""
        name = f"_c{len(self.names)}"
        self.names[name] = value
        return name

    def temp(self) -> str:
        """A fresh local name."""
        self.temps += 1
        return f"_t{self.temps}"

    def read(self, axis: Axis) -> str:
        """The expression that reads ``axis`` off ``ctx``: the attribute itself for a
        core axis read the usual way, else the axis's own getter."""
        name, get = axis.name, axis.getter
        # (ASCII only: Python normalises the identifiers in source text, attrgetter not)
        if (axis.core and name.isascii() and name.isidentifier() and not keyword.iskeyword(name)
                and type(get) is operator.attrgetter
                and get.__reduce__() == (operator.attrgetter, (name,))):
            return f"ctx.{name}"
        return f"{self.const(axis.getter)}(ctx)"


def _generate(spec: Spec) -> Callable[[CallContext], Any]:
    """``spec.matches`` as one function: its clauses inline, in order, short-circuiting
    as ``matches`` does (``spec.matcher()`` keeps it)."""
    out = _Source()
    try:
        body = spec._source(out)
        code = compile(f"def _matches(ctx):\n    return {body}\n", "<astrai spec>", "exec")
    except Exception:  # too deep for the compiler, or a spec of unforeseen make
        return spec.matches  # the tree walk answers
    exec(code, out.names)  # the text: axis names and fixed words; values are bound names
    return out.names["_matches"]  # type: ignore[no-any-return]


class _Build:
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


_BUILD = _Build()


def _decode(plain: Plain, vocabulary: Vocabulary) -> Spec:
    tag = plain[0]
    if tag == "const":
        return _ALWAYS if plain[1] else _NEVER
    if tag == "axis":
        return _Flag(vocabulary.axes[plain[1]])
    if tag == "pred":
        return _Named(plain[1], _decode(plain[2], vocabulary))
    if tag == "cmp":
        return _Compare(vocabulary.axes[plain[1]], plain[2], _decode_value(plain[3]))
    if tag == "cmpaxes":
        return _CompareAxes(vocabulary.axes[plain[1]], plain[2], vocabulary.axes[plain[3]])
    if tag == "in":
        values = (_decode_value(v) for v in plain[2])
        return _Member(vocabulary.axes[plain[1]], values, bool(plain[3]))
    if tag == "not":
        return _Not(_decode(plain[1], vocabulary))
    if tag in ("and", "or"):
        junction = _And if tag == "and" else _Or
        return junction.join(_decode(p, vocabulary) for p in plain[1])
    raise TypeError(tag)


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
