"""astrai's optional native extension: the facades' compiled hot path (``hot.cpp``) and
the CPU kernels of the ``native`` rows (``astrai/native/kernels.cpp``).

The pure-Python path is complete on its own; the compiled one only answers, for a call
in a facade's last world, the decision the Python route already took for that call's
key, reading the tensors' metadata in C++ instead of through Python attributes. It
answers only calls it reads exactly as Python does and declines (``None``) everything
else, so what a call is served by, and every error a malformed call raises, are the
Python path's. The kernels are what the ``native`` rows of the ``rms_norm`` and ``rotary``
tables run; without the extension those rows are unavailable, with this module's reason.

It is built from the package's own sources with the machine's C++ compiler against the
installed torch (``astrai-ops native --build``, about 15 s: the two sources compile side
by side) into a cache directory, one file per torch / Python / source version, and then
loaded by every process. ``ASTR_NATIVE`` says what to do: unset or ``auto``, load it when
built; ``0`` / ``off``, never; ``1`` / ``on``, build it on first import when missing,
warning once with the reason when that fails.
"""

from __future__ import annotations

__all__ = ["NATIVE_DIR_ENV", "NATIVE_ENV", "NativeBuildError", "NativeStatus", "build", "load",
           "load_from", "status"]

import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from astrai.dispatch.env import NATIVE_DIR_ENV, NATIVE_ENV

_SOURCE = Path(__file__).with_name("hot.cpp")
#: Every source of the extension: the hot path (which defines the module) and the kernels.
_SOURCES = (_SOURCE, Path(__file__).with_name("kernels.cpp"))
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


def _flags() -> tuple[list[str], list[str]]:
    """The compiler's flags, ``(compiling, linking)``: torch's headers and libraries (where
    its wheel puts them; ``torch.utils.cpp_extension`` says the same but costs an import),
    Python's headers. No ``-march``: the file may be shared by machines of one
    architecture but not one CPU model; no contraction into fused multiply-adds, which
    would round differently from torch's own kernels."""
    import sysconfig

    root = Path(torch.__file__).parent
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    includes = [root / "include", root / "include" / "torch" / "csrc" / "api" / "include",
                sysconfig.get_paths()["include"]]
    libs = [root / "lib"]
    compiling = ["-O3", "-fPIC", "-std=c++17", "-ffp-contract=off",
                 f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{p}" for p in includes)]
    linking = ["-shared", *(f"-L{p}" for p in libs),
               "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python",
               *(f"-Wl,-rpath,{p}" for p in libs)]
    return compiling, linking


def _tag() -> str:
    """What the built file depends on: the sources, this torch (the flags follow from
    where it lives and its ABI) and this Python."""
    h = hashlib.sha256()
    for source in _SOURCES:
        h.update(source.read_bytes())
    abi = getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)
    h.update(f"{torch.__version__}|{torch.__file__}|{abi}|{sys.version}".encode())
    return h.hexdigest()[:16]


def _path() -> Path:
    root = os.environ.get(NATIVE_DIR_ENV)
    if root:
        base = Path(root).expanduser()
    else:
        cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        base = Path(cache) / "astrai" / "native"
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    return base / f"{_NAME}-{_tag()}{suffix}"


class NativeBuildError(RuntimeError):
    """The native extension could not be built here (the reason, compiler output
    included)."""


def build(*, force: bool = False) -> Path:
    """Build the native extension for this torch and Python (unless built already) and
    return its path; ``NativeBuildError`` says why it cannot be."""
    import shutil
    import tempfile

    path = _path()
    if path.exists() and not force:
        return path
    given = os.environ.get("CXX")
    found = given or shutil.which("c++") or shutil.which("g++")
    if not found:
        raise NativeBuildError("no C++ compiler found (set CXX, or install g++)")
    try:
        compiler = shlex.split(found) if given else [found]  # CXX may be "ccache g++"
    except ValueError as e:
        raise NativeBuildError(f"CXX={given!r} is not a command line: {e}") from e
    if not compiler:
        raise NativeBuildError("CXX is empty: set it to a C++ compiler, or unset it")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".build-", dir=path.parent) as work:
        tmp = os.path.join(work, path.name)
        objects = _compile(compiler, work)
        _run([*compiler, *objects, "-o", tmp, *_flags()[1]], compiler)
        if not os.path.isfile(tmp):
            raise NativeBuildError(f"{' '.join(compiler)} reported success but wrote no "
                                   f"{path.name}")
        os.replace(tmp, path)
    return path


