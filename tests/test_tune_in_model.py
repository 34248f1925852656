"""A routed family measured inside the model (``astrai.tune.in_model``): whole runs with
the family routed against runs with it left to the model's own code; a family that makes
the run slower beyond the noise is left to the model, the verdicts say why otherwise,
and the model's routing is left as it was."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import yaml

import astrai
from astrai.backends.frozen import is_frozen
from astrai.backends.rms_norm import torch_rms_norm
from astrai.dispatch import ImplRecord, register_impl, state, unregister_impl
from astrai.dispatch.registry import current
from astrai.dispatch.scopes import set_process_profiles
from astrai.tune import in_model, measure
from astrai.tune import model as tuning
from astrai.tune.in_model import InModel, measure_in_model, routed_families
from astrai.tune.measure import Timing
from astrai.tune.noise import NoiseMonitor
from tests import _zoo

transformers = pytest.importorskip("transformers")
from astrai.integrations.transformers import dispatch_model  # noqa: E402
from astrai.integrations.transformers.routing import ROUTE_ATTR  # noqa: E402

#: Busy-waited per rms_norm call by the slow row (a sleep spends no CPU time).
SLOW_S = 0.002


class _Quiet(NoiseMonitor):
    """A monitor that reads the machine as quiet (the verdict's other input is tested
    with ``_Busy``)."""

    def busy_since(self, mark: int) -> bool:
        return False


class _Busy(NoiseMonitor):
    def busy_since(self, mark: int) -> bool:
        return True


def _slow_rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None,
                   eps: float = 1e-6, **features: Any) -> torch.Tensor:
    end = time.perf_counter() + SLOW_S
    while time.perf_counter() < end:
        pass
    return torch_rms_norm(x, weight, eps, **features)


@pytest.fixture
def slow_rms_norm() -> Iterator[None]:
    """A row placed first in rms_norm's table that computes torch's rms_norm after
    spending ``SLOW_S`` of CPU time."""
    first = current().family("rms_norm").row_names()[0]
    register_impl(ImplRecord("rms_norm", "slow", _slow_rms_norm,
                             features=frozenset({"weight_offset", "cast_before_weight"})),
                  before=first)
    try:
        yield
    finally:
        unregister_impl("rms_norm", "slow")


def _run(model: Any) -> Any:
    return lambda: tuning._run(model, False, 4, 2)


def _without(model: Any) -> Any:
    return lambda family: dispatch_model(model, mode="inference", tuned=False, leave=[family])


def _routing(model: Any) -> list[tuple[Any, Any]]:
    return [(m.__dict__.get("forward"), m.__dict__.get(ROUTE_ATTR)) for m in model.modules()]


def test_a_family_that_slows_the_run_is_left_to_the_model(slow_rms_norm: None) -> None:
    model = _zoo.build("llama")
    dispatch_model(model, mode="inference", tuned=False)
    before = _routing(model)
    assert all(is_frozen(p) for p in model.parameters())
    got = measure_in_model(model, _run(model), "a tiny run", _without(model), rounds=5,
                           budget=0.0, monitor=_Quiet())
    assert set(got) == routed_families(model) and "rms_norm" in got
    slow = got["rms_norm"]
    assert slow.verdict == "faster" and slow.left_to_model
    assert slow.ratio.interval.low > 1.05 and slow.astrai.median_us > slow.model.median_us
    assert slow.ratio.samples >= in_model.ROUNDS and slow.run == "a tiny run"
    # the model is routed as it was, its parameters still declared frozen
    assert _routing(model) == before
    assert all(is_frozen(p) for p in model.parameters())
    # the busy machine's figures keep the family routed, and say why
    busy = measure_in_model(model, _run(model), "a tiny run", _without(model), rounds=5,
                            budget=0.0, monitor=_Busy())["rms_norm"]
    assert busy.verdict == "cannot tell (busy)" and not busy.left_to_model


def _figures(low: float, median: float, high: float, busy: bool = False) -> InModel:
    def t(value: float) -> Timing:
        return Timing(value, 0.0, value, value, 11)
    return InModel("a run", t(100.0), t(100.0 * median), Timing(median, 0.0, low, high, 11),
                   busy)


@pytest.mark.parametrize(("low", "median", "high", "busy", "verdict"), [
    (1.01, 1.02, 1.03, False, "faster"),
    (1.01, 1.02, 1.03, True, "cannot tell (busy)"),
    (1.001, 1.002, 1.003, False, "tie"),  # beyond the noise, within the margin
    (0.99, 1.02, 1.04, False, "cannot tell"),
    (0.99, 1.0, 1.01, False, "tie"),
    (0.97, 0.98, 0.99, False, "routed"),
])
def test_the_verdicts(low: float, median: float, high: float, busy: bool,
                      verdict: str) -> None:
    got = _figures(low, median, high, busy)
    assert got.verdict == verdict
    assert got.left_to_model is (verdict == "faster")
    again = InModel.from_plain(got.plain())
    assert again.verdict == verdict and again.ratio.interval.low == pytest.approx(low)


def test_models_combine_into_one_figure() -> None:
    one, two = _figures(1.01, 1.02, 1.03), _figures(0.97, 0.98, 0.99, busy=True)
    both = InModel.combine([one, two])
    assert both.ratio.median_us == pytest.approx(1.0)
    assert both.ratio.interval.low == pytest.approx(0.99) and both.busy
    assert both.verdict == "tie"


def test_leave_routes_the_rest() -> None:
    model = _zoo.build("llama")
    report = dispatch_model(model, mode="inference", tuned=False, leave=["rms_norm"])
    assert not report.paths("rms_norm") and report.paths("rotary")
    assert dict(report.model_code)["rms_norm"].endswith("leave=...) names it")
    with pytest.raises(ValueError, match="unknown family 'rms_nrom'"):
        dispatch_model(_zoo.build("llama"), leave=["rms_nrom"])


def _no_calls(call: Any, rounds: int, *args: Any) -> str:
    return "not timed in this test"


def test_tune_model_leaves_a_family_slower_inside_the_model(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The calls compared one by one say nothing (not timed here); inside the model the
    rotary family makes the run slower: the profile leaves it, and says so."""
    def fake(model: Any, run: Any, what: str, without: Any, *args: Any) -> dict[str, InModel]:
        return {f: _figures(1.01, 1.02, 1.03) if f == "rotary" else _figures(0.99, 1.0, 1.01)
                for f in routed_families(model)}

    monkeypatch.setattr(measure, "time_rows", lambda calls, rounds, *a, **k: {
        n: [1.0 + 0.001 * i for i in range(rounds)] for n in calls})
    monkeypatch.setattr(measure, "_warm", lambda fn, timer: 1)
    monkeypatch.setattr(tuning, "_time", _no_calls)
    monkeypatch.setattr(tuning, "measure_in_model", fake)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("ASTR_TUNED", raising=False)
    saved = state.snapshot
    try:
        got = astrai.tune_model(_zoo.build("llama"), rounds=3, budget=0.0, prompt=4,
                                new_tokens=1, cache=tmp_path)
        assert got.left_to_model() == ["rotary"]
        doc = yaml.safe_load(got.path.read_text())
        assert doc["families"]["rotary"]["model_code"] is True
        figures = doc["provenance"]["model_code"]["rotary"]
        assert figures["in_model"]["verdict"] == "faster" and figures["left_to_model"]
        assert math.isnan(figures["model_us"]) and figures["verdict"] == "not timed"
        assert figures["models"][got.model]["in_model"]["ratio"] == pytest.approx(1.02)
        assert "inside the model" in got.summary()
        report = dispatch_model(_zoo.build("llama"))
        assert not report.paths("rotary") and report.paths("rms_norm")
        why = dict(report.model_code)["rotary"]
        assert "were not timed one by one" in why
        assert "inside the model (a run), a run routed took 1.020x [1.010, 1.030]" in why
    finally:
        set_process_profiles()
        state.snapshot = saved
        state.reset()


def test_tune_model_keeps_no_reference_to_the_model(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The capture of the model's calls (its spies stood in rebound namespaces) goes with
    the tuning: a model tuned and dropped is freed, its weights no longer declared
    frozen."""
    import gc
    import weakref

    from astrai.backends import frozen

    monkeypatch.setattr(measure, "time_rows", lambda calls, rounds, *a, **k: {
        n: [1.0 + 0.001 * i for i in range(rounds)] for n in calls})
    monkeypatch.setattr(measure, "_warm", lambda fn, timer: 1)
    monkeypatch.setattr(tuning, "_time", _no_calls)
    monkeypatch.setattr(tuning, "measure_in_model", lambda *a, **k: {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    saved = state.snapshot
    try:
        model = _zoo.build("llama")
        alive = weakref.ref(model)
        astrai.tune_model(model, rounds=3, budget=0.0, prompt=4, new_tokens=1, cache=tmp_path)
        del model
        gc.collect()
        assert alive() is None
        assert not frozen.any_frozen()
    finally:
        set_process_profiles()
        state.snapshot = saved
        state.reset()
