"""Tests for the spec expression grammar (SPEC §4): parsing, type checks, text, compilation."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from astrai.dispatch._parser import MAX_DEPTH
from astrai.dispatch.axes import CORE_VOCABULARY, DTYPES, KEYWORDS, Axis, CallContext, Vocabulary
from astrai.dispatch.grammar import (
    AndNode,
    AxisNode,
    CompareNode,
    ConstNode,
    Expr,
    MemberNode,
    NotNode,
    OrNode,
    PredicateNode,
    compile_expression,
    parse_expression,
    to_spec,
    to_text,
)
from astrai.dispatch.spec import Spec
from astrai.errors import ECHO, SpecSyntaxError

WINDOW = Axis("window", "int", nullable=True, core=False)
WINDOWED = CORE_VOCABULARY.with_extras({"window": WINDOW})
#: Error messages list the common dtypes (every torch dtype name is accepted).
COMMON = ("float16, bfloat16, float32, float64, float8_e4m3fn, float8_e5m2, int8, int16, "
          "int32, int64, uint8, bool, complex64, complex128")
ALL_DTYPES = f"{COMMON}, none"
CORE_AXES = "device_cuda, dtype, fwd, grad_enabled, has_cache, has_mask, head_dim, ndim"
CORE_NAMES = (
    "cuda_device, device_cuda, dtype, fwd, grad_enabled, has_cache, has_mask, head_dim, "
    "inference, mask_free, ndim, no_grad, training"
)

BIG = (
    "fwd in {prefill, decode} and has_cache and ndim == 3 and dtype == bfloat16"
    " and head_dim in {32, 64, 128, 256}"
)
#: The examples of SPEC §4 with a call each accepts and a call each refuses.
SPEC_EXAMPLES: list[tuple[str, dict[str, Any], dict[str, Any] | None]] = [
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
        parse_expression(text, vocabulary)
    return info.value.render()


def error(message: str, source: str, caret: str) -> str:
    """The expected rendering of an error."""
    return f"{message}\n    {source}\n    {caret}"


# -- property-test machinery --------------------------------------------------------------

TOKEN_SOUP = [
    *sorted(KEYWORDS), "(", ")", "{", "}", ",", "==", "!=", "<", "<=", ">", ">=", "=", "!",
    "fwd", "dtype", "ndim", "head_dim", "has_cache", "has_mask", "device_cuda", "grad_enabled",
    "inference", "training", "no_grad", "mask_free", "cuda_device", "dtpye", "window",
    "prefill", "decode", "float16", "half", "bfloat16", "bfloat61", "0", "3", "64", "3d",
    "9" * 30, "@", "é", "\n",
]  # fmt: skip


def check_compiles_or_fails_cleanly(text: str) -> None:
    """``text`` compiles to a spec whose description round-trips, or fails with a caret."""
    try:
        spec = compile_expression(text)
    except SpecSyntaxError as exc:
        start, end = exc.span
        assert 0 <= start <= end <= len(text)
        assert exc.render().startswith(exc.message)
        return
    assert compile_expression(spec.description).description == spec.description


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


def _comparisons(axis: str) -> st.SearchStrategy[Expr]:
    values = st.sampled_from(VALUES[axis])
    equalities = st.builds(
        CompareNode, axis=st.just(axis), op=st.sampled_from(["==", "!="]), value=values
    )
    members = st.builds(
        MemberNode,
        axis=st.just(axis),
        values=st.lists(values, min_size=1, max_size=3).map(tuple),
        negated=st.booleans(),
    )
    if axis not in ("ndim", "head_dim"):
        return equalities | members
    ordered = st.sampled_from([v for v in VALUES[axis] if v is not None])
    orderings = st.builds(
        CompareNode, axis=st.just(axis), op=st.sampled_from(ORDERINGS), value=ordered
    )
    return equalities | members | orderings


LEAVES: st.SearchStrategy[Expr] = st.one_of(
    st.builds(ConstNode, value=st.booleans()),
    st.builds(AxisNode, axis=st.sampled_from(BOOL_AXES)),
    st.builds(PredicateNode, name=st.sampled_from(sorted(CORE_VOCABULARY.predicates))),
    *[_comparisons(axis) for axis in VALUES],
)


def _compound(children: st.SearchStrategy[Expr]) -> st.SearchStrategy[Expr]:
    several = st.lists(children, min_size=2, max_size=3).map(tuple)
    return st.one_of(
        st.builds(NotNode, item=children),
        st.builds(AndNode, items=several),
        st.builds(OrNode, items=several),
    )


def _depth(node: Expr) -> int:
    """How deeply ``not``, ``and`` and ``or`` nest in ``node``."""
    if isinstance(node, NotNode):
        return 1 + _depth(node.item)
    if isinstance(node, (AndNode, OrNode)):
        return 1 + max(_depth(item) for item in node.items)
    return 0


EXPRESSIONS: st.SearchStrategy[Expr] = st.recursive(LEAVES, _compound, max_leaves=10).filter(
    lambda node: _depth(node) < MAX_DEPTH // 2
)

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
        case ConstNode(value=value):
            return value
        case AxisNode(axis=axis):
            return bool(getattr(ctx, axis))
        case PredicateNode(name=name):
            return _PREDICATES[name](ctx)
        case CompareNode(axis=axis, op=op, value=value):
            got = getattr(ctx, axis)
            if op in ORDERINGS and got is None:
                return False
            return _OPERATORS[op](got, value)
        case MemberNode(axis=axis, values=values, negated=negated):
            return (getattr(ctx, axis) in values) != negated
        case NotNode(item=item):
            return not evaluate(item, ctx)
        case AndNode(items=items):
            return all(evaluate(i, ctx) for i in items)
        case OrNode(items=items):
            return any(evaluate(i, ctx) for i in items)
    raise AssertionError(node)


class TestParseExpression:
    @pytest.mark.parametrize("text", [example for example, _, _ in SPEC_EXAMPLES])
    def test_spec_examples_parse(self, text: str) -> None:
        """Every example of SPEC §4 parses and prints back as itself."""
        assert to_text(parse_expression(text)) == text

    def test_builds_typed_nodes(self) -> None:
        """Values are typed by their axis: enum strings, dtypes, ints, bools and None."""
        node = parse_expression("fwd in {prefill, none} and dtype == half and ndim >= 3")
        assert node == AndNode(
            items=(
                MemberNode(axis="fwd", values=("prefill", None), span=(0, 22)),
                CompareNode(axis="dtype", op="==", value=torch.float16, span=(27, 40)),
                CompareNode(axis="ndim", op=">=", value=3, span=(45, 54)),
            ),
            span=(0, 54),
        )

    def test_bool_axis_comparisons(self) -> None:
        """A bool axis compares with true and false, and tests membership."""
        node = parse_expression("has_cache == true or has_mask not in {false}")
        assert node == OrNode(
            items=(
                CompareNode(axis="has_cache", op="==", value=True, span=(0, 17)),
                MemberNode(axis="has_mask", values=(False,), negated=True, span=(21, 44)),
            ),
            span=(0, 44),
        )

    def test_names_axes_and_predicates(self) -> None:
        """A standing bool axis becomes an AxisNode and a predicate a PredicateNode."""
        node = parse_expression("not has_cache and inference")
        assert node == AndNode(
            items=(
                NotNode(item=AxisNode(axis="has_cache", span=(4, 13)), span=(0, 13)),
                PredicateNode(name="inference", span=(18, 27)),
            ),
            span=(0, 27),
        )

    def test_parenthesised_span_includes_the_parentheses(self) -> None:
        """A parenthesised expression's span covers its parentheses."""
        node = parse_expression("has_cache and ( fwd == decode )")
        assert isinstance(node, AndNode)
        assert node.items[1].span == (14, 31)

    def test_precedence(self) -> None:
        """``not`` binds tighter than ``and``, which binds tighter than ``or``."""
        node = parse_expression("not has_cache and has_mask or device_cuda")
        assert isinstance(node, OrNode) and isinstance(node.items[0], AndNode)
        assert isinstance(node.items[0].items[0], NotNode)

    def test_whitespace_is_free(self) -> None:
        """Whitespace between tokens is optional and may be any amount."""
        assert (
            to_text(parse_expression("\tndim>=3 and(fwd!=none)\n")) == "ndim >= 3 and fwd != none"
        )

    def test_keywords_are_only_keywords_as_whole_words(self) -> None:
        """Extra axes whose names start with a keyword are ordinary names."""
        extras = {
            "order": Axis("order", "int", core=False),
            "notes": Axis("notes", "bool", core=False),
            "inner": Axis("inner", "bool", core=False),
        }
        text = "order in {1, 2} or notes and not inner"
        assert to_text(parse_expression(text, CORE_VOCABULARY.with_extras(extras))) == text

    @pytest.mark.parametrize("keyword", sorted(KEYWORDS))
    def test_keywords_cannot_name_an_axis(self, keyword: str) -> None:
        """A keyword in an axis's place is a syntax error, whatever the vocabulary says."""
        vocabulary = CORE_VOCABULARY.with_extras({keyword: Axis(keyword, "int", core=False)})
        with pytest.raises(SpecSyntaxError):
            parse_expression(f"{keyword} == 3", vocabulary)

    def test_extra_axis(self) -> None:
        """An extra axis is accepted in the vocabulary that declares it."""
        assert parse_expression("window >= 128", WINDOWED) == CompareNode(
            axis="window", op=">=", value=128, span=(0, 13)
        )

    def test_errors_are_value_errors(self) -> None:
        """The syntax error is a ValueError carrying the source and span."""
        with pytest.raises(ValueError) as info:
            parse_expression("ndim == x")
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
        assert rendered("window >= 128") == error(
            f"unknown axis 'window'; expected one of: {CORE_AXES}", "window >= 128", "^~~~~~"
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
            parse_expression("not " * 5000 + "has_cache")


class TestToText:
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
        assert to_text(parse_expression(text)) == expected
        assert compile_expression(text).description == expected

    def test_hand_built_nested_ands_flatten(self) -> None:
        """An ``and`` inside an ``and`` prints without parentheses, as the spec does."""
        inner = AndNode(items=(AxisNode(axis="has_cache"), AxisNode(axis="has_mask")))
        node = AndNode(items=(inner, ConstNode(value=False)))
        assert to_text(node) == "has_cache and has_mask and never"
        assert to_spec(node).description == to_text(node)

    def test_or_inside_not_and_and_is_parenthesised(self) -> None:
        """An ``or`` under ``not`` or ``and`` keeps its parentheses."""
        either = OrNode(items=(AxisNode(axis="has_cache"), PredicateNode(name="training")))
        node = AndNode(items=(NotNode(item=either), either))
        assert to_text(node) == "not (has_cache or training) and (has_cache or training)"

    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(node=EXPRESSIONS)
    def test_round_trip(self, node: Expr) -> None:
        """Canonical text parses back to a node with the same canonical text."""
        text = to_text(node)
        assert to_text(parse_expression(text)) == text
        assert to_spec(node).description == text


class TestToSpec:
    @pytest.mark.parametrize(("text", "accepted", "refused"), SPEC_EXAMPLES)
    def test_spec_examples_evaluate(
        self, text: str, accepted: dict[str, Any], refused: dict[str, Any] | None
    ) -> None:
        """Each SPEC §4 example accepts the call it should and refuses the other."""
        spec = to_spec(parse_expression(text))
        assert spec.matches(call(**accepted))
        if refused is not None:
            assert not spec.matches(call(**refused))

    def test_extra_axis_reads_the_context_extras(self) -> None:
        """An extra axis reads its value from ``ctx.extra``."""
        spec = to_spec(parse_expression("window >= 128 and has_cache", WINDOWED), WINDOWED)
        assert spec.matches(call(has_cache=True, extra={"window": 256}))
        assert not spec.matches(call(has_cache=True, extra={"window": 64}))
        assert not spec.matches(call(has_cache=True))

    def test_vocabulary_predicate(self) -> None:
        """A vocabulary's own predicate compiles from its expression."""
        vocabulary = Vocabulary(
            predicates={"long_window": ("window > 4096", "window")}
        ).with_extras({"window": WINDOW})
        spec = to_spec(parse_expression("long_window", vocabulary), vocabulary)
        assert spec.description == "long_window"
        assert spec.matches(call(extra={"window": 8192}))
        assert not spec.matches(call(extra={"window": 1024}))

    def test_error_unknown_axis_in_hand_built_node(self) -> None:
        """A hand-built node naming an unknown axis is refused against its own text."""
        node = AndNode(items=(AxisNode(axis="has_cache"), AxisNode(axis="has_cahce")))
        with pytest.raises(SpecSyntaxError) as info:
            to_spec(node)
        assert info.value.render() == error(
            f"unknown axis 'has_cahce' (did you mean 'has_cache'?); expected one of: {CORE_AXES}",
            "has_cache and has_cahce",
            "^" + "~" * 22,
        )

    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(node=EXPRESSIONS)
    def test_truth_table_survives_text(self, node: Expr) -> None:
        """The compiled node, its reparsed text and a reference evaluator agree on every call."""
        direct = to_spec(node)
        reparsed = compile_expression(to_text(node))
        for ctx in GRID:
            expected = evaluate(node, ctx)
            assert direct.matches(ctx) is expected
            assert reparsed.matches(ctx) is expected


class TestCompileExpression:
    def test_returns_spec(self) -> None:
        """The result is a Spec whose description is the canonical text."""
        spec = compile_expression("dtype in {half} and head_dim <= 128")
        assert isinstance(spec, Spec)
        assert spec.description == "dtype in {float16} and head_dim <= 128"

    def test_parse_spec_uses_the_grammar(self) -> None:
        """``Spec.parse`` compiles through the grammar."""
        assert Spec.parse("training or no_grad") == compile_expression("training or no_grad")

    def test_cached_per_text(self) -> None:
        """Compiling the same text twice returns the same object."""
        assert compile_expression("has_cache and ndim == 4") is compile_expression(
            "has_cache and ndim == 4"
        )

    def test_cached_per_vocabulary(self) -> None:
        """Equal vocabularies share a cache entry; a different vocabulary does not."""
        again = CORE_VOCABULARY.with_extras({"window": WINDOW})
        spec = compile_expression("window == none", WINDOWED)
        assert compile_expression("window == none", again) is spec
        other = CORE_VOCABULARY.with_extras({"window": Axis("window", "int", core=False)})
        with pytest.raises(SpecSyntaxError, match="expected an integer for 'window'"):
            compile_expression("window == none", other)

    def test_extra_axis_only_in_its_vocabulary(self) -> None:
        """An extra axis compiles in its vocabulary and fails in the core one."""
        assert compile_expression("window > 0", WINDOWED).matches(call(extra={"window": 1}))
        with pytest.raises(SpecSyntaxError, match="unknown axis 'window'"):
            compile_expression("window > 0")

    def test_error_is_rendered_with_caret(self) -> None:
        """Compilation raises the parser's error unchanged."""
        with pytest.raises(SpecSyntaxError) as info:
            compile_expression("fwd == prefil")
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
        text = to_text(node)
        cut = data.draw(st.integers(min_value=0, max_value=len(text)))
        word = data.draw(st.sampled_from(TOKEN_SOUP))
        check_compiles_or_fails_cleanly(text[:cut])
        check_compiles_or_fails_cleanly(f"{text[:cut]} {word} {text[cut:]}")


class TestNodes:
    def test_frozen(self) -> None:
        """Nodes cannot be changed after construction."""
        node = AxisNode(axis="has_cache")
        with pytest.raises(ValidationError):
            node.axis = "has_mask"  # type: ignore[misc, unused-ignore]

    def test_hashable(self) -> None:
        """Equal nodes hash equally."""
        assert hash(parse_expression("not has_cache")) == hash(parse_expression("not has_cache"))

    def test_boolean_nodes_need_two_items(self) -> None:
        """An ``and`` of one item is refused."""
        with pytest.raises(ValidationError):
            AndNode(items=(AxisNode(axis="has_cache"),))
