"""The library's error types: one base class, each also the closest builtin."""

from __future__ import annotations

__all__ = [
    "AstraiError",
    "ExplicitSelectionError",
    "FileFormatError",
    "KVCacheFullError",
    "LockDriftError",
    "NoImplementationError",
    "OutputPathError",
    "PlanMismatchError",
    "ScopeError",
    "SpecSyntaxError",
    "StaleBatchError",
    "TableError",
    "TableProblem",
    "UnknownFamilyError",
    "UnsupportedFeatureError",
]

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: How much of a user's expression an error echoes either side of the offending token.
ECHO = 60
#: The longest message text (a name or value echoed from user input, the list of valid
#: names) before eliding.
CLIP = 800


def clip(text: str, limit: int = CLIP) -> str:
    """``text``, or its start and end around ``...`` when longer than ``limit``: an error
    about a 1 MB input must not be a 2 MB message."""
    if len(text) <= limit:
        return text
    keep = (limit - 5) // 2
    return f"{text[:keep]} ... {text[-keep:]}"


class AstraiError(Exception):
    """Base class of every error astrai raises on purpose."""


class SpecSyntaxError(AstraiError, ValueError):
    """A spec expression that does not parse or does not type-check.

    ``message`` says what was wrong and what was expected, ``source`` is the
    expression, ``span`` the ``(start, end)`` character range of the offending
    token. ``file``/``line``/``column`` are set when the expression came from a
    table file (``column`` is 1-based and points into the file).
    """

    def __init__(
        self,
        message: str,
        source: str,
        span: tuple[int, int],
        *,
        file: str | None = None,
        line: int | None = None,
        column: int | None = None,
    ) -> None:
        self.message = message
        self.source = source
        self.span = span
        self.file = file
        self.line = line
        self.column = column
        super().__init__(self.render())

    def render(self) -> str:
        """``file:line:col: message``, then the expression (at most ``ECHO`` characters
        either side of the error, elided with ``...``) with a caret under the span."""
        start, end = self.span
        lo = max(0, start - ECHO)
        hi = min(len(self.source), max(end, start + 1) + ECHO, start + 2 * ECHO)
        head = "..." if lo > 0 else ""
        shown = head + self.source[lo:hi] + ("..." if hi < len(self.source) else "")
        caret_at = len(head) + start - lo
        marker = " " * caret_at + "^" + "~" * max(0, min(end, hi) - start - 1)
        where = ""
        if self.line is not None:
            where = f"{self.file or '<string>'}:{self.line}:{self.column}: "
        return f"{where}{clip(self.message)}\n    {shown}\n    {marker}"

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (
            _rebuild_syntax_error,
            (self.message, self.source, self.span, self.file, self.line, self.column),
        )


def _rebuild_syntax_error(
    message: str,
    source: str,
    span: tuple[int, int],
    file: str | None,
    line: int | None,
    column: int | None,
) -> SpecSyntaxError:
    return SpecSyntaxError(message, source, span, file=file, line=line, column=column)


@dataclass(frozen=True)
class TableProblem:
    """One problem found in a table or profile file."""

    file: str
    line: int
    column: int
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}: {clip(self.message, 4 * CLIP)}"


