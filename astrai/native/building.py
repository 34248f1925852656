"""Building astrai's native extension with torch's own machinery.

The extension is compiled by ``torch.utils.cpp_extension.load`` (ninja; the C++ standard,
ABI, include and library paths and platform flags torch chooses for its extensions) in a
child process, so a hung compiler is stopped after ``ASTR_NATIVE_BUILD_TIMEOUT`` seconds
(600 by default) and nothing it left behind survives. Builds of one version are
serialised by a file lock beside the result, so several processes (ranks of one job)
starting together build it once and the rest load it. Each build is kept under a tag
that covers everything the file depends on: the sources, torch (version, location and
ABI), Python, the flags astrai adds and the compiler (its path, size and date).

A build is renamed into place whole (a reader never sees half a file) after it is flushed to
disk, and its size and SHA-256 are recorded beside it (``digest_path``). A file is loaded only
when it matches that record (``verify``): a truncated, overwritten or damaged file, or one with
no record, would otherwise be mapped by the dynamic loader and end the process (``SIGBUS``)
or run other code than was built.

Supported: Linux with GCC or Clang (tested), macOS with Clang (torch's machinery handles
it; untested here). Windows is not supported (the lock and the sources use POSIX and
GCC/Clang facilities); there the build says so and the pure-Python path serves.
"""

from __future__ import annotations

__all__ = ["BUILD_TIMEOUT_ENV", "EXTRA_CFLAGS", "NAME", "OPENMP_FLAGS", "PREBUILT_DIR", "SOURCES",
           "NativeBuildError", "build", "built_path", "compiler", "digest_path",
           "discard_if_bad", "failed_marker", "prebuilt_path", "preflight", "record_digest",
           "verify"]

import hashlib
import importlib.machinery
import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from astrai.env import NATIVE_DIR_ENV, cache_root

#: The extension's module name (its ``PyInit_`` symbol).
NAME = "_astrai_hot"
_HERE = Path(__file__).parent
#: Every source of the extension: the hot path (which defines the module) and the kernels.
SOURCES = (_HERE / "hot.cpp", _HERE / "kernels.cpp")
#: What astrai adds to torch's flags: optimised, and no contraction into fused
#: multiply-adds, which would round differently from torch's own kernels. No ``-march``:
#: a built file may be shared by machines of one architecture but not one CPU model.
EXTRA_CFLAGS = ("-O3", "-ffp-contract=off")
#: Added where torch runs its intra-op threads on OpenMP: ATen's ``parallel_for``, which the
#: kernels split a call's rows with, is OpenMP in torch's headers and runs on one thread in
#: code compiled without it. The runtime linked is the one torch loaded (same library
#: name), so the kernels share torch's threads and ``torch.set_num_threads``.
OPENMP_FLAGS = ("-fopenmp",)
#: Seconds a build may take before it is stopped.
BUILD_TIMEOUT_ENV = "ASTR_NATIVE_BUILD_TIMEOUT"
_DEFAULT_TIMEOUT = 600.0
#: How many built versions the cache keeps (the most recently built or loaded).
_KEEP = 8
#: The clock a build's time limit is measured on (seconds; a test may stand in its own).
_clock: Callable[[], float] = time.monotonic


class NativeBuildError(RuntimeError):
    """The native extension could not be built here (the reason, compiler output
    included)."""


def compiler() -> list[str]:
    """The C++ compiler torch's machinery runs: ``CXX`` (a command line, ``ccache g++``
    allowed), else ``c++``; ``NativeBuildError`` when ``CXX`` is not a command line."""
    given = os.environ.get("CXX")
    if given is None:
        return ["c++"]
    try:
        words = shlex.split(given)
    except ValueError as e:
        raise NativeBuildError(f"CXX={given!r} is not a command line: {e}") from e
    if not words:
        raise NativeBuildError("CXX is empty: set it to a C++ compiler, or unset it")
    return words


def _compiler_identity() -> str:
    """The compiler by where it is and which file it is (cheap: no process is run)."""
    try:
        words = compiler()
    except NativeBuildError as e:
        return f"invalid: {e}"
    parts = []
    for word in words:
        found = shutil.which(word)
        if found is None:
            parts.append(word)
            continue
        real = os.path.realpath(found)
        try:
            st = os.stat(real)
            parts.append(f"{real}:{st.st_size}:{st.st_mtime_ns}")
        except OSError:
            parts.append(real)
    return " ".join(parts)


def _openmp() -> tuple[str, ...]:
    """The OpenMP flags a build tries first: ``OPENMP_FLAGS`` where torch has OpenMP."""
    import torch

    return OPENMP_FLAGS if torch._C.has_openmp else ()


