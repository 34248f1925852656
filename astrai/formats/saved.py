"""Values kept in files: a recorded workload and a decision lock are each saved as, and
loaded from, one YAML document (``documents`` reads and writes them; imported only
then, since it brings pydantic)."""

from __future__ import annotations

__all__ = ["Saved"]

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

T = TypeVar("T", bound="Saved")


class Saved:
    """A value saved as a ``KIND`` document: it gives its file form (``plain``) and the
    file's first line (``headline``), and is built back from a validated file form
    (``from_plain``)."""

    KIND: ClassVar[str]

    def plain(self) -> dict[str, Any]:
        """The file's form of the value."""
        raise NotImplementedError

    def headline(self) -> str:
        """The comment that opens the file."""
        raise NotImplementedError

    @classmethod
    def from_plain(cls: type[T], data: Mapping[str, Any], source: str) -> T:
        """The value of a validated file form read from ``source``."""
        raise NotImplementedError

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the value as YAML to ``path`` (with a schema line for editors)."""
        from astrai.formats.documents import write_document

        return write_document(path, self.plain(), self.KIND, self.headline())

    @classmethod
    def load(cls: type[T], path: str | os.PathLike[str]) -> T:
        """Read the file at ``path``; ``FileFormatError`` lists every problem, located."""
        from astrai.formats.documents import read_document

        return cls.from_plain(read_document(path, cls.KIND), os.fspath(path))
