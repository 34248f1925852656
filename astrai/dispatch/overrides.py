"""Overrides for a scope: ``op_backend(...)`` and ``use_profile(...)``.

Both live in ``ContextVar``s holding immutable values, so they are per thread and
per asyncio task, and nested scopes restore the outer value with the saved token.
String names are validated eagerly (``ValueError`` before the body runs);
implementation objects pass through.
"""

from __future__ import annotations

__all__ = [
    "current_overrides",
    "current_profiles",
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

from astrai.dispatch._suggest import did_you_mean
from astrai.dispatch.registry import current

_EMPTY: Mapping[str, Any] = MappingProxyType({})
_overrides: ContextVar[Mapping[str, Any]] = ContextVar("astrai_overrides", default=_EMPTY)
_profiles: ContextVar[tuple[str, ...]] = ContextVar("astrai_profiles", default=())


def current_overrides() -> Mapping[str, Any]:
    """The ``op_backend`` overrides in force in this thread / task."""
    return _overrides.get()


def current_profiles() -> tuple[str, ...]:
    """The profiles activated in code (``use_profile``) for this thread / task, in order."""
    return _profiles.get()


def _validate(family: str, handle: Any) -> None:
    state = current()
    if family not in state.families:
        raise ValueError(f"Unknown family: {family!r}{did_you_mean(family, state.families)}; "
                         f"known families: {', '.join(sorted(state.families))}")
    if isinstance(handle, str):
        from astrai.dispatch.resolution import active_view

        names = active_view(state, family).row_names()
        if handle not in names:
            raise ValueError(f"Unknown {family} implementation: {handle!r}"
                             f"{did_you_mean(handle, names)}; rows: {', '.join(names)}")


def set_override(family: str, handle: Any) -> Token[Mapping[str, Any]]:
    """Select ``handle`` (a row name or an implementation object; ``None`` clears) for
    ``family`` in this context until ``reset_override(token)``."""
    if handle is not None:
        _validate(family, handle)
    merged = dict(_overrides.get())
    if handle is None:
        merged.pop(family, None)
    else:
        merged[family] = handle
    return _overrides.set(MappingProxyType(merged))


def get_override(family: str) -> Any:
    """The override for ``family`` in this context, or ``None``."""
    return _overrides.get().get(family)


def reset_override(token: Token[Mapping[str, Any]]) -> None:
    """Undo the ``set_override`` that returned ``token``."""
    _overrides.reset(token)


@contextmanager
def op_backend(**handles: Any) -> Iterator[None]:
    """Within the block, use these rows (or objects) per family: strict selection.

    ``with op_backend(attention="torch_native", rotary="torch"): ...``
    """
    for family, handle in handles.items():
        if handle is not None:
            _validate(family, handle)
    merged = dict(_overrides.get())
    for family, handle in handles.items():
        if handle is None:
            merged.pop(family, None)
        else:
            merged[family] = handle
    token = _overrides.set(MappingProxyType(merged))
    try:
        yield
    finally:
        _overrides.reset(token)


@contextmanager
def use_profile(*names: str) -> Iterator[None]:
    """Within the block, apply these profiles (after any from ``ASTR_OPS``), in order."""
    known = current().profiles
    for name in names:
        if name not in known:
            raise ValueError(f"Unknown profile: {name!r}{did_you_mean(name, known)}; "
                             f"known profiles: {', '.join(sorted(known)) or '(none)'}")
    token = _profiles.set((*_profiles.get(), *names))
    try:
        yield
    finally:
        _profiles.reset(token)
