"""Tests for the spec expression grammar (contract §4): parsing, type checks, text, compilation."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from astrai.dispatch.axes import (
    CORE_VOCABULARY,
    DTYPES,
    EXPRESSION_AXES,
    KEYWORDS,
    PREDICATES,
    Axis,
    CallContext,
    Vocabulary,
)
from astrai.dispatch.expr._parser import MAX_DEPTH
from astrai.dispatch.expr.spec import Spec, parse_spec
from astrai.errors import ECHO, SpecSyntaxError, clip

SPAN = Axis("span", "int", nullable=True, core=False)
SPANNED = CORE_VOCABULARY.with_extras({"span": SPAN})
#: Error messages list the common dtypes (every torch dtype name is accepted).
COMMON = ("float16, bfloat16, float32, float64, float8_e4m3fn, float8_e5m2, int8, int16, "
          "int32, int64, uint8, bool, complex64, complex128")
ALL_DTYPES = f"{COMMON}, none"
#: What error messages list: every built-in axis, then every axis and predicate, sorted.
CORE_AXES = ", ".join(sorted(EXPRESSION_AXES))
CORE_NAMES = ", ".join(sorted([*EXPRESSION_AXES, *PREDICATES]))

BIG = (
    "fwd in {prefill, decode} and has_cache and ndim == 3 and dtype == bfloat16"
    " and head_dim in {32, 64, 128, 256}"
)
#: The examples of contract §4 with a call each accepts and a call each refuses.
CONTRACT_EXAMPLES: list[tuple[str, dict[str, Any], dict[str, Any] | None]] = [
    ("always", {}, None),
    (
        BIG,
        dict(fwd="decode", has_cache=True, ndim=3, dtype=torch.bfloat16, head_dim=128),
        dict(fwd="decode", has_cache=True, ndim=3, dtype=torch.bfloat16, head_dim=96),
    ),
    (
        "dtype in {float16, bfloat16} and not has_mask",
        dict(dtype=torch.float16),
        dict(dtype=torch.float16, has_mask=True),
    ),
    ("training or no_grad", dict(fwd="prefill", grad_enabled=False), dict(fwd="prefill")),
    ("has_cache", dict(has_cache=True), dict(has_cache=False)),
    ("inference and mask_free", dict(fwd="decode"), dict(fwd="decode", has_mask=True)),
    ("cuda_device", dict(device_cuda=True), dict(device_cuda=False)),
]


def call(**fields: Any) -> CallContext:
    """A call context for the attention family."""
    return CallContext(family="attention", **fields)


def rendered(text: str, vocabulary: Vocabulary | None = None) -> str:
    """The rendered error that parsing ``text`` raises."""
    with pytest.raises(SpecSyntaxError) as info:
        parse_spec(text, vocabulary)
    return info.value.render()


def error(message: str, source: str, caret: str) -> str:
    """The expected rendering of an error."""
    return f"{message}\n    {source}\n    {caret}"


# -- property-test machinery --------------------------------------------------------------

TOKEN_SOUP = [
    *sorted(KEYWORDS), "(", ")", "{", "}", ",", "==", "!=", "<", "<=", ">", ">=", "=", "!",
    "fwd", "dtype", "ndim", "head_dim", "has_cache", "has_mask", "device_cuda", "grad_enabled",
    "inference", "training", "no_grad", "mask_free", "cuda_device", "dtpye", "span",
    "prefill", "decode", "float16", "half", "bfloat16", "bfloat61", "0", "3", "64", "3d",
    "9" * 30, "@", "é", "\n",
]  # fmt: skip


def check_compiles_or_fails_cleanly(text: str) -> None:
    """``text`` compiles to a spec whose description round-trips, or fails with a caret."""
    try:
        spec = parse_spec(text)
    except SpecSyntaxError as exc:
        start, end = exc.span
        assert 0 <= start <= end <= len(text)
        assert exc.render().startswith(clip(exc.message))  # a long message is clipped
        return
    assert parse_spec(spec.description) == spec
    assert parse_spec(spec.description).description == spec.description


ORDERINGS = ["<", "<=", ">", ">="]
VALUES: dict[str, list[Any]] = {
    "fwd": [None, "prefill", "decode"],
    "dtype": [None, torch.float32, torch.bfloat16, torch.float16, torch.float64],
    "ndim": [None, 2, 3, 4],
    "head_dim": [None, 64, 96, 128],
    "has_cache": [True, False],
    "has_mask": [True, False],
    "device_cuda": [True, False],
    "grad_enabled": [True, False],
}
BOOL_AXES = ["has_cache", "has_mask", "device_cuda", "grad_enabled"]


#: A reference expression, independent of ``Spec``: ("const", bool), ("axis", name),
#: ("pred", name), ("cmp", axis, op, value), ("in", axis, values, negated),
#: ("not", expr), ("and", (expr, ...)), ("or", (expr, ...)).
Expr = tuple[Any, ...]


def _comparisons(axis: str) -> st.SearchStrategy[Expr]:
    values = st.sampled_from(VALUES[axis])
    equalities = st.tuples(st.just("cmp"), st.just(axis), st.sampled_from(["==", "!="]), values)
    members = st.tuples(
        st.just("in"), st.just(axis), st.lists(values, min_size=1, max_size=3).map(tuple),
        st.booleans(),
    )
    if axis not in ("ndim", "head_dim"):
        return equalities | members
    ordered = st.sampled_from([v for v in VALUES[axis] if v is not None])
    orderings = st.tuples(st.just("cmp"), st.just(axis), st.sampled_from(ORDERINGS), ordered)
    return equalities | members | orderings


LEAVES: st.SearchStrategy[Expr] = st.one_of(
    st.tuples(st.just("const"), st.booleans()),
    st.tuples(st.just("axis"), st.sampled_from(BOOL_AXES)),
    st.tuples(st.just("pred"), st.sampled_from(sorted(CORE_VOCABULARY.predicates))),
    *[_comparisons(axis) for axis in VALUES],
)


def _compound(children: st.SearchStrategy[Expr]) -> st.SearchStrategy[Expr]:
    several = st.lists(children, min_size=2, max_size=3).map(tuple)
    return st.one_of(
        st.tuples(st.just("not"), children),
        st.tuples(st.just("and"), several),
        st.tuples(st.just("or"), several),
    )


def _depth(node: Expr) -> int:
    """How deeply ``not``, ``and`` and ``or`` nest in ``node``."""
    if node[0] == "not":
        return 1 + _depth(node[1])
    if node[0] in ("and", "or"):
        return 1 + max(_depth(item) for item in node[1])
    return 0


EXPRESSIONS: st.SearchStrategy[Expr] = st.recursive(LEAVES, _compound, max_leaves=10).filter(
    lambda node: _depth(node) < MAX_DEPTH // 2
)


def build(node: Expr) -> Spec:
    """The spec for ``node``, made with the public combinators (no text involved)."""
    match node:
        case ("const", value):
            return Spec.always() if value else Spec.never()
        case ("axis", axis):
            return Spec.has_cache() if axis == "has_cache" else parse_spec(axis)
        case ("pred", name):
            return getattr(Spec, name)()  # type: ignore[no-any-return]
        case ("cmp", axis, op, value):
            return Spec.compare(axis, op, value)
        case ("in", axis, values, negated):
            return Spec.member(axis, values, negated)
        case ("not", item):
            return ~build(item)
        case ("and", items):
            spec = build(items[0])
            for item in items[1:]:
                spec = spec & build(item)
            return spec
        case ("or", items):
            spec = build(items[0])
            for item in items[1:]:
                spec = spec | build(item)
            return spec
    raise AssertionError(node)


GRID = [
    call(fwd=fwd, dtype=dtype, ndim=ndim, head_dim=head_dim, has_cache=cache, has_mask=mask,
         grad_enabled=grad, device_cuda=cuda)
    for fwd, dtype, ndim, head_dim, (cache, mask, grad, cuda) in itertools.product(
        [None, "prefill", "decode"],
        [torch.float32, torch.bfloat16, torch.float16, None],
        [None, 3, 4],
        [None, 64, 128],
        [(False, False, True, False), (True, False, False, True), (True, True, True, False),
         (False, True, False, True)],
    )
]  # fmt: skip

_OPERATORS: dict[str, Callable[[Any, Any], bool]] = {
    "==": operator.eq, "!=": operator.ne, "<": operator.lt,
    "<=": operator.le, ">": operator.gt, ">=": operator.ge,
}  # fmt: skip
_PREDICATES: dict[str, Callable[[CallContext], bool]] = {
    "inference": lambda ctx: ctx.fwd is not None,
    "training": lambda ctx: ctx.fwd is None,
    "no_grad": lambda ctx: not ctx.grad_enabled,
    "mask_free": lambda ctx: not ctx.has_mask,
    "cuda_device": lambda ctx: ctx.device_cuda,
}


def evaluate(node: Expr, ctx: CallContext) -> bool:
    """A reference evaluator, written independently of ``Spec``."""
    match node:
        case ("const", value):
            return bool(value)
        case ("axis", axis):
            return bool(getattr(ctx, axis))
        case ("pred", name):
            return _PREDICATES[name](ctx)
        case ("cmp", axis, op, value):
            got = getattr(ctx, axis)
            if op in ORDERINGS and got is None:
                return False
            return _OPERATORS[op](got, value)
        case ("in", axis, values, negated):
            return (getattr(ctx, axis) in values) != negated
        case ("not", item):
            return not evaluate(item, ctx)
        case ("and", items):
            return all(evaluate(i, ctx) for i in items)
        case ("or", items):
            return any(evaluate(i, ctx) for i in items)
    raise AssertionError(node)


class TestParseExpression:
    @pytest.mark.parametrize("text", [example for example, _, _ in CONTRACT_EXAMPLES])
    def test_spec_examples_parse(self, text: str) -> None:
        """Every example of contract §4 parses and prints back as itself."""
        assert parse_spec(text).description == text

    def test_builds_typed_combinators(self) -> None:
        """Values are typed by their axis: enum strings, dtypes, ints, bools and None."""
        spec = parse_spec("fwd in {prefill, none} and dtype == half and ndim >= 3")
        assert spec == (Spec.member("fwd", ("prefill", None))
                        & Spec.compare("dtype", "==", torch.float16)
                        & Spec.compare("ndim", ">=", 3))
        assert spec.encode() == ["and", [["in", "fwd", ["prefill", None], False],
                                         ["cmp", "dtype", "==", {"dtype": "float16"}],
                                         ["cmp", "ndim", ">=", 3]]]

    def test_bool_axis_comparisons(self) -> None:
        """A bool axis compares with true and false, and tests membership."""
        spec = parse_spec("has_cache == true or has_mask not in {false}")
        assert spec == (Spec.compare("has_cache", "==", True)
                        | Spec.member("has_mask", (False,), negated=True))

    def test_names_axes_and_predicates(self) -> None:
        """A standing bool axis is an atom; a predicate stands for its definition."""
        spec = parse_spec("not has_cache and inference")
        assert spec == ~Spec.has_cache() & Spec.inference()
        negated, named = spec.parts
        assert (negated.kind, negated.parts[0].kind, named.kind) == ("not", "atom", "named")
        assert named.parts == (Spec.compare("fwd", "!=", None),)

    def test_parentheses_leave_no_trace(self) -> None:
        """A parenthesised expression is the expression itself."""
        assert parse_spec("has_cache and ( fwd == decode )") == parse_spec(
            "has_cache and fwd == decode")

    def test_precedence(self) -> None:
        """``not`` binds tighter than ``and``, which binds tighter than ``or``."""
        spec = parse_spec("not has_cache and has_mask or device_cuda")
        assert spec.kind == "or" and spec.parts[0].kind == "and"
        assert spec.parts[0].parts[0].kind == "not"

    def test_whitespace_is_free(self) -> None:
        """Whitespace between tokens is optional and may be any amount."""
        assert (
            parse_spec("\tndim>=3 and(fwd!=none)\n").description == "ndim >= 3 and fwd != none"
        )

    def test_keywords_are_only_keywords_as_whole_words(self) -> None:
        """Extra axes whose names start with a keyword are ordinary names."""
        extras = {
            "order": Axis("order", "int", core=False),
            "notes": Axis("notes", "bool", core=False),
            "inner": Axis("inner", "bool", core=False),
        }
        text = "order in {1, 2} or notes and not inner"
        assert parse_spec(text, CORE_VOCABULARY.with_extras(extras)).description == text

    @pytest.mark.parametrize("keyword", sorted(KEYWORDS))
    def test_keywords_cannot_name_an_axis(self, keyword: str) -> None:
        """A keyword in an axis's place is a syntax error, whatever the vocabulary says."""
        vocabulary = CORE_VOCABULARY.with_extras({keyword: Axis(keyword, "int", core=False)})
        with pytest.raises(SpecSyntaxError):
            parse_spec(f"{keyword} == 3", vocabulary)

    def test_extra_axis(self) -> None:
        """An extra axis is accepted in the vocabulary that declares it."""
        spec = parse_spec("span >= 128", SPANNED)
        assert spec.test is not None and spec.test.axis == SPAN
        assert spec.encode() == ["cmp", "span", ">=", 128]

    def test_errors_are_value_errors(self) -> None:
        """The syntax error is a ValueError carrying the source and span."""
        with pytest.raises(ValueError) as info:
            parse_spec("ndim == x")
        assert isinstance(info.value, SpecSyntaxError)
        assert (info.value.source, info.value.span) == ("ndim == x", (8, 9))

    def test_error_unknown_axis(self) -> None:
        """An unknown axis in a comparison is named, with a suggestion and the axes."""
        assert rendered("dtpye == float16") == error(
            f"unknown axis 'dtpye' (did you mean 'dtype'?); expected one of: {CORE_AXES}",
            "dtpye == float16",
            "^~~~~",
        )

    def test_error_unknown_name(self) -> None:
        """An unknown standing name lists both axes and predicates."""
        assert rendered("has_cache and no_grd") == error(
            f"unknown axis or predicate 'no_grd' (did you mean 'no_grad'?); "
            f"expected one of: {CORE_NAMES}",
            "has_cache and no_grd",
            "              ^~~~~~",
        )

    def test_error_extra_axis_outside_its_vocabulary(self) -> None:
        """An extra axis is unknown to the core vocabulary."""
        assert rendered("span >= 128") == error(
            f"unknown axis 'span'; expected one of: {CORE_AXES}", "span >= 128", "^~~~"
        )

    def test_error_unknown_dtype(self) -> None:
        """An unknown dtype suggests the close one and lists the common dtypes."""
        assert rendered("dtype == bfloat61") == error(
            f"unknown dtype 'bfloat61' (did you mean 'bfloat16'?); expected a torch dtype "
            f"name such as {ALL_DTYPES}",
            "dtype == bfloat61",
            "         ^~~~~~~~",
        )

    def test_every_torch_dtype_name_parses(self) -> None:
        """The error lists only common dtypes, but every torch dtype name is accepted."""
        for name, dtype in DTYPES.items():
            assert Spec.parse(f"dtype == {name}").matches(CallContext("f", dtype=dtype))

    def test_error_unknown_enum_value(self) -> None:
        """An unknown forward mode suggests the close one and lists the modes."""
        assert rendered("fwd == prefil") == error(
            "unknown value 'prefil' for 'fwd' (did you mean 'prefill'?); "
            "expected one of: prefill, decode, none",
            "fwd == prefil",
            "       ^~~~~~",
        )

    def test_error_wrong_type(self) -> None:
        """A dtype name where an integer belongs is a type error under the value."""
        assert rendered("head_dim == bfloat16") == error(
            "expected an integer or none for 'head_dim', got 'bfloat16'",
            "head_dim == bfloat16",
            "            ^~~~~~~~",
        )

    def test_error_wrong_type_in_set(self) -> None:
        """An integer in a set of forward modes lists the modes."""
        assert rendered("fwd in {prefill, 3}") == error(
            "expected a value for 'fwd', got '3'; one of: prefill, decode, none",
            "fwd in {prefill, 3}",
            "                 ^",
        )

    def test_error_wrong_case_boolean(self) -> None:
        """``True`` is not a value; the error suggests ``true``."""
        assert rendered("has_cache == True") == error(
            "expected true or false for 'has_cache', got 'True' (did you mean 'true'?)",
            "has_cache == True",
            "             ^~~~",
        )

    def test_error_none_on_non_nullable_axis(self) -> None:
        """``none`` is refused on an axis that cannot be None."""
        assert rendered("has_cache != none") == error(
            "expected true or false for 'has_cache', got 'none'",
            "has_cache != none",
            "             ^~~~",
        )

    def test_error_ordering_on_unordered_axis(self) -> None:
        """``<`` on a dtype is refused under the operator."""
        assert rendered("dtype < float16") == error(
            "'dtype' is not ordered (a dtype axis); expected ==, !=, in or not in, got '<'",
            "dtype < float16",
            "      ^",
        )

    def test_error_ordering_against_none(self) -> None:
        """An ordering comparison needs an integer, not ``none``."""
        assert rendered("ndim < none") == error(
            "expected an integer for 'ndim', got 'none'", "ndim < none", "       ^~~~"
        )

    def test_error_axis_standing_alone(self) -> None:
        """A non-bool axis without a comparison is refused under its name."""
        assert rendered("dtype and has_cache") == error(
            "'dtype' needs a comparison (==, !=, in or not in); only bool axes stand alone",
            "dtype and has_cache",
            "^~~~~",
        )

    def test_error_int_axis_standing_alone(self) -> None:
        """An integer axis standing alone lists the ordering operators too."""
        assert rendered("ndim = 3") == error(
            "'ndim' needs a comparison (==, !=, <, <=, >, >=, in or not in); "
            "only bool axes stand alone",
            "ndim = 3",
            "^~~~",
        )

    def test_error_predicate_with_comparison(self) -> None:
        """A predicate cannot be compared."""
        assert rendered("inference == true") == error(
            "'inference' is a predicate and takes no comparison, got '=='",
            "inference == true",
            "          ^~",
        )

    def test_error_missing_value(self) -> None:
        """A comparison cut short lists the values the axis takes."""
        assert rendered("dtype ==") == error(
            f"expected a value for 'dtype', got end of input; one of: {ALL_DTYPES}",
            "dtype ==",
            "        ^",
        )

    def test_error_keyword_as_value(self) -> None:
        """A keyword is not a value."""
        assert rendered("fwd == and") == error(
            "expected a value for 'fwd', got keyword 'and'; one of: prefill, decode, none",
            "fwd == and",
            "       ^~~",
        )

    def test_error_keyword_as_axis(self) -> None:
        """A keyword where an atom belongs says what an atom can be."""
        assert rendered("in == 3") == error(
            "expected an axis, a predicate, 'not', 'always', 'never' or '(', got keyword 'in'",
            "in == 3",
            "^~",
        )

    def test_error_empty_input(self) -> None:
        """Empty text is missing an expression."""
        assert rendered("") == error(
            "expected an axis, a predicate, 'not', 'always', 'never' or '(', got end of input",
            "",
            "^",
        )

    def test_error_dangling_operator(self) -> None:
        """An ``and`` with nothing after it points just past the end."""
        assert rendered("has_cache and") == error(
            "expected an axis, a predicate, 'not', 'always', 'never' or '(', got end of input",
            "has_cache and",
            "             ^",
        )

    def test_error_unclosed_parenthesis(self) -> None:
        """An unclosed ``(`` underlines everything from the bracket on."""
        assert rendered("not (has_cache or has_mask") == error(
            "expected 'and', 'or' or ')' to close '(', got end of input",
            "not (has_cache or has_mask",
            "    ^~~~~~~~~~~~~~~~~~~~~~",
        )

    def test_error_garbage_inside_parentheses(self) -> None:
        """Garbage before a ``)`` underlines from the open bracket through the garbage."""
        assert rendered("(has_cache foo)") == error(
            "expected 'and', 'or' or ')' to close '(', got 'foo'",
            "(has_cache foo)",
            "^~~~~~~~~~~~~~",
        )

    def test_error_unclosed_brace(self) -> None:
        """An unclosed ``{`` underlines everything from the bracket on."""
        assert rendered("fwd in {prefill, decode") == error(
            "expected ',' or '}' to close '{', got end of input",
            "fwd in {prefill, decode",
            "       ^~~~~~~~~~~~~~~~",
        )

    def test_error_empty_set(self) -> None:
        """``{}`` is refused."""
        assert rendered("fwd in {}") == error(
            "empty set: 'in' needs at least one value for 'fwd'", "fwd in {}", "       ^~"
        )

    def test_error_trailing_comma(self) -> None:
        """A comma must be followed by a value."""
        assert rendered("fwd in {prefill,}") == error(
            "expected a value for 'fwd', got '}'; one of: prefill, decode, none",
            "fwd in {prefill,}",
            "                ^",
        )

    def test_error_missing_brace(self) -> None:
        """``in`` must be followed by a ``{``."""
        assert rendered("fwd in prefill") == error(
            "expected '{' after 'in', got 'prefill'", "fwd in prefill", "       ^~~~~~~"
        )

    def test_error_not_without_in(self) -> None:
        """``not`` after an axis must begin ``not in``."""
        assert rendered("fwd not prefill") == error(
            "expected 'in' after 'not', got 'prefill'", "fwd not prefill", "        ^~~~~~~"
        )

    def test_error_trailing_garbage(self) -> None:
        """Text after a complete expression is refused."""
        assert rendered("has_cache foo") == error(
            "expected 'and', 'or' or end of input, got 'foo'", "has_cache foo", "          ^~~"
        )

    def test_error_stray_closing_parenthesis(self) -> None:
        """A ``)`` with no ``(`` is refused."""
        assert rendered("has_cache)") == error(
            "expected 'and', 'or' or end of input, got ')'", "has_cache)", "         ^"
        )

    def test_error_unknown_character(self) -> None:
        """A character no token starts with is named."""
        assert rendered("has_cache && has_mask") == error(
            "expected 'and', 'or' or end of input, got unknown character '&'",
            "has_cache && has_mask",
            "          ^",
        )

    def test_error_malformed_integer(self) -> None:
        """Digits run into letters are not an integer."""
        assert rendered("ndim == 3d") == error(
            "expected an integer or none for 'ndim', got '3d'", "ndim == 3d", "        ^~"
        )

    def test_error_integer_too_large(self) -> None:
        """An integer literal longer than 18 digits is refused."""
        digits = "1" * 19
        assert rendered(f"ndim == {digits}") == error(
            "integer too large for 'ndim' (at most 18 digits)",
            f"ndim == {digits}",
            "        ^" + "~" * 18,
        )

    def test_error_nested_too_deeply(self) -> None:
        """Nesting past the limit is refused at the first bracket too many."""
        text = "(" * (MAX_DEPTH + 1) + "has_cache" + ")" * (MAX_DEPTH + 1)
        # A long expression is echoed 60 characters either side of the error, elided.
        lo = MAX_DEPTH - ECHO
        assert rendered(text) == error(
            f"expression nested too deeply (more than {MAX_DEPTH} levels of '(' and 'not')",
            "..." + text[lo:MAX_DEPTH + 1 + ECHO] + "...",
            " " * (3 + ECHO) + "^",
        )

    def test_deep_not_chains_never_overflow_the_stack(self) -> None:
        """Thousands of ``not``s are a syntax error, not a RecursionError."""
        with pytest.raises(SpecSyntaxError):
            parse_spec("not " * 5000 + "has_cache")


