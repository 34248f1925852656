"""``astrai.tune_model``: one call tunes the machine for a model and keeps the profile in
the user's cache; ``dispatch_model`` then puts it in force without being asked, leaves
to the model's own code the families measured faster there, and ignores a profile tuned
under another fingerprint."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

import astrai
from astrai.dispatch import state
from astrai.dispatch.explain import explanation
from astrai.dispatch.scopes import process_profiles, set_process_profiles
from astrai.tune import measure
from astrai.tune import model as tuning
from astrai.tune.measure import Timing
from astrai.tune.noise import NoiseMonitor
from tests import _zoo

transformers = pytest.importorskip("transformers")
from astrai.integrations.transformers import dispatch_model  # noqa: E402

#: Rows the fake measurement makes fastest (every family's fallback, never the shipped
#: choice here): the tuned profile puts them first, which a call's decision then shows.
FAST_ROWS = {"reference"}
#: Families whose own code the fake measurement makes faster than the routed call.
MODEL_FASTER = {"rms_norm"}


def _samples(base: float, rounds: int) -> list[float]:
    return [base + 0.001 * i for i in range(rounds)]


def _fake_rows(calls: Mapping[str, Any], rounds: int, *args: Any, **kwargs: Any
               ) -> dict[str, list[float]]:
    return {name: _samples(1.0 if name in FAST_ROWS else 5.0, rounds) for name in calls}


def _fake_code(call: Any, rounds: int, *args: Any) -> tuple[Timing, Timing, bool]:
    own, routed = (1.0, 4.0) if call.family in MODEL_FASTER else (4.0, 1.0)
    return Timing.of(_samples(own, 7)), Timing.of(_samples(routed, 7)), False


def _no_runs(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """No family measured inside the model (tests/test_tune_in_model.py does)."""
    return {}


@pytest.fixture(scope="module")
def tuned_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Any]]:
    """A cache holding the profile ``tune_model`` wrote for the tiny Llama, the rows and
    the model's own code measured by the fakes above; the tables and the process-wide
    profiles are put back as they were."""
    cache = tmp_path_factory.mktemp("cache")
    saved = state.snapshot
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(measure, "time_rows", _fake_rows)
        mp.setattr(measure, "_warm", lambda fn, timer: 1)
        mp.setattr(tuning, "_time", _fake_code)
        mp.setattr(tuning, "measure_in_model", _no_runs)
        mp.setenv("XDG_CACHE_HOME", str(cache))
        mp.delenv("ASTR_TUNED", raising=False)
        model = _zoo.build("llama")
        got = astrai.tune_model(model, rounds=3, budget=0.0, prompt=6, new_tokens=2,
                                cache=cache)
    set_process_profiles()
    state.snapshot = saved
    state.reset()
    yield cache, got


@pytest.fixture
def in_cache(tuned_cache: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch
             ) -> Iterator[tuple[Path, Any]]:
    """The cache above as the user's; no profile in force before or after the test."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tuned_cache[0]))
    monkeypatch.delenv("ASTR_TUNED", raising=False)
    set_process_profiles()
    try:
        yield tuned_cache
    finally:
        set_process_profiles()


def _first(workload: Any, family: str) -> Any:
    return next(c for c in workload.calls if c.family == family)


def test_one_call_writes_the_profile_into_the_cache(tuned_cache: tuple[Path, Any]) -> None:
    cache, got = tuned_cache
    profiles = cache / "astrai" / "profiles"
    assert got.path.parent == profiles and got.path.is_file()
    assert got.name.startswith("tuned-") and got.path.stem == got.name
    assert [p.name for p in got.workloads.glob("*.yaml")] == [f"{got.model}.yaml"]
    doc = yaml.safe_load(got.path.read_text())
    assert doc["provenance"]["machine"]["cpu"]
    families = {c.family for c in got.workload.calls}
    assert {"rms_norm", "linear", "rotary", "attention"} <= families
    assert doc["families"]["rotary"]["order"][0] == "reference"
    assert "in force process-wide" in got.summary()


def test_the_next_dispatch_uses_it_without_being_asked(in_cache: tuple[Path, Any]) -> None:
    _, got = in_cache
    call = _first(got.workload, "rotary")
    assert explanation("rotary", call.context()).row != "reference"  # the shipped order
    report = dispatch_model(_zoo.build("llama"))
    assert process_profiles() == (got.name,)
    assert report.tuned.startswith(f"{got.name} from {got.path} (tuned ")
    assert f"tuned profile: {got.name} from {got.path}" in str(report)
    said = explanation("rotary", call.context())
    assert said.row == "reference"  # the call resolves by the tuned profile
    assert said.profiles == (got.name,)
    text = said.render()
    assert f"profiles: {got.name} (in force process-wide, from {got.path}, tuned " in text


