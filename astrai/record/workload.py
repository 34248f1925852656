"""A recorded workload: the distinct calls a process made, enough to rebuild them.

``record()`` (``astrai.record.recording``) collects a ``Workload``; ``save`` writes it as
YAML (``schemas/workload.schema.json``) and ``Workload.load`` reads one back, every
problem located (``file:line:col``) as for tables. Each ``RecordedCall`` holds:

- ``family`` and ``axes``: every axis of the call's ``CallContext`` as ``context_fields``
  gives it (raw values: lengths, not intervals; a dtype by its name), so ``context()``
  gives back the context the call was resolved with, under any table;
- ``args`` / ``kwargs``: the arguments the chosen row was called with, each described
  as a value (below), so ``arguments()`` builds inputs of the recorded shapes and
  ``astrai.ops.call(family, *args, **kwargs)`` repeats the call (a tuner times the rows
  on them);
- ``backend`` and ``scope``: the explicit ``backend=`` of the call, and the
  ``op_backend`` row and ``use_profile`` profiles in force for it;
- ``count``: how many calls were alike in all of the above.

Argument values are plain data: ``None``, booleans, numbers and strings as they are,
and tagged mappings for the rest: ``{tensor: {shape, dtype, device[, requires_grad]
[, stride]}}`` (``stride`` only for a tensor that is not contiguous; contents are not
recorded: a rebuilt float tensor holds normal random numbers, a boolean one ``True``,
an integer one zeros), ``{paged: {fwd, prefix_lens, extend_lens, pool: {...}}}`` (an
``astrai.kv_cache.PagedBatch``: its pool's sizes and each request's cached and new
tokens), ``{dtype: name}``, ``{seq: [values]}`` (a list or tuple, rebuilt as a list) and
``{object: "module:qualname"}`` for anything else (recorded, but not rebuildable).
"""

from __future__ import annotations

__all__ = [
    "WORKLOAD_VERSION",
    "DtypeArg",
    "ObjectArg",
    "PagedArg",
    "RecordedCall",
    "Selection",
    "SeqArg",
    "TensorArg",
    "Workload",
    "describe_value",
    "selection_of",
    "selection_plain",
    "value_from_plain",
]

import datetime
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from astrai.dispatch.axes import DTYPES, EMPTY, CallContext, context_from_fields, dtype_name
from astrai.dispatch.machine import Machine
from astrai.dispatch.scopes import op_backend, use_profile
from astrai.formats.common import storage_elements
from astrai.formats.saved import Saved
from astrai.kv_cache import KVPool, PagedBatch, extend_batch

if TYPE_CHECKING:
    from astrai.dispatch.registry import Registry

WORKLOAD_VERSION = 1


def _dtype(name: str) -> torch.dtype:
    return DTYPES[name]


def _device(recorded: str, device: str | torch.device | None) -> torch.device:
    return torch.device(recorded if device is None else device)


@dataclass(frozen=True)
class TensorArg:
    """A tensor argument: shape, dtype, device, whether it requires grad, and its
    strides when it is not contiguous (``None`` when it is)."""

    shape: tuple[int, ...]
    dtype: str
    device: str
    requires_grad: bool = False
    stride: tuple[int, ...] | None = None

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorArg:
        """The description of ``t``."""
        return cls(tuple(t.shape), dtype_name(t.dtype), str(t.device), t.requires_grad,
                   None if t.is_contiguous() else tuple(t.stride()))

    def plain(self) -> dict[str, Any]:
        """The file's form: ``{tensor: {...}}`` (defaults left out)."""
        got: dict[str, Any] = {"shape": list(self.shape), "dtype": self.dtype,
                               "device": self.device}
        if self.requires_grad:
            got["requires_grad"] = True
        if self.stride is not None:
            got["stride"] = list(self.stride)
        return {"tensor": got}

    def build(self, device: str | torch.device | None = None,
              generator: torch.Generator | None = None) -> torch.Tensor:
        """A tensor like the recorded one (on ``device`` when given): normal random
        floats, ``True`` booleans, integer zeros."""
        dtype, where = _dtype(self.dtype), _device(self.device, device)
        shape, stride = self.shape, self.stride
        size = storage_elements(shape, stride)
        if dtype.is_complex:
            flat = torch.randn(size, generator=generator, dtype=dtype).to(where)
        elif dtype.is_floating_point:  # drawn in float32: not every float dtype has randn
            flat = torch.randn(size, generator=generator).to(dtype=dtype, device=where)
        elif dtype == torch.bool:
            flat = torch.ones(size, dtype=dtype, device=where)
        else:
            flat = torch.zeros(size, dtype=dtype, device=where)
        t = flat.view(shape) if stride is None else flat.as_strided(shape, stride)
        if self.requires_grad:
            t = t.detach().requires_grad_(True)
        return t


