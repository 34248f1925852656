"""The tokenizer for spec expressions, driven on demand by the parser.

There is no token stream built up front: the parser asks ``check("AND")`` at the
points where the grammar allows an ``and``, so a word is a keyword only where the
grammar expects that keyword. Whitespace between tokens is skipped. Every error
is a ``SpecSyntaxError`` with a caret under the offending text.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NoReturn

from astrai.dispatch.axes import KEYWORDS
from astrai.errors import SpecSyntaxError

_WORD_END = r"(?!\w)"
_KEYWORD_PATTERN = "|".join(sorted(KEYWORDS))

#: Token name -> pattern matched at the current position. Keywords are ordinary
#: rules, so the parser only sees one where it asks for it.
RULES: Mapping[str, re.Pattern[str]] = {
    "LEFT_PAREN": re.compile(r"\("),
    "RIGHT_PAREN": re.compile(r"\)"),
    "LEFT_BRACE": re.compile(r"\{"),
    "RIGHT_BRACE": re.compile(r"\}"),
    "COMMA": re.compile(r","),
    "OP": re.compile(r"==|!=|<=|>=|<|>"),
    "AND": re.compile(r"and" + _WORD_END),
    "OR": re.compile(r"or" + _WORD_END),
    "NOT": re.compile(r"not" + _WORD_END),
    "IN": re.compile(r"in" + _WORD_END),
    "ALWAYS": re.compile(r"always" + _WORD_END),
    "NEVER": re.compile(r"never" + _WORD_END),
    "NONE": re.compile(r"none" + _WORD_END),
    "TRUE": re.compile(r"true" + _WORD_END),
    "FALSE": re.compile(r"false" + _WORD_END),
    "INT": re.compile(r"[0-9]+" + _WORD_END),
    # A name is any word but a keyword: keywords never name an axis or a value.
    "NAME": re.compile(rf"(?!(?:{_KEYWORD_PATTERN}){_WORD_END})[^\W\d]\w*"),
    "END": re.compile(r"\Z"),
}

_PUNCTUATION_RULES = ("LEFT_PAREN", "RIGHT_PAREN", "LEFT_BRACE", "RIGHT_BRACE", "COMMA", "OP")
_WHITESPACE = re.compile(r"\s*")
_WORD = re.compile(r"\w+")


@dataclass(frozen=True, slots=True)
class Token:
    """One token: its rule name, its text and its start offset in the source."""

    name: str
    text: str
    position: int

    @property
    def end(self) -> int:
        """Offset just past the token."""
        return self.position + len(self.text)

    @property
    def span(self) -> tuple[int, int]:
        """``(start, end)`` of the token in the source."""
        return (self.position, self.end)


class Tokenizer:
    """Hands out tokens of ``source`` as the parser asks for them."""

    def __init__(self, source: str, rules: Mapping[str, re.Pattern[str]] = RULES) -> None:
        self.source = source
        self.rules = rules
        self.position = 0
        self.next_token: Token | None = None

    def check(self, name: str) -> bool:
        """Whether the next token is a ``name``; if so it is kept for ``read``."""
        self._skip_whitespace()
        match = self.rules[name].match(self.source, self.position)
        if match is None:
            self.next_token = None
            return False
        self.next_token = Token(name, match[0], self.position)
        return True

    def read(self) -> Token:
        """Take the token found by the last successful ``check``."""
        token = self.next_token
        if token is None:  # pragma: no cover - a parser bug, not an input error
            raise RuntimeError("read() without a successful check()")
        self.position = token.end
        self.next_token = None
        return token

    def consume(self, name: str) -> Token | None:
        """Take the next token if it is a ``name``."""
        return self.read() if self.check(name) else None

    def expect(self, name: str, *, expected: str, opened: Token | None = None) -> Token:
        """Take the next token, which must be a ``name``; else fail saying what was ``expected``."""
        if not self.check(name):
            self.raise_unexpected(expected, opened=opened)
        return self.read()

    def raise_syntax_error(self, message: str, span: tuple[int, int]) -> NoReturn:
        """Fail with ``message`` and a caret under ``span``."""
        raise SpecSyntaxError(message, self.source, span)

    def raise_unexpected(self, expected: str, *, opened: Token | None = None) -> NoReturn:
        """Fail with ``expected <expected>, got <what is next>``.

        With ``opened`` (an unclosed bracket) the span reaches back to that bracket.
        """
        got, (start, end) = self.describe_next()
        if opened is not None:
            start = opened.position
        self.raise_syntax_error(f"expected {expected}, got {got}", (start, end))

    def describe_next(self) -> tuple[str, tuple[int, int]]:
        """What comes next, in words, and where: ``'foo'``, ``keyword 'and'``, ``end of input``."""
        self._skip_whitespace()
        pos, source = self.position, self.source
        if pos >= len(source):
            return "end of input", (pos, pos)
        word = _WORD.match(source, pos)
        if word is not None:
            kind = "keyword " if word[0] in KEYWORDS else ""
            return f"{kind}{word[0]!r}", word.span()
        for rule in _PUNCTUATION_RULES:
            punct = self.rules[rule].match(source, pos)
            if punct is not None:
                return repr(punct[0]), punct.span()
        return f"unknown character {source[pos]!r}", (pos, pos + 1)

    def _skip_whitespace(self) -> None:
        match = _WHITESPACE.match(self.source, self.position)
        if match is not None:
            self.position = match.end()
