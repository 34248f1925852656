"""Lint: static analysis of decision tables over their finite axes (contract §10).

A family's rows are checked against every distinguishable call: the axes some row
tests, each narrowed to the values the expressions mention (plus one
representative of everything else). Lint's findings assume every row is available —
availability depends on the machine — but respect what profiles do: disabled rows and
non-faithful or explicit-only rows nobody enables never win implicitly, and a forced row
takes every call it accepts. It reports:

- *unsatisfiable* rows, whose condition accepts no call at all;
- *shadowed* rows, which accept calls but lose every one of them to earlier rows (a row
  that loses only to rows with an availability probe is a backup for the machines where
  they are unavailable: a note, not a finding);
- a coverage matrix: which row wins each (compacted) region of the domain, ``no row``
  where not even the fallback serves (the call raises ``NoImplementationError``), and
  where the winner is not available on this machine, the row that serves here - the row
  ``explain`` names for a call of that region;
- warnings that do not fail lint: a definition (``define:``) that no row uses.

A condition that calls opaque Python (``Spec.of``, ``register_family``) cannot be
analysed; it is treated as "may match anything" (three-valued logic), so it never
counts as a shadowing row and is never wrongly reported.
"""

from __future__ import annotations

__all__ = ["LintFinding", "LintReport", "lint_all", "lint_family", "lint_view"]

import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from astrai.dispatch.axes import (
    AXES,
    DTYPES,
    FEATURE_AXES,
    Axis,
    CallContext,
    asked_features,
    format_value,
)
from astrai.dispatch.expr.analysis import three_valued
from astrai.dispatch.expr.spec import Spec
from astrai.dispatch.registry import Registry, current
from astrai.dispatch.tables.model import ALWAYS_AVAILABLE, ImplRecord, View

#: Above this many combinations, a deterministic sample of this size is analysed.
MAX_COMBINATIONS = 200_000

_ORDERING = frozenset({"<", "<=", ">", ">="})
# Representatives for "some other dtype", most common first.
_OTHER_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int8", "bool")

Domain = list[tuple[Any, str]]  # (value, label) pairs; together they cover the axis


@dataclass(frozen=True)
class LintFinding:
    """A row that can never win: ``shadowed`` (by the rows in ``by``) or ``unsatisfiable``."""

    kind: Literal["shadowed", "unsatisfiable"]
    row: str
    message: str
    by: tuple[str, ...] = ()


