"""The pieces every file format of astrai shares: the frozen, closed model base, names and
counts, and the machine fingerprint's model.

A leaf: it imports pydantic and nothing of astrai's but the name rule, so the table
formats here and the workflows' documents (``astrai.formats``) both build on it.
"""

from __future__ import annotations

__all__ = ["Count", "FileModel", "MachineModel", "Name", "Positive"]

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
