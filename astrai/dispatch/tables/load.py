"""Reading table and profile files into engine objects; every problem at once.

Owns the way from a file to ``FamilyTable`` (``parse_file``) and to ``Profile``
(``build_profile``, once the families it changes are known): reading the bytes
safely, YAML with positions (``_yaml``), validation against the one file format
(``format``), binding ``module:attribute`` paths (``_bind``), and building the
engine objects (``model``). Every problem in a file is collected (not only the
first) and reported as ``file:line:col: message``. Nothing here touches the live
registry; the registry swaps in what this module builds only when everything is
valid.

A file whose bytes match a precompiled shipped file (``artifact``) skips the YAML and
pydantic stages: its validated data (the same format dump), row positions and parsed
expressions come from the artifact, and the same builders run on them. pydantic and
PyYAML are imported only when some file needs the full path; a problem found on the
fast path reads the file's YAML then, for exact positions.
"""

from __future__ import annotations

__all__ = ["ParsedFile", "build_overlay_rows", "build_profile", "parse_file", "parse_text",
           "validate_directory"]

import hashlib
import os
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from astrai.dispatch._suggest import did_you_mean
from astrai.dispatch.axes import CORE_VOCABULARY, Axis, Vocabulary
from astrai.dispatch.expr.spec import Plain, Spec
from astrai.dispatch.tables import artifact
from astrai.dispatch.tables._bind import BindError, bind, missing_requirement
from astrai.dispatch.tables.model import (
    ALL,
    FALLBACK,
    FamilyOverlay,
    FamilyTable,
    ImplRecord,
    Profile,
    Unavailable,
)
from astrai.errors import SpecSyntaxError, TableError, TableProblem

if TYPE_CHECKING:
    from pydantic import BaseModel, ValidationError

    from astrai.dispatch.tables._yaml import Located

PathT = tuple[Any, ...]
#: What a value that fails a format pattern should look like, by key.
_PATTERN_MEANS = {
    "impl": "an import path 'module.path:attribute' (exactly one ':')",
    "available": "an import path 'module.path:attribute' (exactly one ':')",
    "env_alias": "an environment variable name (letters, digits, '_')",
    "requires": "a module name such as flash_attn",
}
_NAME_MEANS = "a valid name (letters, digits, '_', '.', '-', starting with a letter or '_')"
#: A file's validated data: the format model's ``model_dump(mode="json")`` (full path)
#: or the same dump stored in the precompiled artifact (fast path).
Data = Mapping[str, Any]


@dataclass
class ParsedFile:
    """One file after validation: a family table, a profile's data, or problems."""

    file: str
    kind: str  # "table" | "profile" | "unknown"
    located: Located | None = None
    table: FamilyTable | None = None
    profile: Data | None = None  # built into a ``Profile`` against the families
    revision: str = ""
    problems: list[TableProblem] = field(default_factory=list)
    text: str | None = None  # kept on the fast path, to find exact positions on demand
    dump: dict[str, Any] | None = None  # the validated model's JSON dump (full path)
    lines: dict[PathT, tuple[int, int]] = field(default_factory=dict)  # rows' positions
    whens: dict[PathT, Plain] = field(default_factory=dict)  # parsed core-vocabulary `when`s
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


#: The largest table or profile file read (the shipped ones are a few KiB).
MAX_TABLE_BYTES = 4 * 1024 * 1024

_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
               (stat.S_ISSOCK, "a socket"))