class _ProblemsError(AstraiError, ValueError):
    """A file that cannot be read; lists every problem found (``problems``), each located
    (``file:line:col: message``)."""

    def __init__(self, problems: list[TableProblem]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (type(self), (self.problems,))


class TableError(_ProblemsError):
    """A table or profile file that cannot be loaded; lists every problem found."""


class FileFormatError(_ProblemsError):
    """A workload or lock file that cannot be read; lists every problem found, each
    located (``file:line:col: message``), like ``TableError`` for tables."""


class LockDriftError(AstraiError, RuntimeError):
    """A live decision differs from the one a decision lock (``ASTR_LOCK``) holds.

    ``family`` and ``signature`` name the call, ``locked`` and ``live`` the rows (``live``
    is ``None`` when no row can serve the call; ``locked`` is ``None`` for a call the lock
    does not know), ``reason`` says why they differ.
    """

    def __init__(self, message: str, *, family: str = "", signature: str = "",
                 locked: str | None = None, live: str | None = None,
                 reason: str = "") -> None:
        self.family = family
        self.signature = signature
        self.locked = locked
        self.live = live
        self.reason = reason
        super().__init__(message)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (_rebuild_drift_error, (str(self), self.family, self.signature, self.locked,
                                       self.live, self.reason))


def _rebuild_drift_error(message: str, family: str, signature: str, locked: str | None,
                         live: str | None, reason: str) -> LockDriftError:
    return LockDriftError(message, family=family, signature=signature, locked=locked,
                          live=live, reason=reason)


class ExplicitSelectionError(AstraiError, RuntimeError):
    """An explicitly selected row (argument or ``op_backend`` scope) cannot serve the call."""

    def __init__(self, message: str, *, family: str = "", row: str = "") -> None:
        self.family = family
        self.row = row
        super().__init__(message)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (_rebuild_selection_error, (str(self), self.family, self.row))


def _rebuild_selection_error(message: str, family: str, row: str) -> ExplicitSelectionError:
    return ExplicitSelectionError(message, family=family, row=row)


class ScopeError(AstraiError, RuntimeError):
    """An ``op_backend`` / ``use_profile`` scope (or ``set_override`` token) ended where it
    is not the innermost scope: out of order, or in another thread or task than the one
    that entered it - typically a generator suspended inside the ``with`` and closed later.
    """


class NoImplementationError(AstraiError, RuntimeError):
    """No row, not even the fallback, can serve a call.

    ``family`` names the family and ``reasons`` holds ``(row, reason)`` for every row
    considered, in order; the message lists them all.
    """

    def __init__(self, message: str, *, family: str = "",
                 reasons: Sequence[tuple[str, str]] = ()) -> None:
        self.family = family
        self.reasons = tuple(reasons)
        super().__init__(message)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (_rebuild_no_implementation, (str(self), self.family, self.reasons))


def _rebuild_no_implementation(message: str, family: str,
                               reasons: tuple[tuple[str, str], ...]) -> NoImplementationError:
    return NoImplementationError(message, family=family, reasons=reasons)


class UnknownFamilyError(AstraiError, KeyError):
    """A family name that no loaded table or registration defines."""

    def __init__(self, family: str, known: list[str]) -> None:
        self.family = family
        self.known = sorted(known)
        super().__init__(family)

    def __str__(self) -> str:
        from astrai.suggestions import did_you_mean

        return (
            f"Unknown family: {self.family!r}{did_you_mean(self.family, self.known)}; "
            f"known families: {', '.join(self.known) or '(none)'}"
        )

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (UnknownFamilyError, (self.family, self.known))


class PlanMismatchError(AstraiError, RuntimeError):
    """Ranks of a ``torch.distributed`` job would not run the same dispatch plan.

    Raised by ``astrai.distributed.agreement.check_agreement`` on every rank alike.
    ``differences`` holds one ``PlanDifference`` per item that differs (a table
    revision, the active profiles, the row a call resolves to, or a family for
    which consensus found no row every rank can run); the message lists them all.
    """

    def __init__(self, message: str, differences: Sequence[Any] = ()) -> None:
        self.differences = tuple(differences)
        super().__init__(message)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (PlanMismatchError, (str(self), self.differences))


class KVCacheFullError(AstraiError, MemoryError):
    """The pool cannot satisfy an allocation: ``requested`` units of ``what``, ``free`` left.

    Raised by ``astrai.kv_cache`` (which re-exports it).
    """

    def __init__(self, what: str, requested: int, free: int, detail: str = "") -> None:
        self.what = what
        self.requested = requested
        self.free = free
        self.detail = detail
        message = f"KV cache full: asked for {requested} {what}, only {free} free"
        super().__init__(f"{message} ({detail})" if detail else message)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (KVCacheFullError, (self.what, self.requested, self.free, self.detail))


class StaleBatchError(AstraiError, ValueError):
    """A ``PagedBatch`` used after one of its requests was freed (its row may be reused).

    Raised by ``astrai.kv_cache`` (which re-exports it).
    """


class UnsupportedFeatureError(AstraiError, NotImplementedError):
    """A transformers attention call uses a feature ``astrai.ops.attention`` cannot express.

    ``feature`` names it, ``value`` is what the call carried, ``hint`` says how to
    proceed (usually: use ``attn_implementation="sdpa"`` or ``"eager"`` for this model).
    Raised by ``astrai.integrations.transformers`` (which re-exports it), whose
    ``ATTN_IMPLEMENTATION`` is the ``'astrai'`` the message names.
    """

    def __init__(self, feature: str, value: Any, hint: str) -> None:
        self.feature = feature
        self.value = value
        self.hint = hint
        super().__init__(
            f"attn_implementation='astrai' does not support {feature} (got {value!r}): {hint}"
        )

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (UnsupportedFeatureError, (self.feature, self.value, self.hint))


class OutputPathError(AstraiError, OSError):
    """A file astrai was asked to write cannot be written there without destroying
    something: the path is not a regular file (a directory, a FIFO, a device, a socket),
    or it is one of the command's own inputs."""
