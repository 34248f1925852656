"""What every command shares: exit codes, the errors that end a command, and standard
output that reports a failed write instead of losing it."""

from __future__ import annotations

__all__ = [
    "BROKEN_PIPE",
    "OK",
    "PROBLEMS",
    "USAGE",
    "OutputError",
    "Stdout",
    "UsageError",
    "help_text",
    "quiet_stdout",
    "report_line",
]

import os
import sys
from typing import Any, TextIO

OK, PROBLEMS, USAGE = 0, 1, 2
#: Exit status after the reader of stdout went away: 128 + SIGPIPE, as a shell reports it.
BROKEN_PIPE = 141


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit code 2."""


class OutputError(Exception):
    """Standard output could not be written (other than a closed pipe): one line, exit 1."""


class Stdout:
    """``sys.stdout`` while a command runs: the real stream, but a failed write or flush
    raises ``OutputError``, and so does a write when there is no stream (file descriptor 1
    was closed, so Python set ``sys.stdout`` to None and ``print`` would drop the text).
    A closed pipe stays a ``BrokenPipeError``. Anything else is the real stream's."""

    def __init__(self, stream: TextIO | None) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        if self.stream is None:
            raise OutputError("standard output is closed")
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            raise
        except (OSError, ValueError) as exc:  # ValueError: the stream was closed
            raise OutputError(str(exc)) from exc

    def flush(self) -> None:
        if self.stream is None:
            return  # nothing written, nothing lost
        try:
            self.stream.flush()
        except BrokenPipeError:
            raise
        except (OSError, ValueError) as exc:
            raise OutputError(str(exc)) from exc

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def help_text(text: str) -> str:
    """Docstring text for ``--help``: reStructuredText's double backticks removed."""
    return text.replace("``", "")


def quiet_stdout() -> None:
    """Point stdout at the null device, so that flushing it at exit cannot fail again."""
    if sys.stdout is None:
        return  # no stream, nothing flushed at exit (and file descriptor 1 is not ours)
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
    except (OSError, ValueError):  # no real file descriptor (an embedding, a test)
        pass


def report_line(line: str) -> None:
    """One line on stderr, if stderr can take it (if not, the exit status has to do)."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