def read_table_bytes(path: str) -> bytes:
    """The bytes of a table file. Only a regular file of at most ``MAX_TABLE_BYTES`` is
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
        while size <= MAX_TABLE_BYTES:
            chunk = os.read(fd, min(1 << 20, MAX_TABLE_BYTES + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > MAX_TABLE_BYTES:
            raise ValueError(f"file is larger than {MAX_TABLE_BYTES} bytes, the most a table "
                             f"or profile file may have")
        return b"".join(chunks)
    finally:
        os.close(fd)


def parse_file(path: str | Path) -> ParsedFile:
    """Read and validate one file; never raises for a bad file (see ``problems``)."""
    name = str(path)
    try:
        data = read_table_bytes(name)
    except OSError as exc:
        return ParsedFile(name, "unknown", problems=[
            TableProblem(name, 1, 1, f"cannot read file: {exc.strerror or exc}")
        ])
    except ValueError as exc:
        return ParsedFile(name, "unknown", problems=[TableProblem(name, 1, 1, str(exc))])
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return ParsedFile(name, "unknown", problems=[
            TableProblem(name, 1, 1, f"file is not UTF-8 text: {exc.reason}")
        ])
    entry = artifact.lookup(data)
    if entry is not None:
        fast = _from_precompiled(name, text, entry)
        if fast is not None:
            return fast
    return parse_text(text, name)


def _from_precompiled(file: str, text: str, entry: artifact.Entry) -> ParsedFile | None:
    """Build a shipped file from its precompiled form; ``None`` if anything goes wrong
    (the caller then takes the full path, which reports the problem properly)."""
    out = ParsedFile(file, entry.kind, revision=entry.revision, text=text,
                     lines=dict(entry.lines), whens=dict(entry.whens))
    try:
        if entry.kind == "table":
            out.table = _build_table(out, entry.data)
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


def parse_text(text: str, file: str = "<string>") -> ParsedFile:
    """Validate the text of a table or profile file (told apart by ``family:``/``profile:``)."""
    from pydantic import ValidationError

    from astrai.dispatch.tables._yaml import YamlProblem, load_located
    from astrai.dispatch.tables.format import ProfileFile, TableFile

    out = ParsedFile(file, "unknown", revision=hashlib.sha256(text.encode()).hexdigest()[:16])
    try:
        out.located = load_located(text)
    except YamlProblem as exc:
        out.problems.append(TableProblem(file, exc.line, exc.column, exc.message))
        return out
    data = out.located.data
    if not isinstance(data, dict):
        out.problem((), "expected a mapping with 'version' and 'family:' (a table) or "
                        "'profile:' (a profile)")
        return out
    if "family" in data and "profile" in data:
        out.problem(("profile",), "a file is either a table ('family:') or a profile "
                                  "('profile:'), not both", key=True)
        return out
    if "family" in data:
        out.kind = "table"
    elif "profile" in data:
        out.kind = "profile"
    else:
        out.problem((), "expected a top-level 'family:' (a table) or 'profile:' (a profile)")
        return out
    if not _check_version(out, data):
        return out
    model_cls: type[BaseModel] = TableFile if out.kind == "table" else ProfileFile
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
        out.table = _build_table(out, out.dump)
    else:
        out.profile = out.dump
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
            _spec_problem(out, real, error)
            out.rejected.add(real)
        elif etype == "extra_forbidden":
            model = _model_at(out, real[:-1])
            valid = sorted(model.model_fields) if model else []
            out.problem(real, f"unknown key {loc[-1]!r}{did_you_mean(str(loc[-1]), valid)}; "
                              f"expected one of: {', '.join(valid)}", key=True)
        elif etype == "missing":
            out.problem(real[:-1] if real == loc else real, f"missing required key {dotted!r}")
        elif etype == "string_pattern_mismatch":
            key = next((p for p in reversed(loc) if isinstance(p, str)), "")
            means = _PATTERN_MEANS.get(key, _NAME_MEANS)
            out.problem(real, f"{dotted}: {err['input']!r} is not {means}")
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
    vocabulary = _declared_vocabulary(data)
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
        _no_fallback(out, fallback, names)


def _declared_vocabulary(data: dict[str, Any]) -> Vocabulary:
    """The family's vocabulary from its well-formed ``axes`` declarations, if any."""
    from pydantic import ValidationError

    from astrai.dispatch.tables.format import AxisModel

    declared = data.get("axes")
    well_formed: list[tuple[int, Data]] = []
    for i, raw in enumerate(declared if isinstance(declared, list) else []):
        try:
            well_formed.append((i, AxisModel.model_validate(raw).model_dump(mode="json")))
        except ValidationError:
            continue
    return family_vocabulary(_family_axes(None, well_formed))


