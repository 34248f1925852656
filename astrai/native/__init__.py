"""astrai's optional native extension, all of it: the facades' compiled hot path
(``hot.cpp``), the CPU kernels of the ``native`` rows (``kernels.cpp``), their build
(``build``) and the one decision, per process, whether to load it.

The pure-Python path is complete on its own; the compiled one only answers, for a call
in a facade's last world, the decision the Python route already took for that call's
key, reading the tensors' metadata in C++ instead of through Python attributes. It
answers only calls it reads exactly as Python does and declines (``None``) everything
else, so what a call is served by, and every error a malformed call raises, are the
Python path's. The kernels are what the ``native`` rows of the ``rms_norm`` and ``rotary``
tables run; without the extension those rows are unavailable, with this module's reason.

It is built from the package's own sources with torch's extension machinery (see
``astrai.native.building``) into a cache folder, one file per sources / torch / Python /
compiler version, and then loaded by every process. A package built for one torch and
Python may ship the file itself (``astrai/native/prebuilt/``), which is then loaded
before anything in the cache. A file is loaded only where it matches the size and SHA-256
recorded when it was built (``building.verify``); one that does not (truncated, damaged,
no record) is never loaded: one line on stderr says what is wrong with it, a cached one is
removed and built again, and where it cannot be, the pure-Python path serves.
``ASTR_NATIVE`` says what to do: unset or ``auto``, use it,
building it at the first need where nothing is built (a facade's first call, or a native
row's first use; never on import), with a line on stderr before and after; where it
cannot be built, one line says why and the pure-Python path serves. ``1`` / ``on``, the
same, and a failure is a warning; ``0`` / ``off``, never load or build it.
"""

from __future__ import annotations

__all__ = ["NATIVE_DIR_ENV", "NATIVE_ENV", "NativeBuildError", "NativeStatus", "add_setup", "build",
           "load", "load_from", "pending", "status"]

import importlib.util
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from astrai.env import NATIVE_DIR_ENV, NATIVE_ENV
from astrai.native.building import (
    PREBUILT_DIR,
    NativeBuildError,
    build,
    built_path,
    discard_if_bad,
    failed_marker,
    prebuilt_path,
    preflight,
    verify,
)

_NAME = "_astrai_hot"
_OFF = {"0", "off", "no", "false"}
_ON = {"1", "on", "yes", "true"}


@dataclass(frozen=True)
class NativeStatus:
    """Whether the native extension (hot path and kernels) is in use in this process, and
    why (not)."""

    loaded: bool
    path: Path
    reason: str

    def __str__(self) -> str:
        return (f"native extension (compiled hot path, CPU kernels): "
                f"{'loaded' if self.loaded else 'not loaded'} "
                f"({self.reason}); {self.path}")


def _mode() -> str:
    raw = os.environ.get(NATIVE_ENV, "").strip().lower()
    if raw in ("", "auto"):
        return "auto"
    if raw in _OFF:
        return "off"
    if raw in _ON:
        return "on"
    warnings.warn(f"{NATIVE_ENV}={raw!r} is not one of auto, on (1), off (0); using auto",
                  RuntimeWarning, stacklevel=3)
    return "auto"


def _path() -> Path:
    return built_path()


def load_from(path: Path) -> ModuleType:
    """The compiled module at ``path`` (``build()``'s), imported and set up for this
    process, whatever ``ASTR_NATIVE`` says (the facades use ``load()``'s)."""
    module = _import(path)
    module.tensor_types(torch.Tensor, torch.nn.Parameter)  # the kernels' (setup binds them too)
    for setup in _setups:
        setup(module)
    return module


