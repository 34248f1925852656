"""``astrai-ops`` / ``python -m astrai``: inspect, explain, validate and lint the tables.

Exit codes: 0 ok, 1 problems found, 2 usage error. Errors are one clear line on
stderr, never a traceback. Output into a pipe that closes early (``astrai-ops list |
head -1``) ends quietly with 141, the status of a command that SIGPIPE ended. Output that
cannot be written (a full disk, stdout closed) is an error: one line, exit 1.
"""

from __future__ import annotations

__all__ = ["main"]

import argparse
import json
import os
import re
import shlex
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any, TextIO, cast

from astrai.dispatch import registry
from astrai.dispatch._suggest import did_you_mean
from astrai.dispatch.axes import AXES, Axis, CallContext, format_value
from astrai.dispatch.plugins import DISABLED, Plugin, discover, plugin_problems
from astrai.dispatch.registry import TABLES_ENV, Registry
from astrai.dispatch.sources import OPS_ENV
from astrai.dispatch.tables.model import FamilyTable, View
from astrai.errors import AstraiError

OK, PROBLEMS, USAGE = 0, 1, 2
#: Exit status after the reader of stdout went away: 128 + SIGPIPE, as a shell reports it.
BROKEN_PIPE = 141
#: Where ``init`` copies the shipped tables by default.
INIT_DIR = "astrai-tables"
_TABLE_SUFFIXES = (".yaml", ".yml")
#: The options that describe a call to ``explain`` (without any, it shows the table).
CALL_OPTIONS = (*(axis.flag for axis in AXES.values()), "--axis")


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit code 2."""


class OutputError(Exception):
    """Standard output could not be written (other than a closed pipe): one line, exit 1."""


class _Stdout:
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


def _plain(text: str) -> str:
    """Docstring text for ``--help``: reStructuredText's double backticks removed."""
    return text.replace("``", "")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="astrai-ops", description=_plain((__doc__ or "").splitlines()[0]),
        epilog="Exit codes: 0 ok, 1 problems found, 2 usage error.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=text, description=text[:1].upper() + text[1:] + ".")

    ls = command("list", "families, rows, availability on this machine, where each family "
                         "and row comes from, and the installed plugins")
    ls.add_argument("--json", action="store_true", help="machine-readable output")

    e = command("explain", "why each row wins or loses for a described call (without call "
                           "options: the family's table, rows in effective order)")
    e.add_argument("family")
    for axis in AXES.values():
        _add_axis_flag(e, axis)
    e.add_argument("--axis", action="append", default=[], metavar="NAME=VALUE",
                   help="a value for one of the family's extra axes")
    e.add_argument("--backend", default=None, metavar="ROW", help="explicit row selection")
    e.add_argument("--profile", action="append", default=[], metavar="P[+P...]",
                   help="activate profiles, applied in order (repeatable)")
    e.add_argument("--json", action="store_true", help="machine-readable output")

    v = command("validate", "check table and profile files")
    v.add_argument("paths", nargs="*",
                   help=f"files or directories (default: shipped tables and {TABLES_ENV})")

    lint = command("lint", "find rows that can never win")
    lint.add_argument("paths", nargs="*", help="extra files or directories to load first")
    lint.add_argument("--profile", action="append", default=[], metavar="P[+P...]",
                      help="lint under profiles, applied in order (repeatable)")
    lint.add_argument("--no-coverage", action="store_true", help="omit the coverage matrix")

    s = command("schema", "regenerate schemas/ and the precompiled shipped tables")
    s.add_argument("--check", action="store_true",
                   help="exit 1 if schemas/ or tables/precompiled.json is stale")

    pc = command("precompile", "write precompiled.json beside a kernel package's table files, "
                               "so they load without pydantic and PyYAML")
    pc.add_argument("dir", metavar="DIR", help="the package folder holding the *.yaml files")
    pc.add_argument("--check", action="store_true",
                    help="exit 1 if DIR's precompiled.json is missing or stale")

    i = command("init", f"copy the shipped tables and profiles into a directory to edit, and "
                        f"print the {TABLES_ENV} line that uses them")
    i.add_argument("dir", nargs="?", default=INIT_DIR, metavar="DIR",
                   help=f"where to copy them (default: ./{INIT_DIR})")
    i.add_argument("--force", action="store_true", help="overwrite files that already exist")

    d = command("demo", "run the demo model and show which rows served it")
    d.add_argument("--hf", "--transformers", dest="transformers", action="store_true",
                   help="run a tiny random Hugging Face Llama instead, the whole model "
                        "dispatched through astrai (dispatch_model)")
    d.add_argument("--record", metavar="WORKLOAD",
                   help="record every call the demo makes and write the workload there")

    t = command("tune", "time every row that can serve each call of a recorded workload and "
                        "write the fastest per shape bucket as a profile (with provenance)")
    t.add_argument("workload", metavar="WORKLOAD", help="a recorded workload (demo --record)")
    t.add_argument("-o", "--output", default="tuned.yaml", metavar="PROFILE",
                   help="where to write the profile; its name is the file's stem "
                        "(default: tuned.yaml)")
    t.add_argument("--rounds", type=int, default=7,
                   help="interleaved timing rounds per call (default: 7)")
    t.add_argument("--allow-nonfaithful", action="store_true",
                   help="time non-faithful rows too (they change numerics)")
    t.add_argument("--report", metavar="REPORT.md",
                   help="write the timing table (markdown) and a plot (PNG, with matplotlib)")

    k = command("lock", "write the decision of every call of a recorded workload to a lock "
                        "file, or check a lock against the tables now (--check)")
    k.add_argument("workload", nargs="?", metavar="WORKLOAD",
                   help="a workload file (astrai-ops demo --record, ASTR_RECORD, record())")
    k.add_argument("-o", "--output", default="astrai.lock", metavar="LOCK",
                   help="where to write the lock (default: astrai.lock)")
    k.add_argument("--check", metavar="LOCK",
                   help="resolve every locked decision again; exit 1 with a table of the "
                        "ones that changed")
    return p


