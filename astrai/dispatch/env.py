"""``ASTR_OPS`` (SPEC §7) and legacy single-value aliases such as ``ASTR_BACKEND``.

``ASTR_OPS="attention=flash,rotary=torch,profile=reference+low-precision"``:
comma-separated ``key=value``; keys are family names or ``profile``. Malformed
entries, unknown families and unknown profiles warn once each through the
``astrai`` logger and are dropped — never fatal. Parsing is cached per distinct
value (and table epoch), so a changed value takes effect on the next call.
"""

from __future__ import annotations

__all__ = ["OPS_ENV", "EnvSettings", "env_settings", "parse_ops"]

import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from astrai.dispatch import state as process
from astrai.dispatch._log import warn_once
from astrai.dispatch._suggest import did_you_mean

OPS_ENV = "ASTR_OPS"
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


def parse_ops(raw: str, families: Collection[str], profiles: Collection[str]) -> EnvSettings:
    """Parse an ``ASTR_OPS`` value, warning once per problem and dropping bad entries."""
    backends: dict[str, str] = {}
    chosen: list[str] = []
    for entry in raw.split(","):
        entry = entry.strip()
        if not entry:
            continue
        key, sep, value = entry.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            warn_once(f"{OPS_ENV}: ignoring malformed entry {entry!r}; expected "
                      f"'family=row' or 'profile=name[+name...]'")
            continue
        if key == PROFILE_KEY:
            for name in value.split("+"):
                name = name.strip()
                if not name:
                    warn_once(f"{OPS_ENV}: ignoring an empty profile name in {entry!r}")
                elif name in profiles:
                    chosen.append(name)
                else:
                    warn_once(f"{OPS_ENV}: ignoring unknown profile {name!r}"
                              f"{did_you_mean(name, profiles)}; known profiles: "
                              f"{', '.join(sorted(profiles)) or '(none)'}")
            continue
        if key not in families:
            warn_once(f"{OPS_ENV}: ignoring unknown family {key!r}"
                      f"{did_you_mean(key, families)}; known families: "
                      f"{', '.join(sorted(families))}, or 'profile'")
            continue
        if key in backends and backends[key] != value:
            warn_once(f"{OPS_ENV}: {key!r} is given twice; using {value!r}")
        backends[key] = value
    return EnvSettings(MappingProxyType(backends), tuple(chosen))


_MAX_PARSED = 64


def env_settings(
    families: Collection[str], profiles: Collection[str], aliases: Mapping[str, str], epoch: int
) -> EnvSettings:
    """The settings for the environment as it is now (cached per distinct values)."""
    environ = os.environ
    raw = environ.get(OPS_ENV, "")
    alias_values = tuple(environ.get(var) for var in aliases.values()) if aliases else ()
    key = (raw, alias_values, epoch)
    got: EnvSettings | None = process.env_parsed.get(key)
    if got is not None:
        return got
    got = parse_ops(raw, families, profiles)
    if aliases:
        backends = dict(got.backends)
        sources: dict[str, str] = {}
        for (family, var), value in zip(aliases.items(), alias_values, strict=True):
            if value is None or not value.strip() or family in backends:
                continue
            backends[family] = value.strip()
            sources[family] = var
        got = EnvSettings(MappingProxyType(backends), got.profiles, MappingProxyType(sources))
    if len(process.env_parsed) >= _MAX_PARSED:
        process.env_parsed.clear()
    process.env_parsed[key] = got
    return got


def encoded(name: str) -> Any:
    """``name`` in the form ``os.environ``'s own dict stores it (for ``raw_get``)."""
    encode = getattr(os.environ, "encodekey", None)
    return encode(name) if callable(encode) else name


ENVIRON_DATA: dict[Any, Any] | None = getattr(os.environ, "_data", None)
if not isinstance(ENVIRON_DATA, dict) or not callable(getattr(os.environ, "encodekey", None)):
    ENVIRON_DATA = None  # pragma: no cover
OPS_KEY = encoded(OPS_ENV)


def raw_get(key: Any) -> Any:
    """The raw value of an environment variable by its pre-encoded ``key`` (or ``None``)."""
    if ENVIRON_DATA is not None:
        return ENVIRON_DATA.get(key)
    return os.environ.get(key)  # pragma: no cover - platforms without os.environ._data

