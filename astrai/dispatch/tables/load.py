"""Reading table and profile files; every problem at once.

Owns the way from a file to validated data and on to ``build`` (``parse_file``):
reading the bytes safely (regular files of bounded size only), YAML with positions
(``_yaml``), validation against the one file format (``format``). Every problem in a
file is collected (not only the first) and reported as ``file:line:col: message``.
Nothing here touches the live registry; the registry swaps in what is built only when
everything is valid.

A file whose bytes match a precompiled shipped file (``artifact``) skips the YAML and
pydantic stages: its validated data (the same format dump), row positions and parsed
expressions come from the artifact, and the same builders run on them. pydantic and
PyYAML are imported only when some file needs the full path; a problem found on the
fast path reads the file's YAML then, for exact positions.
"""

from __future__ import annotations

__all__ = ["MAX_TABLE_BYTES", "parse_bytes", "parse_file", "parse_text", "read_table_bytes",
           "validate_directory"]

import hashlib
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from astrai.dispatch.axes import Vocabulary
from astrai.dispatch.tables import artifact
from astrai.dispatch.tables.build import (
    build_extension,
    build_overlay_rows,
    build_profile,
    build_table,
    family_axes,
    family_definitions,
    family_vocabulary,
    no_fallback,
)
from astrai.dispatch.tables.model import FamilyTable
from astrai.dispatch.tables.parsed import Data, ParsedFile, PathT, spec_problem
from astrai.errors import SpecSyntaxError, TableError, TableProblem
from astrai.suggestions import did_you_mean

if TYPE_CHECKING:
    from pydantic import BaseModel, ValidationError


#: What a value that fails a format pattern should look like, by key.
_PATTERN_MEANS = {
    "impl": "an import path 'module.path:attribute' (exactly one ':')",
    "available": "an import path 'module.path:attribute' (exactly one ':')",
    "env_alias": "an environment variable name (letters, digits, '_')",
    "requires": "a module name such as flash_attn",
    "define": "a definition name (letters, digits and '_', starting with a letter or '_')",
}
#: The top-level key that tells each kind of file apart.
_KINDS = {"family": "table", "profile": "profile", "extends": "overlay"}
_NAME_MEANS = "a valid name (letters, digits, '_', '.', '-', starting with a letter or '_')"
#: The largest table or profile file read (the shipped ones are a few KiB).
MAX_TABLE_BYTES = 4 * 1024 * 1024

_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
               (stat.S_ISSOCK, "a socket"))


def read_table_bytes(path: str, limit: int = MAX_TABLE_BYTES) -> bytes:
    """The bytes of a table file. Only a regular file of at most ``limit`` bytes is
    read (``ValueError`` saying what it is otherwise): a FIFO, a device or ``/dev/zero``
    must never block a load or fill memory. Opened without blocking, checked on the
    opened descriptor, and read no further than the cap."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = next((k for test, k in _FILE_KINDS if test(info.st_mode)), "not a file")
            raise ValueError(f"not a regular file ({kind}): only regular files are tables")
        chunks: list[bytes] = []
        size = 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise ValueError(f"file is larger than {limit} bytes, the most such a file may "
                             f"have")
        return b"".join(chunks)
    finally:
        os.close(fd)


def parse_file(path: str | Path, provided_by: str = "") -> ParsedFile:
    """Read and validate one file; never raises for a bad file (see ``problems``).
    ``provided_by`` says who provided it (``ImplRecord.provided_by`` of its rows)."""
    name = str(path)
    try:
        data = read_table_bytes(name)
    except OSError as exc:
        return ParsedFile(name, "unknown", problems=[
            TableProblem(name, 1, 1, f"cannot read file: {exc.strerror or exc}")
        ])
    except ValueError as exc:
        return ParsedFile(name, "unknown", problems=[TableProblem(name, 1, 1, str(exc))])
    return parse_bytes(data, name, provided_by)


def parse_bytes(data: bytes, name: str, provided_by: str = "",
                precompiled: Mapping[str, artifact.Entry] | None = None) -> ParsedFile:
    """Validate a file's bytes (``name`` places its problems). A file whose bytes have
    an entry in ``precompiled`` (a plugin's artifact; default: the shipped one) is built
    from it."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return ParsedFile(name, "unknown", problems=[
            TableProblem(name, 1, 1, f"file is not UTF-8 text: {exc.reason}")
        ])
    entry = artifact.lookup(data, precompiled)
    if entry is not None:
        fast = _from_precompiled(name, text, entry, provided_by)
        if fast is not None:
            return fast
    return parse_text(text, name, provided_by)


