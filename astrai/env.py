"""The process environment: every ``ASTR_*`` variable astrai reads, declared here once,
and raw reads of it cheap enough for the hot path.

``os.environ`` decodes on every read; its own dict (``os.environ._data``) holds the
encoded names and values, so a lookup there by a pre-encoded name is one dict get.
"""

from __future__ import annotations

__all__ = [
    "CACHE_HOME_ENV",
    "ENVIRON_DATA",
    "LOCK_ENV",
    "LOCK_KEY",
    "LOCK_MODE_ENV",
    "LOCK_MODE_KEY",
    "MACHINE_ENV",
    "NATIVE_DIR_ENV",
    "NATIVE_ENV",
    "OPS_ENV",
    "OPS_KEY",
    "PLUGINS_ENV",
    "RECORD_ENV",
    "RECORD_OWNER_ENV",
    "TABLES_ENV",
    "TUNED_ENV",
    "cache_root",
    "decoded",
    "encoded",
    "environ_get",
    "raw_get",
]

import functools
import os
from pathlib import Path
from typing import Any


@functools.lru_cache(maxsize=256)
def encoded(name: str) -> Any:
    """``name`` in the form ``os.environ``'s own dict stores it (for ``raw_get``)."""
    encode = getattr(os.environ, "encodekey", None)
    return encode(name) if callable(encode) else name


ENVIRON_DATA: dict[Any, Any] | None = getattr(os.environ, "_data", None)
if not isinstance(ENVIRON_DATA, dict) or not callable(getattr(os.environ, "encodekey", None)):
    ENVIRON_DATA = None  # pragma: no cover


def raw_get(key: Any) -> Any:
    """The raw value of an environment variable by its pre-encoded ``key`` (or ``None``)."""
    if ENVIRON_DATA is not None:
        return ENVIRON_DATA.get(key)
    return os.environ.get(key)  # pragma: no cover - platforms without os.environ._data


#: ``raw_get`` itself, or where possible the dict's own ``get`` (the hot path's).
environ_get = raw_get if ENVIRON_DATA is None else ENVIRON_DATA.get



def decoded(raw: Any) -> str | None:
    """A raw value (``raw_get``'s) as the ``str`` ``os.environ`` would give (or ``None``)."""
    if raw is None or isinstance(raw, str):
        return raw
    decode = getattr(os.environ, "decodevalue", None)
    return decode(raw) if callable(decode) else str(raw)  # type: ignore[no-any-return]


# -- every variable astrai reads ----------------------------------------------------

#: Rows and profiles for the process: ``family=row,...,profile=name+name``.
OPS_ENV = "ASTR_OPS"
#: Table files and directories to load instead of the shipped tables (path list).
TABLES_ENV = "ASTR_TABLES"
#: Which installed kernel packages' tables join (``none``, or names to leave out).
PLUGINS_ENV = "ASTR_PLUGINS"
#: Record every call of the process into this workload file, written at exit.
RECORD_ENV = "ASTR_RECORD"
#: Set by the process that records under ``ASTR_RECORD`` (its pid), for the processes it
#: starts: they inherit both, and write files of their own beside it.
RECORD_OWNER_ENV = "ASTR_RECORD_OWNER"
#: The decision lock in force (``astrai.lock.enforce``) and what a drift from it does.
LOCK_ENV = "ASTR_LOCK"
LOCK_MODE_ENV = "ASTR_LOCK_MODE"
#: Whether the facades use the compiled hot path (``auto``, ``on``, ``off``;
#: ``astrai.native``) and where it is built (a folder).
NATIVE_ENV = "ASTR_NATIVE"
NATIVE_DIR_ENV = "ASTR_NATIVE_DIR"
#: Whether ``dispatch_model`` puts this machine's tuned profile (``astrai.tune_model``,
#: kept in the user's cache) in force: ``on`` (the default) or ``off``.
TUNED_ENV = "ASTR_TUNED"
#: The machine axes taken in place of this machine's, for the whole process:
#: ``cpu_vendor=amd,cpu_isa=avx512`` (``astrai.dispatch.hardware``).
MACHINE_ENV = "ASTR_MACHINE"
#: The user's cache (the XDG base directory); astrai's lives in ``<it>/astrai``.
CACHE_HOME_ENV = "XDG_CACHE_HOME"


def cache_root(home: str | os.PathLike[str] | None = None) -> Path:
    """astrai's folder in the user's cache: ``<home>/astrai``, ``home`` by default
    ``XDG_CACHE_HOME``, else ``~/.cache`` (the native build and tuned profiles live
    under it)."""
    base = home if home is not None else (os.environ.get(CACHE_HOME_ENV)
                                          or Path.home() / ".cache")
    return Path(base).expanduser() / "astrai"

#: The names as ``os.environ`` stores them, for the raw reads of the hot path.
OPS_KEY = encoded(OPS_ENV)
LOCK_KEY = encoded(LOCK_ENV)
LOCK_MODE_KEY = encoded(LOCK_MODE_ENV)
