"""Branches a forward can never take on a module, read from its source and attributes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from astrai.recognition.guards import ruled_out


def turn(x: Any) -> Any:
    return x


def either(self: Any, x: Any) -> Any:
    if self.sliding_window is None or self.is_sliding:
        x = turn(x)
    return x


def otherwise(self: Any, x: Any) -> Any:
    if self.full:
        return x
    else:
        return turn(x)


def by_argument(self: Any, x: Any, position_embeddings: Any = None) -> Any:
    if position_embeddings is not None:
        x = turn(x)
    return x


def twice(self: Any, x: Any) -> Any:
    if self.local:
        x = turn(x)
    return turn(x)


@pytest.mark.parametrize("forward, attributes, want", [
    (either, dict(sliding_window=4, is_sliding=False),
     "self.sliding_window is None or self.is_sliding"),
    (either, dict(sliding_window=4, is_sliding=True), None),
    (either, dict(sliding_window=None, is_sliding=False), None),
    (either, dict(sliding_window=4), None),  # is_sliding unknown: not decided
    (otherwise, dict(full=True), "not (self.full)"),
    (otherwise, dict(full=False), None),
    (otherwise, dict(full=[1]), None),  # not a plain value: not decided
    (by_argument, {}, None),
    (twice, dict(local=False), None),  # one call is unguarded
])
def test_ruled_out(forward: Any, attributes: dict[str, Any], want: str | None) -> None:
    assert ruled_out(forward, {"turn"}, SimpleNamespace(**attributes)) == want


def test_a_forward_without_the_call_or_source_decides_nothing() -> None:
    assert ruled_out(either, {"other"}, SimpleNamespace(sliding_window=4,
                                                        is_sliding=False)) is None
    assert ruled_out(len, {"turn"}, SimpleNamespace()) is None