def _no_fallback(out: ParsedFile, fallback: str, names: list[str]) -> None:
    out.problem(("fallback",), f"fallback {fallback!r} names no row"
                               f"{did_you_mean(fallback, names)}; rows: {', '.join(names)}")


def _model_at(out: ParsedFile, path: PathT) -> type[BaseModel] | None:
    """The model class that validates the mapping at ``path`` (for listing valid keys)."""
    from astrai.dispatch.tables.format import (
        AxisModel,
        FamilyOverlayModel,
        ProfileFile,
        RowModel,
        TableFile,
    )

    top: type[BaseModel] = TableFile if out.kind == "table" else ProfileFile
    if not path:
        return top
    head = path[0]
    if out.kind == "table":
        models: dict[str, type[BaseModel]] = {"rows": RowModel, "axes": AxisModel}
        return models.get(str(head))
    if head == "families":
        if len(path) == 2:
            return FamilyOverlayModel
        if len(path) >= 4 and path[2] == "add":
            return RowModel
    return None


def _column_of_expression(out: ParsedFile, path: PathT) -> tuple[int, int]:
    line, col = out.where(path)
    if out.located is not None and out.located.styles.get(path) in ("'", '"'):
        col += 1
    return line, col


def _spec_problem(out: ParsedFile, path: PathT, exc: SpecSyntaxError) -> None:
    """Record an expression's syntax error at its file position, caret and all."""
    line, col = _column_of_expression(out, path)
    out.problems.append(TableProblem(out.file, line, col + exc.span[0], exc.render()))


def compile_when(out: ParsedFile, path: PathT, text: str, vocabulary: Vocabulary) -> Spec | None:
    """Parse a row's expression; a syntax error is recorded with the file position.

    With the core vocabulary the parsed form is kept in ``out.whens`` (what the
    precompiled tables store), or taken from there on the fast path. An expression
    the format's validation already rejected (``out.rejected``) is not reported again.
    """
    if path in out.rejected:
        return None
    try:
        if vocabulary is not CORE_VOCABULARY:
            return Spec.parse(text, vocabulary)
        plain = out.whens.get(path)
        if plain is not None:
            return Spec.decode(plain, vocabulary)
        spec = Spec.parse(text, vocabulary)
        out.whens[path] = spec.encode()
        return spec
    except SpecSyntaxError as exc:
        _spec_problem(out, path, exc)
        return None


def bind_row(out: ParsedFile, path: PathT, family: str, row: Data, spec: Spec,
             priority: int) -> ImplRecord | None:
    """Bind a row's ``impl`` and ``available`` paths into an ``ImplRecord``."""
    requires: list[str] = row["requires"]
    try:
        impl = bind(row["impl"], requires)
    except BindError as exc:
        out.problem((*path, "impl"), str(exc))
        return None
    probe: Callable[[], Any] | None = None
    missing = impl.missing or missing_requirement(requires)
    available: str | None = row["available"]
    if missing is not None:
        reason = missing
        probe = lambda: Unavailable(reason)  # noqa: E731
    elif available is not None:
        try:
            bound = bind(available, requires)
        except BindError as exc:
            out.problem((*path, "available"), str(exc))
            return None
        if bound.missing is not None:
            missing = bound.missing
            probe = lambda: Unavailable(missing)  # noqa: E731
        elif not callable(bound.obj):
            out.problem((*path, "available"), f"{available!r} is not callable")
            return None
        else:
            probe = bound.obj
    out.lines[path] = out.where(path)
    line = out.lines[path][0]
    kwargs: dict[str, Any] = {} if probe is None else {"available": probe}
    return ImplRecord(
        family=family,
        name=row["name"],
        obj=impl.obj,
        spec=spec,
        priority=priority,
        faithful=row["faithful"],
        description=row["description"],
        source=f"{out.file}:{line}",
        **kwargs,
    )