def _import(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(_NAME, path)
    if spec is None or spec.loader is None:  # pragma: no cover - a path with a known suffix
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: What ``load`` decided for this process (once): its status and the module, if any.
_decided: list[tuple[NativeStatus, ModuleType | None]] = []


def _found() -> Path | None:
    """The compiled file this process can load: a prebuilt one shipped in the package,
    else one built earlier into the cache, whichever first matches its recorded digest;
    ``None`` when neither does."""
    for path in (prebuilt_path(), _path()):
        if path.exists() and verify(path) is None:
            return path
    return None


def _refuse_bad() -> None:
    """Say, one line each, which compiled files this process would load but that fail
    ``verify``, so are not loaded: a prebuilt one (left as shipped), and, unless a prebuilt
    one serves, a cached one, which is removed (checked again under its build lock first:
    a build may be renaming a new file and its digest into place)."""
    prebuilt, cached = prebuilt_path(), _path()
    if prebuilt.exists():
        problem = verify(prebuilt)
        if problem is None:
            return
        _say(f"astrai: not loading the prebuilt native extension {prebuilt}: {problem}")
    if cached.exists() and verify(cached) is not None:
        problem = discard_if_bad(cached)
        if problem is not None:
            then = ("it is left in place, never loaded" if cached.exists() else
                    "the file is removed (a new build replaces it)")
            _say(f"astrai: not loading the native extension {cached}: {problem}; {then}")


def _say(line: str, end: str = "\n") -> None:
    print(line, end=end, file=sys.stderr, flush=True)


def _build_on_first_use(path: Path) -> Path:
    """Build ``path`` for this process, saying so on stderr: one line before, the seconds
    passing (on a terminal), one line after. A failure is remembered for this torch,
    Python and compiler, so later processes say why at once instead of compiling again."""
    marker = failed_marker(path)
    try:
        earlier = marker.read_text(encoding="utf-8").strip()
    except OSError:
        earlier = ""
    if earlier:
        raise NativeBuildError(f"{earlier} (an earlier build; `astrai-ops native --build` "
                               f"tries again)")
    preflight()
    where = path.parent
    _say(f"astrai: building its native extension (compiled hot path, CPU kernels) for torch "
         f"{torch.__version__}, once, into {where} (about half a minute; {NATIVE_ENV}=off "
         f"skips it)")
    tty = sys.stderr.isatty()

    def tick(seconds: float) -> None:
        if tty:
            _say(f"\r  compiling... {seconds:.0f} s", end="")

    start = time.monotonic()
    try:
        built = build(progress=tick)
    except NativeBuildError as e:
        if tty:
            _say("")
        try:
            where.mkdir(parents=True, exist_ok=True)
            marker.write_text(str(e).splitlines()[0] + "\n", encoding="utf-8")
        except OSError:
            pass
        raise
    if tty:
        _say("")
    _say(f"astrai: native extension built in {time.monotonic() - start:.0f} s: {built}")
    return built


def load() -> ModuleType | None:
    """The compiled module, set up for this process, or ``None`` (``status()`` says why).
    Decided once per process: a prebuilt or earlier-built file that matches its recorded
    digest is loaded (one that does not is never loaded: one line says why); else, unless
    ``ASTR_NATIVE=off``, it is built now (a C++ compiler is needed), and where it cannot
    be, one line on stderr says why and the pure-Python path serves every call."""
    if _decided:
        return _decided[0][1]
    mode = _mode()
    path = _path()
    module: ModuleType | None = None
    if mode == "off":
        reason = f"{NATIVE_ENV}=off"
    else:
        try:
            _refuse_bad()
            found = _found()
            if found is None:
                found = _build_on_first_use(path)
                reason = "built for this process" if mode == "auto" else f"{NATIVE_ENV}=on"
            else:
                reason = ("prebuilt" if found.parent == PREBUILT_DIR else "built"
                          ) if mode == "auto" else f"{NATIVE_ENV}=on"
            path = found
            module = load_from(found)
        except (NativeBuildError, ImportError, OSError) as e:
            module = None
            reason = f"failed: {e}"
            if mode == "on":
                warnings.warn(f"astrai: {NATIVE_ENV}=on, but the native extension is not "
                              f"available ({e}); the pure-Python path serves every call "
                              f"and the native rows are unavailable",
                              RuntimeWarning, stacklevel=2)
            else:
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                _say(f"astrai: no native extension here ({first}); the pure-Python path "
                     f"serves every call ({NATIVE_ENV}=off silences this)")
    _decided.append((NativeStatus(module is not None, path, reason), module))
    return module


def pending() -> bool:
    """Whether this process's decision is still to be made and would build the extension
    (nothing prebuilt or built yet, ``ASTR_NATIVE`` not off): importing the facades never
    builds, so they stand in for the hot path until their first call makes that decision
    (``load()``)."""
    return not _decided and _mode() != "off" and _found() is None


def status() -> NativeStatus:
    """Whether this process uses the native extension, why, and where it lives."""
    load()
    return _decided[0][0]


def add_setup(setup: Callable[[ModuleType], None]) -> None:
    """Run ``setup`` on every module loaded from now on, and on the one loaded already:
    the engine hands the compiled hot path what it reads (``astrai.dispatch.hot_native``);
    a setup raising ``ImportError`` on a module about to be loaded refuses it (the
    pure-Python path serves)."""
    _setups.append(setup)
    if _decided and _decided[0][1] is not None:
        setup(_decided[0][1])


#: What every loaded module is set up with (``add_setup``).
_setups: list[Callable[[ModuleType], None]] = []
