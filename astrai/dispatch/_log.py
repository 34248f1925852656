"""The ``astrai`` logger and warn-once bookkeeping (never on the root logger)."""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("astrai")

_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(message: str) -> None:
    """Log ``message`` as a warning the first time it is seen in this process."""
    if message in _warned:
        return
    with _warned_lock:
        if message in _warned:
            return
        _warned.add(message)
    logger.warning("%s", message)


def forget_warnings() -> None:
    """Allow every warning to be logged again (tests)."""
    with _warned_lock:
        _warned.clear()
