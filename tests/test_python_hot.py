"""The Python hot path (``astrai.dispatch.python_hot``): where the native extension is not
in use, each route's plan is compiled into one generated function that keys a call
exactly as the family's reading does (and so as the route does), and answers a call only
with the decision its route took for that very key in the world in force."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import astrai.dispatch as d
from astrai import ops
from astrai.dispatch import facade, python_hot, state
from astrai.dispatch.facade import FACADES
from tests.conftest import adopted
from tests.test_key_plans import check_keys, slow_paths  # noqa: F401
from tests.test_native import NAMES, _agrees, _ask, _common, _random_calls


@pytest.fixture
def py_hot() -> Iterator[Any]:
    """The facades on the Python hot path (as in a process without the extension), every
    facade's plan made from now on (the default planner makes some only)."""
    with adopted(None):
        state.hot_planner = python_hot.plan
        yield python_hot


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), seed=st.integers(0, 10_000), grad=st.booleans())
def test_the_generated_key_is_the_readings_and_the_routes(
        slow_paths: list[bool], data: Any, seed: int, grad: bool) -> None:  # noqa: F811
    check_keys(python_hot, slow_paths, data, seed, grad)


def test_every_answer_is_the_routes_decision(py_hot: Any) -> None:
    answered: dict[str, int] = {}
    for grad, seed in ((False, 0), (True, 1)):
        with torch.set_grad_enabled(grad):
            for name, args in _random_calls(random.Random(seed)):
                answered[name] = answered.get(name, 0) + _agrees(py_hot, name, args)
    assert sorted(answered) == sorted(NAMES) and min(answered.values()) >= 5, answered


@pytest.mark.parametrize("name", NAMES)
def test_a_common_call_is_answered_once_its_route_decided_it(py_hot: Any, name: str) -> None:
    args = _common(name)
    assert _ask(py_hot, name, args) is None  # nothing decided yet
    assert _agrees(py_hot, name, args)
    assert type(FACADES[name].last[0].plan) is python_hot.Plan


@pytest.mark.parametrize("name", ["rms_norm", "linear", "attention_heads_first"])
def test_a_change_of_world_is_declined(py_hot: Any, name: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    args = _common(name)
    assert _agrees(py_hot, name, args)
    family = FACADES[name].call.family
    row = {"linear": "torch", "attention": "math"}.get(family, "reference")

    def ask() -> Any:
        return _ask(py_hot, name, args)

    with d.op_backend(**{family: row}):
        assert ask() is None  # another scope
    assert ask() is not None
    monkeypatch.setenv("ASTR_OPS", f"{family}={row}")
    assert ask() is None  # another ASTR_OPS
    monkeypatch.delenv("ASTR_OPS")
    assert ask() is not None
    state.reset()  # another snapshot
    assert ask() is None


class _Sub(torch.Tensor):
    pass


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_what_it_cannot_read_exactly_is_declined(py_hot: Any) -> None:
    x, w, eps = _common("rms_norm")
    assert _agrees(py_hot, "rms_norm", (x, w, eps))
    last = FACADES["rms_norm"].last
    assert py_hot.lookup(last, x.as_subclass(_Sub), w, eps, False, False) is None
    assert py_hot.lookup(last, x.to_sparse(), w, eps, False, False) is None
    nested = torch.nested.nested_tensor([torch.zeros(2, 512), torch.zeros(3, 512)])
    assert py_hot.lookup(last, nested, w, eps, False, False) is None
    assert py_hot.lookup(last, x, w, eps) is None  # a wrong arity is not answered
    assert py_hot.lookup(last, x, torch.nn.Parameter(w), eps, False, False) is not None
    assert py_hot.lookup([facade.NO_WORLD], x, w, eps, False, False) is None


def test_the_facades_serve_count_and_refuse_through_it(py_hot: Any) -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 16, generator=g), torch.randn(16, generator=g)
    lin = torch.randn(8, 16, generator=g)
    assert FACADES["linear"].lookup is python_hot.lookup
    d.reset_stats()
    for _ in range(3):
        torch.testing.assert_close(ops.rms_norm(x, w), torch.nn.functional.rms_norm(
            x, (16,), w, 1e-6))
        torch.testing.assert_close(ops.linear(x, lin), x @ lin.T)
    assert _ask(py_hot, "linear", (x, lin, None)) is not None
    rows = d.stats().by_row()
    assert sum(sum(v.values()) for v in rows["rms_norm"].values()) == 3
    assert sum(sum(v.values()) for v in rows["linear"].values()) == 3
    with pytest.raises(ValueError, match="weight"):
        ops.rms_norm(x, torch.randn(15))
    with pytest.raises(ValueError, match="linear expects"):
        ops.linear(x, torch.randn(8, 15))
    with d.record() as rec:  # a recording takes every call through its route
        assert FACADES["linear"].lookup is None
        ops.linear(x, lin)
    assert FACADES["linear"].lookup is python_hot.lookup
    assert sum(c.count for c in rec.calls) == 1


def test_python_path_plans_with_it_and_gives_the_plans_back() -> None:
    x, lin = torch.randn(2, 16), torch.randn(8, 16)
    planner = state.hot_planner
    with facade.python_path():
        ops.linear(x, lin)
        assert type(FACADES["linear"].last[0].plan) is python_hot.Plan
        assert _ask(python_hot, "linear", (x, lin, None)) is not None
    assert state.hot_planner is planner
    ops.linear(x, lin)
    assert (type(FACADES["linear"].last[0].plan) is python_hot.Plan) == (
        planner is python_hot.planner)


def test_without_the_extension_every_reading_is_planned() -> None:
    """The default planner compiles a plan for every facade that declares a reading - a
    family keyed by several lazy items (linear: device and tokens) as one keyed by one
    interval (rms_norm: tokens) - and the calls it answers are counted as the route's."""
    with adopted(None):
        assert state.hot_planner is python_hot.planner
        x, w, lin = torch.randn(1, 1, 16), torch.randn(16), torch.randn(8, 16)
        d.reset_stats()
        for _ in range(3):
            ops.linear(x, lin)
            ops.rms_norm(x, w)
        for name in ("linear", "rms_norm"):
            assert type(FACADES[name].last[0].plan) is python_hot.Plan
            assert FACADES[name].lookup is python_hot.lookup
        assert _ask(python_hot, "linear", (x, lin, None)) is not None
        assert _ask(python_hot, "rms_norm", (x, w, 1e-6)) is not None
        rows = d.stats().by_row()
        assert sum(sum(v.values()) for v in rows["rms_norm"].values()) == 3
        assert sum(sum(v.values()) for v in rows["linear"].values()) == 3


def test_an_interval_is_written_as_bisect_right() -> None:
    """The generated interval of a value between cut points is ``bisect_right``'s, for
    any number of points (a chain of comparisons, halved past four)."""
    from bisect import bisect_right

    rng = random.Random(3)
    for n in range(13):
        for _ in range(10):
            points = tuple(sorted(rng.sample(range(-8, 60), n)))
            at = eval(f"lambda v: {python_hot._interval(points, 'v')}")  # our own source
            assert [at(v) for v in range(-12, 66)] == [
                bisect_right(points, v) for v in range(-12, 66)], points
