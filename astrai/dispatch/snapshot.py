"""``Registry``: one consistent snapshot of everything resolution reads.

The loaded families and profiles, the legacy aliases, the programmatic families and
joined rows, the plugins, and the caches that belong to this snapshot only (views,
decisions, key plans, the views of each world): a new snapshot starts with empty ones.
Snapshots are built by ``assembly`` and put in force by ``registry``.
"""

from __future__ import annotations

__all__ = ["Registry"]

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from astrai.dispatch import state as process
from astrai.dispatch.joined import EMPTY as JOINED_NONE
from astrai.dispatch.joined import Joined
from astrai.dispatch.plugins import Plugin
from astrai.dispatch.tables.model import (
    ALWAYS_AVAILABLE,
    FamilyTable,
    ImplRecord,
    Profile,
    View,
    check,
    make_view,
)
from astrai.env import encoded
from astrai.errors import UnknownFamilyError


@dataclass(frozen=True, eq=False)
class Registry:
    """One consistent snapshot of everything resolution reads."""

    families: Mapping[str, FamilyTable]
    profiles: Mapping[str, Profile]
    aliases: Mapping[str, str]  # family -> legacy env var (tables' and registered)
    epoch: int
    programmatic: Mapping[str, tuple[Any, Any]] = field(default_factory=dict)
    registered_aliases: Mapping[str, str] = field(default_factory=dict)  # register_env_alias
    joined: Mapping[str, tuple[Joined, ...]] = field(default_factory=lambda: JOINED_NONE)
    #: The installed plugins (``plugins.discover``), loaded, disabled or broken.
    plugins: tuple[Plugin, ...] = ()
    #: family -> the rows the loaded plugins' row overlays join to it, in order.
    extended: Mapping[str, tuple[Joined, ...]] = field(default_factory=lambda: JOINED_NONE)
    # Caches that belong to this snapshot; a new snapshot starts with empty ones.
    _views: dict[tuple[str, tuple[str, ...]], View] = field(init=False, default_factory=dict)
    decisions: dict[Any, Any] = field(init=False, default_factory=dict)
    made: dict[Any, Any] = field(init=False, default_factory=dict)  # (row id, origin) -> Decision
    keys: dict[str, Any] = field(init=False, default_factory=dict)  # family -> keying.KeyPlan
    # (family, route token) -> how that facade route reads a call into its key
    # (ops._families.Keyer, or None) and how the compiled hot path may (ops._facade.route)
    facade_keys: dict[tuple[str, object], Any] = field(init=False, default_factory=dict)
    # (family, raw ASTR_OPS, raw alias, scope token) -> (environment.EnvSettings, View): what
    # the environment asks of the family in one world, and its view under the profiles
    # in force there (resolution.evaluate; bounded)
    worlds: dict[Any, Any] = field(init=False, default_factory=dict)
    # family -> the world its last decision on this snapshot was taken in (world.world_now:
    # a decision in the same world builds none)
    last_worlds: dict[str, Any] = field(init=False, default_factory=dict)
    # family -> how a whole CallContext becomes its key (keying.signature_key)
    signature_keys: dict[str, Any] = field(init=False, default_factory=dict)
    alias_keys: Mapping[str, Any] = field(init=False, default_factory=dict)
    #: ``alias_keys``' values, in order (what ``environment.env_now`` reads).
    alias_names: tuple[Any, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        # Per family, its legacy variable's name as os.environ stores it (hot path).
        keys = {f: encoded(v) for f, v in self.aliases.items()}
        object.__setattr__(self, "alias_keys", keys)
        object.__setattr__(self, "alias_names", tuple(keys.values()))

    def family(self, name: str) -> FamilyTable:
        """The family ``name``; ``UnknownFamilyError`` (a ``KeyError``) lists the known ones."""
        try:
            return self.families[name]
        except KeyError:
            raise UnknownFamilyError(name, list(self.families)) from None

    def view(self, family: str, profiles: tuple[str, ...]) -> View:
        """``family`` under the named active profiles (cached per snapshot)."""
        key = (family, profiles)
        got = self._views.get(key)
        if got is None:
            table = self.family(family)
            got = make_view(table, tuple(self.profiles[p] for p in profiles))
            self._views[key] = got
        return got

    def availability(self, record: ImplRecord) -> tuple[bool, str]:
        """``(available, reason)`` for a row, probed once per snapshot/refresh."""
        if record.available is ALWAYS_AVAILABLE:
            return True, ""
        # Per process (not per snapshot): a load of another family must not re-probe.
        probe = record.available  # keyed by the probe: a row's copies share its answer
        got = process.probed.get(id(probe))
        if got is None or got[0] is not probe:
            with process.probe_lock:  # concurrent first callers: one runs the probe, all share it
                got = process.probed.get(id(probe))
                if got is None or got[0] is not probe:
                    # Stored with its probe, so the id cannot be reused meanwhile.
                    got = process.probed[id(probe)] = (probe, *check(probe))
        return got[1], got[2]
