"""A recorded call's inputs, rebuilt for tuning: whether they can be here, fresh for
every row, and what a row did to them.

- **Reproducible here** (``unreproducible``): every device the call's tensors were on must
  exist on this machine (``cuda:1`` needs two CUDA devices; a device type torch cannot
  allocate on is refused), and the inputs must fit: tune holds one copy of a call's
  inputs per candidate row, plus about two more for the reference's output and a row's,
  and measures the call only when all of them take at most ``MEMORY_SHARE`` (half) of the
  memory available on their device when it is measured (``/proc/meminfo``'s
  ``MemAvailable`` on the host; ``torch.cuda.mem_get_info`` on a GPU). A call that fails
  either is skipped with the reason; the run goes on.
- **Fresh inputs**: every row gets its own inputs, built from the same seed (equal values,
  other storage), so no row sees what another did.
- **What a row did to them** (``changed_inputs``): after a row's first call its inputs are
  compared with the reference row's after its own first call. A row that leaves them
  otherwise than the reference does (``x.add_(1)`` on an input, say) is excluded with that
  reason. Writes the family means to make (a paged attention call stores the new keys and
  values in its pool) are made by the reference too, so they compare equal.
"""

from __future__ import annotations

__all__ = ["MEMORY_SHARE", "changed_inputs", "input_bytes", "tensors_in", "unreproducible"]

import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import torch

from astrai.formats.common import storage_elements
from astrai.record.workload import PagedArg, RecordedCall, SeqArg, TensorArg

#: The share of a device's available memory that the copies of one call's inputs tune
#: holds at once may take.
MEMORY_SHARE = 0.5


def _dtype_size(name: str) -> int:
    from astrai.dispatch.axes import DTYPES

    return int(torch.empty((), dtype=DTYPES[name]).element_size())


def _described(value: Any) -> Iterator[tuple[str, int]]:
    """``(device, bytes)`` of every tensor a described argument rebuilds into."""
    if isinstance(value, TensorArg):
        yield value.device, storage_elements(value.shape, value.stride) * _dtype_size(
            value.dtype)
    elif isinstance(value, PagedArg):
        token = value.kv_heads * value.head_dim * _dtype_size(value.dtype)
        yield value.device, 2 * value.layers * value.slots * token  # the K and V buffers
        yield value.device, value.max_requests * value.max_context * 8  # req_to_token
    elif isinstance(value, SeqArg):
        for item in value.items:
            yield from _described(item)


def input_bytes(call: RecordedCall) -> dict[str, int]:
    """Per device (as recorded), the bytes the call's rebuilt inputs take."""
    out: dict[str, int] = {}
    for value in (*call.args, *call.kwargs.values()):
        for device, n in _described(value):
            out[device] = out.get(device, 0) + n
    return out


def _missing_device(text: str) -> str | None:
    """Why tensors cannot be made on ``text`` here (``None``: they can)."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError) as exc:
        return f"the device {text!r} is not one torch knows ({str(exc).splitlines()[0]})"
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return f"recorded on {text}; this machine has no CUDA device"
        if device.index is not None and device.index >= torch.cuda.device_count():
            return (f"recorded on {text}; this machine has {torch.cuda.device_count()} CUDA "
                    f"devices")
        return None
    try:
        torch.empty(0, device=device)
    except Exception as exc:  # any backend's own error: the device is not here
        return f"recorded on {text}; torch cannot allocate there ({str(exc).splitlines()[0]})"
    return None


def _available(device: str) -> int | None:
    """Bytes available on ``device`` now (``None``: not known)."""
    where = torch.device(device)
    if where.type == "cuda":
        return int(torch.cuda.mem_get_info(where.index if where.index is not None else 0)[0])
    if where.type != "cpu":
        return None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return None


def _size(n: int) -> str:
    """``n`` bytes in words (``1.5 GiB``)."""
    value, unit = float(n), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"


def unreproducible(call: RecordedCall, copies: int = 4) -> str | None:
    """Why ``call`` cannot be measured here holding ``copies`` copies of its inputs
    (module docstring), or ``None``."""
    need = input_bytes(call)
    for device in need:
        why = _missing_device(device)
        if why is not None:
            return why
    for device, n in need.items():
        free = _available(device)
        if free is not None and n * copies > MEMORY_SHARE * free:
            return (f"its inputs take {_size(n)} on {device}; the {copies} copies tune would "
                    f"hold are over {MEMORY_SHARE:.0%} of the {_size(free)} available there")
    return None


def tensors_in(value: Any, depth: int = 3) -> list[torch.Tensor]:
    """Every tensor ``value`` holds: itself, in lists, tuples and dicts, and in the fields
    of objects such as a paged batch and its pool (``depth`` levels of them), in a fixed
    order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in tensors_in(v, depth)]
    if isinstance(value, dict):
        return [t for k in sorted(value, key=str) for t in tensors_in(value[k], depth)]
    if depth <= 0 or value is None or isinstance(value, str | int | float | bool | torch.dtype):
        return []
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    else:
        fields = dict(getattr(value, "__dict__", {}))
    return [t for k in sorted(fields) for t in tensors_in(fields[k], depth - 1)]


def changed_inputs(got: list[torch.Tensor], want: list[torch.Tensor]) -> str | None:
    """How a row's inputs after its call (``got``) differ from the reference row's after
    its own (``want``), in words; ``None`` when they agree."""
    if len(got) != len(want):
        return f"its inputs hold {len(got)} tensors after the call, the reference's {len(want)}"
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"it reshaped or retyped input tensor {i}"
        a, b = a.detach(), b.detach()
        same = (torch.equal(a, b) if not (a.is_floating_point() or a.is_complex())
                else torch.allclose(a, b, atol=0.0, rtol=0.0, equal_nan=True))
        if not same:
            return (f"it writes into its inputs (input tensor {i} {tuple(a.shape)} differs "
                    f"from the reference row's after the call)")
    return None
