"""A spec's plain, JSON-ready form, read back (``Spec.encode`` / ``Spec.decode``).

The precompiled tables store each row's ``when`` in this form, so loading them needs no
parser. Each form writes its own encoding (``encode``); ``decode`` rebuilds a spec from
one through a ``Builder`` - the same interface the parser drives - so the forms are
made in one place whichever way a spec is read.

Forms: ``["const", bool]``, ``["axis", name]``, ``["pred", name, plain]`` (a predicate
or a table's definition, with what it stands for), ``["cmp", axis, op, value]``,
``["cmpaxes", axis, op, other_axis]``, ``["in", axis, [value, ...], negated]``,
``["not", plain]``, ``["and", [plain, ...]]``, ``["or", [plain, ...]]``; a value is
``null``, a bool, an int, a str, or ``{"dtype": name}``.
"""

from __future__ import annotations

__all__ = ["Plain", "decode", "decode_value", "encode_value"]

from typing import TYPE_CHECKING, Any, TypeVar

import torch

from astrai.dispatch.axes import DTYPES, Vocabulary, dtype_name

if TYPE_CHECKING:
    from astrai.dispatch.expr._parser import Builder

T = TypeVar("T")

#: A spec's plain form (lists, so it survives JSON).
Plain = list[Any]


def encode_value(value: Any) -> Any:
    """A value a spec names, as plain data (a dtype as ``{"dtype": name}``)."""
    return {"dtype": dtype_name(value)} if isinstance(value, torch.dtype) else value


def decode_value(value: Any) -> Any:
    """``encode_value``'s inverse."""
    return DTYPES[value["dtype"]] if isinstance(value, dict) else value


def decode(plain: Plain, vocabulary: Vocabulary, build: Builder[T]) -> T:
    """The spec ``plain`` encodes, its axes looked up in ``vocabulary``, made by ``build``.
    Data that is no such encoding raises ``KeyError``, ``IndexError`` or ``TypeError``."""
    tag = plain[0]
    if tag == "const":
        return build.const(bool(plain[1]))
    if tag == "axis":
        return build.flag(vocabulary.axes[plain[1]])
    if tag == "pred":
        return build.named(plain[1], decode(plain[2], vocabulary, build))
    if tag == "cmp":
        return build.compare(vocabulary.axes[plain[1]], plain[2], decode_value(plain[3]))
    if tag == "cmpaxes":
        return build.compare_axes(vocabulary.axes[plain[1]], plain[2],
                                  vocabulary.axes[plain[3]])
    if tag == "in":
        values = tuple(decode_value(v) for v in plain[2])
        return build.member(vocabulary.axes[plain[1]], values, bool(plain[3]))
    if tag == "not":
        return build.negate(decode(plain[1], vocabulary, build))
    if tag in ("and", "or"):
        parts = [decode(p, vocabulary, build) for p in plain[1]]
        return build.all_of(parts) if tag == "and" else build.any_of(parts)
    raise TypeError(tag)
