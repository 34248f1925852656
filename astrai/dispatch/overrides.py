"""Overrides for a scope: ``op_backend(...)`` and ``use_profile(...)``.

Both live in ``ContextVar``s holding immutable values, so they are per thread and
per asyncio task, and nested scopes restore the outer value with the saved token.
String names are validated eagerly (``ValueError`` before the body runs);
implementation objects pass through.
"""

from __future__ import annotations

__all__ = [
    "Scope",
    "current_overrides",
    "current_profiles",
    "current_scope",
    "get_override",
    "op_backend",
    "reset_override",
    "set_override",
    "use_profile",
]

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar, Token
from types import MappingProxyType
from typing import Any

from astrai.dispatch import compiled
from astrai.dispatch._suggest import did_you_mean
from astrai.dispatch.registry import current

_EMPTY: Mapping[str, Any] = MappingProxyType({})


class Scope:
    """Immutable per-context state: ``op_backend`` handles and ``use_profile`` names.

    ``keys`` holds, per family, the hashable form of the handle that keys the
    decision cache (``None`` when the handle is an object whose verdict depends on
    the raw call, so decisions under it are never cached).
    """

    __slots__ = ("cache_token", "compile_key", "handles", "keys", "profiles")

    def __init__(self, handles: Mapping[str, Any], profiles: tuple[str, ...]) -> None:
        self.handles = MappingProxyType(dict(handles))
        self.profiles = profiles
        self.keys = MappingProxyType({f: handle_key(h) for f, h in handles.items()})
        self.compile_key = (tuple(sorted(self.keys.items())), profiles)
        # The same description as a str: equal scopes give equal tokens, and a str caches
        # its hash, so the decision-cache key does not rehash nested tuples on every call.
        self.cache_token = repr(self.compile_key)


def _enter(scope: Scope) -> Token[Scope]:
    for family, handle in scope.handles.items():
        if not isinstance(handle, str):
            compiled.publish(family, _object_name(family, handle), handle)
    token = _scope.set(scope)
    compiled.note_scope(scope.compile_key)
    return token


def _leave(token: Token[Scope]) -> None:
    _scope.reset(token)
    compiled.note_scope(_scope.get().compile_key)


def handle_key(handle: Any) -> Any:
    """How a selection handle enters the decision-cache key (``UNCACHEABLE`` if it can't)."""
    if handle is None or isinstance(handle, str):
        return handle
    if callable(getattr(handle, "supports_call", None)):
        return UNCACHEABLE  # its verdict depends on the raw call
    return ("obj", id(handle))  # the scope keeps the object alive


UNCACHEABLE = ("uncacheable",)


def _object_name(family: str, obj: Any) -> str:
    """The row name an implementation object resolves under (its row's, or its own)."""
    state = current()
    table = state.families.get(family)
    if table is not None:
        for rec in table.rows:
            if rec.obj is obj:
                return rec.name
    return str(getattr(obj, "name", None) or getattr(obj, "__name__", None)
               or type(obj).__name__)
EMPTY_SCOPE = Scope(_EMPTY, ())
_scope: ContextVar[Scope] = ContextVar("astrai_scope", default=EMPTY_SCOPE)


def current_scope() -> Scope:
    """The scope in force in this thread / task."""
    return _scope.get()


def current_overrides() -> Mapping[str, Any]:
    """The ``op_backend`` overrides in force in this thread / task."""
    return _scope.get().handles


def current_profiles() -> tuple[str, ...]:
    """The profiles activated in code (``use_profile``) for this thread / task, in order."""
    return _scope.get().profiles


def _validate(family: str, handle: Any) -> None:
    state = current()
    if family not in state.families:
        raise ValueError(f"Unknown family: {family!r}{did_you_mean(family, state.families)}; "
                         f"known families: {', '.join(sorted(state.families))}")
    from astrai.dispatch.resolution import active_view, check_handle

    names = active_view(state, family).row_names()
    check_handle(family, handle, names)
    if isinstance(handle, str):
        if handle not in names:
            raise ValueError(f"Unknown {family} implementation: {handle!r}"
                             f"{did_you_mean(handle, names)}; rows: {', '.join(names)}")


def _with_handles(handles: Mapping[str, Any]) -> Scope:
    scope = _scope.get()
    merged = dict(scope.handles)
    for family, handle in handles.items():
        if handle is None:
            merged.pop(family, None)
        else:
            merged[family] = handle
    return Scope(merged, scope.profiles)


def set_override(family: str, handle: Any) -> Token[Scope]:
    """Select ``handle`` (a row name or an implementation object; ``None`` clears) for
    ``family`` in this context until ``reset_override(token)``."""
    if handle is not None:
        _validate(family, handle)
    return _enter(_with_handles({family: handle}))


def get_override(family: str) -> Any:
    """The override for ``family`` in this context, or ``None``."""
    return _scope.get().handles.get(family)


def reset_override(token: Token[Scope]) -> None:
    """Undo the ``set_override`` that returned ``token``."""
    _leave(token)


@contextmanager
def op_backend(**handles: Any) -> Iterator[None]:
    """Within the block, use these rows (or objects) per family: strict selection.

    ``with op_backend(attention="torch_native", rotary="torch"): ...``
    """
    for family, handle in handles.items():
        if handle is not None:
            _validate(family, handle)
    token = _enter(_with_handles(handles))
    try:
        yield
    finally:
        _leave(token)


@contextmanager
def use_profile(*names: str) -> Iterator[None]:
    """Within the block, apply these profiles (after any from ``ASTR_OPS``), in order."""
    known = current().profiles
    for name in names:
        if name not in known:
            raise ValueError(f"unknown profile {name!r}{did_you_mean(name, known)}; "
                             f"known profiles: {', '.join(sorted(known)) or '(none)'}")
    scope = _scope.get()
    token = _enter(Scope(scope.handles, (*scope.profiles, *names)))
    try:
        yield
    finally:
        _leave(token)
