"""Table and profile files: ``validate``, ``lint``, ``precompile``, ``schema`` and ``init``."""

from __future__ import annotations

__all__ = ["cmd_init", "cmd_lint", "cmd_precompile", "cmd_schema", "cmd_validate"]

import argparse
import os
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from astrai.cli.inspect import profile_names
from astrai.cli.output import OK, PROBLEMS, UsageError
from astrai.dispatch import registry
from astrai.dispatch.environment import ops_problems
from astrai.dispatch.plugins import DISABLED, discover, plugin_problems
from astrai.env import OPS_ENV, TABLES_ENV
from astrai.suggestions import did_you_mean


def _table_files(path: Path) -> list[Path]:
    """The files the loader would read for ``path`` (a file is read whatever its name)."""
    if not path.is_dir():
        return [path] if path.exists() else []
    return [Path(p) for p in registry.yaml_files(path)[0]]


def _names(items: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def cmd_validate(args: argparse.Namespace) -> int:
    paths: list[str] = list(args.paths)
    env_paths = [] if paths else registry.env_table_paths()
    if paths:
        what = ", ".join(paths)
    else:
        plugins = [p.distribution for p in discover() if p.status != DISABLED]
        what = "shipped tables" + (f", plugins ({', '.join(plugins)})" if plugins else "") + (
            f" and {TABLES_ENV} ({', '.join(env_paths)})" if env_paths else "")
    found = registry.validate(*paths)
    problems = [(p.file, str(p)) for p in found]
    if args.strict:
        problems += [(OPS_ENV, p) for p in ops_problems()]
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


def cmd_lint(args: argparse.Namespace) -> int:
    from astrai.dispatch.lint import lint_all

    if args.paths:
        registry.load_tables(*args.paths)
    profiles = profile_names(args.profile, registry.current())
    reports = lint_all(profiles)
    for report in reports:
        print(report.render(coverage=not args.no_coverage))
        print()
    broken = plugin_problems(registry.current().plugins)  # left out of what was linted
    for problem in broken:
        print(problem, file=sys.stderr)
    return OK if all(r.ok for r in reports) and not broken else PROBLEMS


def cmd_precompile(args: argparse.Namespace) -> int:
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


def cmd_schema(args: argparse.Namespace) -> int:
    from astrai.dispatch.tables.artifact import (
        ARTIFACT,
        format_digest,
        render_artifact,
        shipped_tables_dir,
    )
    from astrai.dispatch.tables.format import schemas_dir
    from astrai.dispatch.tables.load import validate_directory
    from astrai.formats.schemas import stale_schemas, write_schemas

    tables = shipped_tables_dir()
    artifact = tables / ARTIFACT
    if args.check:
        stale = [schemas_dir() / name for name in stale_schemas()]
        compiled = render_artifact(tables, validate_directory(tables))
        if not artifact.is_file() or artifact.read_text(encoding="utf-8") != compiled:
            stale.append(artifact)
        for path in stale:
            print(f"{path}: stale; run 'astrai-ops schema' to regenerate", file=sys.stderr)
        return PROBLEMS if stale else OK
    for path in write_schemas():
        print(f"wrote {path}")
    format_digest.cache_clear()  # the artifact is made for the schemas just written
    compiled = render_artifact(tables, validate_directory(tables))
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


def _defines(path: Path) -> str:
    """The family or profile a shipped file defines (its ``family:`` or ``profile:``)."""
    for line in path.read_text(encoding="utf-8").splitlines():
        key, sep, value = line.partition(":")
        if sep and key in ("family", "profile"):
            return value.strip().strip("'\"")
    return ""


def cmd_init(args: argparse.Namespace) -> int:
    src = registry.shipped_tables_dir()
    dest = Path(args.dir).expanduser().absolute()
    if dest.resolve() == src.resolve():
        raise UsageError(f"{dest} is the shipped tables directory itself; choose another DIR")
    if dest.exists() and not dest.is_dir():
        print(f"astrai-ops init: error: {dest} exists and is not a directory", file=sys.stderr)
        return PROBLEMS
    sources = sorted(p for p in _table_files(src) if p.is_file())
    if args.only:
        named = {_defines(p): p for p in sources}
        unknown = [n for n in args.only if n not in named]
        if unknown:
            known = sorted(n for n in named if n)
            raise UsageError(f"--only {unknown[0]!r} is no shipped family or profile"
                             f"{did_you_mean(unknown[0], known)}; they are: {', '.join(known)}")
        sources = [named[n] for n in dict.fromkeys(args.only)]
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
