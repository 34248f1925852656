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
    """Run a probe: ``(True, "")`` or ``(False, reason)``; never raises, never exits.

    A probe answers ``True``, ``False`` or ``Unavailable(reason)``. Anything else it
    returns, and any failure (``SystemExit`` included), makes the row unavailable with
    the reason; only ``KeyboardInterrupt`` passes through.
    """
    name = getattr(probe, "__qualname__", repr(probe))
    try:
        result = probe()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # a probe must not take the process down
        detail = f": {exc}" if str(exc) else ""
        return False, f"probe raised {type(exc).__name__}{detail}"
    if isinstance(result, Unavailable):
        return False, result.reason
    if result is True:
        return True, ""
    if result is False:
        return False, f"{name}() returned False"
    return False, (f"{name}() returned a {type(result).__name__}, not True, False or "
                   f"astrai.dispatch.Unavailable(reason)")