class TestDescription:
    @pytest.mark.parametrize(
        ("text", "canonical"),
        [
            (
                "fwd in {prefill,decode} and has_cache and dtype==bfloat16",
                "fwd in {prefill, decode} and has_cache and dtype == bfloat16",
            ),
            ("not (has_cache or has_mask)", "not (has_cache or has_mask)"),
            ("(has_cache or has_mask) and device_cuda", "(has_cache or has_mask) and device_cuda"),
            (
                "(has_cache and has_mask) and (device_cuda and no_grad)",
                "has_cache and has_mask and device_cuda and no_grad",
            ),
            ("has_cache or (has_mask or (device_cuda))", "has_cache or has_mask or device_cuda"),
            ("(not has_cache) and not not has_mask", "not has_cache and not not has_mask"),
            ("dtype in {half, float16, bfloat16}", "dtype in {float16, bfloat16}"),
            ("dtype == half", "dtype == float16"),
            ("fwd!=none", "fwd != none"),
        ],
    )
    def test_canonical_text(self, text: str, canonical: str) -> None:
        """Text is printed canonically, equal to the compiled spec's description."""
        expected = canonical
        assert parse_spec(text).description == expected
        assert parse_spec(expected) == parse_spec(text)

    def test_hand_built_nested_ands_flatten(self) -> None:
        """An ``and`` inside an ``and`` prints without parentheses, as the spec does."""
        inner = Spec.has_cache() & parse_spec("has_mask")
        spec = inner & Spec.never()
        assert spec.description == "has_cache and has_mask and never"
        assert len(spec.parts) == 3

    def test_or_inside_not_and_and_is_parenthesised(self) -> None:
        """An ``or`` under ``not`` or ``and`` keeps its parentheses."""
        either = Spec.has_cache() | Spec.training()
        spec = ~either & either
        assert spec.description == "not (has_cache or training) and (has_cache or training)"
        assert parse_spec(spec.description) == spec

    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(node=EXPRESSIONS)
    def test_round_trip(self, node: Expr) -> None:
        """A spec's description parses back to an equal spec with the same description, and
        its plain encoding decodes to an equal spec."""
        spec = build(node)
        text = spec.description
        assert parse_spec(text) == spec
        assert parse_spec(text).description == text
        assert Spec.decode(spec.encode()) == spec
        assert Spec.decode(spec.encode()).description == text


