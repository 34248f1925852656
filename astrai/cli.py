"""``astrai-ops`` / ``python -m astrai``: inspect, explain, validate and lint the tables.

Exit codes: 0 ok, 1 problems found, 2 usage error. Errors are one clear line on
stderr, never a traceback.
"""

from __future__ import annotations

__all__ = ["main"]

import argparse
import json
import os
import sys
from collections.abc import Sequence
from contextlib import ExitStack

from astrai.dispatch import registry
from astrai.dispatch._suggest import did_you_mean
from astrai.dispatch.axes import DTYPES, FWD_MODES
from astrai.dispatch.context import CallContext
from astrai.dispatch.env import OPS_ENV
from astrai.errors import AstraiError

OK, PROBLEMS, USAGE = 0, 1, 2


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit code 2."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="astrai-ops", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sub.add_parser("list", help="families, rows, availability on this machine")

    e = sub.add_parser("explain", help="why each row wins or loses for a described call")
    e.add_argument("family")
    e.add_argument("--fwd", choices=["none", *FWD_MODES], default="none")
    e.add_argument("--dtype", default=None, help="a torch dtype name, e.g. bfloat16")
    e.add_argument("--ndim", type=int, default=None)
    e.add_argument("--head-dim", type=int, default=None)
    e.add_argument("--cache", action="store_true", help="a KV cache is passed")
    e.add_argument("--mask", action="store_true", help="an attention mask is passed")
    e.add_argument("--no-grad", action="store_true", help="autograd is not recording")
    e.add_argument("--cuda", action="store_true", help="tensors on a CUDA device")
    e.add_argument("--axis", action="append", default=[], metavar="NAME=VALUE",
                   help="a value for one of the family's extra axes")
    e.add_argument("--backend", default=None, help="explicit row selection")
    e.add_argument("--profile", action="append", default=[], help="activate a profile")
    e.add_argument("--json", action="store_true", help="machine-readable output")

    v = sub.add_parser("validate", help="check table and profile files")
    v.add_argument("paths", nargs="*", help="files or directories (default: shipped tables)")

    lint = sub.add_parser("lint", help="find rows that can never win")
    lint.add_argument("paths", nargs="*", help="extra files or directories to load first")
    lint.add_argument("--profile", action="append", default=[], help="lint under a profile")
    lint.add_argument("--no-coverage", action="store_true", help="omit the coverage matrix")

    s = sub.add_parser("schema", help="regenerate schemas/ and the precompiled shipped tables")
    s.add_argument("--check", action="store_true",
                   help="exit 1 if schemas/ or tables/precompiled.json is stale")

    d = sub.add_parser("demo", help="run the demo model and show which rows served it")
    d.add_argument("--transformers", action="store_true",
                   help="run a tiny random Hugging Face Llama through astrai instead")
    return p


def _cmd_list(args: argparse.Namespace) -> int:
    state = registry.current()
    print(f"{OPS_ENV}={os.environ.get(OPS_ENV, '')!r}")
    print(f"profiles: {', '.join(sorted(state.profiles)) or '(none)'}")
    from astrai.dispatch.resolution import active_view

    for name in sorted(state.families):
        view = active_view(state, name)
        table = view.table
        alias = f"  (env alias {state.aliases[name]})" if name in state.aliases else ""
        print(f"\n[{name}] {table.description}{alias}")
        if view.profiles:
            print(f"  active profiles: {' + '.join(view.profiles)}")
        for rec in view.rows:
            ok, reason = state.availability(rec)
            flags = [] if rec.faithful else ["not faithful"]
            if rec is view.fallback:
                flags.append("fallback")
            flag = f" [{', '.join(flags)}]" if flags else ""
            status = "available" if ok else f"unavailable: {reason}"
            print(f"  {rec.name:<14} {status}{flag}")
            print(f"  {'':<14} when: {rec.spec.description}")
    return OK


