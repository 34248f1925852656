"""Dispatch under ``torch.compile``: the decision is a constant at trace time, and guarded.

Dynamo cannot trace ``ContextVar.get``, so while compiling, the facades take the
decision from ``decision_name`` (run once at trace time, its result baked into the
graph) instead of the eager cache, and call the object ``state.impls`` holds under
that name. The graph is guarded on ``state.compile_key``: a plain module-level tuple
naming the table epoch and the scope (``op_backend`` / ``use_profile``) most
recently entered or left. Dynamo installs a value guard on a global read, so a
reload, a ``refresh()``, or a different scope recompiles.

Limits (documented in docs/compile.md): ``ASTR_OPS`` is read when the graph is
traced (a changed value takes effect after ``torch.compiler.reset()`` or a
table reload), and the key follows the most recent scope change in any thread,
so give a compiled model one scope per process.
"""

from __future__ import annotations

__all__ = ["compiling", "constant_result", "cut_points_for", "decision_name", "representatives"]

import sys
from typing import Any

import torch

from astrai.dispatch import state as process
from astrai.dispatch.axes import AXES, CallContext
from astrai.dispatch.keying import key_plan
from astrai.dispatch.registry import current
from astrai.dispatch.resolution import evaluate, settle

#: Dynamo folds this to True while tracing (it cannot trace the ContextVar read of the
#: eager path); eagerly it is a one-line ``return False``.
compiling = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)


def constant_result(fn: Any) -> Any:
    """Mark ``fn`` as ``torch.compiler.assume_constant_result`` does, without importing
    ``torch._dynamo`` (which costs over a second at import time). The compile tests
    check that the mark still takes effect (zero graph breaks)."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)  # type: ignore[no-untyped-call]
    fn._dynamo_marked_constant = True
    return fn


@constant_result
def cut_points_for(family: str, key: tuple[Any, ...]) -> tuple[tuple[str, Any], ...]:
    """At trace time: the cut points of ``family``'s int axes over its table and every
    loaded profile, as ``((axis, points), ...)``, then ``("=", pairs)`` naming the pairs
    of int axes compared with each other; ``(("*", ()),)`` when a row's spec calls Python
    (no value can then stand for another). ``key`` as for ``decision_name``."""
    found = key_plan(current(), family).found
    if found.opaque:
        return (("*", ()),)
    return (*sorted(found.points.items()), ("=", tuple(sorted(found.pairs))))


@constant_result
def decision_name(family: str, names: tuple[str, ...], values: tuple[Any, ...], backend: Any,
                  key: tuple[Any, ...]) -> str:
    """Decide at trace time for the call with these axis values; returns the
    ``state.impls`` key of the object to call.

    ``key`` is ``state.compile_key`` as the traced code read it: it is passed so the
    read (and so the guard) is part of the graph.
    """
    ctx = CallContext.of(family, (*names, "traced"), (*values, True))
    state = current()
    record = settle(state, family, backend, ctx, evaluate(family, ctx, backend,
                                                          state=state))[0].record
    name = process.impl_key(family, record.name, record.obj)
    if name not in process.impls:
        raise RuntimeError(
            f"{family}: {record.name!r} cannot be used under torch.compile: its object was "
            "not published before tracing (pass a row name, not an object, as backend=)")
    return name


def representatives(family: str, names: tuple[str, ...],
                    values: tuple[Any, ...]) -> tuple[Any, ...]:
    """In traced code: the int axis values replaced by plain ints that every spec of the
    family answers alike, so a decision on dynamic (symbolic) lengths is a constant,
    guarded only on the comparisons the tables make, and one graph serves every call
    those comparisons cannot tell apart.

    Each int value is located between its cut points, and each pair of int axes the
    tables compare with each other is ordered (each test a guard on symbolic values);
    the representatives are then the least values with the same intervals and orderings
    (lower bounds raised along the pairs until they hold). An int axis no table compares
    becomes its lowest value; one the data decides (an unbacked size) that a table compares
    becomes ``None``, as a length that cannot be read: no spec comparing it holds."""
    cuts = dict(cut_points_for(family, process.compile_key))
    if "*" in cuts:
        return values
    pairs = cuts.pop("=")
    out = list(values)
    at: dict[str, int] = {}
    for i, (name, value) in enumerate(zip(names, values, strict=True)):
        axis = AXES.get(name)
        if value is None or isinstance(value, bool) or (
                axis is not None and axis.kind != "int") or not isinstance(value, (int, _SymInt)):
            continue
        points = cuts.get(name, ())
        low: int | None = axis.minimum if axis is not None else _LOWEST  # below the first
        for point in points:  # each comparison is a guard on a symbolic value
            above = _at_least(value, point)
            if above is None:
                # a size the data decides (the tokens an expert got): no comparison of it
                # can be guarded, so it is unknown to the tables, as a length nobody can
                # read is (no spec comparing it holds)
                low = None
                break
            if not above:
                break
            low = point
        out[i] = low
        if low is not None:
            at[name] = i
    orders = []
    for a, b in pairs:
        if a in at and b in at:
            va, vb = values[at[a]], values[at[b]]
            orders.append((at[a], at[b], 0 if va == vb else (-1 if va < vb else 1)))
    for _ in range(len(at) + 1):  # the least values that keep every pair's order
        changed = False
        for i, j, sign in orders:
            if sign == 0 and out[i] != out[j]:
                out[i] = out[j] = max(out[i], out[j])
            elif sign < 0 and out[j] <= out[i]:
                out[j] = out[i] + 1
            elif sign > 0 and out[i] <= out[j]:
                out[i] = out[j] + 1
            else:
                continue
            changed = True
        if not changed:
            break
    return tuple(out)


_SymInt = torch.SymInt


def _at_least(value: int | torch.SymInt, point: int) -> bool | None:
    """``value >= point`` (a guard where ``value`` is symbolic), or ``None`` where the data
    decides ``value`` and nothing known of it answers (an unbacked size: no guard can be
    made on it)."""
    # traced only (dynamo imported it already): nothing to import for an eager process
    from torch.fx.experimental.symbolic_shapes import guard_or_false, guard_or_true

    test = value >= point
    if guard_or_false(test):
        return True
    return None if guard_or_true(test) else False


#: The lowest value of a table-declared int axis (it may be negative).
_LOWEST = -(1 << 62)

