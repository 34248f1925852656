"""Recursive-descent parser for spec expressions (contract §4): text -> ``Spec``, type-checked.

The grammar (each ``_parse_*`` method's docstring is its rule)::

    expr       := or_expr
    or_expr    := and_expr ("or" and_expr)*
    and_expr   := not_expr ("and" not_expr)*
    not_expr   := "not" not_expr | atom
    atom       := "(" expr ")" | "always" | "never" | AXIS | comparison | PREDICATE
                | DEFINITION
    comparison := AXIS ("==" | "!=" | "<" | "<=" | ">" | ">=") value
                | AXIS ["not"] "in" "{" value ("," value)* "}"
    value      := NAME | INT | "none" | "true" | "false"

There is no intermediate tree: as each rule is recognised the parser calls the
matching constructor of a ``Builder`` - ``spec`` passes the forms of ``combinators`` -
so imports run one way (``spec`` -> ``parsing`` -> ``_parser`` -> ``_tokenizer``). The vocabulary
decides what a name is (an axis, a predicate or a table's definition) and what values
an axis takes, so an expression that parses is well-typed; a predicate is built from
its own expression over the axes, a definition was built with its table
(``definitions``). Nesting deeper than ``MAX_DEPTH`` levels of ``(`` and ``not`` is
refused, so no input can exhaust the interpreter's stack. Every error is a
``SpecSyntaxError`` with a caret under the offending text.
"""

from __future__ import annotations

__all__ = ["MAX_DEPTH", "Builder", "Value", "parse"]

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Generic, NoReturn, Protocol, TypeVar, cast

import torch

from astrai.dispatch.axes import DTYPES, Axis, Vocabulary
from astrai.dispatch.expr._tokenizer import Token, Tokenizer
from astrai.suggestions import did_you_mean

#: How deeply ``(`` and ``not`` may nest.
MAX_DEPTH = 64

#: Longest integer literal accepted (an axis value, not a bignum).
MAX_INT_DIGITS = 18

_ORDERING = frozenset({"<", "<=", ">", ">="})

#: A typed value: ``bool`` (bool axes), ``int``, ``str`` (enum axes), a dtype, or ``None``.
Value = bool | int | str | torch.dtype | None

T = TypeVar("T")


class Builder(Protocol[T]):
    """What the parser calls as it recognises each form (``combinators.Build`` makes specs)."""

    def const(self, value: bool) -> T:
        """``always`` (true) or ``never``."""

    def flag(self, axis: Axis) -> T:
        """A bool axis standing alone."""

    def compare(self, axis: Axis, op: str, value: Value) -> T:
        """``axis <op> value``."""

    def member(self, axis: Axis, values: tuple[Value, ...], negated: bool) -> T:
        """``axis [not] in {values}``."""

    def compare_axes(self, axis: Axis, op: str, other: Axis) -> T:
        """``axis <op> other``: two axes of one type."""

    def named(self, name: str, inner: T) -> T:
        """A predicate ``name`` standing for ``inner``."""

    def negate(self, item: T) -> T:
        """``not item``."""

    def all_of(self, items: list[T]) -> T:
        """``a and b ...`` (two or more)."""

    def any_of(self, items: list[T]) -> T:
        """``a or b ...`` (two or more)."""


def parse(source: str, vocabulary: Vocabulary, build: Builder[T]) -> T:
    """Parse and type-check ``source`` against ``vocabulary``, building with ``build``."""
    return Parser(source, vocabulary, build).parse()


