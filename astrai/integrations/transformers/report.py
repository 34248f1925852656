"""What ``dispatch_model`` routed in a model, and what it could not route and why."""

from __future__ import annotations

__all__ = ["DispatchReport", "NotRouted", "Routed"]

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


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
    #: ``(reaching astrai, in all)``: the model's parameters (each tensor once), and the
    #: multiply-adds x 2 per token of its weight matmuls (linear layers; an expert stack
    #: counts the share of experts a token runs; attention's own products aside).
    parameters: tuple[int, int] = (0, 0)
    matmul_flops: tuple[int, int] = (0, 0)
    #: What else the report must say about the model as a whole (hub kernels asked for).
    notes: tuple[str, ...] = ()
    #: The families ``dispatch_model`` knew, in the order it reports them, and what it
    #: counts for each (``modules``, ``call sites``).
    order: tuple[str, ...] = ()
    nouns: Mapping[str, str] = field(default_factory=dict)

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
        }

    def shares(self) -> dict[str, float]:
        """The share (0..1) of the model's parameters and weight-matmul FLOPs per token
        that reach astrai (1.0 for a model with none)."""
        return {name: (got / total if total else 1.0)
                for name, (got, total) in (("parameters", self.parameters),
                                           ("matmul_flops", self.matmul_flops))}

    def __str__(self) -> str:
        lines = [f"astrai dispatch_model: {self.model} "
                 f"({self.changed} module{'s' if self.changed != 1 else ''} changed)"]
        for family, n in self.counts().items():
            kinds: Counter[tuple[str, str]] = Counter(
                (r.kind, r.detail) for r in self.routed if r.family == family)
            what = self.nouns.get(family, "modules")
            lines.append(f"  {family:<10} {n:>4} {what} routed")
            lines += [f"      {count} x {kind}" + (f": {detail}" if detail else "")
                      for (kind, detail), count in sorted(kinds.items())]
        lines += [f"  note: {note}" for note in self.notes]
        share = self.shares()
        lines.append(f"  reaching astrai: {share['matmul_flops']:.1%} of the weight matmul "
                     f"FLOPs per token, {share['parameters']:.1%} of the parameters")
        if self.not_routed:
            lines.append("  not routed:")
            lines += [f"    {n.family:<10} {n.path} ({n.kind}): {n.reason}"
                      for n in self.not_routed]
        else:
            lines.append("  not routed: nothing")
        return "\n".join(lines)
