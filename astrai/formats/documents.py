"""The workload and lock file formats (version 1), and reading and writing them.

The pydantic models here are the only definition of the two formats: ``schemas/``
holds their JSON Schemas (``astrai-ops schema``), and ``read_document`` validates a
file against them, reporting every problem at once as ``file:line:col: message``
(``FileFormatError``), as tables are reported. ``write_document`` writes YAML with a
``# yaml-language-server: $schema=`` line so that editors validate the file too.
The values in them are described in ``astrai.record.workload`` (calls, arguments)
and ``astrai.lock.model`` (decisions). Imported only to read or write such a file
(pydantic is slow to import).
"""

from __future__ import annotations

__all__ = [
    "DOCUMENT_VERSION",
    "LockFile",
    "WorkloadFile",
    "document_schemas",
    "read_document",
    "write_document",
]

import math
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    Tag,
    ValidationError,
    model_validator,
)

from astrai.dispatch.axes import AXES, DTYPES, FWD_MODES, format_value
from astrai.dispatch.names import family_name_problem
from astrai.dispatch.tables._yaml import Located, YamlProblem, load_data, load_located
from astrai.dispatch.tables.format import schemas_dir
from astrai.errors import FileFormatError, TableProblem
from astrai.formats.common import (
    Count,
    FileModel,
    MachineModel,
    Name,
    Positive,
    atomic_write,
    storage_elements,
)

DOCUMENT_VERSION = 1
#: The largest workload or lock file read, and the most values in one.
MAX_DOCUMENT_BYTES = 256 * 1024 * 1024
MAX_DOCUMENT_VALUES = 20_000_000
#: The origins a locked decision may have (resolution's, and ``lock`` for a pinned one).
ORIGINS = ("explicit", "context", "lock", "env", "profile", "chain", "fallback")

Scalar = StrictBool | StrictInt | StrictFloat | StrictStr | None


def _dtype_name(name: str) -> str:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected a torch dtype name such as "
                         f"float16, bfloat16, float32")
    return name


def _family(name: str) -> str:
    problem = family_name_problem(name)
    if problem is not None:
        raise ValueError(problem)
    return name


DtypeName = Annotated[StrictStr, AfterValidator(_dtype_name),
                      Field(description="a torch dtype name, e.g. bfloat16")]
FamilyName = Annotated[StrictStr, AfterValidator(_family), Field(description="a family name")]




class TensorSpec(FileModel):
    """A tensor: its contents are not recorded (a rebuilt one is random)."""

    shape: list[Count]
    dtype: DtypeName
    device: StrictStr = Field(description="torch.device text: cpu, cuda:0, ...")
    requires_grad: StrictBool = False
    stride: list[Count] | None = Field(default=None,
                                       description="present only when not contiguous")

    @model_validator(mode="after")
    def _strides_fit(self) -> TensorSpec:
        if self.stride is not None and len(self.stride) != len(self.shape):
            raise ValueError(f"stride has {len(self.stride)} entries for a shape of "
                             f"{len(self.shape)}")
        _buildable(self.shape, self.stride)
        return self


#: The most elements a tensor can have (torch indexes storage with int64).
MAX_ELEMENTS = 2 ** 63 - 1


def _buildable(shape: list[int], stride: list[int] | None) -> None:
    """No machine can build a tensor whose elements (or whose strided storage) exceed
    ``MAX_ELEMENTS``."""
    if 0 in shape:
        return
    need = max(math.prod(shape), storage_elements(shape, stride))
    if need > MAX_ELEMENTS:
        raise ValueError(f"a tensor of shape {shape} needs {need:.3g} elements; no machine "
                         f"can build one over 2**63 - 1")


