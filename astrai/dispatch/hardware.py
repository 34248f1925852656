"""What a table may ask of the machine: the CPU's vendor and instruction set, its cores,
torch's threads and the GPU's vendor.

These are the *machine axes* of the expression language (``cpu_isa >= avx512 and
cpu_vendor == amd``). They are read once per process (``machine_facts``; ``refresh()``
reads them again) and never enter a call's decision key: every call of a process runs on
the same machine, so a decision taken once serves every later call. ``explain`` and
``lint`` may ask a table about another machine by giving a call context these values
(``CallContext.extra``), which then take the place of the facts read here;
``ASTR_MACHINE=cpu_vendor=amd,cpu_isa=avx512`` states them for a whole process (and the
processes it starts), ``astrai.dispatch.assume_machine`` within a block.

``cpu_isa`` is an ordered axis within one architecture: ``x86_64 < avx2 < avx512 <
avx512_bf16 < amx`` on x86, ``neon < sve < sve2`` on Arm. A comparison between levels of
two architectures is false either way (an Arm CPU is neither above nor below AVX2). The
level is the one torch's own CPU kernels run: the CPU's flags capped by the capability
torch reports (``ATEN_CPU_CAPABILITY=avx2`` makes an AVX-512 machine read ``avx2``, as
it restricts torch's kernels).
"""

from __future__ import annotations

__all__ = [
    "CPU_VENDORS",
    "GPU_VENDORS",
    "ISA_LEVELS",
    "IsaLevel",
    "MachineFacts",
    "assume",
    "assumed",
    "cpuinfo",
    "forget",
    "isa_level",
    "machine_facts",
]

import functools
import os
import platform
from dataclasses import asdict, dataclass
from typing import Any

import torch

from astrai.env import MACHINE_ENV

#: The ``cpu_vendor`` axis's values.
CPU_VENDORS: tuple[str, ...] = ("intel", "amd", "arm", "apple", "other")
#: The ``gpu_vendor`` axis's values (``none``: no GPU torch can use).
GPU_VENDORS: tuple[str, ...] = ("cuda", "rocm", "xpu", "mps")
#: The ``cpu_isa`` axis's levels, in order within each architecture.
_FAMILIES: tuple[tuple[str, ...], ...] = (
    ("x86_64", "avx2", "avx512", "avx512_bf16", "amx"),
    ("neon", "sve", "sve2"),
)
#: Every level the ``cpu_isa`` axis may name.
ISA_LEVELS: tuple[str, ...] = tuple(level for family in _FAMILIES for level in family)
_RANK: dict[str, tuple[int, int]] = {level: (f, i) for f, family in enumerate(_FAMILIES)
                                     for i, level in enumerate(family)}


class IsaLevel(str):
    """An instruction-set level: a ``str`` (``== "avx512"`` holds) ordered within its
    architecture; any ordering with a level of another architecture (or an unknown name)
    is false."""

    __slots__ = ()

    def _pair(self, other: object) -> tuple[int, int] | None:
        mine, theirs = _RANK.get(str(self)), _RANK.get(str(other))
        if mine is None or theirs is None or mine[0] != theirs[0]:
            return None
        return mine[1], theirs[1]

    def __lt__(self, other: object) -> bool:
        pair = self._pair(other)
        return pair is not None and pair[0] < pair[1]

    def __le__(self, other: object) -> bool:
        pair = self._pair(other)
        return pair is not None and pair[0] <= pair[1]

    def __gt__(self, other: object) -> bool:
        pair = self._pair(other)
        return pair is not None and pair[0] > pair[1]

    def __ge__(self, other: object) -> bool:
        pair = self._pair(other)
        return pair is not None and pair[0] >= pair[1]

    __hash__ = str.__hash__
    __eq__ = str.__eq__
    __ne__ = str.__ne__


def isa_level(name: str) -> IsaLevel:
    """``name`` as an ordered level (``ValueError`` for a name that is no level)."""
    if name not in _RANK:
        raise ValueError(f"unknown instruction-set level {name!r}; levels: "
                         f"{', '.join(ISA_LEVELS)}")
    return IsaLevel(name)


@dataclass(frozen=True)
class MachineFacts:
    """The values of the machine axes on one machine (``None``: not known here)."""

    cpu_vendor: str
    cpu_isa: IsaLevel | None
    cores: int
    threads: int
    gpu_vendor: str | None

    def as_dict(self) -> dict[str, Any]:
        """The facts as plain data (the level as its name)."""
        got = asdict(self)
        got["cpu_isa"] = None if self.cpu_isa is None else str(self.cpu_isa)
        return got

    def describe(self) -> str:
        """``cpu_vendor=intel cpu_isa=avx512 cores=2 threads=1 gpu_vendor=none``."""
        return " ".join(f"{k}={'none' if v is None else v}" for k, v in self.as_dict().items())