@dataclass(frozen=True)
class PagedArg:
    """A paged batch (``astrai.kv_cache.PagedBatch``): its forward mode, each request's
    cached (``prefix_lens``) and new (``extend_lens``) tokens, and its pool's sizes."""

    fwd: str
    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]
    layers: int
    slots: int
    kv_heads: int
    head_dim: int
    max_requests: int
    max_context: int
    dtype: str
    device: str
    padding_slot: bool = True

    @classmethod
    def of(cls, batch: PagedBatch) -> PagedArg:
        """The description of ``batch`` (read on the host: no device synchronisation)."""
        pool = batch.pool
        prefix = tuple(s - e for s, e in zip(batch.seq_lens_host, batch.extend_lens_host,
                                             strict=True))
        return cls(batch.fwd, prefix, tuple(batch.extend_lens_host), pool.layers, pool.slots,
                   pool.kv_heads, pool.head_dim, pool.max_requests, pool.max_context,
                   dtype_name(pool.dtype), str(pool.device), pool.first_slot == 1)

    def plain(self) -> dict[str, Any]:
        """The file's form: ``{paged: {fwd, prefix_lens, extend_lens, pool: {...}}}``."""
        pool = {"layers": self.layers, "slots": self.slots, "kv_heads": self.kv_heads,
                "head_dim": self.head_dim, "max_requests": self.max_requests,
                "max_context": self.max_context, "dtype": self.dtype, "device": self.device,
                "padding_slot": self.padding_slot}
        return {"paged": {"fwd": self.fwd, "prefix_lens": list(self.prefix_lens),
                          "extend_lens": list(self.extend_lens), "pool": pool}}

    def build(self, device: str | torch.device | None = None,
              generator: torch.Generator | None = None) -> PagedBatch:
        """A pool of the recorded sizes with random K/V, and a batch over it in which
        each request holds its recorded context and new tokens."""
        pool = KVPool(self.layers, self.slots, self.kv_heads, self.head_dim, self.max_requests,
                      self.max_context, dtype=_dtype(self.dtype),
                      device=_device(self.device, device),
                      reserve_padding_slot=self.padding_slot)
        for buffer in (pool.k_buffer, pool.v_buffer):
            buffer.copy_(torch.randn(buffer.shape, generator=generator, dtype=buffer.dtype))
        rows = pool.alloc_requests(len(self.extend_lens))
        cached = [(row, n) for row, n in zip(rows, self.prefix_lens, strict=True) if n]
        if cached:
            extend_batch(pool, [r for r, _ in cached], [n for _, n in cached], fwd="prefill")
        return extend_batch(pool, rows, self.extend_lens, fwd=self.fwd)  # type: ignore[arg-type]


@dataclass(frozen=True)
class DtypeArg:
    """A ``torch.dtype`` argument, by name."""

    name: str

    def plain(self) -> dict[str, Any]:
        """The file's form: ``{dtype: name}``."""
        return {"dtype": self.name}

    def build(self, device: str | torch.device | None = None,
              generator: torch.Generator | None = None) -> torch.dtype:
        """The dtype."""
        return _dtype(self.name)


@dataclass(frozen=True)
class SeqArg:
    """A list or tuple argument, item by item (rebuilt as a list)."""

    items: tuple[Any, ...]

    def plain(self) -> dict[str, Any]:
        """The file's form: ``{seq: [values]}``."""
        return {"seq": [_plain(v) for v in self.items]}

    def build(self, device: str | torch.device | None = None,
              generator: torch.Generator | None = None) -> list[Any]:
        """The items, rebuilt."""
        return [_build(v, device, generator) for v in self.items]


@dataclass(frozen=True)
class ObjectArg:
    """Any other argument: only its type is recorded (``module:qualname``)."""

    type: str

    def plain(self) -> dict[str, Any]:
        """The file's form: ``{object: "module:qualname"}``."""
        return {"object": self.type}

    def build(self, device: str | torch.device | None = None,
              generator: torch.Generator | None = None) -> Any:
        """Always ``ValueError``: an object of a type astrai does not know is not rebuilt."""
        raise ValueError(f"cannot rebuild an argument of type {self.type} (only its type was "
                         f"recorded)")


#: How a call's selection (``backend=`` or an ``op_backend`` handle) is written down.
Selection = str | ObjectArg | None