class PoolSpec(FileModel):
    """The sizes of a paged KV pool (``astrai.kv_cache.KVPool``)."""

    layers: Positive
    slots: Positive
    kv_heads: Positive
    head_dim: Positive
    max_requests: Positive
    max_context: Positive
    dtype: DtypeName
    device: StrictStr
    padding_slot: StrictBool = True

    @model_validator(mode="after")
    def _pool_fits(self) -> PoolSpec:
        _buildable([2, self.layers, self.slots, self.kv_heads, self.head_dim], None)
        _buildable([self.max_requests, self.max_context], None)
        return self


class PagedSpec(FileModel):
    """A paged batch: per request, tokens already cached and new tokens."""

    fwd: Literal[FWD_MODES]  # type: ignore[valid-type]
    prefix_lens: list[Count]
    extend_lens: list[Positive] = Field(min_length=1)
    pool: PoolSpec

    @model_validator(mode="after")
    def _one_length_per_request(self) -> PagedSpec:
        if len(self.prefix_lens) != len(self.extend_lens):
            raise ValueError(f"{len(self.prefix_lens)} prefix_lens for "
                             f"{len(self.extend_lens)} extend_lens: one of each per request")
        return self


class TensorValue(FileModel):
    tensor: TensorSpec


class PagedValue(FileModel):
    paged: PagedSpec


class DtypeValue(FileModel):
    dtype: DtypeName


class ObjectValue(FileModel):
    object: StrictStr = Field(description="the type of an argument that is not rebuilt")


class SeqValue(FileModel):
    seq: list[Value]


_TAGS = ("tensor", "paged", "dtype", "seq", "object")


def _kind(value: Any) -> str | None:
    """Which form a value takes: a scalar, or the one key of a tagged mapping."""
    if isinstance(value, dict):
        keys = list(value)
        return keys[0] if len(keys) == 1 and keys[0] in _TAGS else None
    if isinstance(value, BaseModel):
        return next(iter(type(value).model_fields))
    return "scalar"


Value = Annotated[
    Annotated[Scalar, Tag("scalar")]
    | Annotated[TensorValue, Tag("tensor")]
    | Annotated[PagedValue, Tag("paged")]
    | Annotated[DtypeValue, Tag("dtype")]
    | Annotated[SeqValue, Tag("seq")]
    | Annotated[ObjectValue, Tag("object")],
    Discriminator(_kind, custom_error_type="value", custom_error_message=(
        "expected null, a boolean, a number, a string, or a mapping with one key of: "
        + ", ".join(_TAGS))),
]
SeqValue.model_rebuild()
Selection = Name | ObjectValue


class ScopeModel(FileModel):
    """The ``op_backend`` row and ``use_profile`` profiles in force for a call."""

    backend: Selection | None = None
    profiles: list[Name] = Field(default_factory=list)


Axes = Annotated[dict[StrictStr, Scalar],
                 Field(description="every axis of the call (context_fields): raw values, "
                                   "a dtype by its name")]


class CallModel(FileModel):
    """One distinct recorded call."""

    family: FamilyName
    count: Positive
    backend: Selection | None = Field(default=None, description="the call's backend=")
    scope: ScopeModel | None = None
    axes: Axes
    args: list[Value] = Field(default_factory=list)
    kwargs: dict[StrictStr, Value] = Field(default_factory=dict)


class _FileModel(FileModel):
    """What every workload and lock file starts with."""

    version: StrictInt = Field(description="the format's version: 1")


class WorkloadFile(_FileModel):
    """A recorded workload: the distinct calls a process made through the facades."""

    model_config = ConfigDict(title="astrai recorded workload (version 1)")

    kind: Literal["workload"]
    recorded: StrictStr = Field(description="when, ISO 8601 UTC")
    machine: MachineModel | None = None
    dropped: Count = Field(default=0, description="calls not kept (the recording was full)")
    calls: list[CallModel]


class TableRevisionModel(FileModel):
    """A family's table when the lock was made."""

    revision: StrictStr
    source: StrictStr = ""


