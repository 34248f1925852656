"""Kernel packages that extend astrai by being installed: the ``astrai.tables`` entry points.

An installed distribution declares, in its ``pyproject.toml``::

    [project.entry-points."astrai.tables"]
    mykernels = "mykernels.tables"

The value names an importable package; its ``*.yaml`` resources (read with
``importlib.resources``, subfolders included) are tables, profiles or *row overlays*
(``extends: rms_norm`` with ``rows:``, each row placed ``before:``/``after:`` a named
row of that family, by default before its first faithful row). They load with the
shipped tables, after them and before ``ASTR_TABLES``, and are validated the same way.

A plugin may ship ``precompiled.json`` beside its YAML files (``astrai-ops precompile
DIR`` writes it, as ``astrai-ops schema`` does for the shipped tables): a file whose
bytes it holds loads without pydantic and PyYAML (about 100 ms less at the first load).

This module finds the plugins and reads their files (``discover``); the registry
builds them into a snapshot, and a plugin whose files have any problem (a typo in its
YAML, an ``impl`` that does not import, a row overlay naming a row the family lacks, a
table for a family that already exists) is left out whole, with a warning naming the
distribution and each problem at ``file:line:col``: the rest of the tables still load.
``astrai-ops lint`` and ``validate()`` report those problems as errors.

``ASTR_PLUGINS`` chooses, read when the tables load (``reload_tables()`` reads it
again): unset, ``1`` or ``all`` loads every plugin; ``0`` or ``none`` none;
``-name`` (comma-separated) leaves those out; plain names load only those. A name is
the entry point's or the distribution's (``-``/``_``/``.`` and case are not told apart).
"""

from __future__ import annotations

__all__ = ["GROUP", "Plugin", "discover", "in_use", "plugin_problems"]

import importlib.metadata
import importlib.resources
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from astrai.dispatch.log import logger, warn_once
from astrai.dispatch.tables.artifact import ARTIFACT, Entry, read_entries
from astrai.dispatch.tables.load import MAX_TABLE_BYTES, parse_bytes, read_table_bytes
from astrai.dispatch.tables.model import FamilyTable
from astrai.dispatch.tables.parsed import ParsedFile
from astrai.env import PLUGINS_ENV
from astrai.errors import TableProblem
from astrai.suggestions import did_you_mean

#: The entry point group a kernel package declares its tables under.
GROUP = "astrai.tables"
_SUFFIXES = (".yaml", ".yml")
LOADED, DISABLED, BROKEN = "loaded", "disabled", "broken"


@dataclass(frozen=True, eq=False)
class Plugin:
    """One ``astrai.tables`` entry point and what became of it.

    ``status`` is ``loaded``, ``disabled`` (by ``ASTR_PLUGINS``; ``reason`` says so) or
    ``broken`` (``problems`` lists each, located and naming the distribution).
    ``files`` are its parsed files (tables, profiles, row overlays).
    """

    name: str  # the entry point's name
    distribution: str
    version: str
    package: str  # the entry point's value: the package holding the YAML files
    status: str = LOADED
    reason: str = ""
    problems: tuple[TableProblem, ...] = ()
    files: tuple[ParsedFile, ...] = field(default=(), repr=False)

    @property
    def provided_by(self) -> str:
        """How its rows say who provided them: ``plugin <distribution> <version>``."""
        return f"plugin {self.distribution} {self.version}"

    def broken(self, problems: list[TableProblem]) -> Plugin:
        """This plugin, left out for ``problems`` (each message names the distribution)."""
        tag = f"{self.provided_by}: "
        named = tuple(p if p.message.startswith(tag)
                      else TableProblem(p.file, p.line, p.column, tag + p.message)
                      for p in problems)
        return replace(self, status=BROKEN, reason=f"{len(named)} problem(s)",
                       problems=named)

    def as_dict(self) -> dict[str, object]:
        """The JSON form (``astrai-ops list --json``)."""
        return {"name": self.name, "distribution": self.distribution,
                "version": self.version, "package": self.package, "status": self.status,
                "reason": self.reason or None,
                "problems": [str(p) for p in self.problems],
                "files": [pf.file for pf in self.files]}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _choice(raw: str | None) -> tuple[bool, set[str], set[str]]:
    """``ASTR_PLUGINS`` as ``(any at all, only these, not these)`` (normalised names);
    an entry that means nothing, or a name both asked for and left out, warns once."""
    text = (raw or "").strip()
    if text.lower() in ("", "1", "all"):
        return True, set(), set()
    if text.lower() in ("0", "none"):
        return False, set(), set()
    names = [t.strip() for t in text.split(",")]
    if any(not t or t == "-" or (t.startswith("-") and not t[1:].strip()) or " " in t.strip("- ")
           for t in names):
        warn_once(f"{PLUGINS_ENV}={raw!r}: expected 0, 1, or comma-separated plugin names, "
                  f"each '-name' to leave it out or 'name' to load only those; empty or "
                  f"malformed entries are ignored")
    only = {_normal(t) for t in names if t and not t.startswith("-") and " " not in t}
    without = {_normal(t[1:].strip()) for t in names
               if t.startswith("-") and t[1:].strip() and " " not in t[1:].strip()}
    both = only & without
    if both:
        warn_once(f"{PLUGINS_ENV}={raw!r} both asks for and leaves out "
                  f"{', '.join(sorted(both))}: left out")
    return True, only - both, without


def _distribution(ep: importlib.metadata.EntryPoint) -> tuple[str, str]:
    """``(name, version)`` of the distribution declaring ``ep`` (its metadata may lack
    either)."""
    dist = ep.dist
    name = getattr(dist, "name", None) if dist is not None else None
    version = getattr(dist, "version", None) if dist is not None else None
    return (name if isinstance(name, str) and name else "(unnamed distribution)",
            version if isinstance(version, str) and version else "?")


