"""What the environment asks for: ``ASTR_OPS`` and the families' legacy alias variables,
parsed.

A family's legacy alias variable (``ASTR_BACKEND``, ``register_env_alias``) names a row in
any case: its value is lower-cased, as the seed reads it (``ASTR_BACKEND=REF`` is ``ref``);
``ASTR_OPS`` values are taken as written.

``ASTR_OPS="attention=flash,rotary=torch,profile=reference+low-precision"``:
comma-separated ``key=value``; keys are family names or ``profile``. Malformed entries,
unknown families and unknown profiles warn once each through the ``astrai`` logger and
are dropped, never fatal. Parsing is cached per distinct raw value (and table epoch), so
a changed value takes effect on the next call.
"""

from __future__ import annotations

__all__ = [
    "PROFILE_KEY",
    "EnvSettings",
    "env_for",
    "env_now",
    "env_overrides",
    "env_selection",
    "env_settings",
    "ops_problems",
    "parse_ops",
]

import os
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from astrai.dispatch import state as process
from astrai.dispatch.log import warn_once
from astrai.dispatch.registry import Registry, current
from astrai.env import OPS_ENV, OPS_KEY, decoded, encoded, environ_get, raw_get
from astrai.suggestions import did_you_mean

PROFILE_KEY = "profile"


@dataclass(frozen=True)
class EnvSettings:
    """What the environment asks for: a row per family, and profiles in order."""

    backends: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    profiles: tuple[str, ...] = ()
    sources: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    def source_of(self, family: str) -> str:
        """Which variable named ``family``'s row (``ASTR_OPS`` or the legacy alias)."""
        return self.sources.get(family, OPS_ENV)


def parse_ops(raw: str, families: Collection[str], profiles: Collection[str],
              report: Callable[[str], object] = warn_once) -> EnvSettings:
    """Parse an ``ASTR_OPS`` value, ``report``-ing each problem (default: a warning, once
    each) and dropping bad entries."""
    backends: dict[str, str] = {}
    chosen: list[str] = []
    for entry in raw.split(","):
        entry = entry.strip()
        if not entry:
            continue
        key, sep, value = entry.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            report(f"{OPS_ENV}: ignoring malformed entry {entry!r}; expected "
                   f"'family=row' or 'profile=name[+name...]'")
            continue
        if key == PROFILE_KEY:
            for name in value.split("+"):
                name = name.strip()
                if not name:
                    report(f"{OPS_ENV}: ignoring an empty profile name in {entry!r}")
                elif name in profiles:
                    chosen.append(name)
                else:
                    report(f"{OPS_ENV}: ignoring unknown profile {name!r}"
                           f"{did_you_mean(name, profiles)}; known profiles: "
                           f"{', '.join(sorted(profiles)) or '(none)'}")
            continue
        if key not in families:
            report(f"{OPS_ENV}: ignoring unknown family {key!r}"
                   f"{did_you_mean(key, families)}; known families: "
                   f"{', '.join(sorted(families))}, or 'profile'")
            continue
        if key in backends and backends[key] != value:
            report(f"{OPS_ENV}: {key!r} is given twice; using {value!r}")
        backends[key] = value
    return EnvSettings(MappingProxyType(backends), tuple(chosen))


_MAX_PARSED = 64


def _alias_row(value: str | None) -> str | None:
    """The row a legacy alias variable's value names (``None``: unset or blank): stripped
    and lower-cased, as the seed reads it."""
    if value is None or not value.strip():
        return None
    return value.strip().lower()


def _parsed(key: Any, got: EnvSettings) -> EnvSettings:
    """Remember ``got`` as the parse of the raw values ``key`` (bounded), and return it."""
    if len(process.env_parsed) >= _MAX_PARSED:
        process.env_parsed.clear()
    process.env_parsed[key] = got
    return got