def _context(args: argparse.Namespace) -> CallContext:
    state = registry.current()
    if args.family not in state.families:
        raise UsageError(f"unknown family {args.family!r}"
                         f"{did_you_mean(args.family, state.families)}; known families: "
                         f"{', '.join(sorted(state.families))}")
    dtype = None
    if args.dtype is not None:
        if args.dtype not in DTYPES:
            raise UsageError(f"unknown dtype {args.dtype!r}{did_you_mean(args.dtype, DTYPES)}")
        dtype = DTYPES[args.dtype]
    extra = {}
    axes = state.families[args.family].axes
    for item in args.axis:
        name, sep, raw = item.partition("=")
        if not sep or name not in axes:
            raise UsageError(f"--axis {item!r}: expected NAME=VALUE with NAME one of: "
                             f"{', '.join(axes) or '(this family has no extra axes)'}")
        axis = axes[name]
        value: object = raw
        if raw == "none":
            value = None
        elif axis.kind == "int":
            try:
                value = int(raw)
            except ValueError:
                raise UsageError(f"--axis {item!r}: expected an integer") from None
        elif axis.kind == "bool":
            if raw not in ("true", "false"):
                raise UsageError(f"--axis {item!r}: expected true or false")
            value = raw == "true"
        extra[name] = value
    return CallContext(
        args.family,
        fwd=None if args.fwd == "none" else args.fwd,
        dtype=dtype,
        device_cuda=args.cuda,
        ndim=args.ndim,
        head_dim=args.head_dim,
        has_cache=args.cache,
        has_mask=args.mask,
        grad_enabled=not args.no_grad,
        extra=extra,
    )


def _cmd_explain(args: argparse.Namespace) -> int:
    from astrai.dispatch.overrides import use_profile
    from astrai.dispatch.resolution import explanation

    ctx = _context(args)
    with ExitStack() as stack:
        if args.profile:
            try:
                stack.enter_context(use_profile(*args.profile))
            except ValueError as exc:
                raise UsageError(str(exc)) from None
        result = explanation(args.family, ctx, args.backend)
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        print(result.render())
    return PROBLEMS if result.error is not None else OK


def _cmd_validate(args: argparse.Namespace) -> int:
    problems = registry.validate(*args.paths)
    for p in problems:
        print(p, file=sys.stderr)
    what = ", ".join(args.paths) if args.paths else "shipped tables"
    if problems:
        print(f"{len(problems)} problem(s) in {what}", file=sys.stderr)
        return PROBLEMS
    print(f"ok: {what}")
    return OK


def _cmd_lint(args: argparse.Namespace) -> int:
    from astrai.dispatch.lint import lint_all

    if args.paths:
        registry.load_tables(*args.paths)
    state = registry.current()
    for name in args.profile:
        if name not in state.profiles:
            raise UsageError(f"unknown profile {name!r}{did_you_mean(name, state.profiles)}; "
                             f"known profiles: {', '.join(sorted(state.profiles))}")
    reports = lint_all(tuple(args.profile))
    for report in reports:
        print(report.render(coverage=not args.no_coverage))
        print()
    return OK if all(r.ok for r in reports) else PROBLEMS


def _cmd_schema(args: argparse.Namespace) -> int:
    from astrai.dispatch.precompiled import ARTIFACT, render_artifact
    from astrai.dispatch.registry import shipped_tables_dir
    from astrai.dispatch.schemas import schemas_dir, stale_schemas, write_schemas

    tables = shipped_tables_dir()
    artifact, compiled = tables / ARTIFACT, render_artifact(tables)
    if args.check:
        stale = [schemas_dir() / name for name in stale_schemas()]
        if not artifact.is_file() or artifact.read_text(encoding="utf-8") != compiled:
            stale.append(artifact)
        for path in stale:
            print(f"{path}: stale; run 'astrai-ops schema' to regenerate", file=sys.stderr)
        return PROBLEMS if stale else OK
    for path in write_schemas():
        print(f"wrote {path}")
    artifact.write_text(compiled, encoding="utf-8")
    print(f"wrote {artifact}")
    return OK


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.transformers:
        from astrai.integrations.transformers import run_transformers_demo

        print(run_transformers_demo())
        return OK
    from astrai.demo import run_demo

    print(run_demo())
    return OK


_COMMANDS = {
    "list": _cmd_list,
    "explain": _cmd_explain,
    "validate": _cmd_validate,
    "lint": _cmd_lint,
    "schema": _cmd_schema,
    "demo": _cmd_demo,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args = _parser().parse_args(argv)
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
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
