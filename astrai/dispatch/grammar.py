"""Spec expressions (SPEC §4): an AST of frozen pydantic models, its text, its ``Spec``.

The grammar::

    expr       := or_expr
    or_expr    := and_expr ("or" and_expr)*
    and_expr   := not_expr ("and" not_expr)*
    not_expr   := "not" not_expr | atom
    atom       := "(" expr ")" | "always" | "never" | AXIS | comparison | PREDICATE
    comparison := AXIS ("==" | "!=" | "<" | "<=" | ">" | ">=") value
                | AXIS ["not"] "in" "{" value ("," value)* "}"
    value      := NAME | INT | "none" | "true" | "false"

``parse_expression`` tokenizes, parses and type-checks text against a vocabulary
(the core axes and predicates, plus a family's extra axes); ``to_text`` prints an
AST canonically; ``to_spec`` builds the ``Spec`` combinators, whose
``description`` is that same canonical text; ``compile_expression`` does all of
it, cached per text and vocabulary. Every error is a ``SpecSyntaxError``.
"""

from __future__ import annotations

__all__ = [
    "AndNode",
    "AxisNode",
    "CompareNode",
    "CompareOp",
    "ConstNode",
    "Expr",
    "MemberNode",
    "Node",
    "NotNode",
    "OrNode",
    "PredicateNode",
    "Value",
    "compile_expression",
    "parse_expression",
    "to_spec",
    "to_text",
]

import functools
from typing import Literal, NoReturn

import torch
from pydantic import BaseModel, ConfigDict, Field

from astrai.dispatch._suggest import did_you_mean
from astrai.dispatch.axes import CORE_VOCABULARY, PREDICATES, Axis, Vocabulary, format_value
from astrai.dispatch.spec import And, Compare, Flag, Member, Named, Not, Or, Spec, predicate
from astrai.errors import SpecSyntaxError

#: A typed value: ``bool`` (bool axes), ``int``, ``str`` (enum axes), a dtype, or ``None``.
Value = bool | int | str | torch.dtype | None
CompareOp = Literal["==", "!=", "<", "<=", ">", ">="]


