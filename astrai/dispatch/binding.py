"""Binding ``module:attribute`` paths to objects when a table loads.

A missing *optional third-party* module makes the row unavailable (the import
error becomes the reason ``explain`` shows). A malformed path, a missing
attribute, or a failing import of astrai's own code is a load error.
"""

from __future__ import annotations

__all__ = ["BindError", "Bound", "bind"]

import importlib
from dataclasses import dataclass
from typing import Any

from astrai.dispatch._suggest import did_you_mean

_OWN_PACKAGE = "astrai"


class BindError(Exception):
    """A path that cannot be bound and must fail the load."""


@dataclass(frozen=True)
class Bound:
    """The result of binding a path: the object, or why it is unavailable."""

    obj: Any
    missing: str | None = None


def _is_own(module_name: str | None) -> bool:
    root = (module_name or "").split(".")[0]
    return root == _OWN_PACKAGE


def bind(path: str) -> Bound:
    """Import ``module:attr`` (attr may be dotted); see the module docstring for failures."""
    if path.count(":") != 1:
        raise BindError(f"import path {path!r} must be 'module:attribute' with exactly one ':'")
    module_name, attr = path.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if _is_own(exc.name) or (_is_own(module_name) and exc.name is None):
            raise BindError(f"cannot import {module_name!r}: {exc}") from None
        return Bound(None, f"cannot import {module_name!r}: {exc}")
    except Exception as exc:
        if _is_own(module_name):
            raise BindError(
                f"importing {module_name!r} failed: {type(exc).__name__}: {exc}"
            ) from None
        return Bound(None, f"importing {module_name!r} failed: {type(exc).__name__}: {exc}")
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
