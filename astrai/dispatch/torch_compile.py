"""Dispatch under ``torch.compile``: the decision is a constant at trace time, and guarded.

Dynamo cannot trace ``ContextVar.get``, so while compiling, the facades take the
decision from ``decision_name`` (run once at trace time, its result baked into the
graph) instead of the eager cache, and call the object ``state.impls`` holds under
that name. The graph is guarded on ``state.compile_key``: a plain module-level tuple
naming the table epoch and the scope (``op_backend`` / ``use_profile``) most
recently entered or left. Dynamo installs a value guard on a global read, so a
reload, a ``refresh()``, or a different scope recompiles.

Limits (documented in the README): ``ASTR_OPS`` is read when the graph is
traced (a changed value takes effect after ``torch.compiler.reset()`` or a
table reload), and the key follows the most recent scope change in any thread,
so give a compiled model one scope per process.
"""

from __future__ import annotations

__all__ = ["compiling", "cut_points_for", "decision_name"]

import sys
from typing import Any

import torch

from astrai.dispatch import state as process
from astrai.dispatch.axes import AXES, CallContext
from astrai.dispatch.expr.spec import cut_points
from astrai.dispatch.registry import current
from astrai.dispatch.resolution import evaluate

#: Dynamo folds this to True while tracing (it cannot trace the ContextVar read of the
#: eager path); eagerly it is a one-line ``return False``.
compiling = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)


def _assume_constant_result(fn: Any) -> Any:
    """Mark ``fn`` as ``torch.compiler.assume_constant_result`` does, without importing
    ``torch._dynamo`` (which costs over a second at import time). The compile tests
    check that the mark still takes effect (zero graph breaks)."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)  # type: ignore[no-untyped-call]
    fn._dynamo_marked_constant = True
    return fn


@_assume_constant_result
def cut_points_for(family: str, key: tuple[Any, ...]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """At trace time: the cut points of ``family``'s int axes over its table and every
    loaded profile, as ``((axis, points), ...)``; ``(("*", ()),)`` when a row's spec calls
    Python (no value can then stand for another). ``key`` as for ``decision_name``."""
    table = current().family(family)
    specs = [r.spec for r in table.rows]
    if table.outside_fallback is not None:
        specs.append(table.outside_fallback.spec)
    for prof in current().profiles.values():
        for ov in prof.for_family(family):
            specs += [*ov.when.values(), *(a.spec for a in ov.add)]
    cuts = cut_points(specs)
    return (("*", ()),) if cuts is None else tuple(sorted(cuts.items()))


@_assume_constant_result
def decision_name(family: str, names: tuple[str, ...], values: tuple[Any, ...], backend: Any,
                  key: tuple[Any, ...]) -> str:
    """Decide at trace time for the call with these axis values; returns the
    ``state.impls`` key of the object to call.

    ``key`` is ``state.compile_key`` as the traced code read it: it is passed so the
    read (and so the guard) is part of the graph.
    """
    record = evaluate(family, CallContext.of(family, names, values), backend).record
    name = process.impl_key(family, record.name, record.obj)
    if name not in process.impls:
        raise RuntimeError(
            f"{family}: {record.name!r} cannot be used under torch.compile: its object was "
            "not published before tracing (pass a row name, not an object, as backend=)")
    return name


def representatives(family: str, names: tuple[str, ...],
                    values: tuple[Any, ...]) -> tuple[Any, ...]:
    """In traced code: each int axis value replaced by a representative of its interval
    between the family's cut points, so a decision on a dynamic (symbolic) length is a
    constant, guarded only on the comparisons the tables make, and one graph serves every
    length of an interval. An int axis no table compares becomes 0."""
    cuts = dict(cut_points_for(family, process.compile_key))
    if "*" in cuts:
        return values
    out = []
    for name, value in zip(names, values, strict=True):
        axis = AXES.get(name)
        if value is None or isinstance(value, bool) or (
                axis is not None and axis.kind != "int") or not isinstance(value, (int, _SymInt)):
            out.append(value)
            continue
        points = cuts.get(name, ())
        chosen = points[0] - 1 if points else 0
        for point in points:  # each comparison is a guard on a symbolic value
            if value >= point:
                chosen = point
            else:
                break
        out.append(chosen)
    return tuple(out)


_SymInt = torch.SymInt

