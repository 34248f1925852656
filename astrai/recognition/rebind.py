"""A copy of a function that sees some of its module's globals as other objects.

transformers' attention layers call module-level functions by their global name
(``apply_rotary_pos_emb(...)``, ``ALL_ATTENTION_FUNCTIONS.get_interface(...)``). To send
one *instance*'s calls elsewhere without touching the module (which every other model
of that architecture shares), ``rebind`` makes a copy of the layer's ``forward`` whose
globals are a copy of its module's, with the chosen names bound to other objects; the
instance gets the copy, everything else keeps the original.

A ``forward`` is often wrapped by decorators (``functools.wraps`` closures such as
transformers' ``deprecate_kwarg``): the copy is made through the closures too, each
wrapper rebuilt around the copy of what it wraps, so the decorators keep working.
``global_names`` lists the global names a function (and what it wraps) reads, with the
globals they are read from, so a caller can see what a ``forward`` calls before
rebinding anything.
"""

from __future__ import annotations

__all__ = ["REBOUND", "global_names", "home", "rebind"]

import sys
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any


def _functions(fn: types.FunctionType, seen: set[int]) -> Iterator[types.FunctionType]:
    """``fn`` and every function its closures hold, depth first, each once."""
    if id(fn) in seen:
        return
    seen.add(id(fn))
    yield fn
    for cell in fn.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, types.FunctionType):
            yield from _functions(value, seen)


def _code_names(code: types.CodeType) -> Iterator[str]:
    """The names ``code`` and the code nested in it (comprehensions, lambdas) may load."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_names(const)


def global_names(fn: Callable[..., Any]) -> list[tuple[str, dict[str, Any]]]:
    """``(name, globals)`` for each name ``fn`` (or a function its closures hold) reads
    that its globals define, in order of first use, each once per globals."""
    if not isinstance(fn, types.FunctionType):
        return []
    out: list[tuple[str, dict[str, Any]]] = []
    seen: set[tuple[str, int]] = set()
    for f in _functions(fn, set()):
        g = f.__globals__
        for name in _code_names(f.__code__):
            if name in g and (name, id(g)) not in seen:
                seen.add((name, id(g)))
                out.append((name, g))
    return out


def rebind(fn: Callable[..., Any], owner: dict[str, Any],
           replacements: Mapping[str, Any]) -> types.FunctionType | None:
    """A copy of ``fn`` in which every function (``fn`` itself or one its closures hold)
    whose globals are ``owner`` sees ``replacements`` instead of those globals; ``None``
    when no such function reads any of the replaced names, or ``fn`` is no Python
    function.

    The copies' globals are the namespace of a module of their own (``home``), a copy
    of ``owner`` with the replacements in it: ``torch.compile`` finds a function's
    globals through the module its ``__name__`` names, so that module must be the one
    holding them. One home serves every copy made with the same replacements (the same
    objects); each ``rebind`` refreshes it from ``owner``, so a global the module bound
    since is seen again (one it deleted stays).
    """
    if not isinstance(fn, types.FunctionType):
        return None
    names = set(replacements)
    if not any(f.__globals__ is owner and names & set(_code_names(f.__code__))
               for f in _functions(fn, set())):
        return None
    return _copy(fn, owner, home(owner, replacements), {})


#: How the names of the namespaces ``home`` registers in ``sys.modules`` start.
REBOUND = "astrai_rebound__"


def home(owner: dict[str, Any], replacements: Mapping[str, Any]) -> dict[str, Any]:
    """The namespace of the module copies of ``owner``'s functions with ``replacements``
    live in (made once, registered in ``sys.modules``; refreshed from ``owner`` here)."""
    tag = "_".join(f"{k}{id(v):x}" for k, v in sorted(replacements.items()))
    name = f"{REBOUND}{str(owner.get('__name__', 'module')).replace('.', '_')}__{tag}"
    module = sys.modules.get(name)
    if module is None:
        module = sys.modules.setdefault(name, types.ModuleType(name))
    namespace = module.__dict__
    namespace.update(owner)
    namespace.update(replacements)
    namespace["__name__"] = name
    return namespace


def _copy(fn: types.FunctionType, owner: dict[str, Any], new_globals: dict[str, Any],
          memo: dict[int, types.FunctionType]) -> types.FunctionType:
    done = memo.get(id(fn))
    if done is not None:
        return done
    memo[id(fn)] = fn  # a closure that holds its own function (recursion) keeps it
    closure = None
    if fn.__closure__ is not None:
        cells = []
        for cell in fn.__closure__:
            try:
                value = cell.cell_contents
            except ValueError:
                cells.append(cell)
                continue
            if isinstance(value, types.FunctionType):
                copied = _copy(value, owner, new_globals, memo)
                cells.append(cell if copied is value else types.CellType(copied))
            else:
                cells.append(cell)
        closure = tuple(cells)
    changed = closure is not None and any(
        a is not b for a, b in zip(closure, fn.__closure__ or (), strict=True))
    if fn.__globals__ is not owner and not changed:
        return fn
    copy = types.FunctionType(fn.__code__, new_globals if fn.__globals__ is owner
                              else fn.__globals__, fn.__name__, fn.__defaults__, closure)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    copy.__annotations__ = fn.__annotations__
    copy.__doc__ = fn.__doc__
    copy.__module__ = fn.__module__
    copy.__dict__.update(fn.__dict__)
    if "__wrapped__" in fn.__dict__ and isinstance(fn.__dict__["__wrapped__"],
                                                   types.FunctionType):
        copy.__dict__["__wrapped__"] = _copy(fn.__dict__["__wrapped__"], owner, new_globals,
                                             memo)
    memo[id(fn)] = copy
    return copy
