"""``astrai-ops tune WORKLOAD -o tuned.yaml``: measure, write the profile, verify it, report.

``tune_workload`` measures every recorded call (``tune``), buckets the winners and
writes the profile (``tuned_profile``) with its provenance (``provenance``), loads it
(``load_tables``) and checks that every tuned call resolves to its bucket's winner
(``TuneError`` otherwise). Under ``torch.distributed`` every rank measures, the
timings are combined (median across ranks) and every rank writes, loads and verifies
rank 0's profile, byte for byte, then ``check_agreement`` confirms the plan
(``tune_ranks``). ``write_report`` writes the timing table as markdown and,
when matplotlib is installed, a PNG of each row's time per bucket.
"""

from __future__ import annotations

__all__ = ["Tuned", "render_table", "tune_workload", "write_report"]

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from astrai.dispatch.distributed import AgreedPlan, check_agreement
from astrai.dispatch.machine import this_machine
from astrai.dispatch.names import NAME_PATTERN
from astrai.dispatch.registry import Registry, current, load_tables
from astrai.dispatch.sources import use_profile
from astrai.dispatch.tables.format import schemas_dir
from astrai.dispatch.tune import CallTiming, measure_workload
from astrai.dispatch.tune_ranks import agree, combine, gather_timings, rank_and_world, share_text
from astrai.dispatch.tuned_profile import Bucket, TuneError, buckets_of, profile_document, verify
from astrai.dispatch.workload import Workload, now_utc


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
    """``tune_workload`` on every rank of the default process group (``tune_ranks``):
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
        _write_atomically(path, text)
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


def profile_text(path: Path, doc: dict[str, Any]) -> str:
    """A profile document as the file's text: a head of comments (the families, how to
    activate it, the schema for editors), then the YAML."""
    text = yaml.safe_dump(doc, sort_keys=False, width=100)
    head = (f"# astrai tuned profile: {sum(1 for _ in doc['families'])} families\n"
            f"# activate: ASTR_TABLES={path} ASTR_OPS=profile={doc['profile']}\n"
            f"# yaml-language-server: $schema={schemas_dir() / 'profile.schema.json'}\n")
    return head + text


def write_profile(path: Path, doc: dict[str, Any]) -> None:
    """Write a profile document as YAML, with a schema line for editors."""
    _write_atomically(path, profile_text(path, doc))


def _write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to a file beside ``path``, then rename it over ``path``: ranks that
    share a directory never read a half-written profile."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def render_table(tuned: Tuned) -> str:
    """The timing table as markdown: one line per bucket, a column per row (median us
    and spread; the winner in bold)."""
    out = []
    for family in dict.fromkeys(b.family for b in tuned.buckets):
        buckets = [b for b in tuned.buckets if b.family == family]
        rows = list(dict.fromkeys(r for b in buckets for r in b.table()))
        out += [f"### {family}", "",
                "| bucket | calls | " + " | ".join(rows) + " | winner |",
                "|---|---:|" + "---:|" * len(rows) + "---|"]
        for b in buckets:
            table = b.table()
            cells = []
            for r in rows:
                if r not in table:
                    cells.append("-")
                    continue
                text = f"{table[r].median_us:.1f} ± {table[r].spread_us:.1f}"
                cells.append(f"**{text}**" if r == b.winner else text)
            calls = sum(t.call.count for t in b.calls)
            out.append(f"| `{b.condition}` | {calls} | " + " | ".join(cells)
                       + f" | {b.winner} |")
        out.append("")
    return "\n".join(out)


def write_report(tuned: Tuned, path: str | os.PathLike[str]) -> list[str]:
    """Write the markdown report to ``path`` (and ``<stem>.png`` beside it when
    matplotlib is installed); returns what it wrote or skipped, one line each."""
    report = Path(path)
    lines = [f"# Tuned profile `{tuned.name}`", "",
             f"Tuned {tuned.document['provenance']['tuned']} on "
             f"{this_machine().describe()}, {tuned.document['provenance']['rounds']} "
             f"rounds; median µs per call ± interquartile range, per shape bucket.",
             "", render_table(tuned)]
    excluded = tuned.excluded()
    if excluded:
        lines += ["## Excluded", ""] + [f"- {e}" for e in excluded] + [""]
    done = []
    png = report.with_suffix(".png")
    try:
        import matplotlib  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        done.append("skipped the plot: matplotlib is not installed "
                    "(pip install 'astrai[plot]')")
    else:
        matplotlib.use("Agg")
        _plot(tuned, png)
        lines += [f"![row time per bucket]({png.name})", ""]
        done.append(f"wrote {png}")
    report.write_text("\n".join(lines), encoding="utf-8")
    return [f"wrote {report}", *done]


def _plot(tuned: Tuned, png: Path) -> None:
    import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]

    families = list(dict.fromkeys(b.family for b in tuned.buckets))
    fig, axes = plt.subplots(len(families), 1, figsize=(10, 3.2 * len(families)),
                             squeeze=False)
    for ax, family in zip(axes[:, 0], families, strict=True):
        buckets = [b for b in tuned.buckets if b.family == family]
        rows = list(dict.fromkeys(r for b in buckets for r in b.table()))
        width = 0.8 / max(1, len(rows))
        for i, r in enumerate(rows):
            xs = [k + i * width for k, b in enumerate(buckets) if r in b.table()]
            ys = [b.table()[r].median_us for b in buckets if r in b.table()]
            ax.bar(xs, ys, width, label=r)
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(buckets))])
        ax.set_xticklabels([b.condition for b in buckets], fontsize=6, rotation=15)
        ax.set_yscale("log")
        ax.set_ylabel("µs per call")
        ax.set_title(family)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
