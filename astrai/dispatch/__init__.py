"""The dispatch engine: call contexts, specs, decision tables, resolution and explain.

Resolution order (SPEC §3) is ``PRECEDENCE``: explicit argument, ``op_backend``
scope, ``ASTR_OPS`` (or a legacy alias), profile forcing, the table's chain, the
fallback row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from astrai.dispatch.axes import CallContext
from astrai.dispatch.expr.spec import Spec, parse_spec
from astrai.dispatch.registry import (
    TABLES_ENV,
    current,
    list_families,
    list_profiles,
    load_tables,
    refresh,
    register_env_alias,
    register_family,
    register_impl,
    reload_tables,
    shipped_tables_dir,
    unregister_impl,
)
from astrai.dispatch.resolution import (
    NoImplementationError,
    Resolution,
    explain,
    explain_plan,
    resolve,
    resolve_plan,
)
from astrai.dispatch.sources import (
    OPS_ENV,
    PRECEDENCE,
    Source,
    current_overrides,
    current_profiles,
    env_overrides,
    env_selection,
    get_override,
    op_backend,
    reset_override,
    set_override,
    use_profile,
)
from astrai.dispatch.stats import UsageStats, reset_stats, stats
from astrai.dispatch.tables.model import FamilyTable, ImplRecord, Unavailable
from astrai.errors import (
    AstraiError,
    ExplicitSelectionError,
    FileFormatError,
    LockDriftError,
    PlanMismatchError,
    ScopeError,
    SpecSyntaxError,
    TableError,
    TableProblem,
    UnknownFamilyError,
)

__all__ = [
    "OPS_ENV",
    "PRECEDENCE",
    "TABLES_ENV",
    "AgreedPlan",
    "AstraiError",
    "CallContext",
    "ExplicitSelectionError",
    "FamilyTable",
    "FileFormatError",
    "ImplRecord",
    "Lock",
    "LockCheck",
    "LockDriftError",
    "NoImplementationError",
    "PlanMismatchError",
    "RecordedCall",
    "Recording",
    "Resolution",
    "ScopeError",
    "Source",
    "Spec",
    "SpecSyntaxError",
    "TableError",
    "TableProblem",
    "Unavailable",
    "UnknownFamilyError",
    "UsageStats",
    "Workload",
    "check_agreement",
    "check_lock",
    "current",
    "current_overrides",
    "current_profiles",
    "env_overrides",
    "env_selection",
    "explain",
    "explain_plan",
    "get_override",
    "list_families",
    "list_profiles",
    "load_tables",
    "lock_workload",
    "op_backend",
    "parse_spec",
    "record",
    "refresh",
    "register_env_alias",
    "register_family",
    "register_impl",
    "reload_tables",
    "reset_override",
    "reset_stats",
    "resolve",
    "resolve_plan",
    "set_override",
    "shipped_tables_dir",
    "stats",
    "unregister_impl",
    "use_profile",
]

if TYPE_CHECKING:
    from astrai.dispatch.distributed import AgreedPlan, check_agreement
    from astrai.dispatch.lock import LockCheck, check_lock, lock_workload
    from astrai.dispatch.lockfile import Lock
    from astrai.dispatch.recording import Recording, record
    from astrai.dispatch.workload import RecordedCall, Workload

#: What loads on first use, and from where: most processes never need it (import time).
_ON_FIRST_USE = {
    "AgreedPlan": "distributed", "check_agreement": "distributed",
    "LockCheck": "lock", "check_lock": "lock", "lock_workload": "lock",
    "Lock": "lockfile",
    "Recording": "recording", "record": "recording",
    "RecordedCall": "workload", "Workload": "workload",
}


def __getattr__(name: str) -> Any:
    """Rank agreement, recording and locks are loaded on first use (import time)."""
    module = _ON_FIRST_USE.get(name)
    if module is not None:
        import importlib

        return getattr(importlib.import_module(f"astrai.dispatch.{module}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