# -- families as tables (list, and explain without a call) ---------------------

def _rows_of(view: View) -> list[Any]:
    """The view's rows in effective order, and a fallback kept outside the chain last."""
    rows = list(view.rows)
    if view.fallback not in rows:
        rows.append(view.fallback)
    return rows


def _row_flags(view: View, rec: Any) -> list[str]:
    flags = []
    if not rec.faithful:
        flags.append("not faithful")
    if rec.explicit_only:
        flags.append("explicit-only")
    if not rec.implicit and rec.name in view.enabled:
        flags.append(f"enabled by profile {view.enabled[rec.name]}")
    if rec.name in view.disabled:
        flags.append(f"disabled by profile {view.disabled[rec.name]}")
    if rec is view.fallback:
        flags.append("fallback" if rec in view.rows else "fallback, outside the chain")
    return flags


def _family_lines(state: Registry, view: View) -> list[str]:
    """A family's block: header, file, profiles, and per row availability and ``when``."""
    name, table = view.table.name, view.table
    alias = f"  (env alias {state.aliases[name]})" if name in state.aliases else ""
    by = (f" ({table.provided_by})"
          if table.provided_by and table.provided_by != table.source else "")
    lines = [f"[{name}] {table.description}{alias}", f"  from: {_source(table)}{by}"]
    lines += [f"  define {d}: {text}" for d, text in _definitions(table).items()]
    if view.profiles:
        lines.append(f"  active profiles: {' + '.join(view.profiles)}")
    for rec in _rows_of(view):
        ok, reason = state.availability(rec)
        flags = _row_flags(view, rec)
        flag = f" [{', '.join(flags)}]" if flags else ""
        status = "available" if ok else f"unavailable: {reason}"
        lines.append(f"  {rec.name:<14} {status}{flag}")
        lines.append(f"  {'':<14} when: {rec.spec.description}")
        if table.provider_of(rec) != table.provided_by:  # a joined row, a profile's add
            lines.append(f"  {'':<14} from: {table.provider_of(rec)} ({rec.source})")
    return lines