def _digest(*parts: object) -> str:
    """A short hash of the sources and ``parts`` (what a built file depends on)."""
    h = hashlib.sha256()
    for source in SOURCES:
        h.update(source.read_bytes())
    h.update("|".join(map(str, parts)).encode())
    return h.hexdigest()[:16]


def _abi_tag() -> str:
    """What a built file needs of the process loading it: the sources, torch (version and
    C++ ABI) and Python. A prebuilt file shipped in the package is named by this tag."""
    import torch

    abi = getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)
    return _digest(torch.__version__, abi, sys.version_info[:2])


def _tag() -> str:
    """What a file built here depends on: the sources, torch (version, location, ABI),
    Python, astrai's flags and the compiler."""
    import torch

    abi = getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)
    return _digest(torch.__version__, torch.__file__, abi, sys.version, EXTRA_CFLAGS,
                   _openmp(), _compiler_identity())


#: Where a package built for one torch and Python would ship its compiled file
#: (``prebuilt_path``); a source install has none, and the file is built on first use.
PREBUILT_DIR = _HERE / "prebuilt"


def prebuilt_path() -> Path:
    """The file a prebuilt package would ship for this torch and Python (it may not
    exist): ``astrai/native/prebuilt/_astrai_hot-<sources, torch, ABI, Python>.so``.
    Found, it is loaded before anything in the cache, and nothing is compiled."""
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    return PREBUILT_DIR / f"{NAME}-{_abi_tag()}{suffix}"


def cache_dir() -> Path:
    """Where built versions live: ``ASTR_NATIVE_DIR``, else the user's cache."""
    root = os.environ.get(NATIVE_DIR_ENV)
    if root:
        return Path(root).expanduser()
    return cache_root() / "native"


def built_path() -> Path:
    """The file this torch, Python, compiler and these sources build (it may not exist)."""
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    return cache_dir() / f"{NAME}-{_tag()}{suffix}"


def failed_marker(path: Path) -> Path:
    """Where a failed build of ``path`` is remembered (its first line; a build that
    succeeds removes it)."""
    return path.with_name(f".{path.name}.failed")


def digest_path(path: Path) -> Path:
    """Where the size and SHA-256 of the built file ``path`` are recorded, beside it:
    ``.<name>.sha256``, one JSON object ``{"sha256": ..., "size": ...}``."""
    return path.with_name(f".{path.name}.sha256")


def _measure(fd: int) -> tuple[int, str]:
    """The size and SHA-256 of what ``fd`` reads from its start to its end."""
    h = hashlib.sha256()
    size = 0
    os.lseek(fd, 0, os.SEEK_SET)
    while chunk := os.read(fd, 1 << 20):
        h.update(chunk)
        size += len(chunk)
    return size, h.hexdigest()


