"""The ``astrai`` logger and warn-once bookkeeping (never on the root logger)."""

from __future__ import annotations

import logging

from astrai.dispatch import state as process

logger = logging.getLogger("astrai")


def warn_once(message: str) -> None:
    """Log ``message`` as a warning the first time it is seen in this process."""
    if message in process.warned:
        return
    with process.warned_lock:
        if message in process.warned:
            return
        process.warned.add(message)
    logger.warning("%s", message)
