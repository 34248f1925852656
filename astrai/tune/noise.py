"""Whether the machine was quiet enough for tune's figures to be the kernels' own.

Three signs are read while tune measures; any one makes the run *noisy*:

- **Other runnable tasks** (Linux): at every timing round, the number of tasks the
  kernel could run right now (``/proc/loadavg``'s running count) less this process's own
  running threads. On a quiet machine that is 0 nearly always; if the median over the
  rounds is ``BUSY_OTHERS`` or more, other processes competed for the cores the whole
  time. The same median over one call's rounds says whether they competed while that
  call was timed: such a call keeps its shipped row, and a run with one is not quiet
  (another run of the same workload may find that call's figures clean and move it).
- **CPU share**: a short spin of the calling thread timed by wall clock and by the
  thread's CPU clock, before and after measuring. A share under ``QUIET_SHARE`` means the
  thread was descheduled for another tenant part of the time.
- **Dispersion**: the median, over the rows timed, of a row's confidence interval width
  relative to its median (``statistics.median_interval``). Over ``WIDE`` the samples
  scatter too much to be one kernel's cost.

On a noisy machine each figure includes waiting for the CPU; tune still measures (the
shipped order stays wherever the intervals do not separate rows), and says so in its
output and in the profile's provenance.
"""

from __future__ import annotations

__all__ = ["BUSY_OTHERS", "QUIET_SHARE", "WIDE", "Noise", "NoiseMonitor", "cpu_share",
           "other_runnable"]

import os
import statistics
import time
from dataclasses import dataclass, field

#: Below this share of a core while spinning, another process took the CPU.
QUIET_SHARE = 0.9
#: Other runnable tasks (median over the rounds) that make a machine busy.
BUSY_OTHERS = 1.0
#: A median relative interval width above this: the samples scatter too much.
WIDE = 0.5
SPIN_S = 0.03


def cpu_share(seconds: float = SPIN_S) -> float:
    """The calling thread's CPU time over the wall time of a spin ``seconds`` long."""
    wall0, cpu0 = time.perf_counter(), time.thread_time()
    while time.perf_counter() - wall0 < seconds:
        pass
    wall = time.perf_counter() - wall0
    return min(1.0, (time.thread_time() - cpu0) / wall) if wall > 0 else 1.0


def _running_self() -> int:
    """This process's threads that are running or runnable now."""
    n = 0
    try:
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            if stat[stat.rindex(b")") + 2:][:1] == b"R":
                n += 1
    except OSError:
        return 0
    return n


def other_runnable() -> int | None:
    """How many tasks of other processes could run right now (``None``: not Linux)."""
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            running = int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0, running - _running_self())


@dataclass(frozen=True)
class Noise:
    """What the machine was like while tune measured (module docstring)."""

    share: float  # the lower CPU share of the spins before and after measuring
    others: float | None  # median other runnable tasks over the rounds (None: unknown)
    width: float | None  # median relative interval width over the rows timed
    busy_calls: int = 0  # calls timed while other processes competed for the cores

    @property
    def quiet(self) -> bool:
        """Whether no sign of a busy machine was seen."""
        return not self.reasons()

    def reasons(self) -> list[str]:
        """What made the run noisy, in words (empty when quiet)."""
        out = []
        if self.others is not None and self.others >= BUSY_OTHERS:
            out.append(f"{self.others:g} other tasks were runnable at the median round "
                       f"(other processes competed for the cores)")
        if self.busy_calls:
            out.append(f"other processes competed for the cores while {self.busy_calls} "
                       f"call{'s were' if self.busy_calls > 1 else ' was'} timed (these "
                       f"keep their shipped rows)")
        if self.share < QUIET_SHARE:
            out.append(f"tune's thread got {self.share:.0%} of a core while spinning")
        if self.width is not None and self.width > WIDE:
            out.append(f"a row's 95% interval was {self.width:.0%} of its median (the "
                       f"median over rows): the samples scatter")
        return out

    def as_dict(self) -> dict[str, object]:
        """The reading as the profile's provenance states it."""
        return {"quiet": self.quiet, "cpu_share": round(self.share, 3),
                "other_runnable": self.others,
                "interval_width": None if self.width is None else round(self.width, 3),
                "busy_calls": self.busy_calls}


@dataclass
class NoiseMonitor:
    """Collects the signs while tune measures: ``start``, ``round`` at every timing
    round, ``finish`` with the relative interval widths of the rows timed."""

    shares: list[float] = field(default_factory=list)
    others: list[int] = field(default_factory=list)

    def start(self) -> None:
        """The CPU share before measuring."""
        self.shares.append(cpu_share())

    def round(self) -> None:
        """One reading of the other runnable tasks."""
        got = other_runnable()
        if got is not None:
            self.others.append(got)

    def mark(self) -> int:
        """Where the readings stand now (for ``busy_since``)."""
        return len(self.others)

    def busy_since(self, mark: int) -> bool:
        """Whether the readings since ``mark`` (the rounds of one call) say that other
        processes competed for the cores (their median: ``BUSY_OTHERS`` or more)."""
        since = self.others[mark:]
        return bool(since) and statistics.median(since) >= BUSY_OTHERS

    def finish(self, widths: list[float], busy_calls: int = 0) -> Noise:
        """The reading of the whole run: ``widths`` the rows' relative interval widths,
        ``busy_calls`` how many calls ``busy_since`` found busy."""
        self.shares.append(cpu_share())
        return Noise(min(self.shares),
                     statistics.median(self.others) if self.others else None,
                     statistics.median(widths) if widths else None, busy_calls)
