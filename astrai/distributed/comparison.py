"""How the fingerprints of several ranks differ (``PlanDifference``), and the consensus
row per family that every rank can run."""

from __future__ import annotations

__all__ = [
    "PlanDifference",
    "consensus_rows",
    "differences",
    "failure_error",
    "rank_groups",
]

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from astrai.distributed.fingerprint import NOT_CHECKED, Fingerprint
from astrai.errors import PlanMismatchError

if TYPE_CHECKING:
    pass
# -- comparing fingerprints ----------------------------------------------------------

def _rank_list(ranks: Sequence[int]) -> str:
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    text = ",".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ",".join(map(str, run))
                    for run in runs)
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {text}"


@dataclass(frozen=True)
class PlanDifference:
    """One item on which ranks differ, with the ranks holding each value.

    ``kind``: ``table`` (a family's revision), ``plugins`` (the plugins whose rows the
    checked families hold, with their versions), ``profiles`` (the active profiles),
    ``lock`` (the decision lock in force, ``ASTR_LOCK``: its digest and mode),
    ``row`` (ranks resolve a call to different rows; consensus can settle it),
    ``call`` (a call failed, or was not checked, on some ranks), ``consensus`` (no row
    of a family that every rank can run for all its calls; values are candidate rows),
    ``format`` (a rank sent a fingerprint this version cannot read), ``failed`` (ranks
    that could not compute a plan at all; the value is their error), ``timeout`` and
    ``collective`` (this rank's wait for the others timed out, or the collective itself
    failed; the value says how, for this rank alone).
    """

    kind: str
    item: str
    values: tuple[tuple[str, tuple[int, ...]], ...]
    notes: tuple[str, ...] = ()

    def ranks_of(self, value: str) -> tuple[int, ...]:
        """The ranks that hold ``value`` (empty if none)."""
        return next((ranks for v, ranks in self.values if v == value), ())

    def __str__(self) -> str:
        if self.kind == "failed":
            lines = [f"{_rank_list(ranks)} could not compute "
                     f"{'its' if len(ranks) == 1 else 'their'} plan: {value}"
                     for value, ranks in self.values]
            return "\n".join([*lines, *(f"    {n}" for n in self.notes)])
        shown = "; ".join(f"{_rank_list(ranks)} -> {value}" for value, ranks in self.values)
        label = {
            "table": f"table {self.item}",
            "profiles": "active profiles",
            "plugins": "plugins (astrai.tables entry points) in the checked families",
            "consensus": f"{self.item}: no row every rank can run for all its {self.item} "
                         "calls (rows each rank can run)",
            "format": "fingerprint format",
            "lock": "decision lock (ASTR_LOCK digest and mode)",
        }.get(self.kind, self.item)
        return "\n".join([f"{label}: {shown}", *(f"    {n}" for n in self.notes)])


def rank_groups(values: Sequence[str], ranks: Sequence[int]) -> tuple[tuple[str, tuple[int, ...]],
                                                                   ...]:
    out: dict[str, list[int]] = {}
    for value, rank in zip(values, ranks, strict=True):
        out.setdefault(value, []).append(rank)
    return tuple((v, tuple(rs)) for v, rs in out.items())


def _profile_values(prints: Sequence[Fingerprint]) -> list[str]:
    names = [" + ".join(n for n, _ in p.profiles) or "(none)" for p in prints]
    full = [" + ".join(f"{n}@{rev}" for n, rev in p.profiles) or "(none)" for p in prints]
    return names if len(set(names)) == len(set(full)) else full


def _unavailable_notes(prints: Sequence[Fingerprint], ranks: Sequence[int], family: str,
                       rows: set[str]) -> tuple[str, ...]:
    notes = []
    for p, rank in zip(prints, ranks, strict=True):
        for fam, row, reason in p.unavailable:
            if fam == family and row in rows:
                notes.append(f"rank {rank} ({p.host}): {row} is unavailable ({reason})")
    return tuple(notes)


def differences(prints: Sequence[Fingerprint], ranks: Sequence[int]) -> list[PlanDifference]:
    """Every item on which the fingerprints (one per rank, in ``ranks`` order) differ."""
    diffs: list[PlanDifference] = []
    tables = [dict(p.tables) for p in prints]
    for family in sorted(set().union(*tables)):
        groups = rank_groups([t.get(family, NOT_CHECKED) for t in tables], ranks)
        if len(groups) > 1:
            diffs.append(PlanDifference("table", family,
                                        tuple((v if v.startswith("(") else f"revision {v}", rs)
                                              for v, rs in groups)))
    groups = rank_groups([", ".join(f"{d} {v}" for d, v in p.plugins) or "(none)" for p in prints],
                     ranks)
    if len(groups) > 1:
        diffs.insert(0, PlanDifference("plugins", "plugins", groups))
    groups = rank_groups([p.lock or "(none)" for p in prints], ranks)
    if len(groups) > 1:
        diffs.append(PlanDifference("lock", "lock", groups))
    groups = rank_groups(_profile_values(prints), ranks)
    if len(groups) > 1:
        diffs.append(PlanDifference("profiles", "profiles", groups))
    calls = [{c.key: c for c in p.calls} for p in prints]
    for key in sorted(set().union(*calls)):
        got = [c.get(key) for c in calls]
        values = [NOT_CHECKED if c is None else c.row if c.row is not None else f"error: {c.error}"
                  for c in got]
        groups = rank_groups(values, ranks)
        if len(groups) == 1:
            continue
        if any(c is None or c.row is None for c in got):
            diffs.append(PlanDifference("call", key, groups))
            continue
        family = next(c.family for c in got if c is not None)
        notes = _unavailable_notes(prints, ranks, family, set(values))
        diffs.append(PlanDifference("row", key, groups, notes))
    return diffs


def failure_error(diffs: Sequence[PlanDifference], n: int, extra: str = "", *,
             head: str = "") -> PlanMismatchError:
    head = head or (f"the {n} ranks of the process group would not run the same dispatch "
                    f"plan{extra}:")
    return PlanMismatchError("\n".join([head, *(f"  {d}" for d in diffs)]), diffs)


def consensus_rows(prints: Sequence[Fingerprint], ranks: Sequence[int],
               diffs: Sequence[PlanDifference]) -> dict[str, str]:
    """Per family with a ``row`` difference, the first row every rank can run for all of
    that family's calls; raises when some family has none."""
    family_of = {c.key: c.family for c in prints[0].calls}
    families = list(dict.fromkeys(family_of[d.item] for d in diffs))
    pinned: dict[str, str] = {}
    stuck: list[PlanDifference] = []
    for family in families:
        order = dict(prints[0].orders).get(family, ())
        usable = []
        for p in prints:
            sets = [set(c.candidates) for c in p.calls if c.family == family]
            usable.append(tuple(r for r in order if all(r in s for s in sets)))
        common = [r for r in order if all(r in u for u in usable)]
        if common:
            pinned[family] = common[0]
        else:
            stuck.append(PlanDifference("consensus", family, rank_groups(
                [", ".join(u) or "(none)" for u in usable], ranks)))
    if stuck:
        raise failure_error([*diffs, *stuck], len(ranks), ", and consensus found no common row")
    return pinned


