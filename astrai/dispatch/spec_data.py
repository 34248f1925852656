"""Spec expressions as plain, JSON-ready data, and their compilation into ``Spec``.

The parser's pydantic AST (``grammar``) converts to this form with ``grammar.to_plain``;
``build_spec`` is the one place that turns an expression into ``Spec`` combinators,
for parsed text and for the precompiled shipped tables alike. This module imports
neither pydantic nor the parser, so loading precompiled tables needs neither.

Forms (lists, so they survive JSON)::

    ["const", bool]            ["axis", name]             ["pred", name]
    ["cmp", axis, op, value]   ["in", axis, [value, ...], negated]
    ["not", item]              ["and", [item, ...]]       ["or", [item, ...]]

A value is ``null``, a bool, an int, a str, or ``{"dtype": name}``.
"""

from __future__ import annotations

__all__ = ["Plain", "build_spec", "decode_value", "encode_value"]

from collections.abc import Callable
from typing import Any, NoReturn

import torch

from astrai.dispatch._suggest import did_you_mean
from astrai.dispatch.axes import DTYPES, PREDICATES, Axis, Vocabulary, dtype_name
from astrai.dispatch.spec import And, Compare, Flag, Member, Named, Not, Or, Spec, predicate
from astrai.errors import SpecSyntaxError

Plain = list[Any]


def encode_value(value: Any) -> Any:
    """A typed value in JSON form (dtypes become ``{"dtype": name}``)."""
    if isinstance(value, torch.dtype):
        return {"dtype": dtype_name(value)}
    return value


def decode_value(value: Any) -> Any:
    """The inverse of ``encode_value``."""
    if isinstance(value, dict):
        return DTYPES[value["dtype"]]
    return value


def build_spec(plain: Plain, vocabulary: Vocabulary, text: Callable[[], str]) -> Spec:
    """The ``Spec`` combinators for ``plain``; names are looked up in ``vocabulary``.

    ``text`` gives the expression's text for an error message (an unknown axis or
    predicate, or a non-bool axis standing alone), raised as ``SpecSyntaxError``.
    """
    return _Builder(vocabulary, text).build(plain)


class _Builder:
    def __init__(self, vocabulary: Vocabulary, text: Callable[[], str]) -> None:
        self.vocabulary = vocabulary
        self.text = text

    def build(self, plain: Plain) -> Spec:
        kind = plain[0]
        if kind == "const":
            return Spec.always() if plain[1] else Spec.never()
        if kind == "axis":
            axis = self.axis(plain[1])
            if axis.kind != "bool":
                self.fail(f"{plain[1]!r} needs a comparison; only bool axes stand alone")
            return Flag(axis)
        if kind == "pred":
            return self.predicate(plain[1])
        if kind == "cmp":
            return Compare(self.axis(plain[1]), plain[2], decode_value(plain[3]))
        if kind == "in":
            values = tuple(decode_value(v) for v in plain[2])
            return Member(self.axis(plain[1]), values, bool(plain[3]))
        if kind == "not":
            return Not(self.build(plain[1]))
        if kind == "and":
            return And.of(self.build(i) for i in plain[1])
        if kind == "or":
            return Or.of(self.build(i) for i in plain[1])
        raise TypeError(f"not a plain spec expression: {plain!r}")

    def axis(self, name: str) -> Axis:
        axis = self.vocabulary.axes.get(name)
        if axis is None:
            names = sorted(self.vocabulary.axes)
            self.fail(f"unknown axis {name!r}{did_you_mean(name, names)}; "
                      f"expected one of: {', '.join(names)}")
        return axis

    def predicate(self, name: str) -> Spec:
        definition = self.vocabulary.predicates.get(name)
        if definition is None:
            names = sorted(self.vocabulary.predicates)
            self.fail(f"unknown predicate {name!r}{did_you_mean(name, names)}; "
                      f"expected one of: {', '.join(names)}")
        if PREDICATES.get(name) == definition:
            return predicate(name)
        # A vocabulary's own predicate: its expression over the axes (no predicates, so
        # a predicate cannot refer to itself). Only custom vocabularies get here.
        from astrai.dispatch.grammar import compile_expression

        return Named(name, compile_expression(definition[0], Vocabulary(self.vocabulary.axes, {})))

    def fail(self, message: str) -> NoReturn:
        text = self.text()
        raise SpecSyntaxError(message, text, (0, len(text)))
