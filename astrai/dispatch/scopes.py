"""The ``op_backend(...)`` / ``use_profile(...)`` scopes, and what is in force for a call.

Scopes live in a ``ContextVar`` holding immutable ``Scope``s, so they are per thread and
per asyncio task. String names are validated eagerly (``ValueError`` before the body
runs); implementation objects pass through. A scope must end where it began and in order
(innermost first): a generator that yields inside ``with op_backend(...)`` leaves its
scope in force in the caller while suspended, and closing it later (or from another
thread) ends a scope that is not the innermost one - that raises ``ScopeError`` instead
of silently restoring the wrong scope; enter the scope around the loop that drives the
generator. The profiles in force for a call are the environment's (``environment``)
first, then the scopes'; profiles put in force process-wide (``set_process_profiles``:
every thread, e.g. the tuned profile ``dispatch_model`` finds) come before both.
"""

from __future__ import annotations

__all__ = [
    "EMPTY_SCOPE",
    "UNCACHEABLE",
    "Scope",
    "active_profiles",
    "active_view",
    "current_overrides",
    "current_profiles",
    "current_scope",
    "get_override",
    "handle_key",
    "op_backend",
    "process_profiles",
    "reset_override",
    "scope_variable",
    "set_override",
    "set_process_profiles",
    "use_profile",
]

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar, Token
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from astrai.dispatch import state as process
from astrai.dispatch.environment import EnvSettings, env_now
from astrai.dispatch.registry import Registry, current
from astrai.dispatch.tables.model import View
from astrai.errors import ScopeError
from astrai.suggestions import did_you_mean

_EMPTY: Mapping[str, Any] = MappingProxyType({})


class Scope:
    """Immutable per-context state: ``op_backend`` handles and ``use_profile`` names.

    ``keys`` holds, per family, the hashable form of the handle that keys the
    decision cache (``None`` when the handle is an object whose verdict depends on
    the raw call, so decisions under it are never cached).
    """

    __slots__ = ("cache_token", "compile_key", "ended", "handles", "keys", "outer", "profiles",
                 "uncacheable")

    def __init__(self, handles: Mapping[str, Any], profiles: tuple[str, ...]) -> None:
        self.handles = MappingProxyType(dict(handles))
        self.profiles = profiles
        self.keys = MappingProxyType({f: handle_key(h) for f, h in handles.items()})
        self.uncacheable = frozenset(f for f, k in self.keys.items() if k is UNCACHEABLE)
        # Under torch.compile every object is told apart, those probed per call included.
        self.compile_key = (tuple(sorted(
            (f, ("probed", id(handles[f])) if k is UNCACHEABLE else k)
            for f, k in self.keys.items())), profiles)
        # The same description as a str: equal scopes give equal tokens, and a str caches
        # its hash, so the decision-cache key does not rehash nested tuples on every call.
        self.cache_token = repr(self.compile_key)
        # Set when entered: the scope it was entered over, and whether it has ended.
        self.outer: Scope | None = None
        self.ended = False

    def describe(self) -> str:
        """The scope in words: its selections and profiles."""
        parts = [f"{f}={h if isinstance(h, str) else _object_name(f, h)}"
                 for f, h in self.handles.items()]
        parts += [f"profile={p}" for p in self.profiles]
        return f"op_backend({', '.join(parts)})" if parts else "no scope"


def _enter(scope: Scope) -> Token[Scope]:
    for family, handle in scope.handles.items():
        if not isinstance(handle, str):
            process.publish(family, _object_name(family, handle), handle)
    scope.outer = _scope.get()
    token = _scope.set(scope)
    process.note_scope(scope.compile_key)
    return token


