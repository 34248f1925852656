"""The native extension's cache: a compiled file is loaded only where it matches the size
and SHA-256 recorded beside it when it was built. A truncated one (which the dynamic
loader maps and the process dies of, ``SIGBUS``), one with changed bytes, or one without
its record is never loaded: one line says what is wrong, a cached one is removed and built
again, or the pure-Python path serves; ``astrai-ops native --build`` replaces it.

Nothing here compiles but conftest's ``built`` (once a session, where nothing is built): the
builds run torch's machinery with a stand-in compiler that "links" by copying the extension
the session built, so each takes seconds. Each process that may load a damaged file is a
child process."""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from astrai.cli import main
from astrai.native import building
from tests.conftest import python_child as _run

#: A process's first facade call and its native status (``argv[1]``, where given: the
#: folder standing in for the package's prebuilt one).
FIRST_CALL = """\
import sys
from pathlib import Path

import astrai.native as n
from astrai.native import building

if len(sys.argv) > 1:
    building.PREBUILT_DIR = n.PREBUILT_DIR = Path(sys.argv[1])
import torch
from astrai import ops

print(ops.rms_norm(torch.ones(1, 4), torch.ones(4)).shape)
print(n.status())
"""


def _said(stderr: str) -> list[str]:
    """astrai's lines on a child's stderr."""
    return [line for line in stderr.splitlines() if line.startswith("astrai")]


def _compiler(tmp_path: Path, good: Path | None) -> Path:
    """A stand-in C++ compiler noting each run in ``tmp_path/runs``: it compiles nothing
    (an empty object file and dependency list), and links by copying ``good`` (the
    extension built for this session); ``None``: every run fails. Asked anything else
    (its version), it is the machine's ``c++``."""
    runs = tmp_path / "runs"
    if good is None:
        body = "exit 1"
    else:
        body = f"""\
out=""; dep=""; prev=""
for a in "$@"; do
  case "$prev" in -o) out="$a";; -MF) dep="$a";; esac
  prev="$a"
done
case "$out" in
  *.so) cp '{good}' "$out";;
  *.o) : > "$out"; printf '%s:\\n' "$out" > "$dep";;
  *) exec c++ "$@";;
esac"""
    script = tmp_path / "cxx"
    script.write_text(f"#!/bin/sh\necho run >> '{runs}'\n{body}\n")
    script.chmod(0o755)
    return script


@pytest.fixture
def good(built: ModuleType) -> Path:
    """The extension this session built (intact: it matches its digest)."""
    path = Path(str(built.__file__))
    assert building.verify(path) is None, building.verify(path)
    return path


def _truncated(path: Path, good: Path) -> str:
    """``good`` at ``path`` with its digest, then cut short (as a copy over it that stopped
    half-way leaves it)."""
    shutil.copy(good, path)
    building.record_digest(path)
    size = good.stat().st_size
    os.truncate(path, size // 3)
    return f"it holds {size // 3} bytes where {size} were built (truncated or overwritten)"


def _flipped(path: Path, good: Path) -> str:
    """``good`` at ``path`` with its digest, then 64 bytes in its middle changed."""
    shutil.copy(good, path)
    building.record_digest(path)
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    path.write_bytes(bytes(data))
    return "its SHA-256 differs from the one recorded when it was built (damaged or overwritten)"


def _no_digest(path: Path, good: Path) -> str:
    """``good`` at ``path``, intact, with no digest beside it."""
    shutil.copy(good, path)
    return (f"no digest of it was recorded when it was built "
            f"({building.digest_path(path).name} is missing)")


DAMAGE: dict[str, Callable[[Path, Path], str]] = {
    "truncated": _truncated, "flipped": _flipped, "no-digest": _no_digest}


def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, good: Path | None) -> Path:
    """A cache folder and a stand-in compiler for this test and its children; the path the
    build of this torch, Python and compiler has there."""
    monkeypatch.setenv("ASTR_NATIVE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(_compiler(tmp_path, good)))
    monkeypatch.setenv("ASTR_NATIVE", "")
    path = building.built_path()
    path.parent.mkdir(parents=True)
    return path


def test_verify_says_what_is_wrong(good: Path, tmp_path: Path) -> None:
    path = tmp_path / good.name
    shutil.copy(good, path)
    problem = _no_digest(path, good)
    assert building.verify(path) == problem
    building.record_digest(path)
    assert building.verify(path) is None
    record = building.digest_path(path)
    assert json.loads(record.read_text()) == {
        "sha256": json.loads(building.digest_path(good).read_text())["sha256"],
        "size": good.stat().st_size}
    umask = os.umask(0o022)
    os.umask(umask)
    assert record.stat().st_mode & 0o777 == 0o666 & ~umask  # readable as the file is
    for damage in (_truncated, _flipped):
        problem = damage(path, good)
        assert building.verify(path) == problem
    record.write_text("{not json")
    assert building.verify(path) == f"its digest {record.name} is malformed"
    assert building.verify(tmp_path / "none.so") == "the file does not exist"


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_bad_cached_file_is_never_loaded_and_is_built_again(
        good: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str) -> None:
    """The process survives (a truncated file would end it with SIGBUS at import), says in
    one line what was wrong, builds the file again and loads the new one."""
    path = _cache(tmp_path, monkeypatch, good)
    problem = DAMAGE[damage](path, good)
    done = _run({}, FIRST_CALL)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-3000:])
    assert "torch.Size([1, 4])" in done.stdout
    assert "loaded (built for this process)" in done.stdout, done.stdout + done.stderr
    lines = _said(done.stderr)
    assert lines[0] == (f"astrai: not loading the native extension {path}: {problem}; the "
                        f"file is removed (a new build replaces it)"), done.stderr
    assert lines[1].startswith("astrai: building its native extension"), done.stderr
    assert lines[2].startswith("astrai: native extension built in "), done.stderr
    assert len(lines) == 3, done.stderr
    assert (tmp_path / "runs").exists()
    assert building.verify(path) is None
    assert path.read_bytes() == good.read_bytes()
    again = _run({}, FIRST_CALL)
    assert "loaded (built)" in again.stdout and _said(again.stderr) == [], again.stderr


