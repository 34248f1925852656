"""Spec text parsed once: the cache in front of the parser (``_parser``).

A table names the same expressions again and again (and every load parses them anew), so
parses are cached per text and vocabulary. A ``Vocabulary``'s mappings are not hashable;
``VocabularyKey`` stands in for one, its axes' getters compared by identity (equal axes
may read differently). The parser itself is imported on first use: loading precompiled
tables never parses.
"""

from __future__ import annotations

__all__ = ["VocabularyKey", "parse_cached"]

import functools
from collections.abc import Hashable
from typing import Any

from astrai.dispatch.axes import CORE_VOCABULARY, Vocabulary


class VocabularyKey:
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
        return isinstance(other, VocabularyKey) and other._key == self._key

    def __hash__(self) -> int:
        return self._hash


_CORE_KEY = VocabularyKey(CORE_VOCABULARY)


def parse_cached(text: str, vocabulary: Vocabulary | None, build: Any) -> Any:
    """``text`` parsed and type-checked against ``vocabulary`` (default: the core axes
    and predicates), made by ``build`` (a ``Builder``, hashed by identity); cached per
    text, vocabulary and builder. Raises ``SpecSyntaxError``."""
    if vocabulary is None or vocabulary is CORE_VOCABULARY:
        return _cached(text, _CORE_KEY, build)
    try:
        key = VocabularyKey(vocabulary)
    except TypeError:  # something unhashable in a custom vocabulary: skip the cache
        return _parse(text, vocabulary, build)
    return _cached(text, key, build)


@functools.lru_cache(maxsize=4096)
def _cached(text: str, key: VocabularyKey, build: Hashable) -> Any:
    return _parse(text, key.vocabulary, build)


def _parse(text: str, vocabulary: Vocabulary, build: Any) -> Any:
    from astrai.dispatch.expr._parser import parse

    return parse(text, vocabulary, build)
