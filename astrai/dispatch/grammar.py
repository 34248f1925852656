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
    "to_plain",
    "to_spec",
    "to_text",
]

import functools
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from astrai.dispatch.axes import CORE_VOCABULARY, Vocabulary, format_value
from astrai.dispatch.spec import Spec
from astrai.dispatch.spec_data import Plain, build_spec, encode_value

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


def to_plain(node: Expr) -> Plain:
    """``node`` as plain JSON-ready data (the forms of ``spec_data``)."""
    match node:
        case ConstNode(value=value):
            return ["const", value]
        case AxisNode(axis=axis):
            return ["axis", axis]
        case PredicateNode(name=name):
            return ["pred", name]
        case CompareNode(axis=axis, op=op, value=value):
            return ["cmp", axis, op, encode_value(value)]
        case MemberNode(axis=axis, values=values, negated=negated):
            return ["in", axis, [encode_value(v) for v in values], negated]
        case NotNode(item=item):
            return ["not", to_plain(item)]
        case AndNode(items=items):
            return ["and", [to_plain(i) for i in items]]
        case OrNode(items=items):
            return ["or", [to_plain(i) for i in items]]
    raise TypeError(f"not a spec expression node: {node!r}")


def to_spec(node: Expr, vocabulary: Vocabulary | None = None) -> Spec:
    """The ``Spec`` combinators for ``node``; names are looked up in ``vocabulary``.

    ``node`` should come from ``parse_expression`` with the same vocabulary; a
    hand-built node naming an unknown axis or predicate raises ``SpecSyntaxError``.
    """
    vocab = CORE_VOCABULARY if vocabulary is None else vocabulary
    return build_spec(to_plain(node), vocab, lambda: to_text(node))


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