def _from_precompiled(file: str, text: str, entry: artifact.Entry,
                      provided_by: str) -> ParsedFile | None:
    """Build a shipped file from its precompiled form; ``None`` if anything goes wrong
    (the caller then takes the full path, which reports the problem properly)."""
    out = ParsedFile(file, entry.kind, revision=entry.revision, text=text,
                     lines=dict(entry.lines), whens=dict(entry.whens), provided_by=provided_by)
    try:
        if entry.kind == "table":
            out.table = build_table(out, entry.data)
        elif entry.kind == "overlay":  # built once the families are known
            if not (isinstance(entry.data["extends"], str)
                    and all(isinstance(r, dict) for r in entry.data["rows"])):
                return None
            out.overlay = entry.data
        else:  # built once the families are known; its shape is checked now
            if not (isinstance(entry.data["profile"], str)
                    and all(isinstance(ov, dict) for ov in entry.data["families"].values())):
                return None
            out.profile = entry.data
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    if out.problems or (out.kind == "table" and out.table is None):
        return None
    return out


def parse_text(text: str, file: str = "<string>", provided_by: str = "") -> ParsedFile:
    """Validate the text of a table, profile or row overlay file (told apart by
    ``family:``, ``profile:`` and ``extends:``)."""
    from pydantic import ValidationError

    from astrai.dispatch.tables._yaml import YamlProblem, load_located
    from astrai.dispatch.tables.format import OverlayFile, ProfileFile, TableFile

    out = ParsedFile(file, "unknown", revision=hashlib.sha256(text.encode()).hexdigest()[:16],
                     provided_by=provided_by)
    try:
        out.located = load_located(text)
    except YamlProblem as exc:
        out.problems.append(TableProblem(file, exc.line, exc.column, exc.message))
        return out
    data = out.located.data
    kinds = [k for k in _KINDS if k in data] if isinstance(data, dict) else []
    if not isinstance(data, dict) or not kinds:
        out.problem((), "expected a mapping with 'version' and 'family:' (a table), "
                        "'profile:' (a profile) or 'extends:' (a row overlay)")
        return out
    if len(kinds) > 1:
        out.problem((kinds[1],), f"a file is one of a table ('family:'), a profile "
                                 f"('profile:') or a row overlay ('extends:'); this one has "
                                 f"{' and '.join(repr(k + ':') for k in kinds)}", key=True)
        return out
    out.kind = _KINDS[kinds[0]]
    if not _check_version(out, data):
        return out
    models: dict[str, type[BaseModel]] = {"table": TableFile, "profile": ProfileFile,
                                          "overlay": OverlayFile}
    model_cls = models[out.kind]
    context = {"vocabulary": _declared_vocabulary(data)} if out.kind == "table" else None
    try:
        model = model_cls.model_validate(data, context=context)
    except ValidationError as exc:
        _report_validation(out, exc)
        if out.kind == "table":
            _check_rows_anyway(out, data)
        return out
    out.dump = model.model_dump(mode="json")
    if out.kind == "table":
        out.table = build_table(out, out.dump)
    elif out.kind == "profile":
        out.profile = out.dump
    else:
        out.overlay = out.dump
        # Where each row is (its source line): kept by the artifact for the fast path.
        out.lines.update({("rows", i): out.where(("rows", i))
                          for i in range(len(out.dump["rows"]))})
    return out


def _check_version(out: ParsedFile, data: dict[str, Any]) -> bool:
    from astrai.dispatch.tables.format import SUPPORTED_VERSION

    version = data.get("version")
    if version is None:
        out.problem((), f"missing 'version' (this astrai reads version {SUPPORTED_VERSION})")
        return False
    if not isinstance(version, int) or isinstance(version, bool):
        out.problem(("version",), f"'version' must be an integer; this astrai reads version "
                                  f"{SUPPORTED_VERSION}")
        return False
    if version > SUPPORTED_VERSION:
        out.problem(("version",), f"{out.kind} version {version} is newer than this astrai "
                                  f"supports (version {SUPPORTED_VERSION}); upgrade astrai")
        return False
    if version != SUPPORTED_VERSION:
        out.problem(("version",), f"unknown {out.kind} version {version}; this astrai reads "
                                  f"version {SUPPORTED_VERSION}")
        return False
    return True


def _report_validation(out: ParsedFile, exc: ValidationError) -> None:
    assert out.located is not None
    for err in exc.errors():
        loc = tuple(err["loc"])
        # pydantic appends union-member / validator tags to ``loc``; keep the real path.
        real = loc
        while real and real not in out.located.values and real[:-1] != real:
            if real[:-1] in out.located.values:
                break
            real = real[:-1]
        dotted = ".".join(str(p) for p in loc if p in real) or "(top level)"
        etype = err["type"]
        error = err.get("ctx", {}).get("error")
        if isinstance(error, SpecSyntaxError):  # a `when` the parser rejected (``models.When``)
            spec_problem(out, real, error)
            out.rejected.add(real)
        elif etype == "extra_forbidden":
            model = _model_at(out, real[:-1])
            valid = sorted(model.model_fields) if model else []
            out.problem(real, f"unknown key {loc[-1]!r}{did_you_mean(str(loc[-1]), valid)}; "
                              f"expected one of: {', '.join(valid)}", key=True)
        elif etype == "missing":
            out.problem(real[:-1] if real == loc else real, f"missing required key {dotted!r}")
        elif etype == "string_pattern_mismatch":
            named = loc[-1] == "[key]"  # a mapping's key: say which mapping
            key = str(loc[-3]) if named and len(loc) >= 3 else next(
                (p for p in reversed(loc) if isinstance(p, str)), "")
            means = _PATTERN_MEANS.get(key, _NAME_MEANS)
            if named:
                real, dotted = loc[:-1], ".".join(str(p) for p in loc[:-1])
            out.problem(real, f"{dotted}: {err['input']!r} is not {means}", key=named)
        else:
            out.problem(real, f"{dotted}: {err['msg'].removeprefix('Value error, ')}")