def _leave(token: Token[Scope], scope: Scope | None = None) -> None:
    """End ``scope`` (entered with ``token``). Only the innermost scope of this context
    may end: anything else raises ``ScopeError`` (the scope is marked ended, so it never
    comes back when an inner one ends later)."""
    here = _scope.get()
    if scope is not None and here is not scope:
        scope.ended = True
        raise ScopeError(
            f"{scope.describe()} ended where it is not the innermost scope (that is "
            f"{here.describe()}): scopes must end in the reverse order they began, in the "
            f"thread or task that began them. A generator suspended inside 'with "
            f"op_backend(...)' and closed later, or from another thread, does this; enter "
            f"the scope around the loop that drives the generator instead.")
    try:
        _scope.reset(token)
    except (ValueError, RuntimeError):  # a token of another Context, or used twice
        if scope is not None:
            scope.ended = True
        raise ScopeError(
            "reset_override: this token belongs to another thread or task, or was already "
            "used; reset it where set_override returned it, once") from None
    if scope is not None:
        scope.ended = True
    restored = outer = _scope.get()
    while outer.ended and outer.outer is not None:  # skip scopes that ended out of order
        outer = outer.outer
    if outer is not restored:
        _scope.set(outer)
    process.note_scope(_scope.get().compile_key)


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


#: The scope in force where no ``op_backend`` / ``use_profile`` block is.
EMPTY_SCOPE = Scope(_EMPTY, ())
_scope: ContextVar[Scope] = ContextVar("astrai_scope", default=EMPTY_SCOPE)


#: The scope in force in this thread / task (the ContextVar's own getter: hot path).
current_scope: Callable[[], Scope] = _scope.get


def scope_variable() -> ContextVar[Scope]:
    """The ``ContextVar`` the scopes live in (read directly by the compiled hot path)."""
    return _scope


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
    names = active_view(state, family).row_names()
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
    scope = _with_handles(handles)
    token = _enter(scope)
    try:
        yield
    finally:
        _leave(token, scope)


@contextmanager
def use_profile(*names: str) -> Iterator[None]:
    """Within the block, apply these profiles (after any from ``ASTR_OPS``), in order."""
    known = current().profiles
    for name in names:
        if name not in known:
            raise ValueError(f"unknown profile {name!r}{did_you_mean(name, known)}; "
                             f"known profiles: {', '.join(sorted(known)) or '(none)'}")
    scope = _scope.get()
    inner = Scope(scope.handles, (*scope.profiles, *names))
    token = _enter(inner)
    try:
        yield
    finally:
        _leave(token, inner)



def set_process_profiles(*names: str) -> tuple[str, ...]:
    """Apply these profiles in every thread and task, before those of ``ASTR_OPS`` and of
    ``use_profile`` scopes (which therefore win where they disagree), until the next call;
    no names: none. Returns the profiles in force process-wide before. Unknown names
    raise ``ValueError``. A new snapshot of the same tables goes in force (a new epoch),
    so no decision cached under the profiles before is used after."""
    known = current().profiles
    for name in names:
        if name not in known:
            raise ValueError(f"unknown profile {name!r}{did_you_mean(name, known)}; "
                             f"known profiles: {', '.join(sorted(known)) or '(none)'}")
    with process.swap_lock:
        before: tuple[str, ...] = process.process_profiles
        process.process_profiles = tuple(dict.fromkeys(names))
        base = current()
        process.snapshot = replace(base, epoch=next(process.epochs))
        process.note_epoch(process.snapshot.epoch)
    return before


def process_profiles() -> tuple[str, ...]:
    """The profiles in force process-wide (``set_process_profiles``)."""
    return tuple(process.process_profiles)


# -- what is in force for a call ---------------------------------------------------

def active_profiles(state: Registry, env: EnvSettings, scope: Scope | None = None
                    ) -> tuple[str, ...]:
    """Profiles in force: those put in force process-wide (``set_process_profiles``)
    first, then those from ``ASTR_OPS``, then ``use_profile`` scopes (of ``scope``, or
    the scope in force); a process-wide one also named later counts once, there."""
    scoped = (scope or _scope.get()).profiles
    wide: tuple[str, ...] = process.process_profiles
    if not scoped and not env.profiles and not wide:
        return ()
    if wide:
        wide = tuple(n for n in wide if n not in env.profiles and n not in scoped)
    names = (*wide, *env.profiles, *scoped) if scoped or wide else env.profiles
    return tuple(n for n in names if n in state.profiles)


def active_view(state: Registry, family: str) -> View:
    """``family`` under the profiles active in this context."""
    return state.view(family, active_profiles(state, env_now(state)))


