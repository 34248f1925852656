"""``Spec``: the one form of a spec expression - evaluated, printed, cached and encoded.

A spec is made of small frozen, slotted *forms* (``combinators``: constants, axis tests,
named parts, ``not``, ``and``, ``or``); ``a & b``, ``a | b`` and ``~a`` compose them and
nested ands and ors flatten. This module states what every spec offers:

- evaluation (``matches``) and, for ``explain``, ``failure(ctx)``: which clause
  rejected a call and the value the call had; ``matcher()``, the same test made into
  one generated Python function (``matcher``), which the evaluator's chain walk calls;
- the one canonical printer, ``description``, which parses back to an equal spec
  (operator binding for printing is stated once: ``BIND_*``);
- a plain, JSON-ready encoding (``encode`` / ``Spec.decode``, forms in ``encoding``)
  for the precompiled tables, so loading them needs no parser;
- a structural view for static analysis (``kind``, ``parts``, ``test``; ``analysis``),
  so tools such as lint never reach into the forms.

The forms are made through one ``Forms`` object, the builder the parser and the decoder
drive too; ``combinators`` provides it when the package is imported (``install``), so
this module never imports the forms it is made of.
"""

from __future__ import annotations

__all__ = [
    "BIND_AND",
    "BIND_ATOM",
    "BIND_NOT",
    "BIND_OR",
    "AxisTest",
    "Forms",
    "Kind",
    "Plain",
    "Spec",
    "call_values",
    "install",
    "parse_spec",
    "predicate",
]

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

import torch

from astrai.dispatch.axes import AXES, CORE_VOCABULARY, Axis, Vocabulary, format_value
from astrai.dispatch.expr.encoding import Plain, decode
from astrai.dispatch.expr.matcher import Source, generate
from astrai.dispatch.expr.parsing import parse_cached

if TYPE_CHECKING:
    from astrai.dispatch.axes import CallContext
    from astrai.dispatch.expr._parser import Builder

#: Binding strength, for deciding where parentheses go when printing.
BIND_OR, BIND_AND, BIND_NOT, BIND_ATOM = 1, 2, 3, 4

#: What a spec is, structurally (``Spec.kind``): an ``atom`` tests one axis
#: (see ``Spec.test``); ``opaque`` calls Python (``Spec.of``) and cannot be analysed.
Kind = Literal["const", "atom", "named", "not", "and", "or", "opaque"]


@dataclass(frozen=True)
class AxisTest:
    """What an atom tests: its ``axis``, the ``values`` it names, and whether it orders
    them (``<``, ``<=``, ``>``, ``>=``)."""

    axis: Axis
    values: tuple[Any, ...]
    ordering: bool = False
    op: str = ""  # a comparison's operator; "" for membership and flags
    other: Axis | None = None  # the axis compared with, for ``axis <op> other``


