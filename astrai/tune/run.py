"""``astrai-ops tune WORKLOAD -o tuned.yaml``: measure, write the profile, verify it, report.

``tune_workload`` measures every recorded call (``tune``), buckets the winners and
writes the profile (``astrai.tune.profile``) with its provenance (``provenance``), loads it
(``load_tables``) and checks that every tuned call resolves to its bucket's winner
(``TuneError`` otherwise). Under ``torch.distributed`` every rank measures, the
timings are combined (median across ranks) and every rank writes, loads and verifies
rank 0's profile, byte for byte, then ``check_agreement`` confirms the plan
(``astrai.tune.ranks``). ``write_report`` writes the timing table as markdown and,
when matplotlib is installed, a PNG of each row's time per bucket (``astrai.tune.report``).
"""

from __future__ import annotations

__all__ = ["Tuned", "tune_workload"]

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from astrai.dispatch.machine import this_machine
from astrai.dispatch.names import NAME_PATTERN
from astrai.dispatch.registry import Registry, current, load_tables
from astrai.dispatch.scopes import use_profile
from astrai.distributed.agreement import AgreedPlan, check_agreement
from astrai.formats.common import atomic_write
from astrai.record.workload import Workload, now_utc
from astrai.tune.measure import CallTiming, measure_workload
from astrai.tune.profile import (
    Bucket,
    TuneError,
    buckets_of,
    profile_document,
    profile_text,
    verify,
    write_profile,
)
from astrai.tune.ranks import agree, combine, gather_timings, rank_and_world, share_text


@dataclass(frozen=True)
class Tuned:
    """What ``tune_workload`` did: the measurements, the buckets, the profile written.

    Under ``torch.distributed``: ``timings`` are the combined ones (median across ranks),
    ``local`` this rank's own, ``ranks`` the world size and ``plan`` what
    ``check_agreement`` confirmed under the profile (``None`` on one rank)."""

    name: str
    path: Path
    timings: tuple[CallTiming, ...]
    buckets: tuple[Bucket, ...]
    document: dict[str, Any]
    local: tuple[CallTiming, ...] = ()
    ranks: int = 1
    plan: AgreedPlan | None = None

    def excluded(self) -> list[str]:
        """One line per row excluded from a call (numerics or an error), and per call
        not tuned."""
        lines = []
        for t in self.timings:
            label = f"{t.call.family} {_sizes(t.call.axes)}"
            if t.skipped is not None:
                lines.append(f"not tuned: {label}: {t.skipped}")
            lines += [f"excluded {t.call.family}.{row} on {label}: {why}"
                      for row, why in t.excluded.items()]
        return lines

    def summary(self) -> str:
        """Per family and bucket: calls, winner, its time and the runner-up's."""
        lines = [f"{'family':<10} {'calls':>5}  {'winner':<14} {'us':>9}  {'next':<14} "
                 f"{'us':>9}  bucket"]
        for b in self.buckets:
            table = sorted(b.table().items(), key=lambda kv: kv[1].median_us)
            win = b.table()[b.winner]
            nxt = next(((r, t) for r, t in table if r != b.winner), None)
            calls = sum(t.call.count for t in b.calls)
            lines.append(f"{b.family:<10} {calls:>5}  {b.winner:<14} {win.median_us:>9.1f}  "
                         f"{nxt[0] if nxt else '-':<14} "
                         f"{nxt[1].median_us if nxt else float('nan'):>9.1f}  {b.condition}")
        return "\n".join(lines)


_SIZE_AXES = ("fwd", "batch", "q_len", "kv_len", "tokens", "in_features", "out_features",
              "head_dim", "grad_enabled")


def _sizes(axes: Any) -> str:
    return " ".join(f"{a}={axes[a]}" for a in _SIZE_AXES if axes.get(a) is not None)


def tune_workload(workload: Workload, output: str | os.PathLike[str], *, rounds: int = 7,
                  allow_nonfaithful: bool = False, source: str = "",
                  progress: bool | None = None) -> Tuned:
    """Measure ``workload``, write the tuned profile to ``output`` (its name: the file's
    stem), load it and verify it (module docstring)."""
    path = Path(output)
    name = path.stem
    state = current()
    rank, world = rank_and_world()
    if world > 1:
        return _tune_ranks(workload, path, state, rank, world, rounds=rounds,
                           allow_nonfaithful=allow_nonfaithful, source=source,
                           progress=progress if rank == 0 else False)
    _check_name(name)
    timings = measure_workload(workload, rounds=rounds, allow_nonfaithful=allow_nonfaithful,
                               progress=progress)
    buckets = buckets_of(timings, state)
    provenance = {"machine": this_machine().as_dict(), "tuned": now_utc(),
                  "workload": source, "rounds": rounds, "ranks": 1}
    doc = profile_document(name, buckets, provenance, state)
    write_profile(path, doc)
    load_tables(path)
    verify(name, buckets)
    return Tuned(name, path, tuple(timings), tuple(buckets), doc, tuple(timings))


def _tune_ranks(workload: Workload, path: Path, state: Registry, rank: int, world: int, *,
                rounds: int, allow_nonfaithful: bool, source: str,
                progress: bool | None) -> Tuned:
    """``tune_workload`` on every rank of the default process group (``astrai.tune.ranks``):
    a collective, every step of which every rank joins even when its own part failed.
    The profile is named after rank 0's output file on every rank."""
    name = path.stem
    local: list[CallTiming] | Exception
    try:
        if rank == 0:  # only rank 0's name counts; a bad one fails every rank, in the gather
            _check_name(name)
        local = measure_workload(workload, rounds=rounds, allow_nonfaithful=allow_nonfaithful,
                                 progress=progress)
    except Exception as exc:  # the others learn of it in the gather instead of hanging
        local = exc
    timings = combine(workload.calls, gather_timings(local))
    assert not isinstance(local, Exception)  # gather_timings raised on every rank
    buckets: list[Bucket] = []
    mine: str | Exception | None = None
    if rank == 0:
        try:
            buckets = buckets_of(timings, state)
            provenance = {"machine": this_machine().as_dict(), "tuned": now_utc(),
                          "workload": source, "rounds": rounds, "ranks": world}
            mine = profile_text(path, profile_document(name, buckets, provenance, state))
        except Exception as exc:
            mine = exc
    text = share_text(mine)
    doc = yaml.safe_load(text)
    name = doc["profile"]  # rank 0's file's stem: one profile name on every rank
    error: Exception | None = None
    try:
        if rank != 0:  # the same buckets from the same timings, unless the tables differ
            buckets = buckets_of(timings, state)
        atomic_write(path, text)
        load_tables(path)
        verify(name, buckets)
    except Exception as exc:
        error = exc
    agree(error, "to write, load and verify the profile")
    with use_profile(name):
        plan = check_agreement([t.call.context() for b in buckets for t in b.calls])
    return Tuned(name, path, tuple(timings), tuple(buckets), doc, tuple(local), world, plan)


def _check_name(name: str) -> None:
    if not re.fullmatch(NAME_PATTERN, name):
        raise TuneError(f"the profile is named after its file, and {name!r} is not a valid "
                        f"profile name (letters, digits, '_', '.', '-'; not starting with a "
                        f"digit)")
