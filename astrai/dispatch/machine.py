"""The machine a decision was taken on: CPU model, core count, GPU name and ``sm``, and
the torch and astrai versions.

A recorded workload, a decision lock (and a tuned profile) carry the fingerprint of the
machine that made them, because which row wins depends on it: another GPU, another torch
build or a kernel package upgrade can make a row unavailable or change its speed.
``Machine.differences`` says, item by item, how two fingerprints differ; loading a lock
written elsewhere warns with it.
"""

from __future__ import annotations

__all__ = ["FIELDS", "Machine", "cuda_initialized", "this_machine"]

import os
import platform
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from astrai.dispatch.hardware import cpuinfo
from astrai.version import __version__


@dataclass(frozen=True)
class Machine:
    """A machine's fingerprint. ``gpu`` and ``sm`` are ``None`` without CUDA (``sm`` is
    the compute capability as major*10 + minor, as the ``sm`` axis has it)."""

    cpu: str
    cores: int
    gpu: str | None
    sm: int | None
    torch: str
    astrai: str

    def as_dict(self) -> dict[str, Any]:
        """The fingerprint as plain data (the files' ``machine:`` mapping)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Machine:
        """The fingerprint of a file's ``machine:`` mapping (already validated)."""
        return cls(**{name: data[name] for name in FIELDS})

    def differences(self, other: Machine, *, gpu: bool = True) -> list[str]:
        """How ``other`` differs from this one: ``"gpu: 'NVIDIA H100' here, None there"``
        per differing item (empty when they are the same machine). ``gpu=False`` leaves
        ``gpu`` and ``sm`` out (this one was taken without looking at the GPU)."""
        names = FIELDS if gpu else tuple(n for n in FIELDS if n not in ("gpu", "sm"))
        return [f"{name}: {getattr(self, name)!r} here, {getattr(other, name)!r} there"
                for name in names if getattr(self, name) != getattr(other, name)]

    def describe(self) -> str:
        """One line for a report: ``cpu (cores cores), gpu (sm), torch, astrai``."""
        gpu = "no GPU" if self.gpu is None else f"{self.gpu} (sm {self.sm})"
        return (f"{self.cpu} ({self.cores} cores), {gpu}, torch {self.torch}, "
                f"astrai {self.astrai}")


#: The fingerprint's items, in order.
FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Machine))


def _cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` knows."""
    found = cpuinfo("model name", "Model", "cpu model")
    if found is not None:
        return found
    return platform.processor() or platform.machine() or "unknown"


def cuda_initialized() -> bool:
    """Whether this process has initialised CUDA (then asking for a GPU's name is free)."""
    return bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]


def this_machine(*, gpu: bool = True) -> Machine:
    """This machine's fingerprint. With ``gpu=False`` the GPU is looked at only if CUDA
    is already initialised in this process (asking a device's name initialises CUDA,
    which a process that forks workers later may not want)."""
    name: str | None = None
    sm: int | None = None
    if torch.cuda.is_available() if gpu else cuda_initialized():
        index = torch.cuda.current_device()
        name = torch.cuda.get_device_name(index)
        major, minor = torch.cuda.get_device_capability(index)
        sm = major * 10 + minor
    return Machine(_cpu_model(), os.cpu_count() or 1, name, sm, str(torch.__version__),
                   __version__)