class Spec:
    """A predicate over a call context. Subclasses are frozen and hashable."""

    __slots__ = ("_m",)
    precedence: ClassVar[int] = BIND_ATOM
    kind: ClassVar[Kind] = "atom"
    #: ``matcher()``'s function once made (``None`` until then).
    _m: Callable[[CallContext], Any] | None

    def __new__(cls, *args: Any, **kwargs: Any) -> Spec:
        self = super().__new__(cls)
        object.__setattr__(self, "_m", None)
        return self

    # -- evaluation -----------------------------------------------------
    def matches(self, ctx: CallContext) -> bool:
        """Whether the call described by ``ctx`` satisfies this spec."""
        raise NotImplementedError

    def matcher(self) -> Callable[[CallContext], Any]:
        """``matches`` as one generated function, made on first use and kept: its result's
        truth is ``matches``'s answer. A spec that does not generate (too deep for the
        compiler, say) keeps its ``matches``."""
        got = self._m
        if got is None:
            got = generate(self)
            object.__setattr__(self, "_m", got)
        return got

    def _source(self, out: Source) -> str:
        """A Python expression over ``ctx`` true exactly when this spec matches (the
        generated ``matcher``); a spec without one calls its own ``matches``."""
        return f"{out.const(self.matches)}(ctx)"

    def __call__(self, ctx: CallContext) -> bool:
        return self.matches(ctx)

    def failure(self, ctx: CallContext) -> str | None:
        """``None`` when ``ctx`` matches, else the clause that failed and the call's value."""
        if self.matches(ctx):
            return None
        return self._reason(ctx)

    def _reason(self, ctx: CallContext) -> str:
        values = call_values(self, ctx)
        return f"{self.description} (call has {values})" if values else self.description

    def axes(self) -> frozenset[str]:
        """The names of the axes this spec reads."""
        return frozenset()

    # -- structure ------------------------------------------------------
    @property
    def parts(self) -> tuple[Spec, ...]:
        """The specs this one is made of: a ``named`` spec's definition, a ``not``'s
        operand, an ``and``/``or``'s operands; ``()`` for the rest."""
        return ()

    @property
    def test(self) -> AxisTest | None:
        """For an ``atom``: the axis it reads and the values it names; else ``None``."""
        return None

    def encode(self) -> Plain:
        """This spec as plain JSON-ready data (the forms: ``encoding``);
        ``Spec.decode`` reads it back."""
        raise TypeError(f"{self.description!r} calls Python and has no plain form")

    @staticmethod
    def decode(plain: Plain, vocabulary: Vocabulary = CORE_VOCABULARY) -> Spec:
        """The spec ``plain`` encodes (see ``encode``), its axes looked up in
        ``vocabulary``. Raises ``ValueError`` for data that is not such an encoding."""
        try:
            return decode(plain, vocabulary, _forms())
        except (KeyError, IndexError, TypeError) as exc:
            raise ValueError(f"not an encoded spec: {plain!r} ({type(exc).__name__})") from None

    # -- text -----------------------------------------------------------
    @property
    def description(self) -> str:
        """Canonical text of this spec."""
        raise NotImplementedError

    def _wrapped(self, outer: int) -> str:
        text = self.description
        return f"({text})" if self.precedence < outer else text

    def __repr__(self) -> str:
        return f"Spec({self.description!r})"

    # -- copies: a spec is an immutable value, so a copy is the spec itself ----
    def __copy__(self) -> Spec:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Spec:
        return self

    def __str__(self) -> str:
        return self.description

    # -- composition ----------------------------------------------------
    def __and__(self, other: Spec) -> Spec:
        return _forms().all_of([self, other])

    def __or__(self, other: Spec) -> Spec:
        return _forms().any_of([self, other])

    def __invert__(self) -> Spec:
        return _forms().negate(self)

    # -- constructors ---------------------------------------------------
    @staticmethod
    def always() -> Spec:
        """Matches every call."""
        return _forms().const(True)

    @staticmethod
    def never() -> Spec:
        """Matches no call."""
        return _forms().const(False)

    @staticmethod
    def of(fn: Callable[[CallContext], bool], desc: str) -> Spec:
        """Wrap an arbitrary callable; ``desc`` is what ``explain`` shows."""
        return _forms().opaque(fn, desc)

    @staticmethod
    def compare(axis: str, op: str, value: Any) -> Spec:
        """``axis <op> value`` for a known core axis."""
        return _forms().compare(AXES[axis], op, value)

    @staticmethod
    def dtype_in(*dtypes: torch.dtype) -> Spec:
        """The call's dtype is one of ``dtypes``."""
        return _forms().member(AXES["dtype"], tuple(dtypes), False)

    @staticmethod
    def ndim(n: int) -> Spec:
        """The main input has rank ``n``."""
        return _forms().compare(AXES["ndim"], "==", n)

    @staticmethod
    def head_dim_in(*dims: int) -> Spec:
        """The head size is one of ``dims``."""
        return _forms().member(AXES["head_dim"], tuple(dims), False)

    @staticmethod
    def fwd_in(*modes: str | None) -> Spec:
        """The forward mode is one of ``modes`` (``None`` = training)."""
        return _forms().member(AXES["fwd"], tuple(modes), False)

    @staticmethod
    def inference() -> Spec:
        """``fwd`` is not ``None`` (prefill or decode)."""
        return predicate("inference")

    @staticmethod
    def training() -> Spec:
        """``fwd`` is ``None``."""
        return predicate("training")

    @staticmethod
    def no_grad() -> Spec:
        """Autograd is not recording."""
        return predicate("no_grad")

    @staticmethod
    def has_cache() -> Spec:
        """A KV cache is passed."""
        return _forms().flag(AXES["has_cache"])

    @staticmethod
    def mask_free() -> Spec:
        """No attention mask is passed."""
        return predicate("mask_free")

    @staticmethod
    def cuda_device() -> Spec:
        """The call's tensors are on a CUDA device."""
        return predicate("cuda_device")

    @staticmethod
    def named(name: str, inner: Spec) -> Spec:
        """``inner`` under the name ``name`` (a table's definition): printed as ``name``,
        evaluated as ``inner``."""
        return _forms().named(name, inner)

    @staticmethod
    def member(axis: str, values: Iterable[Any], negated: bool = False) -> Spec:
        """``axis in {values}`` (``negated``: ``not in``) for a known core axis."""
        return _forms().member(AXES[axis], tuple(values), negated)

    @staticmethod
    def parse(text: str, vocabulary: Vocabulary | None = None) -> Spec:
        """Parse a spec expression (contract §4)."""
        return parse_spec(text, vocabulary)


if TYPE_CHECKING:
    class Forms(Builder[Spec], Protocol):
        """How every spec is made: the parser's forms, and a Python callable."""

        def opaque(self, fn: Callable[[CallContext], bool], desc: str) -> Spec:
            """``Spec.of``: ``fn`` answers, ``desc`` is what explain shows."""
else:
    Forms = Any

_FORMS: list[Forms] = []


def install(forms: Forms) -> None:
    """Make ``forms`` the way specs are made (``combinators`` calls it once, on import)."""
    _FORMS[:] = [forms]


def _forms() -> Forms:
    return _FORMS[0]


def parse_spec(text: str, vocabulary: Vocabulary | None = None) -> Spec:
    """Parse and type-check a spec expression (contract §4) against ``vocabulary`` (default:
    the core axes and predicates); cached per text and vocabulary. Raises
    ``SpecSyntaxError``."""
    got: Spec = parse_cached(text, vocabulary, _forms())
    return got


def predicate(name: str) -> Spec:
    """The core predicate ``name`` (``inference``, ``no_grad``...)."""
    return parse_spec(name)


def _read(axis: str, ctx: CallContext) -> Any:
    known = AXES.get(axis)
    if known is not None:
        return known.getter(ctx)
    return ctx.extra.get(axis)


def call_values(spec: Spec, ctx: CallContext) -> str:
    """The call's values of the axes ``spec`` reads: ``has_cache=false, ndim=3``."""
    return ", ".join(f"{a}={format_value(_read(a, ctx))}" for a in sorted(spec.axes()))
