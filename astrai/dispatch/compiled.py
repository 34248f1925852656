"""Dispatch under ``torch.compile``: the decision is a constant at trace time, and guarded.

Dynamo cannot trace ``ContextVar.get``, so while compiling, the facades take the
decision from ``decision_obj`` (run once at trace time, its result baked into the
graph) instead of the eager cache. The graph is guarded on ``KEY``: a plain
module-level tuple naming the table epoch and the scope (``op_backend`` /
``use_profile``) most recently entered or left. Dynamo installs a value guard on
a global read, so a reload, a ``refresh()``, or a different scope recompiles.

Limits (documented in the README): ``ASTR_OPS`` is read when the graph is
traced (a changed value takes effect after ``torch.compiler.reset()`` or a
table reload), and ``KEY`` follows the most recent scope change in any thread,
so give a compiled model one scope per process.
"""

from __future__ import annotations

__all__ = ["IMPLS", "KEY", "decision_name", "impl_key", "note_epoch", "note_scope", "publish"]

import sys
from collections.abc import Iterable
from typing import Any

import torch

from astrai.dispatch.axes import CallContext

_scope: tuple[Any, ...] = ((), ())  # the empty scope's compile_key (see overrides.Scope)
_epoch = 0
KEY: tuple[Any, ...] = (_epoch, _scope)


def impl_key(family: str, name: str, obj: Any) -> str:
    """The ``IMPLS`` key of an implementation object."""
    return f"{family}.{name}@{id(obj):x}"


def publish(family: str, name: str, obj: Any) -> None:
    """Make ``obj`` reachable from traced code. Dynamo reads ``IMPLS`` as it was when
    tracing started, so every object a decision may return is published beforehand:
    all rows on every table swap, scope objects when a scope is entered."""
    IMPLS[impl_key(family, name, obj)] = obj


def note_epoch(epoch: int, rows: Iterable[tuple[str, str, Any]] = ()) -> None:
    """Called on every table swap, with every ``(family, row, object)`` now loaded."""
    global KEY, _epoch
    for family, name, obj in rows:
        publish(family, name, obj)
    _epoch = epoch
    KEY = (_epoch, _scope)


def note_scope(keys: tuple[Any, ...]) -> None:
    """Called whenever a scope is entered or left, with its hashable description."""
    global KEY, _scope
    _scope = keys
    KEY = (_epoch, _scope)


#: Implementation objects chosen at trace time, by the name ``decision_name`` returns.
IMPLS: dict[str, Any] = {}


def _assume_constant_result(fn: Any) -> Any:
    """Mark ``fn`` as ``torch.compiler.assume_constant_result`` does, without importing
    ``torch._dynamo`` (which costs over a second at import time). The compile tests
    check that the mark still takes effect (zero graph breaks)."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)  # type: ignore[no-untyped-call]
    fn._dynamo_marked_constant = True
    return fn


@_assume_constant_result
def decision_name(family: str, names: tuple[str, ...], values: tuple[Any, ...], backend: Any,
                  key: tuple[Any, ...]) -> str:
    """Decide at trace time for the call with these axis values; returns the ``IMPLS`` key
    of the object to call.

    ``key`` is ``KEY`` as the traced code read it: it is passed so the read (and
    so the guard) is part of the graph.
    """
    from astrai.dispatch.resolution import evaluate

    record = evaluate(family, CallContext.of(family, names, values), backend).record
    name = impl_key(family, record.name, record.obj)
    if name not in IMPLS:
        raise RuntimeError(
            f"{family}: {record.name!r} cannot be used under torch.compile: its object was "
            "not published before tracing (pass a row name, not an object, as backend=)")
    return name
