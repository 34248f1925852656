"""``astrai-ops tune`` under ``torch.distributed``: many ranks, one decision.

Every rank measures the workload on its own (``tune.measure_workload``); then:

1. ``gather_timings``: each rank's measurements travel to every rank as JSON (through
   ``distributed``'s byte all-gather: no pickle); a rank that failed to measure sends its
   error instead, and every rank raises the same ``TuneError`` naming it;
2. ``combine``: one ``CallTiming`` per recorded call from all ranks' - a row's time is
   the **median across ranks** of its per-rank medians (its spread and each end of its
   interval the median of the ranks' own); a row excluded on any rank (numerics, an
   exception) or not a candidate on some rank is excluded on all, with the rank named; a
   call not tuned on some rank is not tuned anywhere. Every rank computes it from the
   same gathered bytes, in rank order, so every rank gets the same floats;
3. rank 0 alone buckets the combined timings and renders the profile document, and
   ``share_text`` hands its bytes to every rank: each rank writes exactly those bytes
   (the provenance carries rank 0's machine, its clock, and ``ranks: N``);
4. every rank loads and verifies the profile, ``agree`` all-gathers whether that worked
   (so a rank whose verification fails cannot leave the others waiting), and
   ``check_agreement`` under the profile confirms that all ranks now resolve every tuned
   call to the same row with the same profile revision.

``init_from_environment`` starts the process group from torchrun's variables when no group
is initialised yet.
"""

from __future__ import annotations

__all__ = ["agree", "combine", "gather_timings", "init_from_environment", "rank_and_world",
           "share_text"]

import json
import os
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from astrai.distributed.collective import all_gather_bytes, describe_failure
from astrai.record.workload import RecordedCall
from astrai.tune.measure import CallTiming, Timing
from astrai.tune.profile import TuneError

#: torchrun's variables; all present (and ``WORLD_SIZE`` > 1) means "start a group".
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size (``(0, 1)`` without a process group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_from_environment(environ: Mapping[str, str] | None = None) -> bool:
    """Start the default process group from torchrun's variables (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``) when none is initialised and ``WORLD_SIZE`` > 1:
    NCCL when CUDA is available (the device set from ``LOCAL_RANK``), else gloo. Returns
    whether it started one (the caller destroys it)."""
    import torch.distributed as dist

    env = os.environ if environ is None else environ
    if not dist.is_available() or dist.is_initialized():
        return False
    if not all(env.get(k) for k in TORCHRUN_ENV) or int(env["WORLD_SIZE"]) < 2:
        return False
    backend = "gloo"
    if torch.cuda.is_available() and dist.is_nccl_available():
        torch.cuda.set_device(int(env.get("LOCAL_RANK", "0")))
        backend = "nccl"
    dist.init_process_group(backend, init_method="env://")
    return True


def _gather_json(payload: Any, timeout: float | None) -> list[Any]:
    import torch.distributed as dist

    data = json.dumps(payload, separators=(",", ":"), sort_keys=True).encode("ascii")
    raw = all_gather_bytes(data, dist.get_world_size(), None, timeout)
    return [json.loads(r.decode("ascii")) for r in raw]


def _failed_ranks(gathered: Sequence[Any], what: str) -> None:
    """Raise ``TuneError`` naming every rank that sent ``{"failed": ...}``."""
    failed = [(r, g["failed"]) for r, g in enumerate(gathered)
              if isinstance(g, dict) and "failed" in g]
    if failed:
        lines = "\n  ".join(f"rank {r}: {why}" for r, why in failed)
        raise TuneError(f"{len(failed)} of the {len(gathered)} ranks failed {what}, so no "
                        f"rank writes a profile:\n  {lines}")


def _to_wire(timing: CallTiming) -> dict[str, Any]:
    return {"family": timing.call.family, "skipped": timing.skipped,
            "excluded": dict(timing.excluded), "shipped": timing.shipped,
            "busy": timing.busy,
            "timings": {r: [t.median_us, t.spread_us, t.low_us, t.high_us, t.samples]
                        for r, t in timing.timings.items()}}


def gather_timings(local: Sequence[CallTiming] | BaseException,
                   timeout: float | None = None) -> list[list[dict[str, Any]]]:
    """Every rank's measurements (wire form), in rank order; ``local`` is this rank's, or
    the exception it measured with (then every rank raises ``TuneError`` naming it)."""
    payload: Any = ({"failed": describe_failure(local)} if isinstance(local, BaseException)
                    else {"calls": [_to_wire(t) for t in local]})
    gathered = _gather_json(payload, timeout)
    _failed_ranks(gathered, "to measure the workload")
    calls = [g["calls"] for g in gathered]
    if len({len(c) for c in calls}) > 1 or any(
            len({c[i]["family"] for c in calls}) > 1 for i in range(len(calls[0]))):
        sizes = ", ".join(f"rank {r}: {len(c)} calls" for r, c in enumerate(calls))
        raise TuneError(f"the ranks tuned different workloads ({sizes}): give every rank "
                        f"the same workload file")
    return calls


def combine(calls: Sequence[RecordedCall], per_rank: Sequence[Sequence[Mapping[str, Any]]]
            ) -> list[CallTiming]:
    """One ``CallTiming`` per call from every rank's (module docstring, step 2)."""
    out = []
    for i, call in enumerate(calls):
        ranks = [r[i] for r in per_rank]
        skipped = [(n, r["skipped"]) for n, r in enumerate(ranks) if r["skipped"] is not None]
        if skipped:
            out.append(CallTiming(call, skipped="; ".join(f"rank {n}: {why}"
                                                          for n, why in skipped), index=i))
            continue
        result = CallTiming(call, index=i, shipped=ranks[0].get("shipped"),
                            busy=any(r.get("busy", False) for r in ranks))
        rows = list(dict.fromkeys(row for r in ranks
                                  for row in [*r["timings"], *r["excluded"]]))
        for row in rows:
            why = [f"rank {n}: {r['excluded'][row]}" for n, r in enumerate(ranks)
                   if row in r["excluded"]]
            why += [f"rank {n}: not a candidate there" for n, r in enumerate(ranks)
                    if row not in r["excluded"] and row not in r["timings"]]
            if why:
                result.excluded[row] = "; ".join(why)
                continue
            figures = [r["timings"][row] for r in ranks]
            median, spread, low, high = (statistics.median(float(f[k]) for f in figures)
                                         for k in range(4))
            result.timings[row] = Timing(median, spread, low, high,
                                         min(int(f[4]) for f in figures))
        out.append(result)
    return out


def share_text(text: str | BaseException | None, timeout: float | None = None) -> str:
    """Rank 0's ``text`` on every rank (the other ranks pass ``None``). When rank 0 passes
    an exception (it could not build the profile), every rank raises ``TuneError``."""
    payload: Any = ({"failed": describe_failure(text)} if isinstance(text, BaseException)
                    else {"text": text})
    gathered = _gather_json(payload, timeout)
    _failed_ranks(gathered, "to build the profile")
    shared = gathered[0].get("text")
    if not isinstance(shared, str):
        raise TuneError("rank 0 sent no profile")
    return shared


def agree(error: BaseException | None, what: str, timeout: float | None = None) -> None:
    """All-gather whether each rank succeeded at ``what``; every rank raises ``TuneError``
    naming the ranks that did not (this rank's own error as ``__cause__``)."""
    payload = {"failed": describe_failure(error)} if error is not None else {"ok": True}
    gathered = _gather_json(payload, timeout)
    try:
        _failed_ranks(gathered, what)
    except TuneError as exc:
        raise exc from error

