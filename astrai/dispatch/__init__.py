"""The dispatch engine: call contexts, specs, decision tables, resolution and explain.

Resolution order (contract §3) is ``PRECEDENCE``: explicit argument, ``op_backend``
scope, ``ASTR_OPS`` (or a legacy alias), profile forcing, the table's chain, the
fallback row.
"""

from __future__ import annotations

from typing import Any

from astrai.dispatch.axes import CallContext
from astrai.dispatch.environment import env_overrides, env_selection
from astrai.dispatch.explain import explain, explain_plan
from astrai.dispatch.expr.spec import Spec, parse_spec
from astrai.dispatch.precedence import PRECEDENCE, Source
from astrai.dispatch.registry import (
    assume_machine,
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
from astrai.dispatch.resolution import NoImplementationError, Resolution, resolve, resolve_plan
from astrai.dispatch.scopes import (
    current_overrides,
    current_profiles,
    get_override,
    op_backend,
    reset_override,
    set_override,
    use_profile,
)
from astrai.dispatch.stats import UsageStats, reset_stats, stats
from astrai.dispatch.tables.model import FamilyTable, ImplRecord, Unavailable
from astrai.env import OPS_ENV, TABLES_ENV
from astrai.errors import (
    AstraiError,
    ExplicitSelectionError,
    FileFormatError,
    LockDriftError,
    OutputPathError,
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
    "OutputPathError",
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
    "assume_machine",
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

#: What loads on first use, and from where: the workflows sit above the engine (it never
#: imports them), and most processes never need them (import time).
_ON_FIRST_USE = {
    "AgreedPlan": "distributed.agreement", "check_agreement": "distributed.agreement",
    "LockCheck": "lock.make", "check_lock": "lock.make", "lock_workload": "lock.make",
    "Lock": "lock.model",
    "Recording": "record.recording", "record": "record.recording",
    "RecordedCall": "record.workload", "Workload": "record.workload",
}


def __getattr__(name: str) -> Any:
    """Rank agreement, recording and locks are loaded on first use (import time)."""
    module = _ON_FIRST_USE.get(name)
    if module is not None:
        import importlib

        return getattr(importlib.import_module(f"astrai.{module}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
