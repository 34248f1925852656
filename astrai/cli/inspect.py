"""Looking at the tables: ``list`` (families, rows, availability, plugins) and
``explain`` (a family's table, or why each row wins or loses for a described call)."""

from __future__ import annotations

__all__ = ["cmd_explain", "cmd_list", "profile_names"]

import argparse
import json
import os
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

from astrai.cli.output import OK, PROBLEMS, UsageError
from astrai.cli.parser import CALL_OPTIONS
from astrai.dispatch import registry
from astrai.dispatch.axes import AXES, MACHINE_AXES, Axis, CallContext
from astrai.dispatch.plugins import Plugin, plugin_problems
from astrai.dispatch.registry import Registry
from astrai.dispatch.tables.model import FamilyTable, View
from astrai.env import OPS_ENV
from astrai.suggestions import did_you_mean

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


def cmd_list(args: argparse.Namespace) -> int:
    from astrai.dispatch.scopes import active_view

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

def profile_names(values: Sequence[str], state: Registry) -> tuple[str, ...]:
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
    extra = _extra_axes(args, state.families[args.family])
    if args.traced:
        extra["traced"] = True
    extra.update(_machine_axes(args))
    return CallContext(args.family, **values, extra=extra)


def _machine_axes(args: argparse.Namespace) -> dict[str, Any]:
    """The machine axes stated for another machine (``--cpu-isa avx2``...)."""
    return {name: _axis_value(axis.flag, axis, raw) for name, axis in MACHINE_AXES.items()
            if (raw := getattr(args, f"machine_{name}", None)) is not None}


def _describes_call(args: argparse.Namespace) -> bool:
    return bool(args.axis) or args.traced or any(
        getattr(args, name) != axis.default for name, axis in AXES.items())


def _explain_table(args: argparse.Namespace, state: Registry, profiles: tuple[str, ...]) -> int:
    """``explain FAMILY`` with no call: the table as resolution sees it, and no verdict."""
    from astrai.dispatch.environment import env_settings
    from astrai.dispatch.scopes import active_view, use_profile

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


def cmd_explain(args: argparse.Namespace) -> int:
    from astrai.dispatch.explain import explanation
    from astrai.dispatch.scopes import use_profile

    state = registry.current()
    _check_family(args.family, state)
    profiles = profile_names(args.profile, state)
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