class TestMatches:
    @pytest.mark.parametrize(("text", "accepted", "refused"), CONTRACT_EXAMPLES)
    def test_spec_examples_evaluate(
        self, text: str, accepted: dict[str, Any], refused: dict[str, Any] | None
    ) -> None:
        """Each contract §4 example accepts the call it should and refuses the other."""
        spec = parse_spec(text)
        assert spec.matches(call(**accepted))
        if refused is not None:
            assert not spec.matches(call(**refused))

    def test_extra_axis_reads_the_context_extras(self) -> None:
        """An extra axis reads its value from ``ctx.extra``."""
        spec = parse_spec("span >= 128 and has_cache", SPANNED)
        assert spec.matches(call(has_cache=True, extra={"span": 256}))
        assert not spec.matches(call(has_cache=True, extra={"span": 64}))
        assert not spec.matches(call(has_cache=True))

    def test_vocabulary_predicate(self) -> None:
        """A vocabulary's own predicate compiles from its expression."""
        vocabulary = Vocabulary(
            predicates={"long_window": ("span > 4096", "span")}
        ).with_extras({"span": SPAN})
        spec = parse_spec("long_window", vocabulary)
        assert spec.description == "long_window"
        assert spec.matches(call(extra={"span": 8192}))
        assert not spec.matches(call(extra={"span": 1024}))

    def test_error_decoding_an_unknown_axis(self) -> None:
        """Decoding names its axes in the vocabulary: an unknown one is a ValueError."""
        with pytest.raises(ValueError, match="not an encoded spec"):
            Spec.decode(["and", [["axis", "has_cache"], ["axis", "has_cahce"]]])

    def test_error_decoding_garbage(self) -> None:
        """Data that is not an encoding is a ValueError, never another exception."""
        for plain in (["xor", []], [], ["cmp", "ndim"], ["in", "fwd", 3, False]):
            with pytest.raises(ValueError, match="not an encoded spec"):
                Spec.decode(plain)

    def test_opaque_spec_has_no_encoding(self) -> None:
        """A spec that calls Python cannot be encoded."""
        with pytest.raises(TypeError, match="calls Python"):
            (Spec.of(bool, "python") & Spec.has_cache()).encode()

    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(node=EXPRESSIONS)
    def test_truth_table_survives_text(self, node: Expr) -> None:
        """The built spec, its reparsed text, its decoded encoding and a reference evaluator
        agree on every call."""
        direct = build(node)
        reparsed = parse_spec(direct.description)
        decoded = Spec.decode(direct.encode())
        for ctx in GRID:
            expected = evaluate(node, ctx)
            assert direct.matches(ctx) is expected
            assert reparsed.matches(ctx) is expected
            assert decoded.matches(ctx) is expected
            # The generated function the evaluator's chain walk calls agrees too.
            assert bool(direct.matcher()(ctx)) is expected
            assert bool(decoded.matcher()(ctx)) is expected


