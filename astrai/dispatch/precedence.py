"""Where a decision comes from: the precedence sources, one object each, in order.

``PRECEDENCE`` states the order once: the explicit argument, the ``op_backend`` scope,
the environment (``ASTR_OPS`` or a family's legacy alias), profile forcing, the table's
chain, the fallback row. Each source answers for itself (``Source.answer``): the row it
decides for the call, or ``None`` to let the next one decide. The first three *select*
a row (or an implementation object) by name; a strict one raises when its row cannot
serve the call, a soft one warns once and falls through. The evaluator
(``resolution.evaluate``) hands each call to ``answer``, which walks the tuple, so
adding a source is one class here and one place in the tuple.
"""

from __future__ import annotations

__all__ = [
    "PRECEDENCE",
    "TABLE_ORDER",
    "Ask",
    "ChainSource",
    "EnvSource",
    "ExplicitSource",
    "FallbackSource",
    "ProfileSource",
    "ScopeSource",
    "SelectingSource",
    "Source",
    "answer",
]

from dataclasses import dataclass
from typing import Any

from astrai.dispatch.axes import CallContext
from astrai.dispatch.environment import EnvSettings
from astrai.dispatch.log import warn_once
from astrai.dispatch.registry import Registry
from astrai.dispatch.scopes import Scope
from astrai.dispatch.tables.model import View
from astrai.dispatch.verdicts import (
    MATCH,
    Resolution,
    chain_resolution,
    lookup,
    no_row_error,
    resolved,
    row_verdict,
    serves,
    why_not,
)
from astrai.errors import ExplicitSelectionError
from astrai.suggestions import did_you_mean


class Ask:
    """One decision as the sources see it: the snapshot and the family's view under the
    profiles in force, the call, its explicit handle, the environment and scope of the
    decision's world, and (for explain) the notes to add to. ``named`` is set once a
    selecting source named a row that exists: profile forcing then stands aside."""

    __slots__ = ("ctx", "env", "explicit", "family", "named", "notes", "scope", "state", "view")

    def __init__(self, state: Registry, view: View, family: str, ctx: CallContext,
                 explicit: Any, env: EnvSettings, scope: Scope,
                 notes: list[str] | None) -> None:
        self.state, self.view, self.family, self.ctx = state, view, family, ctx
        self.explicit, self.env, self.scope, self.notes = explicit, env, scope, notes
        self.named = False

    def note(self, text: str) -> None:
        """Add ``text`` to explain's notes (when explaining)."""
        if self.notes is not None:
            self.notes.append(text)


@dataclass(frozen=True)
class Source:
    """One place a decision can come from. ``strict`` sources raise instead of falling
    through; ``label`` says where, in words."""

    origin: str
    strict: bool
    label: str

    def answer(self, ask: Ask) -> Resolution | None:
        """The resolution this source gives the call, or ``None`` (the next one decides)."""
        raise NotImplementedError

    def where(self, ask: Ask) -> str:
        """Where this source's selection came from, in words."""
        return self.label


class SelectingSource(Source):
    """A source that names a row (or an implementation object) itself."""

    def handle(self, ask: Ask) -> Any:
        """The row name or object this source names for the call, or ``None``."""
        raise NotImplementedError

    def answer(self, ask: Ask) -> Resolution | None:
        handle = self.handle(ask)
        if handle is None:
            return None
        family, view = ask.family, ask.view
        rec = lookup(view, handle)
        where = self.where(ask)
        if rec is None:
            names = view.row_names()
            msg = f"Unknown {family} implementation: {handle!r}"
            if self.strict:
                raise ValueError(f"{msg}{did_you_mean(handle, names)}; rows: "
                                 f"{', '.join(names)}")
            warn_once(f"{msg} from {where}{did_you_mean(handle, names)}; ignored; rows: "
                      f"{', '.join(names)}")
            ask.note(f"{self.origin}: {handle!r} names no row; ignored")
            return None
        ask.named = True
        # Words and verdict at once: an object's supports_call is probed once per call.
        verdict, detail = row_verdict(ask.state, view, rec, ask.ctx, implicit=False)
        if verdict == MATCH:
            return resolved(ask.state, rec, self.origin)
        why = why_not(verdict, detail)
        if self.strict:
            raise ExplicitSelectionError(
                f"{family} implementation {rec.name!r} selected by {where} cannot serve "
                f"this call: {why}", family=family, row=rec.name)
        # Soft: not honoured for this call, and never silently (once per reason).
        warn_once(f"{family}={rec.name} from {where} cannot serve this call: {why}; "
                  f"using the table's choice instead")
        ask.note(f"{self.origin}: {rec.name} from {where} cannot serve this call: "
                 f"{why}; falling through")
        return None