def selection_of(state: Registry, family: str, handle: Any) -> Selection:
    """How a selection handle is written down: a row name as it is, an implementation
    object as its row's name (or its type, ``ObjectArg``, when it is no row's)."""
    if handle is None or isinstance(handle, str):
        return handle
    table = state.families.get(family)
    for rec in table.rows if table is not None else ():
        if rec.obj is handle:
            return rec.name
    target = handle if hasattr(handle, "__qualname__") else type(handle)
    return ObjectArg(f"{getattr(target, '__module__', '?')}:"
                     f"{getattr(target, '__qualname__', '?')}")


def selection_plain(value: Selection) -> Any:
    """The file's form of a selection."""
    return value.plain() if isinstance(value, ObjectArg) else value


_SCALARS = (type(None), bool, int, float, str)
Tagged = TensorArg | PagedArg | DtypeArg | SeqArg | ObjectArg


#: How deep lists and tuples are described; deeper (or a list that holds itself) is
#: recorded by type.
MAX_DEPTH = 16


def describe_value(value: Any, _path: tuple[int, ...] = ()) -> Any:
    """An argument as a recorded value: a scalar as it is, else a hashable ``*Arg``.
    Never raises: what cannot be described faithfully (a nested or sparse tensor, a
    symbolic size, a list that contains itself or nests deeper than ``MAX_DEPTH``) is
    recorded by its type, as an ``ObjectArg`` (not rebuildable)."""
    if value.__class__ in _SCALARS:
        return value
    try:
        if isinstance(value, torch.Tensor):
            return TensorArg.of(value) if _plain_tensor(value) else _by_type(value)
        if isinstance(value, PagedBatch):
            return PagedArg.of(value)
        if isinstance(value, torch.dtype):
            return DtypeArg(dtype_name(value))
        if isinstance(value, list | tuple):
            if id(value) in _path or len(_path) >= MAX_DEPTH:
                return _by_type(value)
            inner = (*_path, id(value))
            return SeqArg(tuple(describe_value(v, inner) for v in value))
    except Exception:  # an object whose attributes cannot be read as expected
        return _by_type(value)
    return _by_type(value)


def _by_type(value: Any) -> ObjectArg:
    kind = type(value)
    return ObjectArg(f"{kind.__module__}:{kind.__qualname__}")