def _family_dict(state: Registry, view: View) -> dict[str, Any]:
    """The JSON form of ``_family_lines``."""
    table = view.table
    rows = []
    for rec in _rows_of(view):
        ok, reason = state.availability(rec)
        rows.append({
            "name": rec.name,
            "when": rec.spec.description,
            "available": ok,
            "reason": None if ok else reason,
            "faithful": rec.faithful,
            "explicit_only": rec.explicit_only,
            "fallback": rec is view.fallback,
            "in_chain": rec in view.rows,
            "enabled_by": view.enabled.get(rec.name),
            "disabled_by": view.disabled.get(rec.name),
            "description": rec.description,
            "provided_by": table.provider_of(rec),
            "source": rec.source,
        })
    return {
        "family": table.name,
        "description": table.description,
        "source": table.source,
        "provided_by": table.provided_by,
        "env_alias": state.aliases.get(table.name),
        "definitions": _definitions(table),
        "profiles": list(view.profiles),
        "fallback": view.fallback.name,
        "rows": rows,
        "notes": list(view.notes),
        "call": None,
    }


def _definitions(table: FamilyTable) -> dict[str, str]:
    """The table's definitions (``define:``): name -> what it stands for, as text."""
    return {name: spec.parts[0].description for name, spec in table.definitions.items()}


def _plugin_text(plugin: Plugin) -> str:
    """``astrai-example-kernels 0.1.0 (example: loaded)`` and the like."""
    why = f", {plugin.reason}" if plugin.reason else ""
    return f"{plugin.distribution} {plugin.version} ({plugin.name}: {plugin.status}{why})"


def _source(table: FamilyTable) -> str:
    return table.source or "(unknown)"


def _cmd_list(args: argparse.Namespace) -> int:
    from astrai.dispatch.sources import active_view

    state = registry.current()
    if args.json:
        print(json.dumps({
            OPS_ENV: os.environ.get(OPS_ENV, ""),
            "profiles": sorted(state.profiles),
            "plugins": [p.as_dict() for p in state.plugins],
            "families": [_family_dict(state, active_view(state, name))
                         for name in sorted(state.families)],
        }, indent=2))
        return OK
    print(f"{OPS_ENV}={os.environ.get(OPS_ENV, '')!r}")
    print(f"profiles: {', '.join(sorted(state.profiles)) or '(none)'}")
    print(f"plugins: {', '.join(_plugin_text(p) for p in state.plugins) or '(none)'}")
    for problem in plugin_problems(state.plugins):
        print(f"  {problem}")
    for name in sorted(state.families):
        print()
        print("\n".join(_family_lines(state, active_view(state, name))))
    return OK


# -- explain ---------------------------------------------------------------------

def _profiles(values: Sequence[str], state: Registry) -> tuple[str, ...]:
    """``--profile`` values, each ``a`` or ``a+b+...`` as in ``ASTR_OPS``, in order."""
    names: list[str] = []
    for value in values:
        for name in value.split("+"):
            name = name.strip()
            if not name:
                raise UsageError(f"--profile {value!r}: empty profile name; expected "
                                 f"NAME or NAME+NAME...")
            if name not in state.profiles:
                raise UsageError(f"unknown profile {name!r}{did_you_mean(name, state.profiles)}"
                                 f"; known profiles: "
                                 f"{', '.join(sorted(state.profiles)) or '(none)'}")
            names.append(name)
    return tuple(names)


def _check_family(family: str, state: Registry) -> None:
    if family not in state.families:
        raise UsageError(f"unknown family {family!r}"
                         f"{did_you_mean(family, state.families)}; known families: "
                         f"{', '.join(sorted(state.families))}")


def _add_axis_flag(parser: argparse.ArgumentParser, axis: Axis) -> None:
    """The ``explain`` option that sets one core axis (declared in ``axes.AXES``)."""
    if axis.kind == "bool":
        parser.add_argument(axis.flag, dest=axis.name, action="store_const",
                            const=not axis.default, default=axis.default,
                            help=f"set {axis.name} to {format_value(not axis.default)} "
                                 f"({axis.description})")
    elif axis.kind == "enum":
        parser.add_argument(axis.flag, dest=axis.name, default=axis.default,
                            choices=[*(["none"] if axis.nullable else []), *axis.values],
                            help=axis.description)
    else:
        what = (f"an integer >= {axis.minimum}" if axis.kind == "int"
                else "a torch dtype name, e.g. bfloat16")
        parser.add_argument(axis.flag, dest=axis.name, default=None,
                            metavar="N" if axis.kind == "int" else "DTYPE",
                            help=f"{axis.description} ({what})")