class ExplicitSource(SelectingSource):
    """The call's own ``backend=`` argument."""

    def handle(self, ask: Ask) -> Any:
        return ask.explicit


class ScopeSource(SelectingSource):
    """The innermost ``op_backend`` scope naming the family."""

    def handle(self, ask: Ask) -> Any:
        return ask.scope.handles.get(ask.family)


class EnvSource(SelectingSource):
    """``ASTR_OPS`` (or the family's legacy alias variable)."""

    def handle(self, ask: Ask) -> Any:
        return ask.env.backends.get(ask.family)

    def where(self, ask: Ask) -> str:
        family = ask.family
        return f"{ask.env.source_of(family)} ({family}={ask.env.backends.get(family)})"


class ProfileSource(Source):
    """A profile in force that forces the family's row (unless a selection named one)."""

    def answer(self, ask: Ask) -> Resolution | None:
        view = ask.view
        if ask.named or view.forced is None:
            return None
        row, prof = view.forced
        rec = view.fallback if row == view.fallback.name else view.row(row)
        assert rec is not None
        if serves(ask.state, view, rec, ask.ctx, implicit=False):
            ask.note(f"profile {prof} forces {row}")
            return resolved(ask.state, rec, self.origin)
        if ask.notes is not None:
            why = why_not(*row_verdict(ask.state, view, rec, ask.ctx, implicit=False))
            ask.note(f"profile {prof} forces {row}, which cannot serve this call ({why}); "
                     f"falling through")
        return None


class ChainSource(Source):
    """The table's order: the first row of the chain that serves the call."""

    def answer(self, ask: Ask) -> Resolution | None:
        return chain_resolution(ask.state, ask.view, ask.ctx, self.origin)


class FallbackSource(Source):
    """The table's fallback row; when even it cannot serve, ``NoImplementationError``."""

    def answer(self, ask: Ask) -> Resolution | None:
        rec = ask.view.fallback
        if not serves(ask.state, ask.view, rec, ask.ctx, implicit=False):
            raise no_row_error(ask.state, ask.view, ask.ctx)
        ask.note(f"no row of the chain matched; the fallback {rec.name} serves")
        return resolved(ask.state, rec, self.origin)


#: Resolution order, highest precedence first.
PRECEDENCE: tuple[Source, ...] = (
    ExplicitSource("explicit", strict=True, label="the explicit argument"),
    ScopeSource("context", strict=True, label="an op_backend scope"),
    EnvSource("env", strict=False, label="the environment"),
    ProfileSource("profile", strict=False, label="an active profile"),
    ChainSource("chain", strict=False, label="the table order"),
    FallbackSource("fallback", strict=False, label="the fallback row"),
)

#: The sources that decide through the table alone: what is left when nothing names a row.
TABLE_ORDER: tuple[Source, ...] = tuple(s for s in PRECEDENCE
                                        if isinstance(s, ChainSource | FallbackSource))
_CHAIN = TABLE_ORDER[0]
assert isinstance(_CHAIN, ChainSource) and isinstance(TABLE_ORDER[1], FallbackSource)


def answer(state: Registry, view: View, family: str, ctx: CallContext, explicit: Any,
           env: EnvSettings, scope: Scope, notes: list[str] | None = None) -> Resolution:
    """The first answer of the sources, in precedence order, for one call (``Ask``'s
    fields). When nothing names a row for the call (no explicit handle, no scope, no
    environment selection, no profile forcing), only the table's sources are asked."""
    sources = PRECEDENCE
    if (explicit is None and view.forced is None and family not in env.backends
            and family not in scope.handles):
        # The chain's first serving row, asked directly (the common miss: no Ask is
        # made); else the fallback, which notes why and may raise.
        got = chain_resolution(state, view, ctx, _CHAIN.origin)
        if got is not None:
            return got
        sources = TABLE_ORDER[1:]
    ask = Ask(state, view, family, ctx, explicit, env, scope, notes)
    for source in sources:
        got = source.answer(ask)
        if got is not None:
            return got
    raise AssertionError("unreachable: the fallback answers or raises")  # pragma: no cover