class TestMatcher:
    """``Spec.matcher()``: the spec as one generated function, the same answers."""

    def test_made_once_and_kept(self) -> None:
        spec = parse_spec("dtype in {half} and head_dim <= 128")
        assert spec.matcher() is spec.matcher()
        assert spec.matcher().__code__.co_filename == "<astrai spec>"

    def test_extra_axis_goes_through_its_getter(self) -> None:
        m = parse_spec("span >= 128 and has_cache", SPANNED).matcher()
        assert m(call(has_cache=True, extra={"span": 256}))
        assert not m(call(has_cache=True, extra={"span": 64}))
        assert not m(call(has_cache=True))  # none is never ordered

    @pytest.mark.parametrize(("text", "ndim", "head_dim", "want"), [
        ("head_dim > ndim", 4, 8, True), ("head_dim < ndim", None, 8, False),
        ("head_dim >= ndim", 4, None, False), ("head_dim == ndim", None, None, True),
        ("ndim < 4", None, None, False), ("ndim != 4", None, None, True),
    ])
    def test_none_is_never_ordered(self, text: str, ndim: int | None, head_dim: int | None,
                                   want: bool) -> None:
        ctx = CallContext("x", ndim=ndim, head_dim=head_dim)
        assert parse_spec(text).matches(ctx) is want
        assert bool(parse_spec(text).matcher()(ctx)) is want

    def test_values_are_bound_not_spelled(self) -> None:
        """A value reaches the generated code by name, whatever its text would be."""
        axis = Axis("tag", "enum", values=("a'); import os; ('",), core=False)
        vocabulary = CORE_VOCABULARY.with_extras({"tag": axis})
        spec = Spec.decode(["in", "tag", ["a'); import os; ('"], False], vocabulary)
        assert spec.matcher()(call(extra={"tag": "a'); import os; ('"}))
        assert not spec.matcher()(call(extra={"tag": "b"}))

    def test_python_predicates_are_called(self) -> None:
        seen: list[CallContext] = []

        def probe(ctx: CallContext) -> bool:
            seen.append(ctx)
            return ctx.ndim == 3

        m = (Spec.of(probe, "probe") & Spec.has_cache()).matcher()
        assert m(call(ndim=3, has_cache=True)) and not m(call(ndim=4, has_cache=True))
        assert len(seen) == 2

    def test_copies_are_the_spec_itself(self) -> None:
        """A spec is an immutable value: copying it gives it back (it used to raise)."""
        import copy

        spec = parse_spec("dtype in {half} and ndim == 4")
        assert copy.copy(spec) is spec and copy.deepcopy(spec) is spec
        assert copy.deepcopy({"when": spec})["when"] is spec

    def test_an_axis_read_by_its_own_function(self) -> None:
        """A core axis whose getter is a function (not the attribute) is read by it."""
        big = Axis("big", "bool", getter=lambda ctx: (ctx.ndim or 0) >= 4)
        spec = parse_spec("big and not has_cache", CORE_VOCABULARY.with_extras({"big": big}))
        assert spec.matcher()(call(ndim=4)) and not spec.matcher()(call(ndim=3))

    def test_a_name_python_would_normalise_is_read_by_the_getter(self) -> None:
        """A non-ASCII axis name is never spelled in the generated text: Python would read
        another attribute (NFKC: a full-width f is an f)."""
        odd = Axis("\uff46amily", "bool")
        spec = Spec.decode(["axis", "\uff46amily"], CORE_VOCABULARY.with_extras({odd.name: odd}))
        with pytest.raises(AttributeError):
            spec.matches(call())
        with pytest.raises(AttributeError):
            spec.matcher()(call())

    def test_too_deep_to_generate_keeps_the_tree_walk(self) -> None:
        """A spec nested beyond what Python compiles answers through ``matches``."""
        spec = Spec.has_cache()
        for _ in range(400):
            spec = ~spec
        assert spec.matcher() == spec.matches
        assert spec.matcher()(call(has_cache=True)) is True


