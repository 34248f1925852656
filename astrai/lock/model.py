"""The decision lock's values: the row each recorded call signature resolved to
(``LockedDecision``), and the lock as a whole (``Lock``), saved as one YAML document
(``schemas/lock.schema.json``). ``astrai.lock.make`` makes and checks locks;
``astrai.lock.enforce`` puts one in force for a process (``ASTR_LOCK``)."""

from __future__ import annotations

__all__ = ["Lock", "LockedDecision"]

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from astrai.dispatch.axes import EMPTY, CallContext, context_from_fields
from astrai.dispatch.machine import Machine
from astrai.formats.saved import Saved
from astrai.record.workload import Selection, now_utc, selection_plain, value_from_plain


@dataclass(frozen=True)
class LockedDecision:
    """One recorded call signature and the decision taken for it when locked.

    ``row`` and ``origin`` are ``None`` (and ``error`` says why) when no row could serve
    the call then. ``table`` is the family's table revision and ``profiles`` the
    profiles in force with theirs; ``calls`` counts the recorded calls it stands for.
    """

    family: str
    signature: str
    axes: Mapping[str, Any]
    row: str | None
    origin: str | None
    table: str
    profiles: Mapping[str, str] = field(default_factory=lambda: EMPTY)
    backend: Selection = None
    scope_backend: Selection = None
    scope_profiles: tuple[str, ...] = ()
    error: str | None = None
    calls: int = 1

    def context(self) -> CallContext:
        """The call's context (its recorded axes)."""
        return context_from_fields(self.family, self.axes)

    def plain(self) -> dict[str, Any]:
        """The file's form of the decision."""
        out: dict[str, Any] = {"family": self.family, "signature": self.signature,
                               "row": self.row, "origin": self.origin}
        if self.error is not None:
            out["error"] = self.error
        out["calls"] = self.calls
        out["table"] = self.table
        out["profiles"] = dict(self.profiles)
        if self.backend is not None:
            out["backend"] = selection_plain(self.backend)
        if self.scope_backend is not None or self.scope_profiles:
            scope: dict[str, Any] = {"profiles": list(self.scope_profiles)}
            if self.scope_backend is not None:
                scope["backend"] = selection_plain(self.scope_backend)
            out["scope"] = scope
        out["axes"] = dict(self.axes)
        return out

    @classmethod
    def from_plain(cls, data: Mapping[str, Any]) -> LockedDecision:
        """A decision from its file form (already validated)."""
        scope = data.get("scope") or {}
        return cls(data["family"], data["signature"], dict(data["axes"]), data["row"],
                   data["origin"], data["table"], dict(data["profiles"]),
                   value_from_plain(data.get("backend")), value_from_plain(scope.get("backend")),
                   tuple(scope.get("profiles", ())), data.get("error"), data["calls"])

    def identity(self) -> tuple[Any, ...]:
        """What tells this decision's call apart, besides its axes: its selection."""
        return (self.backend, self.scope_backend, self.scope_profiles)


@dataclass(frozen=True)
class Lock(Saved):
    """A decision lock (see the module docstring). ``tables`` maps each family to its
    ``(revision, source)`` when the lock was made; ``environment`` holds the astrai
    variables then in force; ``source`` is the file it was read from; ``plugins`` the
    plugins whose rows the locked families held (distribution -> version)."""

    KIND: ClassVar[str] = "lock"

    decisions: tuple[LockedDecision, ...]
    machine: Machine
    tables: Mapping[str, tuple[str, str]] = field(default_factory=lambda: EMPTY)
    environment: Mapping[str, str | None] = field(default_factory=lambda: EMPTY)
    created: str = ""
    workload: str = ""
    source: str = ""
    plugins: Mapping[str, str] = field(default_factory=lambda: EMPTY)

    @property
    def digest(self) -> str:
        """A short hash of the decisions (calls and rows), equal for equal locks wherever
        they are read: ``check_agreement`` compares it across ranks."""
        text = json.dumps([[d.family, sorted(d.axes.items()), selection_plain(d.backend),
                            selection_plain(d.scope_backend), list(d.scope_profiles), d.row]
                           for d in self.decisions], sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def plain(self) -> dict[str, Any]:
        """The file's form of the lock."""
        return {"version": 1, "kind": "lock", "created": self.created or now_utc(),
                "workload": self.workload, "machine": self.machine.as_dict(),
                "environment": dict(self.environment),
                "tables": {f: {"revision": rev, "source": src}
                           for f, (rev, src) in self.tables.items()},
                "plugins": dict(self.plugins),
                "decisions": [d.plain() for d in self.decisions]}

    def headline(self) -> str:
        """The comment that opens the file."""
        return f"astrai decision lock: {len(self.decisions)} decisions, digest {self.digest}"

    @classmethod
    def from_plain(cls, data: Mapping[str, Any], source: str = "") -> Lock:
        """The lock of a validated file form (read from ``source``)."""
        return cls(tuple(LockedDecision.from_plain(d) for d in data["decisions"]),
                   Machine.from_dict(data["machine"]),
                   {f: (t["revision"], t["source"]) for f, t in data["tables"].items()},
                   dict(data["environment"]), data["created"], data["workload"], source,
                   dict(data.get("plugins", {})))
