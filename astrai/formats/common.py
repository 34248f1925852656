"""The pieces every file format of astrai shares: the frozen, closed model base, names and
counts, the machine fingerprint's model, and writing a file whole.

A leaf: it imports pydantic and nothing of astrai's but the name rule, so the table
formats of the core and the workflows' documents both build on it.
"""

from __future__ import annotations

__all__ = ["Count", "FileModel", "MachineModel", "Name", "Positive", "atomic_write"]

import os
import tempfile
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from astrai.dispatch.names import NAME_PATTERN


class FileModel(BaseModel):
    """A part of a file: unknown keys are errors, and values are never changed in place."""

    model_config = ConfigDict(extra="forbid", frozen=True)


Name = Annotated[StrictStr, Field(pattern=NAME_PATTERN, description="a row or profile name")]
Count = Annotated[StrictInt, Field(ge=0)]
Positive = Annotated[StrictInt, Field(ge=1)]


class MachineModel(FileModel):
    """A machine's fingerprint (``astrai.dispatch.machine.Machine``)."""

    cpu: StrictStr
    cores: Positive
    gpu: StrictStr | None
    sm: Count | None
    torch: StrictStr
    astrai: StrictStr


def atomic_write(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to a new file beside ``path``, then rename it over ``path``: a
    reader (another rank sharing the directory, a crash half-way) never sees half a file.
    The file gets the mode a newly created file gets in this process (the umask's)."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp",
                               dir=target.parent or Path("."))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