def _axis_value(option: str, axis: Axis, raw: str) -> Any:
    try:
        return axis.parse(raw)
    except ValueError as exc:
        raise UsageError(f"{option} {raw!r}: {exc}") from None


def _extra_axes(args: argparse.Namespace, table: FamilyTable) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    axes = table.axes
    for item in args.axis:
        name, sep, raw = item.partition("=")
        if not sep or name not in axes:
            raise UsageError(f"--axis {item!r}: expected NAME=VALUE with NAME one of: "
                             f"{', '.join(axes) or '(this family has no extra axes)'}")
        extra[name] = _axis_value("--axis", axes[name], raw)
    return extra


def _context(args: argparse.Namespace, state: Registry) -> CallContext:
    values = {name: (getattr(args, name) if axis.kind == "bool" or getattr(args, name) is None
                     else _axis_value(axis.flag, axis, getattr(args, name)))
              for name, axis in AXES.items()}
    return CallContext(args.family, **values,
                       extra=_extra_axes(args, state.families[args.family]))


def _describes_call(args: argparse.Namespace) -> bool:
    return bool(args.axis) or any(
        getattr(args, name) != axis.default for name, axis in AXES.items())


def _explain_table(args: argparse.Namespace, state: Registry, profiles: tuple[str, ...]) -> int:
    """``explain FAMILY`` with no call: the table as resolution sees it, and no verdict."""
    from astrai.dispatch.sources import active_view, env_settings, use_profile

    if args.backend is not None:
        raise UsageError(f"--backend needs a described call; give at least one of "
                         f"{', '.join(CALL_OPTIONS)}")
    with use_profile(*profiles):
        view = active_view(state, args.family)
    env = env_settings(state.families, state.profiles, state.aliases, state.epoch)
    notes = list(view.notes)
    if args.family in env.backends:
        notes.append(f"{env.source_of(args.family)} selects {env.backends[args.family]} "
                     f"(used for a call it can serve)")
    if view.forced is not None:
        row, prof = view.forced
        notes.append(f"profile {prof} forces {row} (for a call it can serve)")
    if args.json:
        doc = _family_dict(state, view)
        doc["notes"] = notes
        print(json.dumps(doc, indent=2))
        return OK
    lines = _family_lines(state, view)
    lines += [f"  note: {n}" for n in notes]
    lines.append(f"(no call described, so no verdict: describe one with "
                 f"{', '.join(CALL_OPTIONS)})")
    print("\n".join(lines))
    return OK


def _cmd_explain(args: argparse.Namespace) -> int:
    from astrai.dispatch.resolution import explanation
    from astrai.dispatch.sources import use_profile

    state = registry.current()
    _check_family(args.family, state)
    profiles = _profiles(args.profile, state)
    if not _describes_call(args):
        return _explain_table(args, state, profiles)
    ctx = _context(args, state)
    with ExitStack() as stack:
        if profiles:
            stack.enter_context(use_profile(*profiles))
        result = explanation(args.family, ctx, args.backend)
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        print(result.render())
    return PROBLEMS if result.error is not None else OK


# -- validate, lint, schema, init, demo -------------------------------------------

def _table_files(path: Path) -> list[Path]:
    """The files the loader would read for ``path`` (a file is read whatever its name)."""
    if not path.is_dir():
        return [path] if path.exists() else []
    return [Path(root) / name for root, dirs, names in os.walk(path)
            for name in (*names, *dirs) if os.path.splitext(name)[1] in _TABLE_SUFFIXES]


def _env_table_paths() -> list[str]:
    return [p for p in os.environ.get(TABLES_ENV, "").split(os.pathsep) if p.strip()]


