"""What ``dispatch_model`` routed in a model, and what it could not route and why.

The report is made at dispatch time: what was routed, and the share of the model's
weights routed (a weight routed is one whose calls go to astrai's facades, not one whose
every call astrai's rows compute). ``calls()`` says, at any later moment, what came of
the calls made since the dispatch: computed by astrai's rows, handed back to torch by
a row (a ``DTensor``, autograd recording: ``stats().handed``) with the reason, or run
by the model's own code.
"""

from __future__ import annotations

__all__ = ["DispatchReport", "NotRouted", "Routed"]

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from astrai.dispatch.stats import FamilyCalls, Mark, since


@dataclass(frozen=True)
class Routed:
    """One module whose calls of ``family`` go through astrai (for a family served at
    call sites: the layer whose forward calls them)."""

    family: str
    path: str  # the module's name in the model (``model.layers.0.self_attn``)
    kind: str  # its class name
    detail: str = ""  # the norm's form; the rotary function the site called


@dataclass(frozen=True)
class NotRouted:
    """One module of a kind astrai knows that it did not route, with the reason."""

    family: str
    path: str
    kind: str
    reason: str


@dataclass(frozen=True)
class DispatchReport:
    """The model's routing after a ``dispatch_model`` call: every module routed (by this
    call or an earlier one), every one of the families asked for that could not be, and
    how many modules this call changed (0 when it had nothing left to do)."""

    model: str
    routed: tuple[Routed, ...]
    not_routed: tuple[NotRouted, ...]
    changed: int
    families: frozenset[str]
    #: ``(routed to astrai, in all)``: the model's parameters (each tensor once; a
    #: quantised module's packed weights included), and the multiply-adds x 2 per token
    #: of its weight matmuls (linear layers, quantised ones included; an expert stack
    #: counts the share of experts a token runs; attention's own products aside).
    parameters: tuple[int, int] = (0, 0)
    matmul_flops: tuple[int, int] = (0, 0)
    #: What else the report must say about the model as a whole (hub kernels asked for).
    notes: tuple[str, ...] = ()
    #: The families ``dispatch_model`` knew, in the order it reports them, and what it
    #: counts for each (``modules``, ``call sites``).
    order: tuple[str, ...] = ()
    nouns: Mapping[str, str] = field(default_factory=dict)
    #: ``dispatch_model``'s mode: ``train``, or ``inference`` (every parameter frozen).
    mode: str = "train"
    #: This machine's tuned profile (``astrai.tune_model``), in words: which, from which
    #: file and when it was tuned, or why none is in force (empty: not looked for).
    tuned: str = ""
    #: ``(family, why)`` per family a profile in force leaves to the model's own code.
    model_code: tuple[tuple[str, str], ...] = ()
    #: The counters when the report was made: ``calls()`` counts from them (``None``:
    #: from the start of the process).
    counted_from: Mark | None = field(default=None, repr=False, compare=False)

    def counts(self) -> dict[str, int]:
        """Modules (call sites) routed, per family, every family asked for included."""
        got = Counter(r.family for r in self.routed)
        order = list(dict.fromkeys([*self.order, *got]))
        return {f: got[f] for f in order if f in self.families or got[f]}

    def paths(self, family: str) -> list[str]:
        """The modules routed for ``family``."""
        return [r.path for r in self.routed if r.family == family]

    def as_dict(self) -> dict[str, Any]:
        """The report as plain data (``json.dumps`` takes it)."""
        return {
            "model": self.model,
            "changed": self.changed,
            "counts": self.counts(),
            "routed": [vars(r) for r in self.routed],
            "not_routed": [vars(n) for n in self.not_routed],
            "parameters": list(self.parameters),
            "matmul_flops": list(self.matmul_flops),
            "notes": list(self.notes),
            "mode": self.mode,
            "tuned": self.tuned,
            "model_code": dict(self.model_code),
            "calls": {f: {"rows": c.rows, "model": c.model,
                          "handed": [{"row": r, "to": to, "why": why, "calls": n}
                                     for (r, to, why), n in sorted(c.handed.items())]}
                      for f, c in self.calls().items()},
        }

    def shares(self) -> dict[str, float | None]:
        """The share (0..1) of the model's parameters and weight-matmul FLOPs per token
        routed to astrai; ``None`` where the model has none to count (no weight matmul:
        a CNN)."""
        return {name: (got / total if total else None)
                for name, (got, total) in (("parameters", self.parameters),
                                           ("matmul_flops", self.matmul_flops))}

    def calls(self) -> dict[str, FamilyCalls]:
        """The calls of each family since the report was made, split: computed by
        astrai's rows, handed back to torch (per row, what computed them and why), run by
        the model's own code. The counts are the process's (every model's calls), as
        ``stats()``'s; resets of ``stats()`` meanwhile change nothing."""
        got = since(self.counted_from or Mark()).families()
        order = list(dict.fromkeys([*self.order, *sorted(got)]))
        return {f: got[f] for f in order if f in got and got[f].total}

    def __str__(self) -> str:
        lines = [f"astrai dispatch_model: {self.model} "
                 f"({self.changed} module{'s' if self.changed != 1 else ''} changed)"]
        lines.append(f"  mode: {self.mode}" + (" (every parameter declared frozen)"
                                               if self.mode == "inference" else ""))
        if self.tuned:
            lines.append(f"  tuned profile: {self.tuned}")
        counts = self.counts()
        calls = self.calls()
        width = max([10, *map(len, counts)])
        for family, n in counts.items():
            kinds: Counter[tuple[str, str]] = Counter(
                (r.kind, r.detail) for r in self.routed if r.family == family)
            what = _noun(self.nouns.get(family, "modules"), n)
            lines.append(f"  {family:<{width}} {n:>4} {what} routed")
            lines += [f"      {count} x {kind}" + (f": {detail}" if detail else "")
                      for (kind, detail), count in sorted(kinds.items())]
        lines += [f"  note: {note}" for note in self.notes]
        share = self.shares()
        flops = ("no weight matmuls to count" if share["matmul_flops"] is None
                 else f"{share['matmul_flops']:.1%} of the weight matmul FLOPs per token")
        params = ("no parameters to count" if share["parameters"] is None
                  else f"{share['parameters']:.1%} of the parameters")
        lines.append(f"  weights routed to astrai: {flops}, {params} (routed, not served: "
                     f"the calls say what computed them)")
        if calls:
            lines.append("  calls since the dispatch (the whole process's, as stats()):")
            width = max([10, *map(len, calls)])
            lines += [f"    {family:<{width}} {c.describe()}" for family, c in calls.items()]
        else:
            lines.append("  calls since the dispatch: none yet (report.calls() counts them, "
                         "computed by astrai's rows apart from those handed back to torch)")
        if self.model_code:
            lines.append("  left to the model's own code:")
            lines += [f"    {family}: {why}" for family, why in self.model_code]
        if self.not_routed:
            lines.append("  not routed:")
            width = max([10, *(len(n.family) for n in self.not_routed)])
            lines += [f"    {n.family:<{width}} {n.path} ({n.kind}): {n.reason}"
                      for n in self.not_routed]
        else:
            lines.append("  not routed: nothing")
        return "\n".join(lines)


def _noun(plural: str, n: int) -> str:
    """``modules`` / ``call sites`` for ``n`` of them (``1 module``)."""
    return plural[:-1] if n == 1 and plural.endswith("s") else plural
