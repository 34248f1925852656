"""Plan agreement across the ranks of a ``torch.distributed`` job.

``check_agreement(contexts)`` resolves the given calls on this rank exactly as
``resolve`` would (tables, active profiles, ``ASTR_OPS``, ``op_backend`` scope),
all-gathers a fingerprint of the result over the process group, and raises
``PlanMismatchError`` on every rank when the ranks would not run the same rows.
With ``consensus=True`` a family whose rows differ is instead pinned, on every
rank, to the first row in table order that every rank can run for every one of
that family's calls; apply it with ``with plan.apply(): ...``.

Without an initialized process group the check runs as a world of one rank, so
a script may call it unconditionally.

A rank that cannot compute its own plan (a bad argument, broken tables on that node,
any other exception) still takes part in the collective: it sends its error instead of
a fingerprint, and every rank raises the same ``PlanMismatchError`` naming it, instead
of leaving the others waiting for the process group's timeout. ``timeout=`` bounds the
wait for the other ranks (a rank that never calls ``check_agreement``).

The fingerprints travel as JSON text in ``uint8`` tensors (``all_gather`` of the lengths,
then of the padded bytes): no pickle, so no rank unpickles another's bytes, and no NumPy,
which ``all_gather_object`` needs and a plain ``pip install torch`` does not install.
"""

from __future__ import annotations

__all__ = [
    "AgreedPlan",
    "check_agreement",
]

import hashlib
import json
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import timedelta
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from astrai.dispatch.scopes import op_backend
from astrai.distributed.collective import failed_payload, failed_text, gather_payloads, seconds_of
from astrai.distributed.comparison import (
    PlanDifference,
    consensus_rows,
    differences,
    failure_error,
    rank_groups,
)
from astrai.distributed.fingerprint import Contexts, Fingerprint, local_plan
from astrai.errors import PlanMismatchError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
# -- the result -------------------------------------------------------

@dataclass(frozen=True)
class AgreedPlan:
    """What every rank of the group runs for the checked calls.

    ``rows`` maps each call's label (``call_key``) to its row; ``overrides`` maps a
    family to the row consensus pinned (empty when the ranks already agreed). The pin
    takes effect only within ``with plan.apply():``.
    """

    ranks: tuple[int, ...]
    rank: int
    fingerprint: Fingerprint
    rows: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    overrides: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def world_size(self) -> int:
        """How many ranks took part."""
        return len(self.ranks)

    @property
    def digest(self) -> str:
        """A short hash of the agreed plan (tables, profiles, rows), equal on every rank."""
        text = json.dumps([self.fingerprint.tables, self.fingerprint.profiles,
                           sorted(self.rows.items())])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def apply(self) -> AbstractContextManager[None]:
        """``op_backend(**overrides)``: the consensus rows, strictly, within the block."""
        return op_backend(**self.overrides)

    def summary(self) -> str:
        """Lines for a log: the digest, the profiles, and each call's row."""
        profiles = " + ".join(n for n, _ in self.fingerprint.profiles) or "(none)"
        lines = [f"astrai plan {self.digest} agreed by {self.world_size} rank(s); "
                 f"profiles: {profiles}"]
        family_of = {c.key: c.family for c in self.fingerprint.calls}
        for key, row in sorted(self.rows.items()):
            pinned = " (consensus)" if family_of.get(key) in self.overrides else ""
            lines.append(f"  {key} -> {row}{pinned}")
        return "\n".join(lines)


def _unusable(gathered: Sequence[Any], prints: Sequence[Fingerprint | None],
              ranks: Sequence[int]) -> PlanMismatchError | None:
    """The error every rank raises when some rank sent an error or an unreadable payload
    instead of a fingerprint (``None`` when all are fingerprints)."""
    failed = [failed_text(g) for g in gathered]
    if not any(f is not None for f in failed) and all(p is not None for p in prints):
        return None
    n = len(ranks)
    diffs: list[PlanDifference] = []
    for text, group_ranks in rank_groups([f or "" for f in failed], ranks):
        if not text:
            continue
        hosts = [str(g.get("host", "?")) for g, f in zip(gathered, failed, strict=True)
                 if f == text]
        notes = tuple(f"rank {r} runs on {h}" for r, h in zip(group_ranks, hosts, strict=True))
        diffs.append(PlanDifference("failed", "plan", ((text, group_ranks),), notes))
    unreadable = [p is None and f is None for p, f in zip(prints, failed, strict=True)]
    if any(unreadable):
        versions = [str(g.get("version", "?")) if isinstance(g, dict) else "?" for g in gathered]
        values = [f"{'unreadable' if bad else 'readable'} (astrai {v})"
                  for bad, v in zip(unreadable, versions, strict=True)]
        diffs.append(PlanDifference("format", "format", rank_groups(values, ranks)))
    count = sum(f is not None for f in failed)
    if not count:
        return failure_error(diffs, n)
    head = (f"{count} of the {n} ranks of the process group could not compute a dispatch "
            f"plan, so the plans cannot be compared:")
    return failure_error(diffs, n, head=head)