class Node(BaseModel):
    """Base of the AST nodes: frozen, hashable, and carrying its ``(start, end)`` source span."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    span: tuple[int, int] = Field(default=(0, 0), repr=False)


class ConstNode(Node):
    """``always`` (``value`` true) or ``never``."""

    value: bool


class AxisNode(Node):
    """A bool axis standing alone: ``has_cache``."""

    axis: str


class PredicateNode(Node):
    """A named predicate: ``inference``, ``no_grad``..."""

    name: str


class CompareNode(Node):
    """``axis <op> value``."""

    axis: str
    op: CompareOp
    value: Value


class MemberNode(Node):
    """``axis in {v, ...}`` or, ``negated``, ``axis not in {v, ...}``."""

    axis: str
    values: tuple[Value, ...] = Field(min_length=1)
    negated: bool = False


class NotNode(Node):
    """``not item``."""

    item: Expr


class AndNode(Node):
    """``item and item ...`` (two or more)."""

    items: tuple[Expr, ...] = Field(min_length=2)


class OrNode(Node):
    """``item or item ...`` (two or more)."""

    items: tuple[Expr, ...] = Field(min_length=2)


Expr = OrNode | AndNode | NotNode | ConstNode | AxisNode | PredicateNode | CompareNode | MemberNode

NotNode.model_rebuild()
AndNode.model_rebuild()
OrNode.model_rebuild()


# -- parsing ---------------------------------------------------------------------------


def parse_expression(text: str, vocabulary: Vocabulary | None = None) -> Expr:
    """Parse and type-check ``text`` against ``vocabulary`` (default: the core axes)."""
    from astrai.dispatch._parser import Parser  # _parser builds this module's nodes

    return Parser(text, CORE_VOCABULARY if vocabulary is None else vocabulary).parse()


# -- canonical text ---------------------------------------------------------------------

# Binding strength, for deciding where parentheses go (the same as ``Spec`` uses).
_OR, _AND, _NOT, _ATOM = 1, 2, 3, 4


def to_text(node: Expr) -> str:
    """The canonical text of ``node``: the ``description`` of the spec it compiles to.

    Nested ``and``s and ``or``s are flattened, set values deduplicated, values
    written canonically (``half`` -> ``float16``) and parentheses placed only
    where precedence needs them.
    """
    match node:
        case ConstNode(value=value):
            return "always" if value else "never"
        case AxisNode(axis=axis):
            return axis
        case PredicateNode(name=name):
            return name
        case CompareNode(axis=axis, op=op, value=value):
            return f"{axis} {op} {format_value(value)}"
        case MemberNode(axis=axis, values=values, negated=negated):
            inner = ", ".join(format_value(v) for v in dict.fromkeys(values))
            return f"{axis} {'not in' if negated else 'in'} {{{inner}}}"
        case NotNode(item=item):
            return f"not {_wrapped(item, _NOT)}"
        case AndNode():
            return " and ".join(_wrapped(i, _AND + 1) for i in _flatten(node))
        case OrNode():
            return " or ".join(_wrapped(i, _OR + 1) for i in _flatten(node))
    raise TypeError(f"not a spec expression node: {node!r}")


def _precedence(node: Expr) -> int:
    if isinstance(node, OrNode):
        return _OR
    if isinstance(node, AndNode):
        return _AND
    return _NOT if isinstance(node, NotNode) else _ATOM


def _wrapped(node: Expr, outer: int) -> str:
    text = to_text(node)
    return f"({text})" if _precedence(node) < outer else text


def _flatten(node: AndNode | OrNode) -> list[Expr]:
    """The items of ``node``, with items of the same kind spliced in (``and`` is associative)."""
    flat: list[Expr] = []
    for item in node.items:
        flat.extend(_flatten(item) if type(item) is type(node) else (item,))
    return flat


# -- compilation ------------------------------------------------------------------------


def to_spec(node: Expr, vocabulary: Vocabulary | None = None) -> Spec:
    """The ``Spec`` combinators for ``node``; names are looked up in ``vocabulary``.

    ``node`` should come from ``parse_expression`` with the same vocabulary; a
    hand-built node naming an unknown axis or predicate raises ``SpecSyntaxError``.
    """
    vocab = CORE_VOCABULARY if vocabulary is None else vocabulary
    return _Builder(vocab, node).build(node)


class _Builder:
    def __init__(self, vocabulary: Vocabulary, root: Expr) -> None:
        self.vocabulary = vocabulary
        self.root = root

    def build(self, node: Expr) -> Spec:
        match node:
            case ConstNode(value=value):
                return Spec.always() if value else Spec.never()
            case AxisNode(axis=name):
                axis = self.axis(name)
                if axis.kind != "bool":
                    self.fail(f"{name!r} needs a comparison; only bool axes stand alone")
                return Flag(axis)
            case PredicateNode(name=name):
                return self.predicate(name)
            case CompareNode(axis=name, op=op, value=value):
                return Compare(self.axis(name), op, value)
            case MemberNode(axis=name, values=values, negated=negated):
                return Member(self.axis(name), values, negated)
            case NotNode(item=item):
                return Not(self.build(item))
            case AndNode(items=items):
                return And.of(self.build(i) for i in items)
            case OrNode(items=items):
                return Or.of(self.build(i) for i in items)
        raise TypeError(f"not a spec expression node: {node!r}")

    def axis(self, name: str) -> Axis:
        axis = self.vocabulary.axes.get(name)
        if axis is None:
            names = sorted(self.vocabulary.axes)
            self.fail(
                f"unknown axis {name!r}{did_you_mean(name, names)}; "
                f"expected one of: {', '.join(names)}"
            )
        return axis

    def predicate(self, name: str) -> Spec:
        definition = self.vocabulary.predicates.get(name)
        if definition is None:
            names = sorted(self.vocabulary.predicates)
            self.fail(
                f"unknown predicate {name!r}{did_you_mean(name, names)}; "
                f"expected one of: {', '.join(names)}"
            )
        if PREDICATES.get(name) == definition:
            return predicate(name)
        # A vocabulary's own predicate: its expression over the axes (no predicates, so
        # a predicate cannot refer to itself).
        inner = compile_expression(definition[0], Vocabulary(self.vocabulary.axes, {}))
        return Named(name, inner)

    def fail(self, message: str) -> NoReturn:
        text = to_text(self.root)
        raise SpecSyntaxError(message, text, (0, len(text)))


class _VocabularyKey:
    """A hashable stand-in for a ``Vocabulary`` (whose mappings are not hashable)."""

    __slots__ = ("_hash", "_key", "vocabulary")

    def __init__(self, vocabulary: Vocabulary) -> None:
        self.vocabulary = vocabulary
        # The getter is compared by identity: equal axes may read differently.
        axes = tuple((name, axis, axis.getter) for name, axis in vocabulary.axes.items())
        self._key = (axes, tuple(vocabulary.predicates.items()))
        self._hash = hash(self._key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _VocabularyKey) and other._key == self._key

    def __hash__(self) -> int:
        return self._hash


_CORE_KEY = _VocabularyKey(CORE_VOCABULARY)


def compile_expression(text: str, vocabulary: Vocabulary | None = None) -> Spec:
    """Parse, type-check and compile ``text`` into a ``Spec`` (cached per text and vocabulary).

    ``vocabulary`` defaults to the core axes and predicates. Raises ``SpecSyntaxError``.
    """
    if vocabulary is None or vocabulary is CORE_VOCABULARY:
        return _compile_cached(text, _CORE_KEY)
    try:
        key = _VocabularyKey(vocabulary)
    except TypeError:  # something unhashable in a custom vocabulary: skip the cache
        return to_spec(parse_expression(text, vocabulary), vocabulary)
    return _compile_cached(text, key)


@functools.lru_cache(maxsize=4096)
def _compile_cached(text: str, key: _VocabularyKey) -> Spec:
    return to_spec(parse_expression(text, key.vocabulary), key.vocabulary)