def _compile(compiler: list[str], work: str) -> list[str]:
    """Every source compiled to an object file in ``work``, side by side."""
    import subprocess

    compiling = _flags()[0]
    jobs: list[tuple[subprocess.Popen[str], str]] = []
    try:
        for source in _SOURCES:
            obj = os.path.join(work, f"{source.stem}.o")
            try:
                job = subprocess.Popen([*compiler, "-c", str(source), "-o", obj, *compiling],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                       text=True)
            except OSError as e:
                raise NativeBuildError(f"cannot run the C++ compiler {' '.join(compiler)!r}: "
                                       f"{e}") from e
            jobs.append((job, obj))
        for job, _ in jobs:
            _, err = job.communicate()
            if job.returncode != 0:
                raise NativeBuildError(_failure(compiler, job.returncode, err))
    finally:
        for job, _ in jobs:
            if job.poll() is None:
                job.kill()
                job.wait()
    return [obj for _, obj in jobs]


def _run(command: list[str], compiler: list[str]) -> None:
    import subprocess

    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as e:
        raise NativeBuildError(f"cannot run the C++ compiler {' '.join(compiler)!r}: {e}") from e
    if done.returncode != 0:
        raise NativeBuildError(_failure(compiler, done.returncode, done.stderr))


def _failure(compiler: list[str], code: int, stderr: str) -> str:
    tail = "\n".join(stderr.strip().splitlines()[-20:])
    return f"{' '.join(compiler)} failed (exit {code}):\n{tail}"


def load_from(path: Path) -> ModuleType:
    """The compiled module at ``path`` (``build()``'s), imported and set up for this
    process, whatever ``ASTR_NATIVE`` says (the facades use ``load()``'s)."""
    module = _import(path)
    _setup(module)
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


def load() -> ModuleType | None:
    """The compiled module, set up for this process, or ``None`` (``status()`` says why).
    Decided once per process."""
    if _decided:
        return _decided[0][1]
    mode = _mode()
    path = _path()
    module: ModuleType | None = None
    if mode == "off":
        reason = f"{NATIVE_ENV}=off"
    elif not path.exists() and mode == "auto":
        reason = "not built: `astrai-ops native --build` builds it"
    else:
        try:
            if not path.exists():
                build()
            module = load_from(path)
            reason = "built" if mode == "auto" else f"{NATIVE_ENV}=on"
        except (NativeBuildError, ImportError, OSError) as e:
            module = None
            reason = f"failed: {e}"
            if mode == "on":
                warnings.warn(f"astrai: {NATIVE_ENV}=on, but the native extension is not "
                              f"available ({e}); the pure-Python path serves every call "
                              f"and the native rows are unavailable",
                              RuntimeWarning, stacklevel=2)
    _decided.append((NativeStatus(module is not None, path, reason), module))
    return module


def status() -> NativeStatus:
    """Whether this process uses the native extension, why, and where it lives."""
    load()
    return _decided[0][0]


def _setup(module: ModuleType) -> None:
    from astrai.dispatch import state as process
    from astrai.dispatch.env import ENVIRON_DATA, OPS_KEY
    from astrai.dispatch.scopes import scope_variable

    if ENVIRON_DATA is None:  # pragma: no cover - platforms without os.environ._data
        raise ImportError("this platform's os.environ has no raw dict to read")
    module.setup(vars(process), scope_variable(), ENVIRON_DATA, OPS_KEY, torch.Tensor,
                 torch.nn.Parameter)
