"""What astrai writes: regular files only, with one mode rule, and never over an input.

Every file astrai saves (workloads, locks, tuned profiles, reports) goes through one
writer: it writes beside the target and renames over it, gives the file the mode a new
file gets in this process (``0o666`` less the umask) whatever was there before, writes
through a symbolic link, and refuses a target that is not a regular file. A command's
output never destroys its input."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import astrai.dispatch as dispatch
from astrai import ops
from astrai.cli import main
from astrai.dispatch import record
from astrai.errors import OutputPathError
from astrai.formats.common import atomic_write, not_an_input
from astrai.record.workload import Workload
from tests._tune_impls import TWICE_TABLE


@pytest.fixture
def umask_022() -> Iterator[None]:
    before = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(before)


@pytest.mark.usefixtures("umask_022")
def test_one_mode_rule_for_new_and_replaced_files(tmp_path: Path) -> None:
    new = atomic_write(tmp_path / "new.yaml", "a: 1\n")
    assert stat.S_IMODE(new.stat().st_mode) == 0o644
    old = tmp_path / "old.yaml"
    old.write_text("b: 2\n")
    old.chmod(0o600)
    atomic_write(old, "b: 3\n")
    assert stat.S_IMODE(old.stat().st_mode) == 0o644 and old.read_text() == "b: 3\n"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_is_refused_not_replaced(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(OutputPathError, match="is a FIFO, not a regular file"):
        atomic_write(fifo, "x")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc (Linux)")
def test_standard_output_by_its_proc_link_is_refused(tmp_path: Path) -> None:
    """``-o /proc/self/fd/1`` names whatever standard output is (here a pipe or a file of
    pytest's): a pipe is refused, never replaced."""
    read, write = os.pipe()
    try:
        with pytest.raises(OutputPathError, match="FIFO"):
            atomic_write(f"/proc/self/fd/{write}", "x")
    finally:
        os.close(read)
        os.close(write)


def test_a_directory_and_a_device_are_refused(tmp_path: Path) -> None:
    with pytest.raises(OutputPathError, match="is a directory"):
        atomic_write(tmp_path, "x")
    if os.path.exists("/dev/null"):
        with pytest.raises(OutputPathError, match="is a character device"):
            Workload.of([]).save("/dev/null")
        assert stat.S_ISCHR(os.stat("/dev/null").st_mode)  # still the device, even as root


def test_a_symlink_is_written_through(tmp_path: Path) -> None:
    real = tmp_path / "real.yaml"
    real.write_text("old\n")
    link = tmp_path / "link.yaml"
    link.symlink_to(real)
    atomic_write(link, "new\n")
    assert link.is_symlink() and real.read_text() == "new\n"
    dangling = tmp_path / "dangling.yaml"
    dangling.symlink_to(tmp_path / "made.yaml")
    atomic_write(dangling, "made\n")
    assert dangling.is_symlink() and (tmp_path / "made.yaml").read_text() == "made\n"


def test_not_an_input_sees_through_links_and_relative_paths(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    src = tmp_path / "wl.yaml"
    src.write_text("x")
    (tmp_path / "hard.yaml").hardlink_to(src)
    monkeypatch.chdir(tmp_path)
    for same in ("wl.yaml", "./wl.yaml", str(src), "hard.yaml"):
        with pytest.raises(OutputPathError, match="is the input"):
            not_an_input(same, src)
    not_an_input("other.yaml", src)


@pytest.fixture
def workload_file(write_yaml: Callable[[str, str], Path], tmp_path: Path) -> Path:
    dispatch.load_tables(write_yaml("twice.yaml", TWICE_TABLE))
    with record() as wl:
        ops.call("twice", torch.randn(4, 8))
    return wl.workload().save(tmp_path / "wl.yaml")


def test_lock_and_tune_never_write_over_their_workload(
        workload_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = workload_file.read_bytes()
    assert main(["lock", str(workload_file), "-o", str(workload_file)]) != 0
    assert "is the input" in capsys.readouterr().err
    assert main(["tune", str(workload_file), "-o", str(workload_file), "--rounds", "1"]) != 0
    assert "is the input" in capsys.readouterr().err
    profile = tmp_path / "p.yaml"
    assert main(["tune", str(workload_file), "-o", str(profile), "--report", str(profile),
                 "--rounds", "1"]) != 0
    assert "--report" in capsys.readouterr().err and not profile.exists()
    assert workload_file.read_bytes() == before


def test_tune_refuses_the_name_of_a_shipped_profile(workload_file: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]
                                                    ) -> None:
    out = tmp_path / "reference.yaml"
    assert main(["tune", str(workload_file), "-o", str(out), "--rounds", "1"]) != 0
    err = capsys.readouterr().err
    assert "'reference' is a profile astrai ships" in err and "tuned-reference.yaml" in err
    assert not out.exists()
