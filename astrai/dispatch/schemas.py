"""The JSON Schemas under ``schemas/``, generated from the pydantic file models."""

from __future__ import annotations

__all__ = ["render_schemas", "schemas_dir", "stale_schemas", "write_schemas"]

import json
from pathlib import Path

from astrai.dispatch.models import json_schemas


def schemas_dir() -> Path:
    """The checked-in ``schemas/`` folder (the repo's, or the copy inside a wheel)."""
    here = Path(__file__).resolve().parent.parent
    packaged = here / "schemas"
    return packaged if packaged.is_dir() else here.parent / "schemas"


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