class Parser(Generic[T]):
    """Parses one expression against one vocabulary."""

    def __init__(self, source: str, vocabulary: Vocabulary, build: Builder[T]) -> None:
        self._tokens = Tokenizer(source)
        self._vocabulary = vocabulary
        self._build = build
        self._depth = 0

    def parse(self) -> T:
        """spec := expr END"""
        node = self._parse_expr()
        self._tokens.expect("END", expected="'and', 'or' or end of input")
        return node

    def _parse_expr(self) -> T:
        """expr := or_expr"""
        return self._parse_or_expr()

    def _parse_or_expr(self) -> T:
        """or_expr := and_expr ("or" and_expr)*"""
        items = [self._parse_and_expr()]
        while self._tokens.consume("OR"):
            items.append(self._parse_and_expr())
        return items[0] if len(items) == 1 else self._build.any_of(items)

    def _parse_and_expr(self) -> T:
        """and_expr := not_expr ("and" not_expr)*"""
        items = [self._parse_not_expr()]
        while self._tokens.consume("AND"):
            items.append(self._parse_not_expr())
        return items[0] if len(items) == 1 else self._build.all_of(items)

    def _parse_not_expr(self) -> T:
        """not_expr := "not" not_expr | atom"""
        word = self._tokens.consume("NOT")
        if word is None:
            return self._parse_atom()
        with self._nested(word):
            return self._build.negate(self._parse_not_expr())

    def _parse_atom(self) -> T:
        """
        atom := "(" expr ")" | "always" | "never" | AXIS | comparison | PREDICATE
              | DEFINITION
        """
        tokens = self._tokens
        if tokens.check("LEFT_PAREN"):
            opened = tokens.read()
            with self._nested(opened):
                node = self._parse_expr()
            tokens.expect("RIGHT_PAREN", expected="'and', 'or' or ')' to close '('",
                          opened=opened)
            return node
        if tokens.check("ALWAYS") or tokens.check("NEVER"):
            return self._build.const(tokens.read().name == "ALWAYS")
        if tokens.check("NAME"):
            return self._parse_name(tokens.read())
        tokens.raise_unexpected("an axis, a predicate, 'not', 'always', 'never' or '('")

    def _parse_name(self, name: Token) -> T:
        """named_atom := AXIS | comparison | PREDICATE | DEFINITION  (told apart by the
        vocabulary)"""
        tokens = self._tokens
        axis = self._vocabulary.axes.get(name.text)
        comparing = self._at_comparison()
        if axis is not None:
            if comparing:
                return self._parse_comparison(name, axis)
            if axis.kind != "bool":
                ops = "==, !=, in or not in"
                if axis.ordered:
                    ops = "==, !=, <, <=, >, >=, in or not in"
                tokens.raise_syntax_error(
                    f"{name.text!r} needs a comparison ({ops}); only bool axes stand alone",
                    name.span,
                )
            return self._build.flag(axis)
        predicate = name.text in self._vocabulary.predicates
        if predicate or name.text in self._vocabulary.definitions:
            if comparing:
                got, span = tokens.describe_next()
                what = "predicate" if predicate else "definition"
                tokens.raise_syntax_error(
                    f"{name.text!r} is a {what} and takes no comparison, got {got}", span
                )
            return self._named(name)
        self._unknown_name(name, comparing)

    def _unknown_name(self, name: Token, comparing: bool) -> NoReturn:
        """Fail at a name that is no axis (before a comparison), nor a predicate or a
        definition (standing alone), listing what it could be; the table's definitions
        are listed on their own, and suggested like any other name."""
        vocabulary = self._vocabulary
        defined: list[str] = []
        if comparing:
            kind, names = "axis", sorted(vocabulary.axes)
        else:
            kind, names = "axis or predicate", vocabulary.names()
            defined = sorted(vocabulary.definitions)
        if defined:
            kind = "axis, predicate or definition"
        listed = ", ".join(names) + (f"; or a definition: {', '.join(defined)}" if defined else "")
        self._tokens.raise_syntax_error(
            f"unknown {kind} {name.text!r}{did_you_mean(name.text, [*names, *defined])}; "
            f"expected one of: {listed}",
            name.span,
        )

    def _named(self, name: Token) -> T:
        """The predicate or definition ``name``: a predicate is built from its expression
        over the axes; a definition was built with its table (a ``str`` in its place is
        why it cannot be used here, reported at the name)."""
        vocabulary = self._vocabulary
        if name.text in vocabulary.predicates:
            definition = vocabulary.predicates[name.text][0]
            inner = parse(definition, Vocabulary(vocabulary.axes, {}), self._build)
            return self._build.named(name.text, inner)
        built = vocabulary.definitions[name.text]
        if isinstance(built, str):
            self._tokens.raise_syntax_error(built, name.span)
        return cast(T, built)

    def _parse_comparison(self, name: Token, axis: Axis) -> T:
        """
        comparison := AXIS ("==" | "!=" | "<" | "<=" | ">" | ">=") (value | AXIS)
                    | AXIS ["not"] "in" set
        """
        tokens = self._tokens
        if tokens.check("OP"):
            op = tokens.read()
            ordering = op.text in _ORDERING
            if ordering and not axis.ordered:
                tokens.raise_syntax_error(
                    f"{axis.name!r} is not ordered (a {axis.kind} axis); "
                    f"expected ==, !=, in or not in, got {op.text!r}",
                    op.span,
                )
            other = self._other_axis(axis)
            if other is not None:
                return self._build.compare_axes(axis, op.text, other)
            value, _ = self._parse_value(axis, ordering=ordering)
            return self._build.compare(axis, op.text, value)
        negated = tokens.consume("NOT") is not None
        tokens.expect("IN", expected="'in' after 'not'")
        return self._build.member(axis, self._parse_set(axis), negated)

    def _other_axis(self, axis: Axis) -> Axis | None:
        """The axis named next, when the comparison is with another axis (a name that is
        an axis and not one of ``axis``'s own values); a type error unless both axes are
        of one type."""
        tokens = self._tokens
        if not tokens.check("NAME"):
            return None
        assert tokens.next_token is not None
        text = tokens.next_token.text
        other = self._vocabulary.axes.get(text)
        if other is None or (axis.kind == "enum" and text in axis.values) or (
                axis.kind == "dtype" and text in DTYPES):
            return None
        token = tokens.read()
        if other.kind != axis.kind or (axis.kind == "enum" and other.values != axis.values):
            tokens.raise_syntax_error(
                f"{axis.name!r} ({axis.kind}) cannot be compared with {other.name!r} "
                f"({other.kind}): axes compared with each other must be of one type",
                token.span)
        return other

    def _parse_set(self, axis: Axis) -> tuple[Value, ...]:
        """set := "{" value ("," value)* "}" """
        tokens = self._tokens
        opened = tokens.expect("LEFT_BRACE", expected="'{' after 'in'")
        if tokens.check("RIGHT_BRACE"):
            closed = tokens.read()
            tokens.raise_syntax_error(
                f"empty set: 'in' needs at least one value for {axis.name!r}",
                (opened.position, closed.end),
            )
        values = [self._parse_value(axis)[0]]
        while tokens.consume("COMMA"):
            values.append(self._parse_value(axis)[0])
        tokens.expect("RIGHT_BRACE", expected="',' or '}' to close '{'", opened=opened)
        return tuple(values)

    def _parse_value(self, axis: Axis, *, ordering: bool = False) -> tuple[Value, Token]:
        """value := NAME | INT | "none" | "true" | "false" """
        tokens = self._tokens
        for rule in ("NONE", "TRUE", "FALSE", "INT", "NAME"):
            if tokens.check(rule):
                token = tokens.read()
                return self._typed_value(token, axis, ordering), token
        got, span = tokens.describe_next()
        tokens.raise_syntax_error(_expected_value(axis, ordering, got), span)

    def _typed_value(self, token: Token, axis: Axis, ordering: bool) -> Value:
        """The value ``token`` stands for on ``axis``, or a type error under it."""
        rule, text, kind = token.name, token.text, axis.kind
        if rule == "NONE" and axis.nullable and not ordering:
            return None
        if kind == "bool" and rule in ("TRUE", "FALSE"):
            return rule == "TRUE"
        if kind == "int" and rule == "INT":
            if len(text) > MAX_INT_DIGITS:
                self._tokens.raise_syntax_error(
                    f"integer too large for {axis.name!r} (at most {MAX_INT_DIGITS} digits)",
                    token.span,
                )
            return int(text)
        names = axis.value_names()
        hint = did_you_mean(text, DTYPES if kind == "dtype" else names) if rule == "NAME" else ""
        if rule == "NAME" and kind == "dtype":
            if text in DTYPES:
                return DTYPES[text]
            message = (f"unknown dtype {text!r}{hint}; expected a torch dtype name such as "
                       f"{', '.join(names)}")
        elif rule == "NAME" and kind in ("enum", "level"):
            if text in axis.values:
                return axis.parse(text)  # type: ignore[no-any-return]
            message = (
                f"unknown value {text!r} for {axis.name!r}{hint}; "
                f"expected one of: {', '.join(names)}"
            )
        else:
            message = _expected_value(axis, ordering, f"{text!r}{hint}")
        self._tokens.raise_syntax_error(message, token.span)

    def _at_comparison(self) -> bool:
        tokens = self._tokens
        return tokens.check("OP") or tokens.check("IN") or tokens.check("NOT")

    @contextmanager
    def _nested(self, opener: Token) -> Iterator[None]:
        """One more level of ``(`` or ``not``, refused past ``MAX_DEPTH``."""
        if self._depth >= MAX_DEPTH:
            self._tokens.raise_syntax_error(
                f"expression nested too deeply (more than {MAX_DEPTH} levels of '(' and 'not')",
                opener.span,
            )
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1


def _expected_value(axis: Axis, ordering: bool, got: str) -> str:
    """``expected <what axis takes> for '<axis>', got <got>``."""
    if axis.kind == "int":
        what = "an integer or none" if axis.nullable and not ordering else "an integer"
        return f"expected {what} for {axis.name!r}, got {got}"
    names = axis.value_names()
    if axis.kind == "bool":
        return f"expected {_or_list(names)} for {axis.name!r}, got {got}"
    return f"expected a value for {axis.name!r}, got {got}; one of: {', '.join(names)}"


def _or_list(words: Sequence[str]) -> str:
    """``a, b or c``."""
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"
