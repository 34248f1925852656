"""Binding ``module:attribute`` paths to objects when a table loads (for ``load``).

Optional dependencies are declared on the row (``requires: [flash_attn]``). Only a
missing *declared* package makes the row unavailable (with the reason ``explain``
shows, e.g. ``flash_attn is not installed (pip install flash-attn)``). Every other
failure - a malformed path, a missing module or submodule that is not declared, a
``SyntaxError`` or anything raised while importing (``SystemExit`` and
``KeyboardInterrupt`` included), a missing attribute - is a
load error, for astrai's own modules and a user's alike: a typo must never quietly
turn a fast row into a slow fallback.
"""

from __future__ import annotations

__all__ = ["BindError", "Bound", "bind", "missing_requirement"]

import importlib
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from astrai.suggestions import closest, did_you_mean


class BindError(Exception):
    """A path that cannot be bound and must fail the load."""


@dataclass(frozen=True)
class Bound:
    """The result of binding a path: the object, or why it is unavailable."""

    obj: Any
    missing: str | None = None


def _root(module: str) -> str:
    return module.split(".")[0]


def _not_installed(package: str) -> str:
    return f"{package} is not installed (pip install {package.replace('_', '-')})"


def missing_requirement(requires: Sequence[str]) -> str | None:
    """The reason a row is unavailable because a declared package is missing, or ``None``."""
    for package in requires:
        try:
            found = importlib.util.find_spec(_root(package)) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return _not_installed(_root(package))
    return None


def _sibling_hint(missing: str) -> str:
    """``(did you mean 'pkg.gelu'?)`` for a missing ``pkg.gelus`` whose package exists:
    the modules beside it, as attribute names get."""
    import pkgutil

    parent, _, leaf = missing.rpartition(".")
    try:
        package = importlib.import_module(parent)
    except BaseException:  # the parent itself is the problem: no sibling to suggest
        return ""
    where = getattr(package, "__path__", None)
    if where is None:
        return ""
    best = closest(leaf, sorted(m.name for m in pkgutil.iter_modules(where)))
    return f" (did you mean {f'{parent}.{best}'!r}?)" if best is not None else ""


def bind(path: str, requires: Sequence[str] = ()) -> Bound:
    """Import ``module:attr`` (attr may be dotted); see the module docstring for failures."""
    if path.count(":") != 1:
        raise BindError(f"import path {path!r} must be 'module:attribute' with exactly one ':'")
    module_name, attr = path.split(":")
    declared = {_root(r) for r in requires}
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or module_name
        if _root(missing) in declared:
            return Bound(None, _not_installed(_root(missing)))
        hint = (f"; if {_root(missing)!r} is an optional dependency, declare it on the row: "
                f"requires: [{_root(missing)}]" if "." not in missing
                else _sibling_hint(missing))
        raise BindError(f"cannot import {module_name!r}: {exc}{hint}") from None
    except BaseException as exc:  # SyntaxError, any error, even SystemExit or
        # KeyboardInterrupt raised by the module's own code: all are load errors
        detail = f": {exc}" if str(exc) else ""
        raise BindError(
            f"importing {module_name!r} failed: {type(exc).__name__}{detail}"
        ) from None
    obj: Any = module
    walked = module_name
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            raise BindError(
                f"{walked!r} has no attribute {part!r}{did_you_mean(part, names)}"
            )
        obj = getattr(obj, part)
        walked = f"{walked}.{part}" if walked != module_name else f"{module_name}:{part}"
    return Bound(obj)
