"""Table rows and families as the engine sees them: immutable once loaded."""

from __future__ import annotations

__all__ = ["FamilyTable", "ImplRecord"]

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from astrai.dispatch.axes import Axis
from astrai.dispatch.expr.spec import Spec


def _always_available() -> bool:
    return True


#: The probe of rows that declare none (never cached: there is nothing to probe).
ALWAYS_AVAILABLE = _always_available


@dataclass(frozen=True, eq=False)
class ImplRecord:
    """One row of a decision table.

    ``obj`` is the implementation itself (called as-is, never instantiated).
    ``available`` is a zero-argument probe (see ``astrai.dispatch.availability``).
    When rows come from ``register_family`` a *lower* ``priority`` is tried first (as in
    the seed; ties keep the provider's order); YAML rows take their priority from their
    position (0 for the first row). ``faithful=False`` marks a row that changes
    numerics: only explicit selection or a profile that enables it can pick it.
    ``source`` says where the row was defined (``file:line`` or ``register_family``).
    """

    family: str
    name: str
    obj: Any
    spec: Spec = field(default_factory=Spec.always)
    available: Callable[[], Any] = _always_available
    priority: int = 100
    faithful: bool = True
    description: str = ""
    source: str = ""

    def __repr__(self) -> str:
        return f"ImplRecord({self.family}.{self.name}, when={self.spec.description!r})"


@dataclass(frozen=True, eq=False)
class FamilyTable:
    """A family: its rows in priority order, its fallback row, and where it came from.

    ``fallback`` names the fallback row. It is one of ``rows``, except for a family
    registered seed-style with a fallback record that the provider does not list: that
    record is ``outside_fallback``, used only when nothing in the chain matched.
    """

    name: str
    rows: tuple[ImplRecord, ...]
    fallback: str
    description: str = ""
    env_alias: str | None = None
    axes: Mapping[str, Axis] = field(default_factory=lambda: MappingProxyType({}))
    source: str = ""
    revision: str = ""
    outside_fallback: ImplRecord | None = None
    context: Callable[..., Any] | None = None  # the table's ``context:`` builder (ops.call)

    def row(self, name: str) -> ImplRecord | None:
        """The row called ``name``, if any."""
        for r in self.rows:
            if r.name == name:
                return r
        return None

    def row_names(self) -> list[str]:
        """Row names in priority order."""
        return [r.name for r in self.rows]

    @property
    def fallback_record(self) -> ImplRecord:
        """The fallback row."""
        rec = self.outside_fallback or self.row(self.fallback)
        assert rec is not None, f"family {self.name!r} has no fallback row {self.fallback!r}"
        return rec