def _plain_tensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a strided dense tensor with plain integer sizes (what a
    ``TensorArg`` describes and rebuilds)."""
    if t.is_nested or t.layout is not torch.strided:
        return False
    return all(type(d) is int for d in t.shape)


def _plain(value: Any) -> Any:
    return value.plain() if isinstance(value, Tagged) else value


def _build(value: Any, device: str | torch.device | None,
           generator: torch.Generator | None) -> Any:
    return value.build(device, generator) if isinstance(value, Tagged) else value


def value_from_plain(data: Any) -> Any:
    """A recorded value from its file form (already validated against the schema)."""
    if not isinstance(data, Mapping):
        return data
    if "tensor" in data:
        t = data["tensor"]
        stride = t.get("stride")
        return TensorArg(tuple(t["shape"]), t["dtype"], t["device"],
                         bool(t.get("requires_grad", False)),
                         None if stride is None else tuple(stride))
    if "paged" in data:
        p = data["paged"]
        pool = p["pool"]
        return PagedArg(p["fwd"], tuple(p["prefix_lens"]), tuple(p["extend_lens"]),
                        pool["layers"], pool["slots"], pool["kv_heads"], pool["head_dim"],
                        pool["max_requests"], pool["max_context"], pool["dtype"],
                        pool["device"], bool(pool.get("padding_slot", True)))
    if "dtype" in data:
        return DtypeArg(data["dtype"])
    if "seq" in data:
        return SeqArg(tuple(value_from_plain(v) for v in data["seq"]))
    return ObjectArg(data["object"])


@dataclass(frozen=True)
class RecordedCall:
    """One distinct call of a workload (see the module docstring)."""

    family: str
    axes: Mapping[str, Any]
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=lambda: EMPTY)
    count: int = 1
    backend: str | ObjectArg | None = None
    scope_backend: str | ObjectArg | None = None
    scope_profiles: tuple[str, ...] = ()

    def context(self) -> CallContext:
        """The ``CallContext`` the call was resolved with (without its raw arguments)."""
        return context_from_fields(self.family, self.axes)

    @property
    def selection(self) -> str | ObjectArg | None:
        """The row selected strictly for the call: ``backend=``, else the ``op_backend``
        scope's (``None``: the tables decided)."""
        return self.backend if self.backend is not None else self.scope_backend

    @contextmanager
    def conditions(self) -> Iterator[None]:
        """Within the block, the conditions the call was made under: its grad mode, and
        the ``op_backend`` row and ``use_profile`` profiles in force for it. Replaying a
        call is ``with call.conditions(): ops.call(call.family, *args,
        backend=call.backend, **kwargs)`` with ``args, kwargs = call.arguments()``."""
        if isinstance(self.scope_backend, ObjectArg):
            raise ValueError(f"the {self.family} call was made under op_backend with an "
                             f"implementation object ({self.scope_backend.type}), which a "
                             f"workload cannot name")
        with ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(bool(self.axes.get("grad_enabled",
                                                                          True))))
            if self.scope_backend is not None:
                stack.enter_context(op_backend(**{self.family: self.scope_backend}))
            if self.scope_profiles:
                stack.enter_context(use_profile(*self.scope_profiles))
            yield

    def arguments(self, device: str | torch.device | None = None,
                  generator: torch.Generator | None = None
                  ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` of the recorded shapes, dtypes and devices (every tensor on
        ``device`` when given), for ``astrai.ops.call(self.family, *args, **kwargs)``."""
        return (tuple(_build(v, device, generator) for v in self.args),
                {k: _build(v, device, generator) for k, v in self.kwargs.items()})

    def plain(self) -> dict[str, Any]:
        """The file's form of the call."""
        out: dict[str, Any] = {"family": self.family, "count": self.count}
        if self.backend is not None:
            out["backend"] = _plain(self.backend)
        if self.scope_backend is not None or self.scope_profiles:
            scope: dict[str, Any] = {}
            if self.scope_backend is not None:
                scope["backend"] = _plain(self.scope_backend)
            if self.scope_profiles:
                scope["profiles"] = list(self.scope_profiles)
            out["scope"] = scope
        out["axes"] = dict(self.axes)
        out["args"] = [_plain(v) for v in self.args]
        out["kwargs"] = {k: _plain(v) for k, v in self.kwargs.items()}
        return out

    @classmethod
    def from_plain(cls, data: Mapping[str, Any]) -> RecordedCall:
        """A call from its file form (already validated)."""
        scope = data.get("scope") or {}
        return cls(data["family"], dict(data["axes"]),
                   tuple(value_from_plain(v) for v in data.get("args", ())),
                   {k: value_from_plain(v) for k, v in data.get("kwargs", {}).items()},
                   data["count"], value_from_plain(data.get("backend")),
                   value_from_plain(scope.get("backend")), tuple(scope.get("profiles", ())))


def now_utc() -> str:
    """The current time as the files write it (ISO 8601, UTC, seconds)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Workload(Saved):
    """The distinct calls of a recording, in the order first seen, and where they ran.

    ``dropped`` counts calls that were not kept because the recording was full
    (``record(max_calls=...)``).
    """

    KIND: ClassVar[str] = "workload"

    calls: tuple[RecordedCall, ...]
    machine: Machine | None = None
    recorded: str = ""
    dropped: int = 0

    @property
    def total(self) -> int:
        """How many calls were recorded (the counts summed)."""
        return sum(c.count for c in self.calls)

    def families(self) -> dict[str, int]:
        """Calls per family, in the order first seen."""
        out: dict[str, int] = {}
        for c in self.calls:
            out[c.family] = out.get(c.family, 0) + c.count
        return out

    def summary(self) -> str:
        """A line per family: distinct calls and calls."""
        distinct: dict[str, int] = {}
        for c in self.calls:
            distinct[c.family] = distinct.get(c.family, 0) + 1
        lines = [f"{'family':<12} {'distinct':>8} {'calls':>8}"]
        lines += [f"{f:<12} {distinct[f]:>8} {n:>8}" for f, n in self.families().items()]
        if self.dropped:
            lines.append(f"({self.dropped} calls not kept: the recording was full)")
        return "\n".join(lines)

    def plain(self) -> dict[str, Any]:
        """The file's form of the workload."""
        out: dict[str, Any] = {"version": WORKLOAD_VERSION, "kind": "workload",
                               "recorded": self.recorded or now_utc()}
        if self.machine is not None:
            out["machine"] = self.machine.as_dict()
        if self.dropped:
            out["dropped"] = self.dropped
        out["calls"] = [c.plain() for c in self.calls]
        return out

    def headline(self) -> str:
        """The comment that opens the file."""
        return f"astrai workload: {len(self.calls)} distinct calls, {self.total} calls"

    @classmethod
    def from_plain(cls, data: Mapping[str, Any], source: str = "") -> Workload:
        """The workload of a validated file form."""
        machine = data.get("machine")
        return cls(tuple(RecordedCall.from_plain(c) for c in data["calls"]),
                   None if machine is None else Machine.from_dict(machine),
                   data["recorded"], data.get("dropped", 0))

    @classmethod
    def of(cls, calls: Sequence[RecordedCall], machine: Machine | None = None,
           dropped: int = 0) -> Workload:
        """A workload of ``calls`` recorded now."""
        return cls(tuple(calls), machine, now_utc(), dropped)