class TestParseSpec:
    def test_returns_spec(self) -> None:
        """The result is a Spec whose description is the canonical text."""
        spec = parse_spec("dtype in {half} and head_dim <= 128")
        assert isinstance(spec, Spec)
        assert spec.description == "dtype in {float16} and head_dim <= 128"

    def test_parse_spec_uses_the_grammar(self) -> None:
        """``Spec.parse`` compiles through the grammar."""
        assert Spec.parse("training or no_grad") == parse_spec("training or no_grad")

    def test_cached_per_text(self) -> None:
        """Compiling the same text twice returns the same object."""
        assert parse_spec("has_cache and ndim == 4") is parse_spec(
            "has_cache and ndim == 4"
        )

    def test_cached_per_vocabulary(self) -> None:
        """Equal vocabularies share a cache entry; a different vocabulary does not."""
        again = CORE_VOCABULARY.with_extras({"span": SPAN})
        spec = parse_spec("span == none", SPANNED)
        assert parse_spec("span == none", again) is spec
        other = CORE_VOCABULARY.with_extras({"span": Axis("span", "int", core=False)})
        with pytest.raises(SpecSyntaxError, match="expected an integer for 'span'"):
            parse_spec("span == none", other)

    def test_extra_axis_only_in_its_vocabulary(self) -> None:
        """An extra axis compiles in its vocabulary and fails in the core one."""
        assert parse_spec("span > 0", SPANNED).matches(call(extra={"span": 1}))
        with pytest.raises(SpecSyntaxError, match="unknown axis 'span'"):
            parse_spec("span > 0")

    def test_error_is_rendered_with_caret(self) -> None:
        """Compilation raises the parser's error unchanged."""
        with pytest.raises(SpecSyntaxError) as info:
            parse_spec("fwd == prefil")
        assert str(info.value) == error(
            "unknown value 'prefil' for 'fwd' (did you mean 'prefill'?); "
            "expected one of: prefill, decode, none",
            "fwd == prefil",
            "       ^~~~~~",
        )

    @settings(max_examples=200, deadline=None)
    @given(text=st.text(max_size=40))
    def test_any_text_compiles_or_raises_syntax_error(self, text: str) -> None:
        """Arbitrary text either compiles or raises SpecSyntaxError."""
        check_compiles_or_fails_cleanly(text)

    @settings(max_examples=200, deadline=None)
    @given(
        words=st.lists(st.sampled_from(TOKEN_SOUP), max_size=12),
        separator=st.sampled_from([" ", ""]),
    )
    def test_any_token_soup_compiles_or_raises_syntax_error(
        self, words: list[str], separator: str
    ) -> None:
        """Any sequence of grammar tokens either compiles or raises SpecSyntaxError."""
        check_compiles_or_fails_cleanly(separator.join(words))

    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(node=EXPRESSIONS, data=st.data())
    def test_any_damaged_expression_compiles_or_raises_syntax_error(
        self, node: Expr, data: st.DataObject
    ) -> None:
        """A valid expression cut short, or with a token spliced in, never crashes the parser."""
        text = build(node).description
        cut = data.draw(st.integers(min_value=0, max_value=len(text)))
        word = data.draw(st.sampled_from(TOKEN_SOUP))
        check_compiles_or_fails_cleanly(text[:cut])
        check_compiles_or_fails_cleanly(f"{text[:cut]} {word} {text[cut:]}")


