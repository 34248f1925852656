"""Names in tables: what a row, family or profile name may be (one rule for the YAML
loader and ``register_family``). Imports nothing heavy: the registry uses it at load."""

from __future__ import annotations

__all__ = ["NAME_PATTERN", "RESERVED_FAMILY_NAMES", "family_name_problem"]

import re

NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_.\-]*$"
#: ``ASTR_OPS`` takes ``profile=...`` for profiles, so no family can be named that.
RESERVED_FAMILY_NAMES = frozenset({"profile"})


def family_name_problem(name: object) -> str | None:
    """Why ``name`` cannot name a family, or ``None`` when it can."""
    if not isinstance(name, str) or not re.fullmatch(NAME_PATTERN, name):
        return (f"{name!r} is not a family name: a letter or '_' first, then letters, "
                f"digits, '_', '.' or '-'")
    if name in RESERVED_FAMILY_NAMES:
        return (f"{name!r} cannot name a family: ASTR_OPS reads 'profile=...' as the "
                f"profiles to apply, so such a family could never be selected there")
    return None
