"""``astrai-ops`` / ``python -m astrai``: inspect, explain, validate and lint the tables.

Exit codes: 0 ok, 1 problems found, 2 usage error. Errors are one clear line on
stderr, never a traceback. Output into a pipe that closes early (``astrai-ops list |
head -1``) ends quietly with 141, the status of a command that SIGPIPE ended. Output that
cannot be written (a full disk, stdout closed) is an error: one line, exit 1.
"""

from __future__ import annotations

__all__ = ["main"]

import os
import sys
from collections.abc import Sequence
from typing import TextIO, cast

from astrai.cli.files import cmd_init, cmd_lint, cmd_precompile, cmd_schema, cmd_validate
from astrai.cli.inspect import cmd_explain, cmd_list
from astrai.cli.native import cmd_native
from astrai.cli.output import (
    BROKEN_PIPE,
    PROBLEMS,
    USAGE,
    OutputError,
    Stdout,
    UsageError,
    quiet_stdout,
    report_line,
)
from astrai.cli.parser import make_parser
from astrai.cli.workflows import cmd_demo, cmd_lock, cmd_tune
from astrai.errors import AstraiError

_COMMANDS = {
    "list": cmd_list,
    "explain": cmd_explain,
    "validate": cmd_validate,
    "lint": cmd_lint,
    "schema": cmd_schema,
    "precompile": cmd_precompile,
    "init": cmd_init,
    "demo": cmd_demo,
    "lock": cmd_lock,
    "tune": cmd_tune,
    "native": cmd_native,
}


def _run(argv: Sequence[str] | None) -> int:
    try:
        args = make_parser().parse_args(argv)
    except SystemExit as exc:  # --help, or argparse's own usage error
        return exc.code if isinstance(exc.code, int) else USAGE
    try:
        return _COMMANDS[args.command](args)
    except UsageError as exc:
        print(f"astrai-ops {args.command}: error: {exc}", file=sys.stderr)
        return USAGE
    except AstraiError as exc:
        first, *rest = str(exc).splitlines() or [""]
        print(f"astrai-ops {args.command}: error: {first}", file=sys.stderr)
        for line in rest:
            print(line, file=sys.stderr)
        return PROBLEMS


def _import_from_here() -> None:
    """Let a table's ``impl:`` and ``context:`` modules import from the current directory,
    as they do under ``python -m astrai`` (which puts it first on ``sys.path``): the
    ``astrai-ops`` script and ``python -m astrai`` then load the same tables alike."""
    here = os.getcwd()
    if "" not in sys.path and here not in sys.path:
        sys.path.insert(0, here)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    _import_from_here()
    real = sys.stdout
    sys.stdout = cast(TextIO, Stdout(real))
    try:
        code = _run(argv)
        sys.stdout.flush()  # inside the try: a failed write shows up here at the latest
        return code
    except BrokenPipeError:
        sys.stdout = real
        quiet_stdout()
        return BROKEN_PIPE
    except OutputError as exc:
        sys.stdout = real
        quiet_stdout()  # what could not be written is dropped, not retried at exit
        report_line(f"astrai-ops: error: cannot write output: {exc}")
        return PROBLEMS
    except KeyboardInterrupt:
        return 130
    finally:
        sys.stdout = real


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