def family_vocabulary(axes: Mapping[str, Axis]) -> Vocabulary:
    """The expression vocabulary of a family with these extra axes."""
    return CORE_VOCABULARY.with_extras(axes) if axes else CORE_VOCABULARY


def _family_axes(out: ParsedFile | None, declared: list[tuple[int, Data]]) -> dict[str, Axis]:
    """A table's extra axes from its ``axes:`` declarations given as ``(index, axis)``;
    a bad declaration is left out (and recorded in ``out``, when given)."""
    axes: dict[str, Axis] = {}
    for i, decl in declared:
        name = decl["name"]
        if name in CORE_VOCABULARY.axes or name in CORE_VOCABULARY.predicates:
            problem = ("name", f"axis {name!r} is already a core axis")
        elif name in axes:
            problem = ("name", f"duplicate axis {name!r}")
        elif (decl["type"] == "enum") != bool(decl["values"]):
            problem = ("", "'values' is required for an enum axis and only for one")
        else:
            axes[name] = Axis(name, decl["type"], tuple(decl["values"]),
                              nullable=decl["nullable"], description=decl["description"],
                              core=False)
            continue
        if out is not None:
            out.problem(("axes", i, problem[0]) if problem[0] else ("axes", i), problem[1])
    return axes


def _build_table(out: ParsedFile, data: Data) -> FamilyTable | None:
    """A validated table's data (a format dump) -> ``FamilyTable``, rows bound."""
    axes = _family_axes(out, list(enumerate(data["axes"])))
    vocabulary = family_vocabulary(axes)
    rows = build_overlay_rows(out, ("rows",), data["family"], list(enumerate(data["rows"])),
                              vocabulary)
    names = list(dict.fromkeys(r["name"] for r in data["rows"]))
    if data["fallback"] not in names:
        _no_fallback(out, data["fallback"], names)
    builder: Any = None
    context: str | None = data["context"]
    if context is not None:
        try:
            builder = bind(context).obj
        except BindError as exc:
            out.problem(("context",), str(exc))
        else:
            if not callable(builder):
                out.problem(("context",), f"{context!r} is not callable")
    if out.problems or rows is None:
        return None
    return FamilyTable(
        name=data["family"],
        rows=tuple(rows),
        fallback=data["fallback"],
        description=data["description"],
        env_alias=data["env_alias"],
        axes=MappingProxyType(axes),
        source=out.file,
        revision=out.revision,
        context=builder,
    )


def build_overlay_rows(out: ParsedFile, path: PathT, family: str,
                       rows: list[tuple[int, Data]],
                       vocabulary: Vocabulary) -> list[ImplRecord] | None:
    """Compile and bind rows given as ``(index, row data)`` (a table's, or a profile's
    ``add``). Every row is checked even after a failing one, so all problems are reported.
    """
    seen: set[str] = set()
    records: list[ImplRecord] = []
    ok = True
    for i, row in rows:
        rpath = (*path, i)
        name = row["name"]
        if name in seen:
            out.problem((*rpath, "name"), f"duplicate row name {name!r}")
            ok = False
        seen.add(name)
        spec = compile_when(out, (*rpath, "when"), row["when"], vocabulary)
        rec = bind_row(out, rpath, family, row, spec or Spec.never(), priority=i)
        if spec is None or rec is None:
            ok = False
            continue
        records.append(rec)
    return records if ok else None


# -- profiles ------------------------------------------------------------