@pytest.mark.parametrize("mode", ["", "on"])
def test_a_bad_file_where_nothing_can_be_built_leaves_the_python_path(
        good: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """A truncated file and a compiler that fails: the process survives, says what was
    wrong with the file, removes it (no later process maps it) and the pure-Python path
    serves."""
    path = _cache(tmp_path, monkeypatch, None)
    problem = _truncated(path, good)
    done = _run({"ASTR_NATIVE": mode}, FIRST_CALL)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-3000:])
    assert "torch.Size([1, 4])" in done.stdout
    assert "not loaded (failed: the build with" in done.stdout, done.stdout
    lines = _said(done.stderr)
    assert lines[0] == (f"astrai: not loading the native extension {path}: {problem}; the "
                        f"file is removed (a new build replaces it)"), done.stderr
    assert lines[1].startswith("astrai: building its native extension"), done.stderr
    if mode == "on":
        assert done.stderr.count("ASTR_NATIVE=on, but the native extension is not "
                                 "available") == 1, done.stderr
    else:
        assert lines[2].startswith("astrai: no native extension here (the build with"), \
            done.stderr
    assert not path.exists() and not building.digest_path(path).exists()
    assert (tmp_path / "runs").exists()


@pytest.mark.parametrize("damage", [None, "truncated", "no-digest"])
def test_a_prebuilt_file_is_loaded_only_where_it_matches_its_digest(
        good: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str | None
        ) -> None:
    """A bad prebuilt file is said, left as shipped and passed over for the cache's."""
    cached = _cache(tmp_path, monkeypatch, None)
    shutil.copy(good, cached)
    building.record_digest(cached)
    shipped = tmp_path / "prebuilt"
    shipped.mkdir()
    monkeypatch.setattr(building, "PREBUILT_DIR", shipped)
    prebuilt = building.prebuilt_path()
    problem = ""
    if damage is None:
        shutil.copy(good, prebuilt)
        building.record_digest(prebuilt)
    else:
        problem = DAMAGE[damage](prebuilt, good)
    done = _run({}, FIRST_CALL, str(shipped))
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-3000:])
    assert "torch.Size([1, 4])" in done.stdout
    if damage is None:
        assert "loaded (prebuilt)" in done.stdout and _said(done.stderr) == [], done.stderr
        return
    assert "loaded (built)" in done.stdout, done.stdout + done.stderr
    assert _said(done.stderr) == [
        f"astrai: not loading the prebuilt native extension {prebuilt}: {problem}"]
    assert prebuilt.exists() and building.verify(cached) is None
    assert not (tmp_path / "runs").exists()  # nothing was built


def test_native_build_replaces_a_file_that_fails_verification(
        good: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    path = _cache(tmp_path, monkeypatch, good)
    shutil.copy(good, path)
    building.record_digest(path)
    assert main(["native", "--build"]) == 0
    assert not (tmp_path / "runs").exists()  # an intact file is kept
    problem = _flipped(path, good)
    capsys.readouterr()
    assert main(["native", "--build"]) == 0
    out, err = capsys.readouterr()
    assert f"astrai-ops native: {path} is built again: {problem}" in err
    assert f"built {path}" in out
    assert (tmp_path / "runs").exists()
    assert building.verify(path) is None and path.read_bytes() == good.read_bytes()


def test_a_reader_racing_a_build_keeps_the_file_the_build_renames_in(
        good: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader finding a file and a digest that disagree (a build between its two renames)
    checks again under the build lock: once the build has put both in place, the file is
    kept, not removed."""
    path = _cache(tmp_path, monkeypatch, None)
    _flipped(path, good)  # the build's new file is in place; its digest not yet
    got: list[str | None] = []
    with building._locked(path.parent / f".{path.name}.lock", 10):  # the build at work
        reader = threading.Thread(target=lambda: got.append(building.discard_if_bad(path)))
        reader.start()
        reader.join(1.0)
        assert reader.is_alive() and not got  # it waits for the lock
        building.record_digest(path)  # the build's second rename
    reader.join(20)
    assert got == [None]
    assert path.exists() and building.verify(path) is None
    problem = _truncated(path, good)  # a file that is bad under the lock too is removed
    assert building.discard_if_bad(path) == problem
    assert not path.exists() and not building.digest_path(path).exists()