def _write_durably(target: Path, text: str) -> None:
    """``text`` in a new file beside ``target`` (the mode a new file gets here: ``0o666``
    less the umask), flushed to disk, renamed over ``target``."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}-{os.urandom(4).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _sync_folder(folder: Path) -> None:
    """Flush ``folder``'s entries (the renames into it) to disk, where the system allows."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def record_digest(path: Path) -> None:
    """Record the size and SHA-256 of the built file ``path`` (flushed to disk first) in
    ``digest_path(path)``, written whole."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        size, sha = _measure(fd)
    finally:
        os.close(fd)
    _write_durably(digest_path(path), json.dumps({"sha256": sha, "size": size}) + "\n")
    _sync_folder(path.parent)


#: Files this process found matching their digests, by what identifies the file and its
#: record on disk: each is hashed once per process, however often it is looked at.
_verified: set[tuple[str, int, int, int, int, int, int]] = set()


def verify(path: Path) -> str | None:
    """``None`` where ``path`` matches the size and SHA-256 recorded beside it when it was
    built, else what is wrong with it (no record, a truncated or changed file, an
    unreadable one): such a file must never be loaded."""
    record = digest_path(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return "the file does not exist"
    except OSError as e:
        return f"it cannot be read ({e.strerror or e})"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return "it is not a regular file"
        try:
            rst = os.stat(record)
            text = record.read_text(encoding="utf-8")
        except FileNotFoundError:
            return f"no digest of it was recorded when it was built ({record.name} is missing)"
        except (OSError, UnicodeDecodeError) as e:
            return f"its digest {record.name} cannot be read ({e})"
        try:
            data = json.loads(text)
            size, sha = data["size"], data["sha256"]
            if type(size) is not int or not isinstance(sha, str):
                raise TypeError(data)
        except (ValueError, TypeError, KeyError):
            return f"its digest {record.name} is malformed"
        key = (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, rst.st_ino,
               rst.st_mtime_ns)
        if key in _verified:
            return None
        if st.st_size != size:
            return (f"it holds {st.st_size} bytes where {size} were built (truncated or "
                    f"overwritten)")
        try:
            got_size, got = _measure(fd)
        except OSError as e:
            return f"it cannot be read ({e.strerror or e})"
        if got_size != size or got != sha:
            return ("its SHA-256 differs from the one recorded when it was built (damaged or "
                    "overwritten)")
        _verified.add(key)
        return None
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    """Remove the built file ``path`` and its digest (either may be missing)."""
    for f in (path, digest_path(path)):
        f.unlink(missing_ok=True)


def discard_if_bad(path: Path) -> str | None:
    """Check the built file ``path`` again while holding its build lock (a build renaming a
    new file and its digest into place holds it) and, where it still fails ``verify``,
    remove it and its digest: what was wrong, or ``None`` where it matches its digest or
    does not exist. A failure to remove it is added to what was wrong (it is still never
    loaded)."""
    try:
        timeout = _timeout()
    except NativeBuildError:
        timeout = _DEFAULT_TIMEOUT
    try:
        with _locked(path.parent / f".{path.name}.lock", timeout):
            if not path.exists():
                return None
            problem = verify(path)
            if problem is not None:
                _remove(path)
            return problem
    except (OSError, NativeBuildError) as e:
        problem = verify(path) if path.exists() else None
        return None if problem is None else f"{problem}; it could not be removed: {e}"


def _timeout() -> float:
    raw = os.environ.get(BUILD_TIMEOUT_ENV, "").strip()
    if not raw:
        return _DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        raise NativeBuildError(f"{BUILD_TIMEOUT_ENV}={raw!r} is not a number of seconds"
                               ) from None
    if not value > 0:
        raise NativeBuildError(f"{BUILD_TIMEOUT_ENV}={raw!r} must be more than 0 seconds")
    return value


def preflight() -> float:
    """Check, without compiling anything, that a build can start here (the platform, the
    compiler, the time limit); the time limit in seconds, or ``NativeBuildError``."""
    if os.name != "posix":
        raise NativeBuildError(f"building the native extension is supported on Linux and "
                               f"macOS, not on {sys.platform}")
    timeout = _timeout()
    words = compiler()
    if shutil.which(words[0]) is None:
        raise NativeBuildError(f"no C++ compiler {words[0]!r} found (set CXX, or install "
                               f"g++ or clang++)")
    return timeout


def build(*, force: bool = False, progress: Callable[[float], None] | None = None) -> Path:
    """Build the native extension for this torch, Python and compiler (unless built
    already) and return its path; ``NativeBuildError`` says why it cannot be.
    ``progress`` is called about once a second while the compiler runs, with the seconds
    since it started."""
    timeout = preflight()
    path = built_path()
    if not force and verify(path) is None:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.parent / f".{path.name}.lock", timeout):
        if not force and verify(path) is None:  # built by another process meanwhile
            return path
        _prune(path.parent, timeout)
        if not force:
            _remove(path)  # it fails verification: never left for a reader to load
        work = tempfile.mkdtemp(prefix=".build-", dir=path.parent)
        try:
            try:
                made = _compile(Path(work), timeout, _openmp(), progress)
            except NativeBuildError as e:
                # A compiler without OpenMP (Apple's clang): the kernels then run each
                # call on one thread.
                if not _openmp() or not re.search(r"openmp|gomp|-lomp|omp\.h", str(e)):
                    raise
                shutil.rmtree(work, ignore_errors=True)
                os.mkdir(work)
                made = _compile(Path(work), timeout, (), progress)
            _install(made, path)
            failed_marker(path).unlink(missing_ok=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return path


def _install(made: Path, path: Path) -> None:
    """Put the built file ``made`` (in a work folder beside ``path``) in place as ``path``:
    renamed over ``path`` whole, then its digest recorded (``record_digest`` flushes the
    file to disk first, so a recorded digest stands for a file on disk; a file left without
    one is never loaded). A reader between the rename and the record finds the file and its
    digest disagreeing and checks again under the build lock (``discard_if_bad``), which
    this build holds."""
    os.replace(made, path)
    record_digest(path)


@contextmanager
def _locked(lock: Path, timeout: float) -> Iterator[None]:
    """An exclusive lock on ``lock`` (a file lock, released by the system if the process
    dies), waited for at most the build's ``timeout`` and a minute more."""
    import fcntl

    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout + 60.0
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise NativeBuildError(f"another process held {lock} for longer than a "
                                           f"build may take") from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _prune(folder: Path, timeout: float) -> None:
    """Drop what earlier builds left: work folders and unfinished digests older than a
    build may take (their builder died or was stopped), and built versions (with their
    digests) beyond the ``_KEEP`` most recently built or loaded."""
    now = time.time()
    for stale in [*folder.glob(".build-*"), *folder.glob(f"..{NAME}-*.tmp")]:
        try:
            if now - stale.stat().st_mtime > timeout:
                if stale.is_dir():
                    shutil.rmtree(stale, ignore_errors=True)
                else:
                    stale.unlink()
        except OSError:
            continue
    versions = []
    for f in folder.glob(f"{NAME}-*"):
        try:
            versions.append((f.stat().st_mtime, f))
        except OSError:
            continue
    for _, old in sorted(versions, reverse=True)[_KEEP - 1:]:
        for f in (old, old.with_name(f".{old.name}.lock"), digest_path(old)):
            try:
                f.unlink()
            except OSError:
                continue