def build_profile(parsed: ParsedFile, families: Mapping[str, FamilyTable]) -> Profile | None:
    """Check a parsed profile against the families it names; problems go to ``parsed``."""
    model = parsed.profile
    assert model is not None
    overlays: dict[str, FamilyOverlay] = {}
    before = len(parsed.problems)
    for family, ov in model["families"].items():
        path = ("families", family)
        if family == ALL:
            known = sorted({r.name for t in families.values() for r in t.rows})
            table = None
        elif family not in families:
            parsed.problem(path, f"unknown family {family!r}"
                                 f"{did_you_mean(family, families)}; known families: "
                                 f"{', '.join(sorted(families)) or '(none)'}, or '*'", key=True)
            continue
        else:
            table = families[family]
            known = table.row_names()
        overlays[family] = _build_overlay(parsed, path, family, ov, table, known)
    if len(parsed.problems) > before:
        return None
    return Profile(model["profile"], MappingProxyType(overlays), model["description"],
                   parsed.file, parsed.revision)


def _build_overlay(parsed: ParsedFile, path: tuple[str, ...], family: str,
                   ov: Mapping[str, Any], table: FamilyTable | None,
                   known: list[str]) -> FamilyOverlay:
    """One family's overlay data (a format dump) -> ``FamilyOverlay``, checked against
    the family's rows (or every family's, for ``"*"``)."""
    added: list[ImplRecord] = []
    if ov["add"]:
        if table is None:
            parsed.problem((*path, "add"), "'add' needs a family, not '*'", key=True)
        else:
            added = build_overlay_rows(parsed, (*path, "add"), family,
                                       list(enumerate(ov["add"])),
                                       family_vocabulary(table.axes)) or []
    names = [*known, *(a["name"] for a in ov["add"])]

    def check(key: str, values: Sequence[str], *, allow_fallback: bool = False) -> None:
        for i, name in enumerate(values):
            if allow_fallback and name == FALLBACK:
                continue
            if name not in names:
                where = f"family {family!r}" if table is not None else "any family"
                parsed.problem((*path, key, i) if key != "force" else (*path, key),
                               f"{key}: row {name!r} does not exist in {where}"
                               f"{did_you_mean(name, names)}; rows: {', '.join(names)}")

    if ov["force"] is not None:
        check("force", [ov["force"]], allow_fallback=True)
    check("order", ov["order"])
    check("disable", ov["disable"])
    check("enable", ov["enable"])
    if ov["fallback"] is not None:
        check("fallback", [ov["fallback"]])
    when: dict[str, Spec] = {}
    vocabulary = family_vocabulary(table.axes if table is not None else {})
    for name, text in ov["when"].items():
        if name not in names:
            parsed.problem((*path, "when", name), f"when: row {name!r} does not exist"
                                                  f"{did_you_mean(name, names)}; rows: "
                                                  f"{', '.join(names)}", key=True)
            continue
        spec = compile_when(parsed, (*path, "when", name), text, vocabulary)
        if spec is not None:
            when[name] = spec
    return FamilyOverlay(family, ov["force"], tuple(ov["order"]), tuple(ov["disable"]),
                         tuple(ov["enable"]), MappingProxyType(when), ov["fallback"],
                         tuple(added))


def validate_directory(directory: Path) -> list[ParsedFile]:
    """Every table and profile under ``directory``, validated the full way (profiles
    built against those tables), for writing the artifact. Raises ``TableError`` listing
    every problem."""
    paths = sorted(p for p in directory.rglob("*") if p.suffix in (".yaml", ".yml"))
    parsed = [parse_text(p.read_bytes().decode("utf-8"), str(p)) for p in paths]
    families = {pf.table.name: pf.table for pf in parsed if pf.table is not None}
    for pf in parsed:
        if pf.profile is not None:
            build_profile(pf, families)  # parses the profiles' expressions into pf.whens
    problems = [prob for pf in parsed for prob in pf.problems]
    if problems:
        raise TableError(problems)
    return parsed