def test_a_profile_of_another_machine_is_ignored_with_one_warning(
        in_cache: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from astrai.dispatch import tuned as tuned_cache_module
    from astrai.dispatch.machine import this_machine

    here = this_machine()
    elsewhere = replace(here, cpu="Another CPU", cores=here.cores + 64)
    monkeypatch.setattr(tuned_cache_module, "this_machine", lambda **_: elsewhere)
    with caplog.at_level(logging.WARNING, logger="astrai"):
        first = dispatch_model(_zoo.build("llama"))
        dispatch_model(_zoo.build("llama"))
    warned = [r.getMessage() for r in caplog.records if "another machine" in r.getMessage()]
    assert len(warned) == 1
    assert "cpu: 'Another CPU' here" in warned[0] and "cores:" in warned[0]
    assert process_profiles() == ()
    assert first.tuned.startswith("none (")
    assert "rms_norm" in first.counts() and first.paths("rms_norm")


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_opting_out_leaves_it_unused(in_cache: tuple[Path, Any], how: str,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    if how == "environment":
        monkeypatch.setenv("ASTR_TUNED", "off")
        report = dispatch_model(_zoo.build("llama"))
        assert report.tuned == "not used (ASTR_TUNED=off)"
    else:
        report = dispatch_model(_zoo.build("llama"), tuned=False)
        assert report.tuned == "not used (dispatch_model(..., tuned=False))"
    assert process_profiles() == ()
    assert report.paths("rms_norm") and not report.model_code  # every family routed


def test_the_model_code_candidate_is_honoured(in_cache: tuple[Path, Any]) -> None:
    _, got = in_cache
    doc = yaml.safe_load(got.path.read_text())
    assert doc["families"]["rms_norm"]["model_code"] is True
    assert not doc["families"]["linear"].get("model_code", False)
    figures = doc["provenance"]["model_code"]["rms_norm"]
    assert figures["left_to_model"] is True and figures["verdict"] == "faster"
    assert figures["model_us"] < figures["astrai_us"]
    assert got.model in figures["models"]
    assert got.left_to_model() == ["rms_norm"]
    # the model tune_model routed is routed again under the profile
    assert got.report is not None and not got.report.paths("rms_norm")
    report = dispatch_model(_zoo.build("llama"))
    assert not report.paths("rms_norm") and report.paths("linear")
    (family, why), = report.model_code
    assert family == "rms_norm" and f"profile {got.name} leaves rms_norm" in why
    assert "us a call" in why and "faster" in why
    assert "left to the model's own code:" in str(report)
    note = [n for n in explanation("rms_norm", _first(got.workload, "rms_norm").context()
                                   ).notes if "leaves rms_norm" in n]
    assert note and note[0].startswith("a model routed by dispatch_model leaves rms_norm "
                                       "to the model's own code")
    # named explicitly, the family is routed all the same, and the report says why
    named = dispatch_model(_zoo.build("llama"), families=("rms_norm",))
    assert named.paths("rms_norm") and any("families= names it" in n for n in named.notes)


def test_a_second_model_merges_its_calls(tuned_cache: tuple[Path, Any],
                                         tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    _, first = tuned_cache
    own = tmp_path / "cache"
    profiles = own / "astrai" / "profiles"
    profiles.mkdir(parents=True)
    (profiles / first.path.name).write_text(first.path.read_text())
    (profiles / first.workloads.name).mkdir()
    for wl in first.workloads.glob("*.yaml"):
        (profiles / first.workloads.name / wl.name).write_text(wl.read_text())
    monkeypatch.setattr(measure, "time_rows", _fake_rows)
    monkeypatch.setattr(measure, "_warm", lambda fn, timer: 1)
    monkeypatch.setattr(tuning, "_time", _fake_code)
    monkeypatch.setattr(tuning, "measure_in_model", _no_runs)
    monkeypatch.setenv("XDG_CACHE_HOME", str(own))
    second = astrai.tune_model(_zoo.build("qwen2"), rounds=3, budget=0.0, prompt=5,
                               new_tokens=1, cache=own)
    assert second.path.name == first.path.name  # one profile per machine
    assert len(list(second.workloads.glob("*.yaml"))) == 2
    assert second.workload.total > first.workload.total
    models = yaml.safe_load(second.path.read_text())["provenance"]["model_code"]["rms_norm"]
    assert set(models["models"]) == {first.model, second.model}


def test_the_own_code_of_each_family_is_captured_and_agrees() -> None:
    """The capture sees each routed family's calls with the model's own code beside the
    routed call, and both agree when replayed."""
    model = _zoo.build("llama")
    dispatch_model(model, mode="inference", tuned=False)
    capture = tuning._Capture()
    with tuning._capturing(model, capture):
        tuning._run(model, False, 5, 1)
    families = {c.family for c in capture.calls.values()}
    assert {"rms_norm", "linear", "rotary", "attention"} <= families
    monitor = NoiseMonitor()
    for family in ("rms_norm", "rotary", "attention"):
        call = next(c for c in capture.calls.values() if c.family == family)
        assert call.odd is None
        got = tuning._time(call, 1, measure.Budget(0.0), monitor)
        assert not isinstance(got, str), got


def test_the_cli_tunes_a_config_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    from astrai.cli import main

    model = _zoo.build("llama")
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(model.config.to_dict()))  # type: ignore[union-attr, operator]
    monkeypatch.setattr(measure, "time_rows", _fake_rows)
    monkeypatch.setattr(measure, "_warm", lambda fn, timer: 1)
    monkeypatch.setattr(tuning, "_time", _fake_code)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    saved = state.snapshot
    try:
        assert main(["tune", "--model", str(folder), "--rounds", "3", "--budget", "0"]) == 0
    finally:
        set_process_profiles()
        state.snapshot = saved
    out = capsys.readouterr().out
    written = list((tmp_path / "cache" / "astrai" / "profiles").glob("tuned-*.yaml"))
    assert len(written) == 1 and f"profile {written[0].stem}: {written[0]}" in out
    assert "the model's own code against the routed call" in out
    assert main(["tune"]) != 0  # neither a workload nor --model


def test_no_profile_stays_in_force_after_the_tests() -> None:
    assert process_profiles() == ()
    assert not any(p.startswith("tuned-") for p in state.snapshot.profiles)
