"""Branches a layer's ``forward`` can never take, read from its source and its attributes.

A layer that applies a function only in some layers says so in its forward with a guard
on its own attributes: ``if self.sliding_window is not None:`` (Cohere 2),
``if self.sliding_window is None or self.is_sliding:`` (EXAONE 4), ``if
self.is_local_attention:`` (AFMoE). ``ruled_out(forward, names, module)`` finds every
call of the given global names in the forward's source, and the guards around each; a
guard built only of the module's attributes, constants, ``is``/``is not``/``==``/``!=``,
``and``/``or``/``not`` is evaluated on the module. When every call sits in a branch its
guard rules out, the calls never happen on this layer, and the guard is returned in
words; a guard on anything else (an argument, ``position_embeddings is not None``) is
not decided here.
"""

from __future__ import annotations

__all__ = ["ruled_out"]

import ast
import functools
import inspect
import textwrap
from typing import Any

_UNKNOWN: Any = object()


def ruled_out(forward: Any, names: set[str], module: Any) -> str | None:
    """The guard (its source) that keeps every call of ``names`` in ``forward`` from
    running on ``module``, or ``None`` when some call may run (or the source cannot be
    read)."""
    parsed = _parsed(getattr(forward, "__func__", forward), frozenset(names))
    if parsed is None:
        return None
    self_name, paths = parsed
    if not paths:
        return None
    guards: list[str] = []
    for path in paths:
        why = _ruled_out_by(path, self_name, module)
        if why is None:
            return None
        guards.append(why)
    return " / ".join(dict.fromkeys(guards))


@functools.cache
def _parsed(fn: Any, names: frozenset[str]
            ) -> tuple[str, list[list[tuple[ast.If, bool]]]] | None:
    """The name of ``fn``'s first parameter and, for every call of ``names`` in its
    source, the ``if`` statements around it (parsed once per function: every layer of a
    model shares it); ``None`` where the source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None
    function = tree.body[0] if tree.body else None
    if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    args = function.args.posonlyargs + function.args.args
    return (args[0].arg if args else "self"), _calls(function, set(names), [])


def _calls(node: ast.AST, names: set[str], path: list[tuple[ast.If, bool]]
           ) -> list[list[tuple[ast.If, bool]]]:
    """For every call of one of ``names`` under ``node``, the ``if`` statements around it
    and whether it sits in each one's body (``True``) or its ``else``."""
    out: list[list[tuple[ast.If, bool]]] = []
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names:
        out.append(list(path))
    if isinstance(node, ast.If):
        out += _calls(node.test, names, path)
        for statement in node.body:
            out += _calls(statement, names, [*path, (node, True)])
        for statement in node.orelse:
            out += _calls(statement, names, [*path, (node, False)])
        return out
    for child in ast.iter_child_nodes(node):
        out += _calls(child, names, path)
    return out


def _ruled_out_by(path: list[tuple[ast.If, bool]], self_name: str, module: Any
                  ) -> str | None:
    for branch, taken in path:
        value = _evaluate(branch.test, self_name, module)
        if value is _UNKNOWN:
            continue
        if bool(value) != taken:
            test = ast.unparse(branch.test)
            return test if taken else f"not ({test})"
    return None


def _evaluate(node: ast.AST, self_name: str, module: Any) -> Any:
    """``node``'s value on ``module``, or ``_UNKNOWN`` for anything but the module's
    attributes, constants and the comparisons and connectives on them."""
    if isinstance(node, ast.Constant):
        return node.value
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == self_name):
        value = getattr(module, node.attr, _UNKNOWN)
        return value if value is None or isinstance(value, (bool, int, float, str)) \
            else _UNKNOWN
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        inner = _evaluate(node.operand, self_name, module)
        return _UNKNOWN if inner is _UNKNOWN else not inner
    if isinstance(node, ast.BoolOp):
        values = [_evaluate(v, self_name, module) for v in node.values]
        known = [v for v in values if v is not _UNKNOWN]
        if isinstance(node.op, ast.And):
            if any(not v for v in known):
                return False
            return _UNKNOWN if len(known) < len(values) else True
        if any(bool(v) for v in known):
            return True
        return _UNKNOWN if len(known) < len(values) else False
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        left = _evaluate(node.left, self_name, module)
        right = _evaluate(node.comparators[0], self_name, module)
        if left is _UNKNOWN or right is _UNKNOWN:
            return _UNKNOWN
        op = node.ops[0]
        if isinstance(op, ast.Is):
            return left is right
        if isinstance(op, ast.IsNot):
            return left is not right
        if isinstance(op, ast.Eq):
            return left == right
        if isinstance(op, ast.NotEq):
            return left != right
    return _UNKNOWN
