"""A family declared by its schema (``astrai.dispatch.schema``): the checks, the compiled
reading, the facade and the rows' check all follow from one statement, so the Python
path and the compiled path give every call the same verdict - the same error, or the
same key - and a constraint the compiled path cannot check sends the call to the Python
route instead of being skipped."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import random
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import astrai.dispatch as d
from astrai import ops
from astrai.dispatch import state
from astrai.dispatch.expr.analysis import comparisons
from astrai.dispatch.expr.spec import Spec
from astrai.dispatch.facade import FACADES
from astrai.dispatch.keying import KeyPlan
from astrai.dispatch.reading import encode, read
from astrai.dispatch.schema import Choice, Scalar, Schema, Tensor
from astrai.errors import TableError
from astrai.families import Family, declare, every_family, undeclare
from tests.conftest import adopted

#: The families declared here: each with the table its rows are in.
SOFTCAP = Schema("softcap", {"x": Tensor("..., f", floating=True),
                             "cap": Scalar("float", gt=0)})
SCALE_SHIFT = Schema("scale_shift", {"x": Tensor("..., f"), "scale": Tensor("f", dtype="x"),
                                     "shift": Tensor("f", dtype="x")})
#: An optional tensor, a bool, an int of one value, a bounded float, a fixed size.
MIXED = Schema("mixed", {"q": Tensor("..., h, 2"), "k": Tensor("h, 2", dtype="q"),
                         "bias": Tensor("h", optional=True), "flag": Scalar("bool", default=False),
                         "groups": Scalar("int", eq=1, default=1),
                         "eps": Scalar("float", ge=0, default=1e-6)})
#: A bound the compiled path cannot check: the Python route serves every call.
CLAMPED = Schema("clamped", {"x": Tensor("..., f"), "p": Scalar("float", ge=0, le=1)})
#: Every built-in family declared by a schema (its package's ``SCHEMA``).
BUILT_IN = tuple(importlib.import_module(f"astrai.families.{name}").SCHEMA
                 for name in sorted(every_family())
                 if importlib.util.find_spec(f"astrai.families.{name}") is not None
                 and hasattr(importlib.import_module(f"astrai.families.{name}"), "SCHEMA"))
SCHEMAS = (SOFTCAP, SCALE_SHIFT, MIXED, CLAMPED)

ROWS = '''
def softcap(x, cap):
    return cap * torch.tanh(x / cap)


def scale_shift(x, scale, shift):
    return x * scale + shift


def mixed(q, k, bias=None, flag=False, groups=1, eps=1e-6):
    return q.sum() + k.sum()


def clamped(x, p):
    return x * p


def fails(x, cap):
    raise RuntimeError("from the row")


def two(x):
    return x
'''


def _table(family: str, rows: str, when: str = "tokens >= 2") -> str:
    return (f"version: 1\nfamily: {family}\nfallback: reference\nrows:\n"
            f"  - name: wide\n    impl: schema_rows:{rows}\n    when: {when}\n"
            f"  - name: reference\n    impl: schema_rows:{family}\n")


@pytest.fixture
def tables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The rows' module on the path, every family's table loaded and its schema's facade
    declared; all forgotten afterwards."""
    (tmp_path / "schema_rows.py").write_text("import torch\n" + ROWS, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    for s in SCHEMAS:
        (tmp_path / f"{s.family}.yaml").write_text(_table(s.family, s.family), encoding="utf-8")
    d.load_tables(*(tmp_path / f"{s.family}.yaml" for s in SCHEMAS))
    for s in SCHEMAS:
        declare(Family(s.family, (s.facade(),)))
    try:
        yield tmp_path
    finally:
        for s in SCHEMAS:
            undeclare(s.family)
        d.reload_tables()


def _fn(schema: Schema) -> Any:
    return FACADES[schema.family].function


# -- the facade ----------------------------------------------------------------------


def test_the_facade_has_the_family_signature(tables: Path) -> None:
    sig = inspect.signature(_fn(MIXED))
    assert list(sig.parameters) == ["q", "k", "bias", "flag", "groups", "eps", "backend"]
    assert sig.parameters["bias"].default is None and sig.parameters["eps"].default == 1e-6
    assert _fn(SOFTCAP).__name__ == "softcap"
    assert MIXED.signature() == ("mixed(q: [..., h, 2], k: [h, 2], bias: [h] or None, "
                                 "flag: bool, groups: int == 1, eps: float >= 0)")
    x = torch.randn(3, 8)
    torch.testing.assert_close(_fn(SOFTCAP)(x, 2.0), 2.0 * torch.tanh(x / 2.0))
    torch.testing.assert_close(ops.call("softcap", x, cap=2.0), 2.0 * torch.tanh(x / 2.0))


@pytest.mark.parametrize("path", ["python", "compiled"])
def test_no_frame_between_the_caller_and_the_row(tables: Path, path: str,
                                                 request: pytest.FixtureRequest) -> None:
    """Warm, a call runs the facade's own frame, then the row's."""
    with adopted(request.getfixturevalue("built") if path == "compiled" else None):
        d.load_tables(tables / "softcap.yaml")
        (tables / "fails.yaml").write_text(_table("softcap", "fails", "tokens >= 1"))
        d.load_tables(tables / "fails.yaml")
        softcap = _fn(SOFTCAP)
        for _ in range(3):
            with pytest.raises(RuntimeError, match="from the row") as got:
                softcap(torch.randn(2, 4), 1.0)
    frames = [f.name for f in traceback.extract_tb(got.value.__traceback__)]
    assert frames[-2:] == ["softcap", "fails"], frames


# -- the checks, and the same verdict on both paths -------------------------------------


def test_checks_name_the_parameter_and_what_was_expected(tables: Path) -> None:
    scale_shift = _fn(SCALE_SHIFT)
    with pytest.raises(ValueError) as got:
        scale_shift(torch.randn(2, 8), torch.randn(4), torch.randn(8))
    assert str(got.value) == ("scale_shift: scale.shape[0] must equal f = x.shape[-1] = 8, "
                              "got 4; got x (2, 8), scale (4,), shift (8,)")
    with pytest.raises(TypeError, match=r"scale_shift: shift must be a torch.Tensor, got str"):
        scale_shift(torch.randn(2, 8), torch.randn(8), "b")
    with pytest.raises(ValueError, match=r"scale must have x's dtype \(torch.float32\)"):
        scale_shift(torch.randn(2, 8), torch.randn(8, dtype=torch.float64), torch.randn(8))
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., f\] \(at least 1 dimension\)"):
        scale_shift(torch.tensor(1.0), torch.randn(8), torch.randn(8))
    mixed = _fn(MIXED)
    with pytest.raises(ValueError, match=r"mixed: q.shape\[-1\] must be 2, got 3"):
        mixed(torch.randn(2, 4, 3), torch.randn(4, 2))
    with pytest.raises(TypeError, match=r"mixed: flag must be a bool, got 1"):
        mixed(torch.randn(2, 4, 2), torch.randn(4, 2), None, 1)
    with pytest.raises(ValueError, match=r"mixed: groups must be an int == 1, got 2"):
        mixed(torch.randn(2, 4, 2), torch.randn(4, 2), groups=2)