@dataclass(frozen=True)
class LintReport:
    """What lint found in one family (under the profiles it was given).

    ``coverage`` maps compacted regions of the analysed axes (cells are value labels
    joined by ``,``; ``*`` means any value) to the row that wins them when every row
    is available (``no row`` where not even the fallback serves: the call raises;
    ``x (here: y)`` where ``x`` is not available on this machine and ``y`` serves);
    ``maybe x, else y`` where an opaque condition may take the call.
    ``warnings`` (a definition no row uses) are shown but leave the report ``ok``.
    """

    family: str
    problems: list[LintFinding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    coverage: list[tuple[dict[str, str], str]] = field(default_factory=list)
    axes: tuple[str, ...] = ()
    profiles: tuple[str, ...] = ()
    warnings: list[str] = field(default_factory=list)
    #: Per coverage region, in order, one call of it (a representative: every call of
    #: the region has the same winner).
    examples: list[CallContext] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether no row is shadowed or unsatisfiable."""
        return not self.problems

    def render(self, coverage: bool = True) -> str:
        """The report as the CLI prints it: problems, notes, then the coverage table."""
        fam = self.family
        lines = [f"{fam}: {p.message}" for p in self.problems]
        lines += [f"{fam}: warning: {w}" for w in self.warnings]
        lines += [f"{fam}: note: {n}" for n in self.notes]
        if self.ok:
            under = f" under profile {' + '.join(self.profiles)}" if self.profiles else ""
            lines.append(f"{fam}: ok: no shadowed or unsatisfiable rows{under}")
        if coverage and self.coverage:
            lines.append(f"{fam}: coverage (every row assumed available; '(here: x)' where "
                         f"the winner is not available on this machine and x serves):")
            header = [*self.axes, "winner"]
            body = [[cells[a] for a in self.axes] + [winner] for cells, winner in self.coverage]
            widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
            for r in [header, *body]:
                cells = (c.ljust(w) for c, w in zip(r, widths, strict=True))
                lines.append(("  " + "  ".join(cells)).rstrip())
        return "\n".join(lines)


# -- the domain ------------------------------------------------------------------


@dataclass
class _Mention:
    axis: Axis
    values: set[Any] = field(default_factory=set)
    ordered: bool = False
    partners: set[str] = field(default_factory=set)  # axes this one is compared with


def _walk(spec: Spec, mentions: dict[str, _Mention], opaque: list[str],
          named: set[str]) -> None:
    """Collect the axes and values ``spec`` tests, the opaque parts it contains and the
    names of its named parts (predicates, definitions)."""
    if spec.kind == "named":
        named.add(spec.description)
    test = spec.test
    if test is not None:
        got = mentions.setdefault(test.axis.name, _Mention(test.axis))
        got.values.update(test.values)
        got.ordered |= test.ordering
        if test.other is not None:  # axis <op> other: both need each other's values
            other = mentions.setdefault(test.other.name, _Mention(test.other))
            other.ordered |= test.ordering
            got.partners.add(test.other.name)
            other.partners.add(test.axis.name)
    elif spec.kind == "opaque":
        opaque.append(spec.description)
    for part in spec.parts:
        _walk(part, mentions, opaque, named)


def _share_values(mentions: dict[str, _Mention]) -> None:
    """Axes compared with each other take each other's values (transitively), so the
    domain holds calls where they are equal and where they differ, on either side of
    every constant either is compared with."""
    changed = True
    while changed:
        changed = False
        for mention in mentions.values():
            for name in mention.partners:
                partner = mentions[name]
                if not mention.values <= partner.values:
                    partner.values |= mention.values
                    changed = True
    for mention in mentions.values():
        if mention.partners and mention.axis.kind == "int":
            low = min((v for v in mention.values if isinstance(v, int)), default=1)
            mention.values |= {low - 1, low - 2}  # two values below all: equal and not


def _int_domain(values: set[Any]) -> Domain:
    """One value per class the comparisons can tell apart: each mentioned int and each gap."""
    ints = sorted({v for v in values if isinstance(v, int) and not isinstance(v, bool)})
    if not ints:
        return [(1, "other")]
    out: Domain = [(ints[0] - 1, f"<{ints[0]}")]
    for lo, hi in itertools.pairwise(ints):
        out.append((lo, str(lo)))
        if hi - lo == 2:
            out.append((lo + 1, str(lo + 1)))
        elif hi - lo > 2:
            out.append((lo + 1, f"{lo + 1}..{hi - 1}"))
    out += [(ints[-1], str(ints[-1])), (ints[-1] + 1, f">{ints[-1]}")]
    return out


def _domain(m: _Mention) -> Domain:
    axis = m.axis
    if axis.kind == "bool":
        out: Domain = [(False, "false"), (True, "true")]
    elif axis.kind == "enum" and axis.machine:
        # a machine's vendor: the values named, and one for every other
        out = [(v, v) for v in axis.values if v in m.values]
        others = [v for v in axis.values if v not in m.values]
        if others:
            out.append((others[0], "other"))
    elif axis.kind == "enum":
        out = [(v, v) for v in axis.values]
    elif axis.kind == "level":
        out = _level_domain(axis, m.values)
    elif axis.kind == "int":
        out = _int_domain(m.values)
    else:
        named = [v for v in m.values if v is not None]
        out = [(v, format_value(v)) for v in sorted(named, key=format_value)]
        rest = [DTYPES[n] for n in _OTHER_DTYPES if DTYPES[n] not in named]
        if rest:
            out.append((rest[0], "other"))
    if axis.nullable and (None in m.values or axis.kind in ("enum", "int", "level")):
        out.insert(0, (None, "none"))
    return out


def _level_domain(axis: Axis, named: set[Any]) -> Domain:
    """One value per class the comparisons of an instruction-set level can tell apart:
    each level named and its neighbours in its architecture, and a level of another
    architecture (where every ordering is false)."""
    levels = list(axis.values)
    keep: set[str] = set()
    for value in named:
        if value is None or value not in levels:
            continue
        i = levels.index(value)
        keep.update(v for v in levels[max(0, i - 1):i + 2]
                    if axis.parse(v) <= axis.parse(value) or axis.parse(v) >= axis.parse(value))
    if keep:
        outside = next((v for v in levels if not any(
            axis.parse(v) <= axis.parse(k) or axis.parse(v) >= axis.parse(k) for k in keep)), None)
        if outside is not None:
            keep.add(outside)
    else:
        keep.add(levels[0])
    return [(axis.parse(v), v) for v in levels if v in keep]


def _combinations(sizes: list[int]) -> tuple[Iterator[tuple[int, ...]], int, bool]:
    """Every index tuple over ``sizes``, or a deterministic sample when there are too many."""
    total = math.prod(sizes)
    if total <= MAX_COMBINATIONS:
        return itertools.product(*(range(n) for n in sizes)), total, False
    picked = sorted(random.Random(0).sample(range(total), MAX_COMBINATIONS))

    def decode() -> Iterator[tuple[int, ...]]:
        for flat in picked:
            digits = []
            for n in reversed(sizes):
                flat, d = divmod(flat, n)
                digits.append(d)
            yield tuple(reversed(digits))

    return decode(), total, True


# -- evaluation ------------------------------------------------------------------


def _tri(spec: Spec, ctx: CallContext) -> bool | None:
    """``spec`` on ``ctx`` in three-valued logic: ``None`` where an opaque part decides."""
    return three_valued(spec, lambda part: part.matches(ctx))


def _plain(spec: Spec, ctx: CallContext) -> bool | None:
    """``spec`` on ``ctx`` for a spec without opaque parts (the fast path)."""
    return spec.matches(ctx)


def _eligible(view: View, rec: ImplRecord) -> bool:
    """Whether the implicit chain may pick ``rec`` (lint assumes it is available)."""
    return rec.name not in view.disabled and (rec.implicit or rec.name in view.enabled)


def _quote(names: list[str] | tuple[str, ...]) -> str:
    return ", ".join(repr(n) for n in names)


Region = tuple[list[frozenset[int]], str]  # (value indices per axis, winner)


def _compact(entries: list[Region]) -> list[Region]:
    """Merge regions that differ on one axis only and have the same winner, to a fixpoint."""
    changed = True
    while changed:
        changed = False
        for a in range(len(entries[0][0]) if entries else 0):
            groups: dict[tuple[Any, ...], list[frozenset[int]]] = {}
            for cells, winner in entries:
                key = (winner, *cells[:a], *cells[a + 1:])
                groups.setdefault(key, []).append(cells[a])
            if len(groups) == len(entries):
                continue
            changed = True
            entries = [([*key[1:a + 1], frozenset().union(*parts), *key[a + 1:]], key[0])
                       for key, parts in groups.items()]
    return sorted(entries, key=lambda e: ([min(c) for c in e[0]], e[1]))


#: What a coverage cell says where not even the fallback serves the call (explain raises).
NO_ROW = "no row"
#: The dimension standing for the feature axes: which features a call asks for.
FEATURES = "features"
_NOTHING: frozenset[str] = frozenset()


def _feature_sets(rows: list[ImplRecord]) -> list[frozenset[str]]:
    """The feature requests lint analyses: none, each declared feature alone, and each
    row's whole declared set (the product of every feature axis would multiply the domain
    by 2**6; these are the requests that tell the rows apart)."""
    asks: list[frozenset[str]] = [_NOTHING]
    for rec in rows:
        for ask in (*(frozenset({f}) for f in sorted(rec.features)), rec.features):
            if ask not in asks:
                asks.append(ask)
    return asks


def _asking(ask: frozenset[str]) -> dict[str, Any]:
    """The feature axis values of a call asking for ``ask``."""
    return {f: _asked_value(AXES[f]) if f in ask else AXES[f].default for f in FEATURE_AXES}


def _asked_value(axis: Axis) -> Any:
    """A value of feature ``axis`` that asks for it: 1, true, or its first value that is
    not the default."""
    if axis.kind == "int":
        return 1
    if axis.kind == "enum":
        return next(v for v in axis.values if v != axis.default)
    return True


def lint_view(view: View, state: Registry | None = None) -> LintReport:
    """Lint one family as ``view`` presents it (rows in effective order, profiles applied).
    With ``state`` (the snapshot ``view`` is of), a coverage cell whose winner is not
    available on this machine also names the row that serves it here."""
    family = view.table.name
    # A profile's chain_when narrows a row for the chain; a forced row is not narrowed.
    forced_row = view.forced[0] if view.forced is not None else None
    rows = [r if r.name == forced_row else view.in_chain(r) for r in view.rows]
    fallback = view.fallback.name
    fallback_row = view.fallback

    def available(rec: ImplRecord) -> bool:
        return state is None or state.availability(rec)[0]

    mentions: dict[str, _Mention] = {}
    notes: list[str] = []
    opaque_rows: set[str] = set()
    named: set[str] = set()
    for rec in rows:
        opaque: list[str] = []
        _walk(rec.spec, mentions, opaque, named)
        if opaque:
            opaque_rows.add(rec.name)
            notes.append(f"row {rec.name!r} is not analysable: its condition calls Python "
                         f"({'; '.join(opaque)}); treated as 'may match anything'")
    asks = _feature_sets(rows)
    for feature in FEATURE_AXES:  # the feature axes move into one dimension, ``features``
        mentions.pop(feature, None)
    order = [*AXES, *view.table.axes]
    _share_values(mentions)
    axes = sorted(mentions, key=lambda a: order.index(a) if a in order else len(order))
    domains = [_domain(mentions[a]) for a in axes]
    if len(asks) > 1:
        axes.append(FEATURES)
        domains.append([(ask, "+".join(sorted(ask)) or "none") for ask in asks])
    combos, total, sampled = _combinations([len(d) for d in domains])
    if sampled:
        notes.append(f"too many combinations ({total}); analysed a sample of "
                     f"{MAX_COMBINATIONS}, so findings may be incomplete")

    forced = view.forced
    chain: list[ImplRecord] = []
    if forced is not None and (frec := view.row(forced[0])) is not None:
        chain.append(frec)
        notes.append(f"profile {forced[1]} forces {forced[0]!r}: it takes every call it accepts")
    chain += [r for r in rows if _eligible(view, r)]
    for rec in rows:
        if rec.name in view.disabled:
            notes.append(f"row {rec.name!r} is disabled by profile {view.disabled[rec.name]}")
        elif not rec.faithful and rec.name not in view.enabled:
            notes.append(f"row {rec.name!r} is explicit-only (not faithful; no profile enables "
                         "it)")
        elif rec.explicit_only and rec.name not in view.enabled:
            notes.append(f"row {rec.name!r} is explicit-only (explicit_only: true; no profile "
                         "enables it)")

    satisfiable: set[str] = set()
    can_win: set[str] = set()
    taken_by: dict[str, set[str]] = {r.name: set() for r in rows}
    entries: list[Region] = []
    core = {a for a in axes if a != FEATURES and mentions[a].axis.core} | set(FEATURE_AXES)
    judges = [(r.name, r.spec, _tri if r.name in opaque_rows else _plain, r.features)
              for r in rows]
    if all(r.name != fallback for r in rows):  # a fallback outside the rows judges too
        judges.append((fallback, fallback_row.spec, _tri, fallback_row.features))
    singles = [frozenset({j}) for j in range(max(map(len, domains), default=0))]
    def context(combo: tuple[int, ...]) -> CallContext:
        """The call of one combination of domain values."""
        values = {a: domains[i][j][0] for i, (a, j) in enumerate(zip(axes, combo, strict=True))}
        values.update(_asking(values.pop(FEATURES, _NOTHING)))
        return CallContext(family, **{a: v for a, v in values.items() if a in core},
                           extra={a: v for a, v in values.items() if a not in core})

    backup_wins: set[str] = set()  # rows that win where the probed rows are unavailable

    def probed(rec: ImplRecord) -> bool:
        return rec.available is not ALWAYS_AVAILABLE

    for combo in combos:
        ctx = context(combo)
        asked = asked_features(ctx)
        verdicts = {name: False if asked - features else judge(spec, ctx)
                    for name, spec, judge, features in judges}
        satisfiable.update(n for n, v in verdicts.items() if v is not False)
        maybe: list[str] = []
        # No chain row takes the call: the fallback serves it, unless it rejects it too.
        last = fallback if verdicts[fallback] is not False else NO_ROW
        winner, later = last, []
        for i, rec in enumerate(chain):
            got = verdicts[rec.name]
            if got:
                winner, later = rec.name, chain[i + 1:]
                break
            if got is None and rec.name not in maybe:
                maybe.append(rec.name)
        # On this machine: the first available row that takes it, else the fallback.
        here = next((r.name for r in chain if verdicts[r.name] and available(r)), None)
        if here is None:
            here = fallback if last == fallback and available(fallback_row) else NO_ROW
        can_win.update((winner, *maybe))
        # Each row taking the call after only rows with an availability probe wins where
        # those are unavailable.
        for rec in chain:
            if verdicts[rec.name]:
                backup_wins.add(rec.name)
                if not probed(rec):
                    break
        for rec in later:
            if verdicts[rec.name] is not False:
                taken_by[rec.name].add(winner)
        label = f"maybe {', '.join(maybe)}, else {winner}" if maybe else winner
        if here != winner and not maybe:
            label = f"{winner} (here: {here})"
        entries.append(([singles[j] for j in combo], label))

    problems: list[LintFinding] = []
    position = {r.name: i for i, r in enumerate(chain) if forced is None or i > 0}
    for rec in rows:
        name = rec.name
        if name not in satisfiable:
            if name == fallback:
                notes.append(f"fallback row {name!r} has a condition that matches no call "
                             f"({rec.spec.description}): a call no other row takes raises "
                             f"NoImplementationError")
            else:
                problems.append(LintFinding("unsatisfiable", name, f"row {name!r} is "
                                            f"unsatisfiable: {rec.spec.description}"))
            continue
        if name in can_win or name not in position:
            continue
        by = tuple(sorted(taken_by[name], key=lambda n: position.get(n, -1)))
        if name == fallback:
            notes.append(f"fallback row {name!r} never wins: every call is taken earlier by "
                         f"{_quote(by)}")
        elif forced is not None and forced[0] in by:
            notes.append(f"row {name!r} never wins while profile {forced[1]} forces "
                         f"{forced[0]!r}")
        elif name in backup_wins:
            # a backup: it wins where the rows with an availability probe are unavailable
            notes.append(f"row {name!r} wins only where {_quote(by)} "
                         f"{'is' if len(by) == 1 else 'are'} unavailable (each has an "
                         f"availability probe)")
        else:
            problems.append(LintFinding("shadowed", name, f"row {name!r} is shadowed by "
                                        f"{_quote(by)} (every call it accepts is taken "
                                        "earlier)", by))
    if fallback not in can_win and fallback not in position and fallback in satisfiable:
        notes.append(f"fallback row {fallback!r} never wins: every call is taken earlier")

    regions = _compact(entries)
    coverage = [({a: _cell(d, c) for a, d, c in zip(axes, domains, cells, strict=True)}, w)
                for cells, w in regions]
    examples = [context(tuple(min(c) for c in cells)) for cells, _ in regions]
    warnings = [f"definition {name!r} is not used by any row"
                for name in view.table.definitions if name not in named]
    return LintReport(family, problems, notes, coverage, tuple(axes), view.profiles, warnings,
                      examples)


def _cell(domain: Domain, picked: frozenset[int]) -> str:
    if len(picked) == len(domain):
        return "*"
    return ",".join(domain[i][1] for i in sorted(picked))


def lint_family(family: str, profiles: tuple[str, ...] = ()) -> LintReport:
    """Lint the loaded family ``family`` under ``profiles`` (applied in order)."""
    state = current()
    state.family(family)  # UnknownFamilyError (a KeyError) names the known families
    unknown = [p for p in profiles if p not in state.profiles]
    if unknown:
        raise ValueError(f"unknown profile {unknown[0]!r}; profiles: "
                         f"{', '.join(sorted(state.profiles)) or '(none)'}")
    return lint_view(state.view(family, tuple(profiles)), state)


def lint_all(profiles: tuple[str, ...] = ()) -> list[LintReport]:
    """Lint every loaded family (sorted by name) under ``profiles``, from one snapshot."""
    state = current()
    unknown = [p for p in profiles if p not in state.profiles]
    if unknown:
        raise ValueError(f"unknown profile {unknown[0]!r}; profiles: "
                         f"{', '.join(sorted(state.profiles)) or '(none)'}")
    return [lint_view(state.view(f, tuple(profiles)), state) for f in sorted(state.families)]
