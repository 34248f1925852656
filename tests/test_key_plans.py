"""The compiled hot path keys a call exactly as Python does.

For random calls of every facade (well-formed ones of many shapes, malformed ones, odd
arguments) under random key plans - specs comparing random lazy axes with constants,
with each other and with base axes, ``device``, an opaque spec - three keys are made:
the Python route's (the family's ``describe`` and the snapshot's keyer), the meaning of
the family's reading (``astrai.dispatch.reading.read``) and the compiled path's
(``key``). The compiled key must equal the reading's; where it is given, the route keys
the call alike (never refusing it); and every call the route keys on its fast path (no
validation beyond the common shape) the compiled path answers.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from astrai.dispatch.expr.analysis import comparisons
from astrai.dispatch.expr.spec import Spec
from astrai.dispatch.facade import FACADES, FIRST_TENSOR_READING, extended_keyer, interval_keyer
from astrai.dispatch.keying import KeyPlan
from astrai.dispatch.reading import Layout, encode, read
from astrai.dispatch.schema import Choice, Schema, Tensor
from astrai.families import every_family
from tests.test_native import (
    NAMES,  # every built-in facade
    _common,
    _full,
    _hot_args,
    _random_calls,
)

#: The int axes a spec may compare, per facade (its lazy ones and its int base ones).
INT_BASE = {"rms_norm": ("ndim",), "linear": ("ndim",), "rotary": ("ndim", "head_dim"),
            "rotary_half": ("ndim", "head_dim"), "attention": ("ndim", "head_dim"),
            "attention_heads_first": ("ndim", "head_dim"),
            "layer_norm": ("ndim",), "activation": ("ndim",), "gated_activation": ("ndim",)}


def _spec_texts(draw: Any, name: str) -> list[str]:
    """Random conditions over ``name``'s lazy axes (and its int base axes)."""
    fc = FACADES[name].call
    ints = [a for a in fc.lazy if a not in ("device", "sm")]
    texts = []
    for axis in draw(st.lists(st.sampled_from(ints), max_size=3, unique=True)):
        op = draw(st.sampled_from(["<", "<=", ">", ">=", "==", "!="]))
        texts.append(f"{axis} {op} {draw(st.integers(0, 600))}")
    if draw(st.booleans()) and len(ints) >= 1:
        a = draw(st.sampled_from(ints))
        b = draw(st.sampled_from([*ints, *INT_BASE[name]]))
        if a != b:
            texts.append(f"{a} < {b}")
    if draw(st.integers(0, 4)) == 0:
        texts.append("device == cpu")
    return texts


def _plan(draw: Any, name: str) -> KeyPlan:
    specs = [Spec.parse(t) for t in _spec_texts(draw, name)]
    if draw(st.integers(0, 9)) == 0:
        specs.append(Spec.of(lambda ctx: True, "opaque"))
    return KeyPlan(FACADES[name].call.family, comparisons(specs))


class _Slow(Exception):
    pass


def _python_key(name: str, plan: KeyPlan, full: tuple[Any, ...]
                ) -> tuple[Any, ...] | BaseException:
    """The route's key of the call given as its full argument tuple (as the route's
    ``_keyer`` makes it), or what it raises."""
    fc = FACADES[name].call
    single = plan.interval(fc.reads, fc.readers)
    if single is not None:
        keyer: Any = interval_keyer(fc.describe, *single)
    else:
        lazy_key = plan.reader(fc.reads, fc.readers)
        keyer = extended_keyer(fc.describe, lazy_key) if lazy_key is not None else None
    try:
        return fc.describe(*full) if keyer is None else keyer(*full)[0]
    except Exception as e:
        return e