@pytest.mark.parametrize("path", ["python", "compiled"])
def test_softcap_at_zero_raises_after_warm_calls(tables: Path, path: str,
                                                 request: pytest.FixtureRequest) -> None:
    with adopted(request.getfixturevalue("built") if path == "compiled" else None):
        softcap = _fn(SOFTCAP)
        x = torch.randn(4, 8)
        for _ in range(5):
            softcap(x, 30.0)
        d.reset_stats()
        softcap(x, 30.0)
        assert d.stats().by_row()["softcap"] == {"wide": {"chain": 1}}
        for bad, kind in ((0.0, ValueError), (-1.0, ValueError), (float("nan"), ValueError),
                          ("a", TypeError), (None, TypeError), (True, TypeError)):
            with pytest.raises(kind, match="softcap: cap must be a float > 0"):
                softcap(x, bad)
        if path == "compiled":  # the compiled path reads softcap's calls
            assert ops.compiled_path()["softcap"] is None


def test_a_constraint_the_compiled_path_cannot_check_sends_calls_to_python(
        tables: Path, built: ModuleType) -> None:
    assert CLAMPED.reading() is None
    assert "cannot check p: float >= 0 and <= 1" in str(CLAMPED.unreadable())
    with adopted(built):
        clamped = _fn(CLAMPED)
        x = torch.randn(3, 4)
        for _ in range(3):
            clamped(x, 0.5)
        with pytest.raises(ValueError, match=r"clamped: p must be a float >= 0 and <= 1, got 2.0"):
            clamped(x, 2.0)
        assert "family declares no reading" in str(ops.compiled_path()["clamped"])


def _tensor(rng: random.Random, shape: tuple[int, ...]) -> Any:
    dtype = rng.choice([torch.float32, torch.float32, torch.float64, torch.int64])
    return torch.zeros(shape, dtype=dtype)


def _value(rng: random.Random, p: Any, sizes: dict[str, int]) -> Any:
    """A value for ``p``: well-formed most of the time, else of a wrong kind, shape,
    size or bound."""
    if isinstance(p, Choice):
        return rng.choice([*p.values, *p.values, "".join(p.values[0]), "nope", None, 1])
    if isinstance(p, Scalar):
        pool: list[Any] = {"float": [1e-6, 0.5, 1.0, 30.0, 0.0, -1.0, 2.0, float("nan"),
                                     float("inf"), 1, True, None, "x"],
                           "int": [1, 1, 2, 0, True, 1.0, None],
                           "bool": [False, True, 0, None]}[p.kind]
        return rng.choice(pool)
    if p.optional and rng.random() < 0.3:
        return None
    if rng.random() < 0.05:
        return rng.choice(["t", 3.0, [1, 2]])
    lead, dims = p.dims()
    shape = [d if isinstance(d, int) else sizes.setdefault(d, rng.choice([1, 2, 3, 8]))
             for d in dims]
    if lead:
        shape = [rng.choice([1, 2, 5]) for _ in range(rng.choice([0, 0, 1, 2]))] + shape
    if shape and rng.random() < 0.1:  # a wrong size
        i = rng.randrange(len(shape))
        shape[i] += 1
    if rng.random() < 0.05:  # a wrong number of dimensions
        shape = shape[1:] if shape and rng.random() < 0.5 else [2, *shape]
    return _tensor(rng, tuple(shape))


