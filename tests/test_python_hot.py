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
from astrai.dispatch.reading import Case, Layout, Reading, encode, read
from tests.test_key_plans import _calls, _plan, _python_key, slow_paths  # noqa: F401
from tests.test_native import NAMES, _agrees, _ask, _common, _random_calls


@pytest.fixture
def py_hot() -> Iterator[Any]:
    """The facades on the Python hot path (as in a process without the extension), every
    facade's plan made from now on (the default planner makes some only)."""
    was = facade.HOT.native, facade.HOT.lookup, facade.HOT.call_lookup
    facade.adopt(None)
    state.hot_planner = python_hot.plan
    state.reset()
    yield python_hot
    facade.adopt(was[0])
    facade.HOT.lookup, facade.HOT.call_lookup = was[1], was[2]
    for f in facade.FACADES.values():
        f.lookup = was[1]
    state.reset()


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), seed=st.integers(0, 10_000), grad=st.booleans())
def test_the_generated_key_is_the_readings_and_the_routes(
        slow_paths: list[bool], data: Any, seed: int, grad: bool) -> None:  # noqa: F811
    plans = {name: _plan(data.draw, name) for name in NAMES}
    made = {}
    for name in NAMES:
        fc = FACADES[name].call
        shape = plans[name].layout(fc.reads, fc.lazy)
        made[name] = (python_hot.plan(*encode(fc.reading, shape)), shape)  # type: ignore[arg-type]
    answered = dict.fromkeys(NAMES, 0)
    with torch.set_grad_enabled(grad):
        for name, hot_args, full in _calls(seed):
            fc = FACADES[name].call
            plan, shape = made[name]
            got = python_hot.key(plan, *hot_args)
            try:
                meant = read(fc.reading, shape, hot_args)  # type: ignore[arg-type]
            except Exception:  # the meaning cannot read it: the generated code declines
                meant = None
            assert got == meant, (name, hot_args, shape, plan.text)
            slow_paths[0] = False
            python = _python_key(name, plans[name], full)
            if got is not None:
                answered[name] += 1
                assert not isinstance(python, BaseException), (name, hot_args, python)
                assert python == got, (name, hot_args, shape)
            elif not isinstance(python, BaseException) and not slow_paths[0]:
                pytest.fail(f"{name}: the route keys {hot_args} on its fast path, the "
                            f"Python hot path declines it (layout {shape})")
    assert all(answered.values()), answered


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


def test_without_the_extension_a_plan_is_made_where_the_route_keys_slower() -> None:
    """The default planner compiles a plan for linear (keyed by device and tokens: the
    route's extended keyer) and none for a family keyed by its describe alone or one
    interval; those calls are served by their route, counted as before."""
    was = facade.HOT.native, facade.HOT.lookup, facade.HOT.call_lookup
    facade.adopt(None)
    state.reset()
    try:
        assert state.hot_planner is python_hot.planner
        x, w, lin = torch.randn(1, 1, 16), torch.randn(16), torch.randn(8, 16)
        d.reset_stats()
        for _ in range(2):
            ops.linear(x, lin)
            ops.rms_norm(x, w)
        assert type(FACADES["linear"].last[0].plan) is python_hot.Plan
        assert FACADES["rms_norm"].last[0].plan is None
        assert _ask(python_hot, "linear", (x, lin, None)) is not None
        assert _ask(python_hot, "rms_norm", (x, w, 1e-6)) is None
        rows = d.stats().by_row()
        assert sum(sum(v.values()) for v in rows["rms_norm"].values()) == 2
        assert sum(sum(v.values()) for v in rows["linear"].values()) == 2
    finally:
        facade.adopt(was[0])
        facade.HOT.lookup, facade.HOT.call_lookup = was[1], was[2]
        for f in facade.FACADES.values():
            f.lookup = was[1]
        state.reset()


def test_every_opcode_compiles_and_means_what_read_says() -> None:
    """A reading using every guard and value, under intervals, a raw axis and a sign."""
    t = torch.zeros(2, 3, 4)
    u = torch.zeros(2, 6)
    reading = Reading(6, (
        Case((("tensor", 0), ("tensor_or_none", 1), ("is", 2, 0), ("float_ge0", 3),
              ("int_eq", 4, 7), ("bool", 5), ("ndim", 0, 3), ("ndim_ge", 1, 2),
              ("size_eq", 0, 0, 1, 0), ("size_is", 0, -1, 4), ("size_ge", 1, 1, 5),
              ("size_even", 0, 2), ("size_div", 1, 1, 0, 1), ("size_twice", 1, 1, 0, 1),
              ("dtype_eq", 0, 1), ("floating", 0),
              ("any", (("shape_eq", 0, 1),), (("ndim", 1, 2), ("size_is", 1, 0, 2)))),
             (("dtype", 0), ("cuda", 0), ("ndim", 1), ("size", 0, 1), ("grad",), ("const", 1),
              ("arg", 4)),
             {"a": ("rows", 0, 1), "b": ("prod", 0, 1, 1, 1), "c": ("device", 0),
              "d": ("sm", 0), "e": ("rows", 1, 1)}),
    ))
    shape = Layout((("interval", "a", (1, 6, 100)), ("raw", "c"), ("raw", "d"),
                    ("interval", "e", tuple(range(0, 20, 2))),
                    ("sign", ("lazy", "a"), ("base", 3)), ("sign", ("lazy", "b"), ("lazy", "a"))))
    plan = python_hot.plan(*encode(reading, shape))
    calls: list[tuple[Any, ...]] = [
        (t, u, None, 0.5, 7, True), (t, None, None, 0.5, 7, True), (t, u, 1, 0.5, 7, True),
        (t, u, None, -1.0, 7, True), (t, u, None, 0.5, 8, True), (t, u, None, 0.5, 7, 1),
        (torch.zeros(2, 3, 5), u, None, 0.5, 7, True), (t, torch.zeros(2, 5), None, 0.5, 7, True),
        (t.double(), u, None, 0.5, 7, False)]
    keys = [python_hot.key(plan, *c) for c in calls]
    assert keys[0] is not None
    assert keys == [read(reading, shape, c) if c[1] is not None else None for c in calls]
    assert python_hot.key(plan, t) is None  # another arity
