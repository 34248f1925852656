"""The JSON Schemas of every file astrai reads, as checked in under ``schemas/``.

Generated from the pydantic models that define the formats: tables and profiles
(``tables.format``), recorded workloads and decision locks (``documents``).
``astrai-ops schema`` writes them; ``astrai-ops schema --check`` (and a test) fails when
a checked-in file differs from what the models generate.
"""

from __future__ import annotations

__all__ = ["json_schemas", "render_schemas", "stale_schemas", "write_schemas"]

import json
from pathlib import Path
from typing import Any

from astrai.dispatch.tables.format import json_schemas as table_schemas
from astrai.dispatch.tables.format import schemas_dir
from astrai.formats.documents import document_schemas


def json_schemas() -> dict[str, dict[str, Any]]:
    """``{file name: JSON Schema}`` for every file format."""
    return {**table_schemas(), **document_schemas()}


def render_schemas() -> dict[str, str]:
    """``{file name: text}`` exactly as the files should read."""
    return {name: json.dumps(schema, indent=2, sort_keys=True) + "\n"
            for name, schema in json_schemas().items()}


def stale_schemas(directory: Path | None = None) -> list[str]:
    """Names of schema files that are missing or differ from the models."""
    directory = directory or schemas_dir()
    stale = []
    for name, text in render_schemas().items():
        path = directory / name
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            stale.append(name)
    return stale


def write_schemas(directory: Path | None = None) -> list[Path]:
    """(Re)write every schema file; returns the paths written."""
    directory = directory or schemas_dir()
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render_schemas().items():
        path = directory / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written