def _names(items: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _cmd_validate(args: argparse.Namespace) -> int:
    paths: list[str] = list(args.paths)
    env_paths = [] if paths else _env_table_paths()
    if paths:
        what = ", ".join(paths)
    else:
        plugins = [p.distribution for p in discover() if p.status != DISABLED]
        what = "shipped tables" + (f", plugins ({', '.join(plugins)})" if plugins else "") + (
            f" and {TABLES_ENV} ({', '.join(env_paths)})" if env_paths else "")
    found = registry.validate(*paths)
    problems = [(p.file, str(p)) for p in found]
    # A path that holds no table or profile file was surely meant to hold some: say so.
    count = 0 if paths else len(_table_files(registry.shipped_tables_dir()))
    here = "here" if paths else f"in this {TABLES_ENV} entry"
    for raw in paths or env_paths:
        if not raw.strip():
            continue  # validate reported it ("" is not the current directory)
        try:
            files, is_dir = _table_files(Path(raw)), Path(raw).is_dir()
        except OSError:
            continue  # validate reported it
        count += len(files)
        if not files and is_dir:
            problems.append((raw, f"{raw}: no table or profile file (*.yaml, *.yml) {here}"))
    for _, text in problems:
        print(text, file=sys.stderr)
    if problems:
        located = list(dict.fromkeys(file for file, _ in problems))
        summary = f"{len(problems)} problem(s) in {_names(located)}"
        if ", ".join(located) != what:
            summary += f" (validated: {what})"
        print(summary, file=sys.stderr)
        return PROBLEMS
    print(f"ok: {what} ({count} file(s))")
    return OK


def _cmd_lint(args: argparse.Namespace) -> int:
    from astrai.dispatch.lint import lint_all

    if args.paths:
        registry.load_tables(*args.paths)
    profiles = _profiles(args.profile, registry.current())
    reports = lint_all(profiles)
    for report in reports:
        print(report.render(coverage=not args.no_coverage))
        print()
    broken = plugin_problems(registry.current().plugins)  # left out of what was linted
    for problem in broken:
        print(problem, file=sys.stderr)
    return OK if all(r.ok for r in reports) and not broken else PROBLEMS


def _cmd_precompile(args: argparse.Namespace) -> int:
    from astrai.dispatch.tables.artifact import ARTIFACT, render_artifact
    from astrai.dispatch.tables.load import validate_directory

    directory = Path(args.dir)
    if not directory.is_dir():
        raise UsageError(f"{directory}: not a directory")
    # Checked against the tables without any plugin: the package may be installed already.
    parsed = validate_directory(directory, registry.unplugged_families())
    if not parsed:
        raise UsageError(f"{directory}: no table, profile or row overlay file (*.yaml, *.yml)")
    artifact, compiled = directory / ARTIFACT, render_artifact(directory, parsed)
    if args.check:
        if not artifact.is_file() or artifact.read_text(encoding="utf-8") != compiled:
            print(f"{artifact}: stale; run 'astrai-ops precompile {directory}' to regenerate",
                  file=sys.stderr)
            return PROBLEMS
        print(f"ok: {artifact} is current ({len(parsed)} file(s))")
        return OK
    artifact.write_text(compiled, encoding="utf-8")
    print(f"wrote {artifact} ({len(parsed)} file(s)); ship it as package data beside them")
    return OK


def _cmd_schema(args: argparse.Namespace) -> int:
    from astrai.dispatch.schemas import stale_schemas, write_schemas
    from astrai.dispatch.tables.artifact import ARTIFACT, render_artifact, shipped_tables_dir
    from astrai.dispatch.tables.format import schemas_dir
    from astrai.dispatch.tables.load import validate_directory

    tables = shipped_tables_dir()
    artifact, compiled = tables / ARTIFACT, render_artifact(tables, validate_directory(tables))
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


_SCHEMA_LINE = re.compile(r"^(#\s*yaml-language-server:\s*\$schema=)(\S+)", re.M)


def _schema_ref(path: Path) -> str:
    """How a copied file's modeline names a schema: an absolute path (a URI if it has spaces)."""
    text = path.as_posix()
    return path.as_uri() if any(c.isspace() for c in text) else text


def _repoint_schema(text: str, origin: Path) -> str:
    """``text`` of the shipped file ``origin`` with its ``$schema=`` modeline made absolute,
    so that editors still find the shipped schema from wherever the copy lives."""
    from astrai.dispatch.tables.format import schemas_dir

    def fix(m: re.Match[str]) -> str:
        ref = m.group(2)
        if "://" in ref:
            return m.group(0)
        target = (origin.parent / ref).resolve()
        if not target.is_file():
            target = (schemas_dir() / Path(ref).name).resolve()
            if not target.is_file():
                return m.group(0)
        return m.group(1) + _schema_ref(target)

    return _SCHEMA_LINE.sub(fix, text)


def _cmd_init(args: argparse.Namespace) -> int:
    src = registry.shipped_tables_dir()
    dest = Path(args.dir).expanduser().absolute()
    if dest.resolve() == src.resolve():
        raise UsageError(f"{dest} is the shipped tables directory itself; choose another DIR")
    if dest.exists() and not dest.is_dir():
        print(f"astrai-ops init: error: {dest} exists and is not a directory", file=sys.stderr)
        return PROBLEMS
    sources = sorted(p for p in _table_files(src) if p.is_file())
    pairs = [(p, dest / p.relative_to(src)) for p in sources]
    existing = [target for _, target in pairs if target.exists() or target.is_symlink()]
    if existing and not args.force:
        print(f"astrai-ops init: error: {len(existing)} file(s) already exist in {dest}; "
              f"nothing was copied (use --force to overwrite them):", file=sys.stderr)
        for target in existing:
            print(f"  {target}", file=sys.stderr)
        return PROBLEMS
    for origin, target in pairs:
        with open(origin, encoding="utf-8", newline="") as f:
            text = f.read()
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink():
            target.unlink()  # --force replaces the link, never writes through it
        with open(target, "w", encoding="utf-8", newline="") as f:
            f.write(_repoint_schema(text, origin))
    print(f"copied {len(pairs)} table and profile file(s) from {src} to {dest}:")
    for _, target in pairs:
        print(f"  {target.relative_to(dest).as_posix()}")
    print("A family or profile defined there replaces the shipped one of the same name. "
          "Use them with:")
    current = os.environ.get(TABLES_ENV, "")
    if current:
        print(f"({TABLES_ENV} is set to {current!r} now; the line below replaces it: join "
              f"both with {os.pathsep!r} to keep those too)")
    if os.name == "nt":
        print(f"set {TABLES_ENV}={dest}")
    else:
        print(f"export {TABLES_ENV}={shlex.quote(str(dest))}")
    return OK


def _cmd_demo(args: argparse.Namespace) -> int:
    from astrai.dispatch.recording import Recording

    recording = Recording()
    with recording if args.record else ExitStack():  # recording costs: only when asked
        if args.transformers:
            from astrai.integrations.transformers import run_transformers_demo

            report = run_transformers_demo()
        else:
            from astrai.demo import run_demo

            report = run_demo()
    print(report)
    if args.record:
        workload = recording.workload()
        try:
            path = workload.save(args.record)
        except OSError as exc:
            print(f"astrai-ops demo: error: cannot write {args.record}: "
                  f"{exc.strerror or exc}", file=sys.stderr)
            return PROBLEMS
        print(f"\nrecorded {len(workload.calls)} distinct calls ({workload.total} calls) "
              f"to {path}")
    return OK


def _cmd_lock(args: argparse.Namespace) -> int:
    from astrai.dispatch.lock import check_lock, lock_workload
    from astrai.dispatch.lockfile import Lock
    from astrai.dispatch.workload import Workload

    if args.check is not None:
        if args.workload is not None:
            raise UsageError("give a WORKLOAD to write a lock, or --check LOCK, not both")
        report = check_lock(Lock.load(args.check))
        print(report.render())
        return OK if report.ok else PROBLEMS
    if args.workload is None:
        raise UsageError("give the WORKLOAD to lock (or --check LOCK)")
    lock = lock_workload(Workload.load(args.workload), source=args.workload)
    try:
        path = lock.save(args.output)
    except OSError as exc:
        print(f"astrai-ops lock: error: cannot write {args.output}: {exc.strerror or exc}",
              file=sys.stderr)
        return PROBLEMS
    print(_lock_summary(lock))
    print(f"wrote {path}: {len(lock.decisions)} decisions, digest {lock.digest}")
    return OK


def _lock_summary(lock: Any) -> str:
    """Per family, row and origin: the locked signatures and the calls they stand for."""
    groups: dict[tuple[str, str, str], list[int]] = {}
    for d in lock.decisions:
        got = groups.setdefault((d.family, d.row or "(none)", d.origin or "error"), [0, 0])
        got[0] += 1
        got[1] += d.calls
    lines = [f"{'family':<12} {'row':<16} {'origin':<9} {'signatures':>10} {'calls':>8}"]
    lines += [f"{f:<12} {r:<16} {o:<9} {n:>10} {c:>8}"
              for (f, r, o), (n, c) in sorted(groups.items())]
    errors = [d for d in lock.decisions if d.error is not None]
    lines += [f"  {d.signature}: {d.error}" for d in errors]
    return "\n".join(lines)

def _cmd_tune(args: argparse.Namespace) -> int:
    from astrai.dispatch.tune_ranks import init_from_environment
    from astrai.dispatch.tuning import tune_workload, write_report
    from astrai.dispatch.workload import Workload

    if args.rounds < 1:
        raise UsageError("--rounds must be at least 1")
    workload = Workload.load(args.workload)
    started = init_from_environment()  # under torchrun: every rank tunes, one profile
    try:
        tuned = tune_workload(workload, args.output, rounds=args.rounds,
                              allow_nonfaithful=args.allow_nonfaithful, source=args.workload)
    finally:
        if started:
            import torch.distributed as dist

            dist.destroy_process_group()
    calls = sum(len(b.calls) for b in tuned.buckets)
    ranks = f" on {tuned.ranks} ranks (median across ranks)" if tuned.ranks > 1 else ""
    if tuned.plan is None or tuned.plan.rank == 0:
        print(tuned.summary())
        for line in tuned.excluded():
            print(line)
    print(f"wrote {tuned.path}: profile {tuned.name!r}, {len(tuned.buckets)} buckets{ranks}; "
          f"verified: each of the {calls} tuned calls resolves to its measured winner")
    if tuned.plan is not None:
        print(f"check_agreement: plan {tuned.plan.digest} agreed by {tuned.ranks} ranks")
    if args.report and (tuned.plan is None or tuned.plan.rank == 0):
        for line in write_report(tuned, args.report):
            print(line)
    print(f"activate: ASTR_TABLES={tuned.path} ASTR_OPS=profile={tuned.name}")
    return OK


_COMMANDS = {
    "list": _cmd_list,
    "explain": _cmd_explain,
    "validate": _cmd_validate,
    "lint": _cmd_lint,
    "schema": _cmd_schema,
    "precompile": _cmd_precompile,
    "init": _cmd_init,
    "demo": _cmd_demo,
    "lock": _cmd_lock,
    "tune": _cmd_tune,
}


def _run(argv: Sequence[str] | None) -> int:
    try:
        args = _parser().parse_args(argv)
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


def _quiet_stdout() -> None:
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


def _report(line: str) -> None:
    """One line on stderr, if stderr can take it (if not, the exit status has to do)."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    real = sys.stdout
    sys.stdout = cast(TextIO, _Stdout(real))
    try:
        code = _run(argv)
        sys.stdout.flush()  # inside the try: a failed write shows up here at the latest
        return code
    except BrokenPipeError:
        sys.stdout = real
        _quiet_stdout()
        return BROKEN_PIPE
    except OutputError as exc:
        sys.stdout = real
        _quiet_stdout()  # what could not be written is dropped, not retried at exit
        _report(f"astrai-ops: error: cannot write output: {exc}")
        return PROBLEMS
    except KeyboardInterrupt:
        return 130
    finally:
        sys.stdout = real


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