#: The child's program: ``torch.utils.cpp_extension.load`` with the arguments on argv.
_CHILD = """
import json, os, sys
import torch.utils.cpp_extension as ext
a = json.loads(sys.argv[1])
os.environ["PATH"] = os.pathsep.join(a["path"] + [os.environ.get("PATH", "")])
ext.load(name=a["name"], sources=a["sources"], extra_cflags=a["cflags"],
         extra_ldflags=a["ldflags"], build_directory=a["work"], is_python_module=True,
         verbose=False, with_cuda=False)
"""


def _ninja_dirs() -> list[str]:
    """Folders holding ``ninja``: the ``ninja`` package's and this Python's scripts."""
    dirs = [str(Path(sys.executable).parent)]
    try:
        import ninja  # type: ignore[import-not-found, import-untyped, unused-ignore]

        dirs.insert(0, str(ninja.BIN_DIR))
    except (ImportError, AttributeError):
        pass
    return dirs


def _compile(work: Path, timeout: float, openmp: tuple[str, ...],
             progress: Callable[[float], None] | None = None) -> Path:
    """Build in ``work`` in a child process, stopped (with everything it started) after
    ``timeout`` seconds; the built file."""
    args = json.dumps({"name": NAME, "sources": [str(s) for s in SOURCES],
                       "cflags": [*EXTRA_CFLAGS, *openmp], "ldflags": list(openmp),
                       "work": str(work),
                       "path": _ninja_dirs()})
    log = work / "build.log"
    with open(log, "w+", encoding="utf-8", errors="replace") as out:
        try:
            child = subprocess.Popen([sys.executable, "-c", _CHILD, args], stdout=out,
                                     stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        except OSError as e:
            raise NativeBuildError(f"cannot start the build: {e}") from e
        start = _clock()
        try:
            while True:
                try:
                    child.wait(timeout=1.0)
                    break
                except subprocess.TimeoutExpired:
                    took = _clock() - start
                    if took > timeout:  # stopped below, with all it started
                        raise NativeBuildError(
                            f"the build took more than {timeout:g} s and was stopped "
                            f"({BUILD_TIMEOUT_ENV} sets the limit)") from None
                    if progress is not None:
                        progress(took)
        except BaseException:
            _stop(child)
            raise
        out.seek(0)
        output = out.read()
    if child.returncode != 0:
        raise NativeBuildError(_failure(child.returncode, output))
    suffix = importlib.machinery.EXTENSION_SUFFIXES
    made = [work / f"{NAME}{s}" for s in (".so", *suffix) if (work / f"{NAME}{s}").is_file()]
    if not made:
        raise NativeBuildError(f"{' '.join(compiler())} reported success but wrote no "
                               f"{NAME} module")
    return made[0]


def _stop(child: subprocess.Popen[str]) -> None:
    """End the child and every process it started (its session)."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except OSError:
        child.kill()
    child.wait()


def _failure(code: int, output: str) -> str:
    lines = [line for line in output.strip().splitlines() if line.strip()]
    if any("Ninja is required" in line for line in lines):
        return ("ninja is not installed: `pip install ninja` (or the `native` extra, "
                "`pip install astrai[native]`) provides it")
    tail = "\n".join(lines[-20:])
    return f"the build with {' '.join(compiler())} failed (exit {code}):\n{tail}"