def _args(schema: Schema, rng: random.Random) -> tuple[Any, ...]:
    sizes: dict[str, int] = {}
    return tuple(_value(rng, p, sizes) for p in schema.params.values())


def _python(schema: Schema, plan: KeyPlan, args: tuple[Any, ...]) -> Any:
    """The route's key of the call (as the Python path keys it), or what it raises."""
    fc = FACADES[schema.family].call
    try:
        values = fc.describe(*args)
    except Exception as e:
        return e
    lazy = plan.reader(fc.reads, fc.readers)
    return values if lazy is None else (*values, *lazy(values, args))


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(points=st.lists(st.integers(0, 40), max_size=3), device=st.booleans(),
       seed=st.integers(0, 10_000), grad=st.booleans())
def test_both_paths_give_every_call_the_same_verdict(tables: Path, built: ModuleType,
                                                     points: list[int], device: bool,
                                                     seed: int, grad: bool) -> None:
    """Random calls, well-formed and not, under random tables, for the families declared
    here and every built-in family declared by a schema: where the compiled path
    answers, its key is the reading's meaning and the Python route's own key (the route
    never refuses it); where the Python route refuses a call, the compiled path declines
    it; every well-formed call of a readable schema is answered."""
    rng = random.Random(seed)
    texts = [f"tokens >= {p}" for p in points] + (["device == cpu"] if device else [])
    answered = 0
    with torch.set_grad_enabled(grad):
        for schema in (*SCHEMAS, *BUILT_IN):
            fc = FACADES[schema.family].call
            plan = KeyPlan(schema.family, comparisons([Spec.parse(t) for t in texts]))
            shape = plan.layout(fc.reads, fc.lazy)
            made = None if fc.reading is None else built.plan(*encode(fc.reading, shape))
            for _ in range(30):
                args = _args(schema, rng)
                python = _python(schema, plan, args)
                compiled = None if made is None else built.key(made, *args)
                if fc.reading is not None:
                    assert compiled == read(fc.reading, shape, args), (schema.family, args)
                if isinstance(python, BaseException):
                    assert compiled is None, (schema.family, args, python)
                elif compiled is not None:
                    answered += 1
                    assert compiled == python, (schema.family, args)
                elif fc.reading is not None and all(
                        type(a) in (torch.Tensor, float, bool, type(None))
                        or (type(a) is int and isinstance(p, Scalar) and p.kind == "int")
                        for a, p in zip(args, schema.params.values(), strict=True)):
                    pytest.fail(f"{schema.family}: the route keys {args}, the compiled "
                                f"path declines it")
    assert answered


# -- the rows' check --------------------------------------------------------------------


def test_a_row_that_cannot_take_the_arguments_is_a_load_error(tables: Path) -> None:
    (tables / "bad.yaml").write_text(_table("softcap", "two"), encoding="utf-8")
    with pytest.raises(TableError) as got:
        d.load_tables(tables / "bad.yaml")
    text = str(got.value)
    assert f"{tables / 'bad.yaml'}:6:" in text
    assert ("row 'wide' (schema_rows:two): it cannot take softcap(x: [..., f], cap: float > 0)"
            in text)
    d.load_tables(tables / "softcap.yaml")  # the family's own table still loads


def test_rows_loaded_before_the_declaration_are_checked_at_it(tables: Path) -> None:
    undeclare("softcap")
    assert "softcap" not in state.row_checks
    (tables / "bad.yaml").write_text(_table("softcap", "two"), encoding="utf-8")
    d.load_tables(tables / "bad.yaml")  # no schema yet: nothing to check against
    with pytest.raises(TableError, match=r"bad.yaml:5:0: row .wide.: it cannot take"):
        SOFTCAP.facade()


def test_a_schema_that_says_nothing_clear_is_refused() -> None:
    with pytest.raises(ValueError, match="the main tensor must be a required Tensor"):
        Schema("s", {"cap": Scalar("float")})
    with pytest.raises(ValueError, match=r"'\.\.\.' may only come first"):
        Schema("s", {"x": Tensor("f, ...")})
    with pytest.raises(ValueError, match="names 'y', which is no tensor parameter"):
        Schema("s", {"x": Tensor("f", dtype="y")})
    with pytest.raises(ValueError, match="eps has no default but follows"):
        Schema("s", {"x": Tensor("f"), "b": Tensor("f", optional=True),
                     "eps": Scalar("float")})


def test_a_schema_facade_compiles_into_one_graph(tables: Path) -> None:
    import torch._dynamo

    torch._dynamo.reset()
    softcap = _fn(SOFTCAP)
    x = torch.randn(4, 8)
    compiled = torch.compile(lambda t: softcap(t, 2.0), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), 2.0 * torch.tanh(x / 2.0))
