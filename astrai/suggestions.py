"""'Did you mean' suggestions for unknown names (every error message naming the valid ones)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate closest to ``name``, if one is close enough to suggest."""
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` or the empty string."""
    best = closest(name, candidates)
    return f" (did you mean {best!r}?)" if best is not None else ""