def check_agreement(contexts: Contexts, group: ProcessGroup | None = None, *,
                    consensus: bool = False,
                    timeout: float | timedelta | None = None) -> AgreedPlan:
    """Check that every rank of ``group`` (default: the whole job) would run the same rows.

    ``contexts`` is ``{family: CallContext}`` or any iterable of contexts (several per
    family allowed, e.g. prefill and decode). Each rank resolves them as ``resolve``
    would there, and a fingerprint (table revisions, active profiles, the row per
    call) is all-gathered; a collective, so call it on every rank of the group. Raises
    ``PlanMismatchError`` on every rank when they differ. With ``consensus=True``, rows
    that differ are settled instead: each such family gets the first row, in table
    order, that every rank can run for all its calls (``AgreedPlan.overrides``; apply
    with ``with plan.apply():``). Differing tables or profiles, a call that fails on
    some rank, or a family without a common row still raise. A call that fails alike
    on every rank re-raises its error. Without a process group this is a world of one.
    With NCCL, set each rank's CUDA device first (the gathered tensors live on
    ``torch.cuda.current_device()``).

    A rank that cannot compute its plan at all (``contexts`` holds something that is
    not a ``CallContext``, its tables fail to load, any other ``Exception``) still joins
    the all-gather, sending its error instead of a fingerprint; every rank then raises
    the same ``PlanMismatchError``, e.g. ``rank 1 could not compute its plan:
    TableError: ...`` (on the failing rank with its own error as ``__cause__``), rather
    than the other ranks waiting for the process group's timeout. When every rank fails
    with the same error, each re-raises its own error instead.

    ``timeout`` (seconds, or a ``datetime.timedelta``; default ``None``: the process
    group's own timeout, 30 minutes unless set) bounds how long this rank waits for the
    others in the all-gather (a rank that never calls ``check_agreement``, or calls it
    much later). When it passes, this rank raises ``PlanMismatchError`` naming the
    all-gather and the time waited; the collective is left pending, so the process
    group is not usable after that (destroy it, or exit). The other ranks need not pass
    the same ``timeout``. The collectives are issued with ``async_op=True`` and waited
    for with the backend's ``Work.wait(timeout)`` (tested with gloo; with NCCL, the first
    collective of a group also creates its communicator, a wait that this timeout may
    not bound). An error of the collective itself (say a rank exited) raises
    ``PlanMismatchError`` too, with the backend's error as ``__cause__``.
    """
    local_error: Exception | None = None
    seconds: float | None = None
    mine: Fingerprint | None = None
    errors: dict[str, Exception] = {}
    try:  # never leave before the collective: this rank's failure is data for the others
        seconds = seconds_of(timeout)
        mine, errors = local_plan(contexts)
        payload = mine.to_wire()
    except Exception as failure:
        local_error, mine = failure, None
        payload = failed_payload(failure)
    gathered, ranks, index = gather_payloads(payload, group, seconds)
    prints = [Fingerprint.from_wire(g) for g in gathered]
    if local_error is not None and all(failed_text(g) == payload["failed"] for g in gathered):
        raise local_error  # the same failure on every rank: the caller's own error is clearer
    problem = _unusable(gathered, prints, ranks)
    if problem is not None:
        raise problem from local_error
    assert mine is not None  # local_error is None, else _unusable reported this rank
    readable = [p for p in prints if p is not None]
    diffs = differences(readable, ranks)
    pinned: dict[str, str] = {}
    if diffs:
        if not consensus:
            raise failure_error(diffs, len(ranks))
        if any(d.kind != "row" for d in diffs):
            raise failure_error(diffs, len(ranks),
                                ", and consensus cannot settle differing tables, "
                                "profiles, plugins or failed calls")
        pinned = consensus_rows(readable, ranks, diffs)
    for exc in errors.values():
        raise exc  # the same failure on every rank: the caller's own error is clearer
    rows = {c.key: pinned.get(c.family, c.row) for c in mine.calls if c.row is not None}
    return AgreedPlan(ranks, ranks[index], mine, MappingProxyType(rows),
                      MappingProxyType(pinned))