def _check_rows_anyway(out: ParsedFile, data: dict[str, Any]) -> None:
    """After a structural error, still check every well-formed row: all problems at once."""
    from pydantic import ValidationError

    from astrai.dispatch.tables.format import RowModel

    rows = data.get("rows")
    if not isinstance(rows, list):
        return
    good: list[tuple[int, Data]] = []
    vocabulary = _declared_vocabulary(data, out)
    for i, raw in enumerate(rows):
        try:  # the structure only: the expressions were checked with the whole file
            good.append((i, RowModel.model_validate(raw).model_dump(mode="json")))
        except ValidationError:  # already reported
            pass
    build_overlay_rows(out, ("rows",), str(data.get("family")), good, vocabulary)
    fallback = data.get("fallback")
    # Every row that has a name counts, even one with other problems (already reported).
    names = list(dict.fromkeys(r["name"] for r in rows
                               if isinstance(r, dict) and isinstance(r.get("name"), str)))
    if isinstance(fallback, str) and names and fallback not in names:
        no_fallback(out, fallback, names)


def _declared_vocabulary(data: dict[str, Any], out: ParsedFile | None = None) -> Vocabulary:
    """The family's vocabulary from its well-formed ``axes`` and ``define`` declarations;
    the definitions' problems are recorded in ``out`` when given."""
    from pydantic import TypeAdapter, ValidationError

    from astrai.dispatch.tables.format import AxisModel, Definitions

    declared = data.get("axes")
    well_formed: list[tuple[int, Data]] = []
    for i, raw in enumerate(declared if isinstance(declared, list) else []):
        try:
            well_formed.append((i, AxisModel.model_validate(raw).model_dump(mode="json")))
        except ValidationError:
            continue
    definitions: dict[str, str] = {}
    defined = data.get("define")
    adapter = TypeAdapter(Definitions)
    for name, text in (defined.items() if isinstance(defined, dict) else ()):
        try:
            definitions.update(adapter.validate_python({name: text}))
        except ValidationError:  # reported by the format
            continue
    vocabulary = family_vocabulary(family_axes(None, well_formed))
    scratch = ParsedFile("", "table")  # problems seen without ``out`` are reported later
    return family_definitions(out or scratch, definitions, vocabulary)


def _model_at(out: ParsedFile, path: PathT) -> type[BaseModel] | None:
    """The model class that validates the mapping at ``path`` (for listing valid keys)."""
    from astrai.dispatch.tables.format import (
        AxisModel,
        FamilyOverlayModel,
        OverlayFile,
        OverlayRowModel,
        ProfileFile,
        RowModel,
        TableFile,
    )

    tops: dict[str, type[BaseModel]] = {"table": TableFile, "overlay": OverlayFile}
    top = tops.get(out.kind, ProfileFile)
    if not path:
        return top
    head = path[0]
    if out.kind == "table":
        models: dict[str, type[BaseModel]] = {"rows": RowModel, "axes": AxisModel}
        return models.get(str(head))
    if out.kind == "overlay":
        return OverlayRowModel if head == "rows" else None
    if head == "families":
        if len(path) == 2:
            return FamilyOverlayModel
        if len(path) >= 4 and path[2] == "add":
            return RowModel
    return None


def validate_directory(directory: Path,
                       known: Mapping[str, FamilyTable] | None = None) -> list[ParsedFile]:
    """Every table, profile and row overlay under ``directory``, validated the full way
    (profiles and overlays built against those tables and the ``known`` families: a
    plugin's extend the loaded ones), for writing the artifact. Raises ``TableError``
    listing every problem."""
    paths = sorted(p for p in directory.rglob("*") if p.suffix in (".yaml", ".yml")
                   and not any(part.startswith(("_", ".")) for part in
                               p.relative_to(directory).parent.parts))  # as plugins are read
    parsed = [parse_bytes(p.read_bytes(), str(p), precompiled={}) for p in paths]
    families = {**(known or {}),
                **{pf.table.name: pf.table for pf in parsed if pf.table is not None}}
    for pf in parsed:
        if pf.profile is not None:
            build_profile(pf, families)  # parses the profiles' expressions into pf.whens
        if pf.overlay is not None:
            build_extension(pf, families, {})
    problems = [prob for pf in parsed for prob in pf.problems]
    if problems:
        raise TableError(problems)
    return parsed
