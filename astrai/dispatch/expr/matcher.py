"""A spec made into one Python function: its clauses inline, in order.

``Spec.matcher()`` calls ``generate`` once per spec and keeps the result: the chain walk
of every decision calls it. Each form writes its own expression over ``ctx`` (its
``_source``, given a ``Source`` to bind constants and make fresh names through); the
values a table names never enter the generated text, only names bound to them.
"""

from __future__ import annotations

__all__ = ["Generates", "Source", "generate"]

import keyword
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from astrai.dispatch.axes import Axis

if TYPE_CHECKING:
    from astrai.dispatch.axes import CallContext


class Generates(Protocol):
    """What ``generate`` makes a function of: a spec's expression and its own test."""

    def _source(self, out: Source) -> str: ...

    def matches(self, ctx: CallContext) -> bool: ...


class Source:
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


def generate(spec: Generates) -> Callable[[CallContext], Any]:
    """``spec.matches`` as one function: its clauses inline, in order, short-circuiting
    as ``matches`` does (``spec.matcher()`` keeps it)."""
    out = Source()
    try:
        body = spec._source(out)
        code = compile(f"def _matches(ctx):\n    return {body}\n", "<astrai spec>", "exec")
    except Exception:  # too deep for the compiler, or a spec of unforeseen make
        return spec.matches  # the tree walk answers
    exec(code, out.names)  # the text: axis names and fixed words; values are bound names
    return out.names["_matches"]  # type: ignore[no-any-return]
