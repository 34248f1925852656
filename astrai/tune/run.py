"""``astrai-ops tune WORKLOAD -o tuned.yaml``: measure, write the profile, verify it, report.

``tune_workload`` checks where the profile goes (before measuring anything), measures
every recorded call (``astrai.tune.measure``) at the torch thread count asked for,
watching whether the machine is quiet (``astrai.tune.noise``), buckets the winners and
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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from astrai.dispatch.machine import this_machine
from astrai.dispatch.names import NAME_PATTERN
from astrai.dispatch.registry import Registry, current, load_tables
from astrai.dispatch.scopes import use_profile
from astrai.distributed.agreement import AgreedPlan, check_agreement
from astrai.formats.common import atomic_write, not_an_input
from astrai.record.workload import Workload, now_utc
from astrai.tune.measure import CallTiming, measure_workload
from astrai.tune.noise import Noise, NoiseMonitor
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

#: What a sample times, as the profile's provenance states it.
TIMED = ("wall-clock time per forward call (in grad mode: with autograd recording, no "
         "backward pass)")
#: Seconds of extra rounds, for the whole workload, where the figures cannot tell yet.
DEFAULT_BUDGET_S = 20.0


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
    noise: Noise | None = None
    threads: int = 0

    def excluded(self) -> list[str]:
        """One line per row excluded from a call (numerics, its inputs or an error), and
        per call not tuned, each naming the call's place in the workload."""
        lines = []
        source = self.document.get("provenance", {}).get("workload", "")
        for t in self.timings:
            label = f"{t.where}{f' of {source}' if source else ''} {_sizes(t.call.axes)}"
            label = label.rstrip()
            if t.skipped is not None:
                lines.append(f"not tuned: {label}: {t.skipped}")
            lines += [f"excluded {t.call.family}.{row} on {label}: {why}"
                      for row, why in t.excluded.items()]
        return lines

    def summary(self) -> str:
        """Per family and bucket: calls, winner with its time and 95% interval, the
        runner-up's, and why the winner won (``faster`` beyond the noise; ``shipped``,
        ``tie`` or ``cannot tell``: the shipped row stays); then whether the machine was
        quiet."""
        lines = [f"{'family':<10} {'calls':>5}  {'winner':<14} {'us':>9} {'95% interval':>17}  "
                 f"{'next':<14} {'us':>9} {'95% interval':>17}  {'verdict':<12} bucket"]
        for b in self.buckets:
            figures = b.table()
            table = sorted(figures.items(), key=lambda kv: kv[1].median_us)
            win = figures[b.winner]
            nxt = next(((r, t) for r, t in table if r != b.winner), None)
            calls = sum(t.call.count for t in b.calls)
            lines.append(f"{b.family:<10} {calls:>5}  {b.winner:<14} {win.median_us:>9.1f} "
                         f"{_interval(win.low_us, win.high_us):>17}  "
                         f"{nxt[0] if nxt else '-':<14} "
                         f"{nxt[1].median_us if nxt else float('nan'):>9.1f} "
                         f"{_interval(nxt[1].low_us, nxt[1].high_us) if nxt else '':>17}  "
                         f"{', '.join(b.verdicts):<12} {b.condition}")
        lines.append(f"timed: {TIMED}, {self.threads} torch threads")
        if self.noise is not None:
            if self.noise.quiet:
                lines.append("machine: quiet while measuring")
            else:
                lines.append("machine: NOT quiet while measuring - "
                             + "; ".join(self.noise.reasons())
                             + ". The figures include waiting for the CPU; where they cannot "
                               "separate rows the shipped order stays (tie / cannot tell). "
                               "Tune again on a quiet machine to trust them.")
        return "\n".join(lines)


def _interval(low: float, high: float) -> str:
    return f"[{low:.1f}, {high:.1f}]"


_SIZE_AXES = ("fwd", "batch", "q_len", "kv_len", "tokens", "in_features", "out_features",
              "head_dim", "grad_enabled")


def _sizes(axes: Any) -> str:
    return " ".join(f"{a}={axes[a]}" for a in _SIZE_AXES if axes.get(a) is not None)


