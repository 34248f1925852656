"""The report of a tuning run: the timing table as markdown (one line per bucket, a
column per row) and, when matplotlib is installed, a PNG of each row's time per bucket."""

from __future__ import annotations

__all__ = ["render_table", "write_report"]

import os
from pathlib import Path

from astrai.dispatch.machine import this_machine
from astrai.formats.common import atomic_write
from astrai.tune.run import Tuned


def render_table(tuned: Tuned) -> str:
    """The timing table as markdown: one line per bucket, a column per row (median us
    and its 95% interval; the winner in bold), the winner and its verdict."""
    out = []
    for family in dict.fromkeys(b.family for b in tuned.buckets):
        buckets = [b for b in tuned.buckets if b.family == family]
        rows = list(dict.fromkeys(r for b in buckets for r in b.table()))
        out += [f"### {family}", "",
                "| bucket | calls | " + " | ".join(rows) + " | winner | verdict |",
                "|---|---:|" + "---:|" * len(rows) + "---|---|"]
        for b in buckets:
            table = b.table()
            cells = []
            for r in rows:
                if r not in table:
                    cells.append("-")
                    continue
                t = table[r]
                text = f"{t.median_us:.1f} [{t.low_us:.1f}, {t.high_us:.1f}]"
                cells.append(f"**{text}**" if r == b.winner else text)
            calls = sum(t.call.count for t in b.calls)
            out.append(f"| `{b.condition}` | {calls} | " + " | ".join(cells)
                       + f" | {b.winner} | {', '.join(b.verdicts)} |")
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
    atomic_write(report, "\n".join(lines))
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
