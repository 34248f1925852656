"""What the workflows' files share: the model base, names, counts and the machine's model
(``astrai.dispatch.tables.parts``, which the table formats build on too), storage sizes,
and writing a file whole."""

from __future__ import annotations

__all__ = ["Count", "FileModel", "MachineModel", "Name", "Positive", "atomic_write",
           "not_an_input", "storage_elements"]

import math
import os
import stat
import tempfile
from pathlib import Path

from astrai.dispatch.tables.parts import Count, FileModel, MachineModel, Name, Positive
from astrai.errors import OutputPathError


def storage_elements(shape: tuple[int, ...] | list[int],
                     stride: tuple[int, ...] | list[int] | None = None) -> int:
    """The elements of storage a tensor of ``shape`` reaches: its element count when it
    is contiguous (``stride`` ``None``), else the extent its strides reach (overlapping
    views, stride 0, included)."""
    if stride is None:
        return math.prod(shape)
    if 0 in shape:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))


def _umask() -> int:
    """This process's umask, read without changing it where the system says it
    (``/proc/self/status``); elsewhere set and restored at once."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def atomic_write(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to a new file beside ``path``, then rename it over ``path``: a
    reader (another rank sharing the directory, a crash half-way) never sees half a file.

    One rule for every file astrai writes: it gets the mode a newly created file gets in
    this process (``0o666`` less the umask) - whatever was there before; a ``path`` that is
    a symbolic link is written through (the file it names is replaced, the link stays); a
    ``path`` that exists and is not a regular file (a directory, a FIFO, a device, a
    socket, or a link to one) is refused with ``OutputPathError``, never replaced."""
    target = Path(path)
    try:
        mode = os.stat(target).st_mode  # through links (/proc/self/fd/1 is the pipe itself)
    except FileNotFoundError:
        mode = None
    if target.is_symlink():
        target = Path(os.path.realpath(target))
    if mode is not None and not stat.S_ISREG(mode):
        where = f"{path} (a link to {target})" if Path(path) != target else f"{path}"
        raise OutputPathError(f"{where} is {_kind(mode)}, not a regular file: astrai writes "
                              f"only regular files and never replaces anything else")
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp",
                               dir=target.parent or Path("."))
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(path)


def not_an_input(output: str | os.PathLike[str], *inputs: str | os.PathLike[str],
                 what: str = "-o") -> None:
    """Refuse (``OutputPathError``) to write ``output`` when it is the same file as one of
    ``inputs`` (through links, hard links and relative paths alike): an output never
    destroys an input."""
    out = Path(output)
    for given in inputs:
        src = Path(given)
        try:
            same = out.exists() and src.exists() and os.path.samefile(out, src)
        except OSError:
            same = False
        if same or os.path.realpath(out) == os.path.realpath(src):
            raise OutputPathError(f"{what} {output} is the input {given}: writing it would "
                                  f"destroy what this command reads; name another file")
