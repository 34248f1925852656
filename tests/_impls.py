"""Implementation objects and probes that the tests' YAML tables bind by import path.

Rows in the test tables say ``impl: tests._impls:fast`` and so on; everything here is
plain and side-effect free except the counters the availability tests read.
"""

from __future__ import annotations

from typing import Any

from astrai.dispatch import Unavailable


def fast(*args: Any, **kwargs: Any) -> str:
    """A row implementation: returns its own name."""
    return "fast"


def medium(*args: Any, **kwargs: Any) -> str:
    """A row implementation: returns its own name."""
    return "medium"


def slow(*args: Any, **kwargs: Any) -> str:
    """A row implementation: returns its own name."""
    return "slow"


def lowp(*args: Any, **kwargs: Any) -> str:
    """A non-faithful row implementation (changes numerics)."""
    return "lowp"


def ref(*args: Any, **kwargs: Any) -> str:
    """The reference (fallback) implementation."""
    return "ref"


def for_explicit(*args: Any, **kwargs: Any) -> str:
    """The row the precedence tests select with the explicit argument."""
    return "for_explicit"


def for_context(*args: Any, **kwargs: Any) -> str:
    """The row the precedence tests select with an ``op_backend`` scope."""
    return "for_context"


def for_env(*args: Any, **kwargs: Any) -> str:
    """The row the precedence tests select through ``ASTR_OPS``."""
    return "for_env"


def for_profile(*args: Any, **kwargs: Any) -> str:
    """The row the precedence tests force with a profile."""
    return "for_profile"


def adhoc(*args: Any, **kwargs: Any) -> str:
    """A function that no table names: selected only as an ad hoc object."""
    return "adhoc"


class Picky:
    """An implementation object that decides for itself through ``supports_call``.

    It accepts a call when the raw call carries ``ok=True``; it records every probe.
    """

    def __init__(self, name: str = "picky") -> None:
        self.name = name
        self.probes: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> str:
        return self.name

    def supports_call(self, *args: Any, **kwargs: Any) -> bool:
        self.probes.append((args, dict(kwargs)))
        return bool(kwargs.get("ok", False))


picky = Picky()


def always_available() -> bool:
    """A probe that always succeeds."""
    return True


def no_widget() -> Unavailable:
    """A probe that says why the row cannot run."""
    return Unavailable("no widget on this machine")


def probe_false() -> bool:
    """A probe that fails without a reason."""
    return False


def probe_raises() -> bool:
    """A probe that raises (the row becomes unavailable with the exception as reason)."""
    raise RuntimeError("driver exploded")


#: Toggle and call counter for ``counted_probe`` (the availability-cache tests).
PROBE = {"available": True, "calls": 0}


def counted_probe() -> bool | Unavailable:
    """A probe that counts its calls and answers from ``PROBE``."""
    PROBE["calls"] += 1
    return True if PROBE["available"] else Unavailable("toggled off")


def slow_probe() -> bool:
    """``counted_probe`` that takes a while: concurrent first callers overlap in it."""
    import time

    time.sleep(0.05)
    PROBE["calls"] += 1
    return True


NOT_CALLABLE = 42


#: The keyword arguments of every call ``attention_spy`` served, in order.
SPY_CALLS: list[dict[str, Any]] = []


def attention_spy(*args: Any, **kwargs: Any) -> Any:
    """An attention row that records its keywords, then computes as ``math`` does."""
    from astrai.backends.attention.math import math_attention

    SPY_CALLS.append(dict(kwargs))
    return math_attention(*args, **kwargs)