def env_settings(
    families: Collection[str], profiles: Collection[str], aliases: Mapping[str, str], epoch: int
) -> EnvSettings:
    """The settings for the environment as it is now (cached per distinct raw values,
    read without decoding them)."""
    key = (raw_get(OPS_KEY), tuple([raw_get(encoded(v)) for v in aliases.values()]), epoch)
    got: EnvSettings | None = process.env_parsed.get(key)
    if got is not None:
        return got
    environ = os.environ
    alias_values = tuple(environ.get(var) for var in aliases.values())
    got = parse_ops(environ.get(OPS_ENV, ""), families, profiles)
    if aliases:
        backends = dict(got.backends)
        sources: dict[str, str] = {}
        for (family, var), value in zip(aliases.items(), alias_values, strict=True):
            row = _alias_row(value)
            if row is None or family in backends:
                continue
            backends[family] = row
            sources[family] = var
        got = EnvSettings(MappingProxyType(backends), got.profiles, MappingProxyType(sources))
    return _parsed(key, got)


# -- what the environment asks now -------------------------------------------------

def env_now(state: Registry) -> EnvSettings:
    """What the environment asks of the tables in ``state``, now (``env_settings``, with
    the lookup of an already parsed value done here, on the pre-encoded names)."""
    keys = state.alias_names
    n = len(keys)  # commonly one (the shipped tables' ASTR_BACKEND): no loop then
    raw = () if not n else (environ_get(keys[0]),) if n == 1 else tuple(map(environ_get, keys))
    got: EnvSettings | None = process.env_parsed.get((environ_get(OPS_KEY), raw, state.epoch))
    if got is None:
        got = env_settings(state.families, state.profiles, state.aliases, state.epoch)
    return got


def env_for(state: Registry, ops: Any, family: str, alias: Any) -> EnvSettings:
    """What the environment asks of ``family`` on ``state``, given the raw values of
    ``ASTR_OPS`` (``ops``) and of the family's legacy alias (``alias``) as one decision's
    world read them: parsed from those values, never from the environment again (cached
    per distinct values and table epoch)."""
    key = (ops, family, alias, state.epoch)
    got: EnvSettings | None = process.env_parsed.get(key)
    if got is not None:
        return got
    got = parse_ops(decoded(ops) or "", state.families, state.profiles)
    var = state.aliases.get(family)
    row = _alias_row(decoded(alias))
    if var is not None and row is not None and family not in got.backends:
        got = EnvSettings(MappingProxyType({**got.backends, family: row}),
                          got.profiles, MappingProxyType({family: var}))
    return _parsed(key, got)


def env_overrides() -> dict[str, str]:
    """The parsed environment, as the seed returns it: ``{family: row}`` from ``ASTR_OPS``
    and the legacy aliases (``ASTR_OPS`` wins), plus ``"profile"`` (names joined by ``+``)
    when profiles are active. Malformed entries and unknown names warn once and are
    dropped, as everywhere."""
    env = env_now(current())
    out = dict(env.backends)
    if env.profiles:
        out[PROFILE_KEY] = "+".join(env.profiles)
    return out


def env_selection(family: str) -> str | None:
    """The row the environment names for ``family`` (``ASTR_OPS`` or its legacy alias)."""
    got: str | None = env_now(current()).backends.get(family)
    return got


def ops_problems(state: Registry | None = None) -> list[str]:
    """Every problem of ``ASTR_OPS`` as it is now, in words, without warning: malformed
    entries, unknown families and profiles, and rows no table of ``state`` has."""
    state = state or current()
    found: list[str] = []
    got = parse_ops(os.environ.get(OPS_ENV, ""), state.families, state.profiles,
                    report=found.append)
    for family, row in got.backends.items():
        names = state.view(family, ()).row_names()
        if row not in names:
            found.append(f"{OPS_ENV}: unknown {family} row {row!r}{did_you_mean(row, names)}; "
                         f"rows: {', '.join(names)}")
    return found
