"""The byte collective behind rank agreement: payloads as JSON text in ``uint8``
tensors (``all_gather`` of the lengths, then of the padded bytes), no pickle and no
NumPy; bounded by a timeout, and a rank's failure travels as a payload of its own."""

from __future__ import annotations

__all__ = [
    "all_gather_bytes",
    "collective_device",
    "decode_payload",
    "describe_failure",
    "encode_payload",
    "failed_payload",
    "failed_text",
    "gather_payloads",
    "seconds_of",
]

import json
import socket
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from astrai.distributed.comparison import PlanDifference
from astrai.distributed.fingerprint import MAX_ERROR_TEXT, WIRE_FORMAT
from astrai.errors import PlanMismatchError
from astrai.version import __version__

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
def encode_payload(payload: dict[str, Any]) -> bytes:
    """The payload as JSON (ASCII: anything else, lone surrogates too, is escaped)."""
    return json.dumps(payload, separators=(",", ":"), sort_keys=True).encode("ascii")


def decode_payload(data: bytes) -> Any:
    """What a rank sent, or ``None`` when it is not JSON (e.g. another version's pickle)."""
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None


def describe_failure(exc: BaseException) -> str:
    """``"TypeError: message"`` for a payload (bounded; never raises)."""
    try:
        text = str(exc)
    except Exception:  # a broken __str__ must not keep this rank from the collective
        text = "(the error's message could not be formatted)"
    if len(text) > MAX_ERROR_TEXT:
        text = text[:MAX_ERROR_TEXT] + " [...]"
    name = type(exc).__name__
    return f"{name}: {text}" if text else name


def failed_payload(exc: BaseException) -> dict[str, Any]:
    """What a rank sends instead of a fingerprint when it could not compute one."""
    try:
        host = socket.gethostname()
    except Exception:
        host = "?"
    return {"wire": WIRE_FORMAT, "version": __version__, "host": host,
            "failed": describe_failure(exc)}


def failed_text(data: Any) -> str | None:
    """The error in a failed rank's payload, or ``None`` when the payload is not one."""
    if (isinstance(data, Mapping) and data.get("wire") == WIRE_FORMAT
            and isinstance(data.get("failed"), str)):
        return str(data["failed"])
    return None


def seconds_of(timeout: float | timedelta | None) -> float | None:
    """``timeout=`` in seconds (``None``: the process group's own timeout)."""
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, int | float) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"check_agreement: timeout must be seconds (a number) or a "
                        f"datetime.timedelta, got {type(timeout).__name__}: {timeout!r}")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"check_agreement: timeout must be a positive, finite number of "
                         f"seconds, got {timeout!r}")
    return seconds


def collective_device(group: ProcessGroup | None) -> torch.device:
    """Where the group's collectives take their tensors: NCCL's on this rank's CUDA device."""
    import torch.distributed as dist  # deferred: ~60 ms, needed only here

    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_gather(out: list[torch.Tensor], tensor: torch.Tensor, group: ProcessGroup | None,
                what: str, start: float, timeout: float | None) -> None:
    """``dist.all_gather``, waited for until ``timeout`` seconds after ``start`` at most;
    a timeout or a failure of the collective raises ``PlanMismatchError`` saying which
    all-gather it was and after how long (the backend's error is its ``__cause__``)."""
    import torch.distributed as dist  # deferred: ~60 ms, needed only here

    timed_out = False
    try:
        work = dist.all_gather(out, tensor, group=group, async_op=True)
        if timeout is None:
            work.wait()
        else:
            left = max(start + timeout - time.monotonic(), 0.001)
            timed_out = work.wait(timeout=timedelta(seconds=left)) is False
    except RuntimeError as exc:  # torch.distributed's errors (DistError and the backends')
        elapsed = time.monotonic() - start
        if timeout is not None and elapsed >= timeout - 0.05:  # clocks differ a little
            raise _collective_error("timeout", what, elapsed, timeout, group) from exc
        raise _collective_error("collective", what, elapsed, timeout, group, exc) from exc
    if timed_out:
        raise _collective_error("timeout", what, time.monotonic() - start, timeout, group)


def _collective_error(kind: str, what: str, elapsed: float, timeout: float | None,
                      group: ProcessGroup | None,
                      exc: BaseException | None = None) -> PlanMismatchError:
    import torch.distributed as dist  # deferred: ~60 ms, needed only here

    rank, n = dist.get_rank(), dist.get_world_size(group)
    where = f"rank {rank} (of a group of {n})"
    if kind == "timeout":
        value = f"timed out after {elapsed:.1f} s (timeout={timeout:g} s)"
        message = (f"check_agreement timed out on {where} after {elapsed:.1f} s "
                   f"(timeout={timeout:g} s) waiting for the other ranks in the all-gather "
                   f"of the {what}: some rank of the group has not called check_agreement. "
                   f"The process group cannot be used after this: destroy it, or exit")
    else:
        value = f"failed after {elapsed:.1f} s: {describe_failure(exc) if exc else '?'}"
        message = (f"check_agreement: the all-gather of the {what} failed on {where} after "
                   f"{elapsed:.1f} s (a rank may have exited or lost its connection): "
                   f"{describe_failure(exc) if exc else '?'}")
    diff = PlanDifference(kind, f"all-gather of the {what}", ((value, (rank,)),))
    return PlanMismatchError(message, [diff])


def all_gather_bytes(data: bytes, n: int, group: ProcessGroup | None,
                      timeout: float | None = None) -> list[bytes]:
    """Every rank's ``data``, in group order: the lengths first, then the bytes padded to
    the longest (two ``all_gather`` calls on plain tensors; neither pickle nor NumPy).
    Both together wait at most ``timeout`` seconds (``None``: the group's own timeout)."""
    start = time.monotonic()
    device = collective_device(group)
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(n)]
    _all_gather(lengths, length, group, "payload lengths", start, timeout)
    sizes = [int(t.item()) for t in lengths]
    longest = max(sizes)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    if data:
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    buffers = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(n)]
    _all_gather(buffers, mine, group, "payloads", start, timeout)
    return [bytes(buf[:size].cpu().tolist()) for buf, size in zip(buffers, sizes, strict=True)]


def gather_payloads(payload: dict[str, Any], group: ProcessGroup | None,
                    timeout: float | None = None) -> tuple[list[Any], tuple[int, ...], int]:
    """Every rank's payload (decoded; ``None`` where not JSON), the group's ranks and
    this rank's index among them."""
    import torch.distributed as dist  # deferred: ~60 ms, needed only here

    if not (dist.is_available() and dist.is_initialized()):
        return [decode_payload(encode_payload(payload))], (0,), 0
    index = dist.get_rank(group)
    if index < 0:
        raise ValueError("check_agreement: this process is not a member of the given group")
    n = dist.get_world_size(group)
    sent = all_gather_bytes(encode_payload(payload), n, group, timeout)
    gathered = [decode_payload(raw) for raw in sent]
    ranks = tuple(range(n)) if group is None else tuple(dist.get_process_group_ranks(group))
    return gathered, ranks, index