@pytest.fixture
def slow_paths(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool]]:
    """``[flag]``: set when a ``describe`` validates beyond its fast path."""
    flag = [False]
    modules = {sys.modules[f.facades[0].call.describe.__module__]
               for f in every_family().values()}
    for module in modules:
        for helper in ("require_tensors", "_attention_slow", "_heads_first_slow",
                       "check_rotary_half_call", "check_rotary_call"):
            real = getattr(module, helper, None)
            if real is None:
                continue

            def wrapped(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
                flag[0] = True
                return _real(*args, **kwargs)

            monkeypatch.setattr(module, helper, wrapped)
    yield flag


def _calls(seed: int) -> list[tuple[str, tuple[Any, ...], tuple[Any, ...]]]:
    """``(facade, arguments as the compiled path takes them, the route's full tuple)``."""
    common = [(name, _common(name)) for name in NAMES]  # each facade's common call, at least
    out = [(name, _hot_args(name, args), _full(name, args))
           for name, args in [*common, *_random_calls(random.Random(seed))]]
    rng = random.Random(seed + 1)
    for _ in range(20):  # the rms_norm forms
        x = torch.zeros(rng.choice([1, 3]), 16, dtype=rng.choice([torch.float32, torch.bfloat16]))
        w, offset, cast = torch.zeros(16), rng.random() < 0.5, rng.random() < 0.5
        asked = {**({"weight_offset": 1.0} if offset else {}),
                 **({"cast_before_weight": True} if cast else {})}
        out.append(("rms_norm", (x, w, 1e-6, offset, cast), (x, w, 1e-6, asked)))
    return out


def _read_exactly(fc: Any, args: tuple[Any, ...]) -> bool:
    """For a family declared by its schema: whether every argument is of the very kind its
    reading reads (a plain tensor, an exact float, int or bool, one of a choice's own
    strings); a call of other kinds (an int eps) is the Python route's. Other families
    say so by their slow paths."""
    schema = getattr(fc.describe, "__self__", None)
    if not isinstance(schema, Schema):
        return True
    named = dict(zip(schema.params, args, strict=True))
    for p, a in zip(schema.params.values(), args, strict=True):
        if isinstance(p, Tensor):
            ok = (a is None and p.optional) or type(a) in (torch.Tensor, torch.nn.Parameter)
            other = named.get(p.dtype) if p.dtype else None
            if ok and a is not None and isinstance(other, torch.Tensor):
                ok = a.dtype == other.dtype  # float32 beside a half type: the route's
        elif isinstance(p, Choice):
            ok = any(a is v for v in p.values)
        else:
            ok = type(a) is {"float": float, "int": int, "bool": bool}[p.kind]
        if not ok:
            return False
    return True


def check_keys(hot: Any, slow_paths: list[bool], data: Any, seed: int, grad: bool) -> None:
    """``hot``'s key (a hot path: ``plan`` and ``key``) of random calls under random key
    plans is the reading's; where it answers, the route keys the call alike (never
    refusing it); every call the route keys on its fast path it answers."""
    plans = {name: _plan(data.draw, name) for name in NAMES}
    made: dict[str, tuple[Any, Layout]] = {}
    for name in NAMES:
        fc = FACADES[name].call
        shape = plans[name].layout(fc.reads, fc.lazy)
        made[name] = (hot.plan(*encode(fc.reading, shape)), shape)  # type: ignore[arg-type]
    answered = dict.fromkeys(NAMES, 0)
    with torch.set_grad_enabled(grad):
        for name, hot_args, full in _calls(seed):
            fc = FACADES[name].call
            plan, shape = made[name]
            got = hot.key(plan, *hot_args)
            try:
                meant = read(fc.reading, shape, hot_args)  # type: ignore[arg-type]
            except Exception:  # the meaning cannot read it: the hot path declines
                meant = None
            assert got == meant, (name, hot_args, shape)
            slow_paths[0] = False
            python = _python_key(name, plans[name], full)
            if got is not None:
                answered[name] += 1
                assert not isinstance(python, BaseException), (name, hot_args, python)
                assert python == got, (name, hot_args, shape)
            elif (not isinstance(python, BaseException) and not slow_paths[0]
                  and _read_exactly(fc, hot_args)):
                pytest.fail(f"{name}: the route keys {hot_args} on its fast path, the "
                            f"hot path declines it (layout {shape})")
    assert all(answered.values()), answered


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), seed=st.integers(0, 10_000), grad=st.booleans())
def test_the_compiled_key_is_the_python_key(built: ModuleType, slow_paths: list[bool],
                                            data: Any, seed: int, grad: bool) -> None:
    check_keys(built, slow_paths, data, seed, grad)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_ops_call_first_tensor_key(built: ModuleType, seed: int) -> None:
    """``ops.call``'s compiled key of a first-tensor call is the Python hot path's."""
    plan = built.plan(*encode(FIRST_TENSOR_READING, Layout()))
    rng = random.Random(seed)
    for _ in range(20):
        t: Any = rng.choice([torch.zeros(rng.choice([(), (2,), (1, 3), (2, 3, 4)]),
                                         dtype=rng.choice([torch.float32, torch.int64])),
                             torch.nn.Parameter(torch.zeros(2)), "x", None, 3.0])
        got = built.key(plan, t)
        if isinstance(t, torch.Tensor):
            assert got == (t.dtype, t.is_cuda, t.dim(), torch.is_grad_enabled())
        else:
            assert got is None