def _entry_points() -> list[tuple[importlib.metadata.EntryPoint, str, str]]:
    """Each ``astrai.tables`` entry point with its distribution's name and version."""
    found = importlib.metadata.entry_points(group=GROUP)
    seen: dict[tuple[str, str], tuple[importlib.metadata.EntryPoint, str, str]] = {}
    for ep in found:  # a distribution seen twice on sys.path: the first one wins
        dist, version = _distribution(ep)
        seen.setdefault((dist, ep.name), (ep, dist, version))
    return sorted(seen.values(), key=lambda e: (_normal(e[1]), e[0].name))


def discover() -> list[Plugin]:
    """Every installed plugin, each with its files read and parsed (or why not), in
    a stable order (by distribution, then entry point name)."""
    wanted, only, without = _choice(os.environ.get(PLUGINS_ENV))
    plugins: list[Plugin] = []
    for ep, dist, version in _entry_points():
        plugin = Plugin(ep.name, dist, version, ep.value)
        names = {_normal(ep.name), _normal(dist)}
        if not wanted:
            plugin = replace(plugin, status=DISABLED, reason=f"{PLUGINS_ENV}=0")
        elif names & without or (only and not names & only):
            plugin = replace(plugin, status=DISABLED,
                             reason=f"{PLUGINS_ENV}={os.environ.get(PLUGINS_ENV)}")
        else:
            plugin = _read(plugin)
        plugins.append(plugin)
    known = {n for p in plugins for n in (_normal(p.name), _normal(p.distribution))}
    for name in sorted((only | without) - known):
        warn_once(f"{PLUGINS_ENV} names plugin {name!r}, which is not installed"
                  f"{did_you_mean(name, known)}; installed plugins: "
                  f"{', '.join(sorted(known)) or '(none)'}")
    return plugins


def _read(plugin: Plugin) -> Plugin:
    """``plugin`` with its files parsed; broken if its package cannot be read."""
    where = f"{plugin.distribution} {plugin.version} (entry point {plugin.name})"
    if ":" in plugin.package or not plugin.package.strip():
        return plugin.broken([TableProblem(where, 1, 1, (
            f"entry point {plugin.name} = {plugin.package!r}: the value names a package "
            f"holding the *.yaml files (like mykernels.tables), not a module:attribute"))])
    try:
        root = importlib.resources.files(plugin.package)
        resources = sorted(_yaml_resources(root, plugin.package.replace(".", "/") + "/"),
                           key=lambda pair: pair[0])
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # the plugin's package fails to import (SystemExit too)
        return plugin.broken([TableProblem(where, 1, 1, f"entry point "
                                           f"{plugin.name} = {plugin.package!r}: cannot read "
                                           f"its table files: {type(exc).__name__}: {exc}")])
    if not resources:
        return plugin.broken([TableProblem(where, 1, 1, f"package {plugin.package!r} has no "
                                                        f"*.yaml table files")])
    precompiled = _artifact(root)
    files: list[ParsedFile] = []
    for label, resource in resources:
        try:
            data = (read_table_bytes(str(resource)) if isinstance(resource, Path)
                    else resource.read_bytes())
            if len(data) > MAX_TABLE_BYTES:
                raise ValueError(f"file is larger than {MAX_TABLE_BYTES} bytes")
        except (OSError, ValueError) as exc:
            files.append(ParsedFile(label, "unknown", problems=[
                TableProblem(label, 1, 1, f"cannot read file: {exc}")]))
            continue
        files.append(parse_bytes(data, label, plugin.provided_by, precompiled or {}))
    plugin = replace(plugin, files=tuple(files))
    problems = [p for pf in files for p in pf.problems]
    return plugin.broken(problems) if problems else plugin


def _artifact(root: Any) -> dict[str, Entry] | None:
    """The plugin's precompiled artifact (``precompiled.json`` beside its YAML files,
    written by ``astrai-ops precompile``): its files then load without pydantic and
    PyYAML. ``None`` without one, or one made for other table formats (then its files
    take the full path, a little slower, and the log says so)."""
    resource = root.joinpath(ARTIFACT)
    try:
        if not resource.is_file():
            return None
        raw = resource.read_bytes()
    except OSError:
        return None
    entries = read_entries(raw)
    if entries is None:
        logger.info("%s: %s was made for other table formats (or cannot be read); the "
                    "plugin's files take the full path", resource, ARTIFACT)
    return entries


def _yaml_resources(root: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    """``(label, resource)`` of every YAML file under ``root`` (an importlib.resources
    ``Traversable``); the label is the file's path when it has one, else
    ``package/relative/name``."""
    for item in root.iterdir():
        rel = f"{prefix}{item.name}"
        if item.is_dir():
            if not item.name.startswith(("_", ".")):  # __pycache__ and the like
                yield from _yaml_resources(item, rel + "/")
        elif item.name.endswith(_SUFFIXES):
            yield (str(item) if isinstance(item, Path) else rel), item


def plugin_problems(plugins: tuple[Plugin, ...]) -> list[TableProblem]:
    """Every problem of the broken ones among ``plugins``."""
    return [p for plugin in plugins for p in plugin.problems]


def in_use(plugins: Iterable[Plugin], tables: Iterable[FamilyTable]) -> dict[str, str]:
    """``{distribution: version}`` of the loaded ``plugins`` that provided a row (or a
    table) among ``tables``: what tells two ranks or two lockfiles apart."""
    providers = {table.provider_of(r) for table in tables for r in table.rows}
    return {p.distribution: p.version for p in sorted(plugins, key=lambda p: p.distribution)
            if p.status == LOADED and p.provided_by in providers}