class DecisionModel(FileModel):
    """One locked decision: a recorded call signature and the row that served it."""

    family: FamilyName
    signature: StrictStr = Field(description="the call's label (axes off their default)")
    axes: Axes
    backend: Selection | None = None
    scope: ScopeModel | None = None
    row: Name | None = Field(description="the row; null when no row could serve the call")
    origin: Literal[ORIGINS] | None  # type: ignore[valid-type]
    error: StrictStr | None = None
    table: StrictStr = Field(description="the revision of the family's table")
    profiles: dict[Name, StrictStr] = Field(
        default_factory=dict, description="the profiles in force, with their revisions")
    calls: Positive = Field(default=1, description="recorded calls with this signature")


class LockFile(_FileModel):
    """A decision lock: the row each recorded call signature resolved to, and where."""

    model_config = ConfigDict(title="astrai decision lock (version 1)")

    kind: Literal["lock"]
    created: StrictStr = Field(description="when, ISO 8601 UTC")
    workload: StrictStr = Field(default="", description="the workload it was made from")
    machine: MachineModel
    environment: dict[StrictStr, StrictStr | None] = Field(
        default_factory=dict, description="the astrai variables in force when it was made")
    tables: dict[StrictStr, TableRevisionModel]
    plugins: dict[StrictStr, StrictStr] = Field(
        default_factory=dict,
        description="the plugins (astrai.tables entry points) whose rows the locked families "
                    "held: distribution -> version")
    decisions: list[DecisionModel]


_MODELS: dict[str, type[FileModel]] = {"workload": WorkloadFile, "lock": LockFile}


def document_schemas() -> dict[str, dict[str, Any]]:
    """``{file name: JSON Schema}`` of the workload and lock formats."""
    return {f"{kind}.schema.json": model.model_json_schema() for kind, model in _MODELS.items()}


# -- writing ---------------------------------------------------------------------------

def _schema_ref(kind: str) -> str:
    path = (schemas_dir() / f"{kind}.schema.json").resolve()
    text = path.as_posix()
    return path.as_uri() if any(c.isspace() for c in text) else text


def write_document(path: str | os.PathLike[str], data: dict[str, Any], kind: str,
                   headline: str) -> Path:
    """Write ``data`` as a ``kind`` file at ``path`` (replaced whole: a reader never sees
    half a file); returns the path."""
    from astrai.formats.yaml_text import dump

    body = dump(data)
    text = (f"# {headline}\n# yaml-language-server: $schema={_schema_ref(kind)}\n{body}")
    return atomic_write(path, text)


# -- reading -------------------------------------------------------------------------

def _read_text(name: str) -> str:
    """The text of a document file (a regular file of bounded size)."""
    from astrai.dispatch.tables.load import read_table_bytes

    try:
        data = read_table_bytes(name, MAX_DOCUMENT_BYTES)
    except OSError as exc:
        raise FileFormatError([TableProblem(name, 1, 1, f"cannot read file: "
                                                        f"{exc.strerror or exc}")]) from None
    except ValueError as exc:
        raise FileFormatError([TableProblem(name, 1, 1, str(exc))]) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FileFormatError([TableProblem(name, 1, 1, f"file is not UTF-8 text: "
                                                        f"{exc.reason}")]) from None