@contextmanager
def _threads(n: int | None) -> Iterator[int]:
    """Within the block, torch's intra-op thread count is ``n`` (unchanged when ``None``);
    yields the count in force."""
    before = torch.get_num_threads()
    if n is not None:
        if n < 1:
            raise TuneError(f"--threads must be at least 1, got {n}")
        torch.set_num_threads(n)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def check_output(path: Path, workload: str = "") -> None:
    """Refuse, before anything is measured, an output path the profile cannot be
    written to: a directory, a file in a directory that is missing or read-only, or the
    workload file itself (``workload``, when it names a file)."""
    if workload and Path(workload).is_file():
        not_an_input(path, workload)
    if path.is_dir():
        raise TuneError(f"-o {path}: that is a directory; name the profile file to write, "
                        f"e.g. {path / 'tuned.yaml'}")
    parent = path.parent
    if not parent.is_dir():
        raise TuneError(f"-o {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise TuneError(f"-o {path}: the directory {parent} is not writable")
    if path.exists() and not os.access(path, os.W_OK):
        raise TuneError(f"-o {path}: the file exists and is not writable")


def tune_workload(workload: Workload, output: str | os.PathLike[str], *, rounds: int = 7,
                  allow_nonfaithful: bool = False, source: str = "",
                  progress: bool | None = None, budget: float = DEFAULT_BUDGET_S,
                  threads: int | None = None) -> Tuned:
    """Measure ``workload``, write the tuned profile to ``output`` (its name: the file's
    stem), load it and verify it (module docstring). ``budget``: seconds of extra rounds
    where the figures cannot tell yet; ``threads``: torch's intra-op threads while
    measuring (default: as now)."""
    path = Path(output)
    name = path.stem
    state = current()
    rank, world = rank_and_world()
    if world > 1:
        with _threads(threads) as count:
            return _tune_ranks(workload, path, state, rank, world, rounds=rounds,
                               allow_nonfaithful=allow_nonfaithful, source=source,
                               progress=progress if rank == 0 else False, budget=budget,
                               threads=count)
    _check_name(name, state)
    check_output(path, source)
    monitor = NoiseMonitor()
    with _threads(threads) as count:
        monitor.start()
        timings = measure_workload(workload, rounds=rounds, allow_nonfaithful=allow_nonfaithful,
                                   progress=progress, budget=budget, monitor=monitor)
        noise = monitor.finish(_widths(timings), sum(t.busy for t in timings))
    buckets = buckets_of(timings, state)
    provenance = _provenance(source, rounds, 1, count, budget, noise)
    doc = profile_document(name, buckets, provenance, state)
    write_profile(path, doc)
    load_tables(path)
    verify(name, buckets)
    return Tuned(name, path, tuple(timings), tuple(buckets), doc, tuple(timings),
                 noise=noise, threads=count)


def _widths(timings: list[CallTiming]) -> list[float]:
    """Every timed row's relative interval width (what ``Noise.width`` summarises)."""
    return [t.interval.relative_width for c in timings for t in c.timings.values()
            if t.samples > 1]


def _provenance(source: str, rounds: int, ranks: int, threads: int, budget: float,
                noise: Noise | None) -> dict[str, Any]:
    got: dict[str, Any] = {"machine": this_machine().as_dict(), "tuned": now_utc(),
                           "workload": source, "rounds": rounds, "ranks": ranks,
                           "threads": threads, "timed": TIMED, "budget_s": float(budget)}
    if noise is not None:
        got["noise"] = noise.as_dict()
    return got


def _tune_ranks(workload: Workload, path: Path, state: Registry, rank: int, world: int, *,
                rounds: int, allow_nonfaithful: bool, source: str,
                progress: bool | None, budget: float, threads: int) -> Tuned:
    """``tune_workload`` on every rank of the default process group (``astrai.tune.ranks``):
    a collective, every step of which every rank joins even when its own part failed.
    The profile is named after rank 0's output file on every rank."""
    name = path.stem
    local: list[CallTiming] | Exception
    try:
        if rank == 0:  # only rank 0's name counts; a bad one fails every rank, in the gather
            _check_name(name, state)
            check_output(path, source)
        local = measure_workload(workload, rounds=rounds, allow_nonfaithful=allow_nonfaithful,
                                 progress=progress, budget=budget)
    except Exception as exc:  # the others learn of it in the gather instead of hanging
        local = exc
    timings = combine(workload.calls, gather_timings(local))
    assert not isinstance(local, Exception)  # gather_timings raised on every rank
    buckets: list[Bucket] = []
    mine: str | Exception | None = None
    if rank == 0:
        try:
            buckets = buckets_of(timings, state)
            provenance = _provenance(source, rounds, world, threads, budget, None)
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
    return Tuned(name, path, tuple(timings), tuple(buckets), doc, tuple(local), world, plan,
                 threads=threads)


def _check_name(name: str, state: Registry | None = None) -> None:
    if not re.fullmatch(NAME_PATTERN, name):
        raise TuneError(f"the profile is named after its file, and {name!r} is not a valid "
                        f"profile name (letters, digits, '_', '.', '-'; not starting with a "
                        f"digit)")
    shipped = (state or current()).profiles.get(name)
    if shipped is not None and _is_shipped(shipped.file):
        raise TuneError(f"the profile is named after its file, and {name!r} is a profile "
                        f"astrai ships ({shipped.source}): loaded after it, the tuned one "
                        f"would replace it for everyone who asks for {name!r}; name the file "
                        f"otherwise (e.g. tuned-{name}.yaml)")


def _is_shipped(file: str) -> bool:
    """Whether a profile's file is one of the shipped tables."""
    from astrai.dispatch.tables.artifact import shipped_tables_dir

    try:
        return Path(file).resolve().is_relative_to(shipped_tables_dir().resolve())
    except (OSError, ValueError):
        return False
