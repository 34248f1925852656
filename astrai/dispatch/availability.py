"""Availability probes: whether a row can run on this machine, and if not, why.

A row's ``available`` is a zero-argument callable. It returns ``True`` when the
row can run, or a falsy value: ``False`` or, better, ``Unavailable(reason)`` so
``explain`` can say why. A probe that raises makes the row unavailable with the
exception as the reason. Probes are evaluated once per process and cached;
``refresh()`` re-evaluates them.
"""

from __future__ import annotations

__all__ = ["Unavailable", "check"]

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Unavailable:
    """A falsy probe result that carries the reason the row cannot run."""

    reason: str

    def __bool__(self) -> bool:
        return False

    def __str__(self) -> str:
        return self.reason


def check(probe: Callable[[], Any]) -> tuple[bool, str]:
    """Run a probe: ``(True, "")`` or ``(False, reason)``; never raises."""
    try:
        result = probe()
    except Exception as exc:  # a probe must not take the process down
        return False, f"probe raised {type(exc).__name__}: {exc}"
    if isinstance(result, Unavailable):
        return False, result.reason
    if result:
        return True, ""
    name = getattr(probe, "__qualname__", repr(probe))
    return False, f"{name}() returned {result!r}"