class TestSpecValues:
    def test_frozen(self) -> None:
        """Specs cannot be changed after construction."""
        spec = parse_spec("has_cache")
        with pytest.raises(AttributeError):
            spec.axis = "has_mask"  # type: ignore[attr-defined]

    def test_hashable(self) -> None:
        """Equal specs hash equally."""
        assert hash(parse_spec("not has_cache")) == hash(~Spec.has_cache())

    def test_junction_of_one_is_the_item(self) -> None:
        """An ``and`` never holds a single item: it is that item."""
        spec = parse_spec("(has_cache)")
        assert spec == Spec.has_cache() and spec.kind == "atom"

    def test_set_order_does_not_matter(self) -> None:
        """Sets are sets: order and repeats do not change equality."""
        assert parse_spec("ndim in {3, 2, 3}") == parse_spec("ndim in {2, 3}")


class TestAxisComparisons:
    """Two axes of one type compared with each other: ``head_dim == ndim``."""

    @pytest.mark.parametrize(("text", "ndim", "head_dim", "want"), [
        ("head_dim == ndim", 4, 4, True), ("head_dim == ndim", 4, 8, False),
        ("head_dim != ndim", 4, 8, True), ("head_dim > ndim", 4, 8, True),
        ("head_dim <= ndim", 4, 8, False), ("head_dim < ndim", None, 8, False),
        ("head_dim == ndim", None, None, True),
    ])
    def test_matches(self, text: str, ndim: int | None, head_dim: int | None,
                     want: bool) -> None:
        spec = parse_spec(text)
        assert spec.matches(CallContext("x", ndim=ndim, head_dim=head_dim)) is want

    def test_round_trips(self) -> None:
        spec = parse_spec("head_dim >= ndim and (fwd != fwd or dtype == dtype)")
        assert spec.description == "head_dim >= ndim and (fwd != fwd or dtype == dtype)"
        assert parse_spec(spec.description) == spec
        assert Spec.decode(spec.encode()) == spec
        assert spec.encode()[1][0] == ["cmpaxes", "head_dim", ">=", "ndim"]

    def test_explain_reason_names_both_values(self) -> None:
        spec = parse_spec("head_dim == ndim")
        assert spec.failure(CallContext("x", ndim=4, head_dim=8)) == (
            "head_dim == ndim (call has 8 and 4)")

    def test_values_still_win_over_axis_names(self) -> None:
        """A name that is one of the axis's own values stays a value."""
        assert parse_spec("fwd == prefill").encode() == ["cmp", "fwd", "==", "prefill"]
        assert parse_spec("dtype == float16").encode()[0] == "cmp"

    @pytest.mark.parametrize(("text", "caret"), [
        ("head_dim == dtype", " " * 12 + "^~~~~"),
        ("fwd == has_cache", " " * 7 + "^~~~~~~~~"),
    ])
    def test_error_axes_of_another_type(self, text: str, caret: str) -> None:
        left, right = text.split(" == ")
        kinds = {"head_dim": "int", "fwd": "enum", "dtype": "dtype", "has_cache": "bool"}
        assert rendered(text) == error(
            f"{left!r} ({kinds[left]}) cannot be compared with {right!r} ({kinds[right]}): "
            f"axes compared with each other must be of one type", text, caret)

    def test_no_cut_points_for_int_axes_compared_with_each_other(self) -> None:
        from astrai.dispatch.expr.analysis import cut_points

        assert cut_points([parse_spec("head_dim == ndim")]) is None
        assert cut_points([parse_spec("fwd == fwd and ndim < 3")]) == {"ndim": (3,)}