def _real_path(data: Any, loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """The path in the document of a pydantic error location (which also holds union
    tags and validator names): the steps that exist in the data, in order."""
    path: list[Any] = []
    node = data
    for step in loc:
        if isinstance(node, dict) and step in node:
            node = node[step]
        elif isinstance(node, list) and isinstance(step, int) and 0 <= step < len(node):
            node = node[step]
        else:
            continue
        path.append(step)
    return tuple(path)


class _Problems:
    """The problems found in one document, each placed at its line and column (the
    document is read again with positions for the first one: a valid file never needs
    them)."""

    def __init__(self, file: str, text: str) -> None:
        self.file = file
        self.text = text
        self.located: Located | None = None
        self.found: list[TableProblem] = []

    def add(self, path: tuple[Any, ...], message: str, *, key: bool = False) -> None:
        if self.located is None:
            self.located = load_located(self.text, MAX_DOCUMENT_VALUES, fast=True)
        line, col = self.located.where(path, key=key)
        self.found.append(TableProblem(self.file, line, col, message))


def _dotted(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path) or "(top level)"


def _validation_problems(problems: _Problems, data: Any, exc: ValidationError) -> None:
    seen: set[tuple[tuple[Any, ...], str]] = set()
    for err in exc.errors():
        loc = tuple(err["loc"])
        path = _real_path(data, loc)
        if err["type"] == "extra_forbidden":
            path = _real_path(data, loc)
            message = f"unknown key {loc[-1]!r} in {_dotted(path[:-1])}"
            key = True
        elif err["type"] == "missing":
            message = f"missing required key {loc[-1]!r} in {_dotted(path)}"
            key = False
        else:
            message = f"{_dotted(path)}: {err['msg'].removeprefix('Value error, ')}"
            key = False
        if (path, message) not in seen:  # a union's members may each say the same
            seen.add((path, message))
            problems.add(path, message, key=key)


def _version_problem(problems: _Problems, data: dict[str, Any], kind: str) -> bool:
    version = data.get("version")
    if version is None:
        problems.add((), f"missing 'version' (this astrai reads {kind} version "
                         f"{DOCUMENT_VERSION})")
    elif not isinstance(version, int) or isinstance(version, bool):
        problems.add(("version",), f"'version' must be an integer; this astrai reads {kind} "
                                   f"version {DOCUMENT_VERSION}")
    elif version > DOCUMENT_VERSION:
        problems.add(("version",), f"{kind} version {version} is newer than this astrai "
                                   f"supports (version {DOCUMENT_VERSION}); upgrade astrai")
    elif version != DOCUMENT_VERSION:
        problems.add(("version",), f"unknown {kind} version {version}; this astrai reads "
                                   f"version {DOCUMENT_VERSION}")
    else:
        return False
    return True


def _axes_problems(problems: _Problems, items: list[Any], key: str) -> None:
    """Each recorded axis value must fit its axis (a dtype name, a mode, an int...)."""
    for i, item in enumerate(items):
        for name, value in item["axes"].items():
            axis = AXES.get(name)  # another name is an axis the family's table declares
            if axis is None:
                continue
            try:
                axis.parse(format_value(value))
            except ValueError as exc:
                problems.add((key, i, "axes", name), f"{key}.{i}.axes.{name}: {exc}")


def read_document(path: str | os.PathLike[str], kind: str) -> dict[str, Any]:
    """The validated content of the ``kind`` file (``workload`` or ``lock``) at ``path``,
    as plain data (the model's JSON dump). ``FileFormatError`` lists every problem."""
    name = os.fspath(path)
    text = _read_text(name)
    try:
        data = load_data(text, MAX_DOCUMENT_VALUES)
    except YamlProblem as exc:
        raise FileFormatError([TableProblem(name, exc.line, exc.column, exc.message)]) from None
    problems = _Problems(name, text)
    if not isinstance(data, dict):
        problems.add((), f"expected a mapping with 'version', 'kind: {kind}', ...")
        raise FileFormatError(problems.found)
    if data.get("kind") != kind:
        other = data.get("kind")
        what = (f"this is a {other} file, not a {kind} file" if other in _MODELS
                else f"expected 'kind: {kind}'")
        problems.add(("kind",) if "kind" in data else (), what)
        raise FileFormatError(problems.found)
    if _version_problem(problems, data, kind):
        raise FileFormatError(problems.found)
    try:
        model = _MODELS[kind].model_validate(data)
    except ValidationError as exc:
        _validation_problems(problems, data, exc)
        raise FileFormatError(problems.found) from None
    del data  # the model holds it all now (a large file is not held three times)
    dump = model.model_dump(mode="json")
    del model
    _axes_problems(problems, dump["calls" if kind == "workload" else "decisions"],
                   "calls" if kind == "workload" else "decisions")
    if problems.found:
        raise FileFormatError(problems.found)
    return dump  # type: ignore[no-any-return]
