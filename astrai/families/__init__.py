"""Families as declarations: everything astrai knows about an op family, in one place.

A family is one ``Family`` declared with ``declare``: its name, its facades (each a
``Facade`` made from a ``FamilyCall``: the signature and validation, the axes a call
reads and how it becomes its key, and the common calls as data for the compiled hot
path; see ``astrai.dispatch.facade``), which facade an ``ops.call`` of the family goes
to, and - for ``dispatch_model`` - how the modules of a model that compute it are
recognised and reach its facade (a ``ModelRecognition``, named by its import path so
that it is imported only when a model is dispatched; ``astrai.families.recognition``).

The engine (``astrai.dispatch``), the compiled hot path and the transformers
integration know no family by name: they reach families through this registry. The
built-in families are the packages of this package, each declaring itself when
imported; a user's family declares itself the same way (``docs/families.md``) and gets
the same facade hot path, compiled key reading and model recognition.
"""

from __future__ import annotations

__all__ = ["Family", "declare", "declared", "every_family", "facade_for", "undeclare"]

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from astrai.dispatch.facade import Facade

#: ``choose(args, kwargs)``: the index of the facade an ``ops.call`` of a family goes to.
Choose = Callable[[tuple[Any, ...], Mapping[str, Any]], int]


@dataclass(frozen=True)
class Family:
    """One family's declaration.

    ``facades``: its facades, the first one the family's own (named after it);
    ``choose``: which of them an ``ops.call(name, *args, **kwargs)`` goes to (the first
    when not given); ``model``: ``"module:attribute"`` of its ``ModelRecognition``, or
    the object itself (``None``: ``dispatch_model`` does not route it).
    """

    name: str
    facades: tuple[Facade, ...]
    choose: Choose | None = None
    model: Any = None

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"a family's name must be an identifier, got {self.name!r}")
        if not self.facades:
            raise ValueError(f"family {self.name!r} declares no facade")
        wrong = [f.name for f in self.facades if f.call.family != self.name]
        if wrong:
            raise ValueError(f"family {self.name!r}: facade(s) {', '.join(wrong)} serve "
                             f"another family")

    def facade_for(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Facade:
        """The facade a call with these arguments goes to."""
        return self.facades[0 if self.choose is None else self.choose(args, kwargs)]

    def recognition(self) -> Any:
        """Its ``ModelRecognition`` (imported now when named by path), or ``None``."""
        model = self.model
        if isinstance(model, str):
            module, _, attribute = model.partition(":")
            model = getattr(importlib.import_module(module), attribute)
        return model


_DECLARED: dict[str, Family] = {}
_BUILTIN_LOADED: list[bool] = []


def declare(family: Family) -> Family:
    """Make ``family`` known (replacing a declaration of the same name: a module
    reloaded); returns it."""
    _DECLARED[family.name] = family
    return family


def undeclare(name: str) -> Family | None:
    """Forget the family declared as ``name`` and its facades (a user's family whose
    module goes away; its table stays loaded, served through ``ops.call`` alone);
    returns what was declared."""
    from astrai.dispatch import state
    from astrai.dispatch.facade import FACADES

    family = _DECLARED.pop(name, None)
    if family is not None:
        for f in family.facades:
            if FACADES.get(f.name) is f:
                del FACADES[f.name]
        state.row_checks.pop(name, None)
    return family


def _load_builtin() -> None:
    """Import every built-in family (the packages of this package) once."""
    if _BUILTIN_LOADED:
        return
    _BUILTIN_LOADED.append(True)
    for info in pkgutil.iter_modules(__path__):
        if info.ispkg and not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")


def declared(name: str) -> Family | None:
    """The family declared as ``name``, or ``None``."""
    got = _DECLARED.get(name)
    if got is None and not _BUILTIN_LOADED:
        _load_builtin()
        got = _DECLARED.get(name)
    return got


def every_family() -> dict[str, Family]:
    """Every declared family by name: the built-in ones first, by name, then the rest in
    the order declared (an order that does not depend on what was imported first)."""
    _load_builtin()
    builtin = sorted(n for n, f in _DECLARED.items() if _is_builtin(f))
    return {**{n: _DECLARED[n] for n in builtin},
            **{n: f for n, f in _DECLARED.items() if not _is_builtin(f)}}


def _is_builtin(family: Family) -> bool:
    """Whether ``family`` is one of this package's."""
    return bool(getattr(family.facades[0].function, "__module__", "").startswith(
        f"{__name__}."))


def facade_for(name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Facade | None:
    """The facade a call of family ``name`` with these arguments goes to, or ``None`` for
    a family declaring none (``ops.call`` then reads it off its first tensor or its
    table's ``context:`` builder)."""
    family = declared(name)
    return None if family is None else family.facade_for(args, kwargs)
