"""``astrai-ops native``: whether astrai's native extension (the compiled hot path and the
native rows' kernels) is in use, and building it."""

from __future__ import annotations

__all__ = ["cmd_native"]

import argparse
import sys

from astrai.cli.output import OK, PROBLEMS


def cmd_native(args: argparse.Namespace) -> int:
    from astrai import native

    if args.build:
        from astrai.native import building

        try:
            current = building.built_path()
            problem = building.verify(current) if current.exists() else None
            if problem is not None and not args.force:
                print(f"astrai-ops native: {current} is built again: {problem}",
                      file=sys.stderr)
            path = native.build(force=args.force)
        except native.NativeBuildError as e:
            print(f"astrai-ops native: cannot build the native extension: {e}",
                  file=sys.stderr)
            return PROBLEMS
        print(f"built {path}")
        print("processes started from now on load it (ASTR_NATIVE=off turns it off)")
        return OK
    print(native.status())
    from astrai import ops

    for name, why in ops.compiled_path().items():
        print(f"  compiled hot path, {name}: {'reads its common calls' if why is None else why}")
    return OK
