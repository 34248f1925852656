"""A table or profile file on its way to engine objects: ``ParsedFile``, which carries
what was read, what was built, and every problem found, each placed at its
``file:line:col`` (positions come from the YAML, or from the artifact on the fast path).
"""

from __future__ import annotations

__all__ = ["Data", "ParsedFile", "PathT", "column_of_expression", "spec_problem"]

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from astrai.dispatch.expr.spec import Plain
from astrai.dispatch.tables.model import FamilyTable
from astrai.errors import SpecSyntaxError, TableProblem

if TYPE_CHECKING:
    from astrai.dispatch.tables._yaml import Located

PathT = tuple[Any, ...]
#: A file's validated data: the format model's ``model_dump(mode="json")`` (full path)
#: or the same dump stored in the precompiled artifact (fast path).
Data = Mapping[str, Any]


@dataclass
class ParsedFile:
    """One file after validation: a family table, a profile's or a row overlay's data,
    or problems."""

    file: str
    kind: str  # "table" | "profile" | "overlay" | "unknown"
    located: Located | None = None
    table: FamilyTable | None = None
    profile: Data | None = None  # built into a ``Profile`` against the families
    overlay: Data | None = None  # a row overlay's data, built against the family it extends
    provided_by: str = ""  # who provided the file (``ImplRecord.provided_by``)
    revision: str = ""
    problems: list[TableProblem] = field(default_factory=list)
    text: str | None = None  # kept on the fast path, to find exact positions on demand
    dump: dict[str, Any] | None = None  # the validated model's JSON dump (full path)
    lines: dict[PathT, tuple[int, int]] = field(default_factory=dict)  # rows' positions
    whens: dict[PathT, Plain] = field(default_factory=dict)  # parsed `when`s, definitions
    rejected: set[PathT] = field(default_factory=set)  # `when`s the format already reported

    def where(self, path: PathT, *, key: bool = False) -> tuple[int, int]:
        """1-based ``(line, column)`` of ``path`` in the file (``(1, 1)`` if unknown)."""
        if not key and path in self.lines:
            return self.lines[path]
        if self.located is None and self.text is not None:
            from astrai.dispatch.tables._yaml import YamlProblem, load_located

            try:
                self.located = load_located(self.text)
            except YamlProblem:
                self.text = None
        return self.located.where(path, key=key) if self.located else (1, 1)

    def problem(self, path: PathT, message: str, *, key: bool = False) -> None:
        """Record a problem at ``path`` of this file."""
        line, col = self.where(path, key=key)
        self.problems.append(TableProblem(self.file, line, col, message))


def column_of_expression(out: ParsedFile, path: PathT) -> tuple[int, int]:
    line, col = out.where(path)
    if out.located is not None and out.located.styles.get(path) in ("'", '"'):
        col += 1
    return line, col


def spec_problem(out: ParsedFile, path: PathT, exc: SpecSyntaxError) -> None:
    """Record an expression's syntax error at its file position, caret and all."""
    line, col = column_of_expression(out, path)
    out.problems.append(TableProblem(out.file, line, col + exc.span[0], exc.render()))
