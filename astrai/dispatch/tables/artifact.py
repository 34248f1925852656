"""The shipped tables and their precompiled artifact: read (the fast path), write (the CLI).

``shipped_tables_dir()`` is where the shipped tables are. ``precompiled.json`` next to
them holds, for every shipped table and profile file, keyed by the SHA-256 of its
bytes: the validated data (the format model's dump, ``format``), the line of every
row, and, already parsed (the plain encoding, ``Spec.encode``), every table's ``when``
expressions and definitions, and every profile ``when`` that needs only the core
vocabulary. ``load`` builds a file whose bytes match an entry from that entry,
with the same builders the full path uses; a file that was edited no longer matches
and takes the full path. The file is JSON: reading it runs no code and needs neither
pydantic nor YAML.

Writing it (``render_artifact``) takes files ``load`` has already validated the full
way; ``astrai-ops schema`` regenerates it and ``--check`` (run in CI, and by a test)
fails when it is stale.

A plugin package (``astrai.dispatch.plugins``) may ship the same kind of artifact next
to its YAML files (``astrai-ops precompile DIR``), so its files load without pydantic
and PyYAML too (``read_entries``). Every artifact names the table formats it was made
for (``format_digest``: a digest of the checked-in JSON Schemas); one made for other
formats is not used (its files take the full path).
"""

from __future__ import annotations

__all__ = ["ARTIFACT", "Entry", "Validated", "build_artifact", "format_digest", "lookup",
           "read_entries", "render_artifact", "schemas_dir", "shipped_tables_dir"]

import functools
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from astrai.dispatch import state as process
from astrai.dispatch.expr.spec import Plain

ARTIFACT = "precompiled.json"
FORMAT = 1

PathT = tuple[Any, ...]


def shipped_tables_dir() -> Path:
    """Where the shipped tables are: inside the package (wheel) or the repo's ``tables/``."""
    here = Path(__file__).resolve().parents[2]  # astrai/
    packaged = here / "tables"
    if packaged.is_dir():
        return packaged
    return here.parent / "tables"


def schemas_dir() -> Path:
    """The checked-in ``schemas/`` folder (the repo's, or the copy inside a wheel)."""
    here = Path(__file__).resolve().parents[2]  # astrai/
    packaged = here / "schemas"
    return packaged if packaged.is_dir() else here.parent / "schemas"


@dataclass(frozen=True)
class Entry:
    """One precompiled file."""

    kind: str  # "table" | "profile" | "overlay"
    revision: str
    data: Mapping[str, Any]
    lines: Mapping[PathT, tuple[int, int]]
    whens: Mapping[PathT, Plain]


def _artifact_path() -> Path:
    return shipped_tables_dir() / ARTIFACT


#: The JSON Schemas of the file formats an artifact's data follows (``format``).
_FORMAT_SCHEMAS = ("table.schema.json", "profile.schema.json", "overlay.schema.json")


@functools.lru_cache(maxsize=1)
def format_digest() -> str:
    """A digest of what an artifact's data means: the table, profile and row overlay
    formats (as their checked-in JSON Schemas state them), the expression language's
    axes (names, kinds, values) and predicates (what each stands for), and the artifact's
    own layout. An artifact made for anything else is not used."""
    from astrai.dispatch.axes import EXPRESSION_AXES, PREDICATES

    digest = hashlib.sha256(json.dumps([
        FORMAT, [[a.name, a.kind, list(a.values), a.nullable]
                 for a in EXPRESSION_AXES.values()],
        sorted([name, *meaning] for name, meaning in PREDICATES.items()),
    ]).encode())
    for name in _FORMAT_SCHEMAS:
        try:
            digest.update((schemas_dir() / name).read_bytes())
        except OSError:
            digest.update(b"(missing)")
    return digest.hexdigest()[:16]


def read_entries(raw: bytes | str) -> dict[str, Entry] | None:
    """An artifact's entries by digest of each file's bytes; ``None`` when it is not an
    artifact of this format made for these table formats (or cannot be read)."""
    try:
        doc = json.loads(raw)
        if doc.get("format") != FORMAT or doc.get("tables_format") != format_digest():
            return None
        return {digest: Entry(e["kind"], digest[:16], e["data"],
                              {tuple(p): (int(lc[0]), int(lc[1])) for p, lc in e["lines"]},
                              {tuple(p): w for p, w in e["whens"]})
                for digest, e in doc["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError, IndexError):
        return None


def _load() -> dict[str, Entry]:
    """The shipped artifact's entries by digest; empty if it is missing or not usable."""
    try:
        text = _artifact_path().read_bytes()
    except OSError:
        return {}
    return read_entries(text) or {}


def lookup(data: bytes, entries: Mapping[str, Entry] | None = None) -> Entry | None:
    """The precompiled entry for a file with these bytes: among ``entries`` (a plugin's
    artifact) when given, else if it is a shipped file."""
    if entries is None:
        entries = process.artifact_entries
        if entries is None:
            entries = process.artifact_entries = _load()
    got: Entry | None = entries.get(hashlib.sha256(data).hexdigest())
    return got


class Validated(Protocol):
    """What the writer needs of a file validated the full way (``parsed.ParsedFile``)."""

    @property
    def file(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def dump(self) -> dict[str, Any] | None: ...
    @property
    def lines(self) -> dict[PathT, tuple[int, int]]: ...
    @property
    def whens(self) -> dict[PathT, Plain]: ...


def build_artifact(directory: Path, files: Iterable[Validated]) -> dict[str, Any]:
    """The artifact for ``files``, the tables and profiles under ``directory``, each
    validated the full way without a problem (``load.validate_directory``)."""
    out: dict[str, Any] = {}
    for pf in files:
        assert pf.dump is not None, f"{pf.file} was not validated"
        path = Path(pf.file)
        out[hashlib.sha256(path.read_bytes()).hexdigest()] = {
            "file": path.relative_to(directory).as_posix(),
            "kind": pf.kind,
            "data": pf.dump,
            "lines": [[list(p), list(lc)] for p, lc in sorted(pf.lines.items(), key=repr)],
            "whens": [[list(p), w] for p, w in sorted(pf.whens.items(), key=repr)],
        }
    return {"format": FORMAT,
            "tables_format": format_digest(),
            "note": "generated by `astrai-ops schema` (a plugin's: `astrai-ops precompile`); "
                    "do not edit",
            "files": dict(sorted(out.items(), key=lambda kv: kv[1]["file"]))}


def render_artifact(directory: Path, files: Iterable[Validated]) -> str:
    """The artifact's text (what ``astrai-ops schema`` writes next to the tables)."""
    return json.dumps(build_artifact(directory, files), indent=1, sort_keys=False) + "\n"