def cpuinfo(*keys: str) -> str | None:
    """The first value ``/proc/cpuinfo`` (Linux) gives any of ``keys``, or None."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() in keys:
                    return value.strip()
    except OSError:
        pass
    return None


def _vendor(vendor_id: str, machine: str) -> str:
    if vendor_id == "GenuineIntel":
        return "intel"
    if vendor_id in ("AuthenticAMD", "HygonGenuine"):
        return "amd"
    if machine in ("arm64", "aarch64"):
        return "apple" if platform.system() == "Darwin" else "arm"
    return "other"


def _torch_capability() -> str:
    """The vector capability torch's CPU kernels run (``AVX512``, ``AVX2``, ``DEFAULT``,
    ``SVE256``...), as ``torch.backends.cpu`` reports it; ``""`` where it cannot."""
    try:
        return str(torch.backends.cpu.get_cpu_capability()).upper()
    except (AttributeError, RuntimeError):
        return ""


def _isa(machine: str, flags: frozenset[str], capability: str) -> IsaLevel | None:
    """The instruction-set level torch's kernels run here (module docstring)."""
    if machine in ("x86_64", "amd64", "AMD64", "i686", "i386"):
        if capability == "DEFAULT" or (not flags and capability not in ("AVX2", "AVX512")):
            return IsaLevel("x86_64")
        level = "x86_64"
        if "avx2" in flags or capability in ("AVX2", "AVX512"):
            level = "avx2"
        if capability != "AVX2" and ("avx512f" in flags or capability == "AVX512"):
            level = "avx512"
            if "avx512_bf16" in flags:
                level = "avx512_bf16"
            if "amx_tile" in flags:
                level = "amx"
        return IsaLevel(level)
    if machine in ("arm64", "aarch64"):
        level = "neon"
        sve = "sve" in flags or capability.startswith("SVE")
        if sve and capability != "DEFAULT":
            level = "sve2" if "sve2" in flags else "sve"
        return IsaLevel(level)
    return None


def _gpu_vendor() -> str | None:
    if torch.cuda.is_available():
        return "rocm" if getattr(torch.version, "hip", None) else "cuda"
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return "xpu"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return None


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@functools.cache
def _detected() -> MachineFacts:
    machine = platform.machine()
    vendor_id = cpuinfo("vendor_id") or ""
    flags = frozenset((cpuinfo("flags", "Features") or "").split())
    facts = MachineFacts(_vendor(vendor_id, machine), _isa(machine, flags, _torch_capability()),
                         _cores(), torch.get_num_threads(), _gpu_vendor())
    stated = os.environ.get(MACHINE_ENV, "").strip()
    return _stated(facts, stated) if stated else facts


def _stated(facts: MachineFacts, text: str) -> MachineFacts:
    """``facts`` with the values ``ASTR_MACHINE`` states (``name=value,...``); an entry
    that names no machine axis or a value it cannot take is left out, with a warning."""
    from dataclasses import replace

    from astrai.dispatch.log import warn_once

    values: dict[str, Any] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, _, raw = item.partition("=")
        name, raw = name.strip(), raw.strip()
        value: Any = None if raw == "none" else int(raw) if raw.isdigit() else raw
        try:
            values.update(_checked({name: value}))
        except ValueError as exc:
            warn_once(f"astrai: {MACHINE_ENV}: {item!r} is left out: {exc}")
    return replace(facts, **values)


#: Facts assumed in place of this machine's (``assume``), innermost last.
_ASSUMED: list[MachineFacts] = []


def machine_facts() -> MachineFacts:
    """This machine's values of the machine axes, read once (``forget`` reads them
    again: ``astrai.refresh()`` does), or those assumed in their place (``assume``)."""
    return _ASSUMED[-1] if _ASSUMED else _detected()


def assume(facts: MachineFacts | None) -> None:
    """Take ``facts`` for this machine's (``None``: stop taking the last assumed).
    ``astrai.assume_machine`` is the way to call it: it also forgets every decision."""
    if facts is None:
        _ASSUMED.pop()
    else:
        _ASSUMED.append(facts)


def assumed(**values: Any) -> MachineFacts:
    """The facts in force with ``values`` in place of theirs (``cpu_isa`` by name);
    ``ValueError`` naming a fact that does not exist or a value it cannot take."""
    from dataclasses import replace

    return replace(machine_facts(), **_checked(values))


def _checked(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` as machine facts (``cpu_isa`` as a level); ``ValueError`` naming a fact
    that does not exist or a value it cannot take."""
    from dataclasses import fields

    values = dict(values)
    names = [f.name for f in fields(MachineFacts)]
    for name, value in values.items():
        if name not in names:
            raise ValueError(f"unknown machine axis {name!r}; machine axes: {', '.join(names)}")
        if name == "cpu_isa" and value is not None:
            values[name] = isa_level(str(value))
        elif name == "cpu_vendor" and value not in CPU_VENDORS:
            raise ValueError(f"unknown cpu_vendor {value!r}; vendors: {', '.join(CPU_VENDORS)}")
        elif name == "gpu_vendor" and value is not None and value not in GPU_VENDORS:
            raise ValueError(f"unknown gpu_vendor {value!r}; vendors: "
                             f"{', '.join(GPU_VENDORS)} or None")
        elif name in ("cores", "threads") and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return values


def forget() -> None:
    """Read this machine's facts again at their next use (a thread count set since)."""
    _detected.cache_clear()
