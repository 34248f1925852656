"""Raw reads of the process environment, cheap enough for the hot path.

``os.environ`` decodes on every read; its own dict (``os.environ._data``) holds the
encoded names and values, so a lookup there by a pre-encoded name is one dict get.
"""

from __future__ import annotations

__all__ = ["ENVIRON_DATA", "LOCK_ENV", "LOCK_KEY", "encoded", "environ_get", "raw_get"]

import functools
import os
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


#: The decision lock in force (``astrai.dispatch.lockfile``), and its name as
#: ``os.environ`` stores it: a decision-cache miss reads it raw.
LOCK_ENV = "ASTR_LOCK"
LOCK_KEY = encoded(LOCK_ENV)
