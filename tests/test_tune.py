"""``astrai-ops tune``: measure, bucket, write a verified profile with
provenance; a wrong row is excluded; a profile tuned elsewhere warns."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml

import astrai.dispatch as dispatch
from astrai import ops
from astrai.cli import main
from astrai.dispatch import record
from astrai.dispatch.explain import explain
from astrai.dispatch.machine import this_machine
from astrai.record.workload import Workload
from astrai.tune.run import tune_workload

TABLE = """\
version: 1
family: twice
context: tests._tune_impls:context
fallback: reference
rows:
  - name: wrong
    impl: tests._tune_impls:wrong
  - name: reference
    impl: tests._tune_impls:reference
  - name: small
    impl: tests._tune_impls:small
  - name: large
    impl: tests._tune_impls:large
    explicit_only: true
"""


@pytest.fixture
def workload(write_yaml: Callable[[str, str], Path]) -> Workload:
    """Calls of ``twice`` on 2, 4 (few) and 64, 128 tokens (many)."""
    dispatch.load_tables(write_yaml("twice.yaml", TABLE))
    with record() as wl:
        for n in (2, 4, 64, 128):
            ops.call("twice", torch.randn(n, 8))
    return wl.workload()


def test_round_trip(workload: Workload, tmp_path: Path) -> None:
    """Tuning writes a profile that gives each bucket its fastest correct row."""
    tuned = tune_workload(workload, tmp_path / "tuned.yaml", rounds=3, progress=False)
    winners = {b.condition: b.winner for b in tuned.buckets}
    assert winners == {"tokens <= 34": "small", "tokens >= 35": "large"}
    doc = yaml.safe_load((tmp_path / "tuned.yaml").read_text())
    assert doc["profile"] == "tuned"
    assert doc["families"]["twice"]["enable"] == ["large"]  # explicit-only, yet it won
    assert doc["provenance"]["machine"] == this_machine().as_dict()
    assert {m["row"] for m in doc["provenance"]["measured"]} == {"reference", "small", "large"}
    # A fresh load through ASTR_TABLES-style loading: each call resolves to its winner.
    dispatch.reload_tables()
    dispatch.load_tables(tmp_path / "twice.yaml", tmp_path / "tuned.yaml")
    with dispatch.use_profile("tuned"):
        for call in workload.calls:
            want = "small" if call.axes["tokens"] <= 34 else "large"
            assert dispatch.resolve("twice", call.context()).name == want
    # The buckets narrow only the implicit chain: a winner that comes first is kept off
    # the other bucket with chain_when, and selecting it by name still serves any call.
    first, _ = doc["families"]["twice"]["order"]
    assert "when" not in doc["families"]["twice"]
    assert list(doc["families"]["twice"]["chain_when"]) == [first]
    with dispatch.use_profile("tuned"):
        for call in workload.calls:
            got = dispatch.resolve("twice", call.context(), first)
            assert (got.name, got.origin) == (first, "explicit")
            with dispatch.op_backend(twice=first):
                assert dispatch.resolve("twice", call.context()).name == first
    # Without the profile, the table's order: the wrong row first.
    assert dispatch.resolve("twice", workload.calls[0].context()).name == "wrong"


def test_wrong_row_excluded(workload: Workload, tmp_path: Path) -> None:
    """The fastest row returns wrong values: it is reported and never wins."""
    tuned = tune_workload(workload, tmp_path / "t.yaml", rounds=3, progress=False)
    assert all("wrong" not in t.timings for t in tuned.timings)
    assert all("differs from the reference" in t.excluded["wrong"] for t in tuned.timings)
    assert any(line.startswith("excluded twice.wrong") for line in tuned.excluded())
    with dispatch.use_profile("t"):
        for call in workload.calls:
            assert dispatch.resolve("twice", call.context()).name != "wrong"


def test_cli_and_explain_provenance(workload: Workload, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``astrai-ops tune`` prints the buckets and verifies; explain names the provenance."""
    wl = workload.save(tmp_path / "wl.yaml")
    out = tmp_path / "fast.yaml"
    assert main(["tune", str(wl), "-o", str(out), "--rounds", "3",
                 "--report", str(tmp_path / "r.md")]) == 0
    text = capsys.readouterr().out
    assert "verified: each of the 4 tuned calls resolves to its measured winner" in text
    assert "| `tokens <= 34` | 2 |" in (tmp_path / "r.md").read_text()
    monkeypatch.setenv("ASTR_TABLES", os.pathsep.join([str(tmp_path / "twice.yaml"), str(out)]))
    monkeypatch.setenv("ASTR_OPS", "profile=fast")
    dispatch.reload_tables()
    assert ops.call("twice", torch.ones(2, 8)).eq(2).all()  # small served it, not wrong
    got = explain("twice", workload.calls[0].context())
    assert "note: profile fast: tuned " in got and f"from {wl}" in got
    assert got.endswith("=> small (origin=chain)")


def test_fingerprint_mismatch_warns(workload: Workload, tmp_path: Path,
                                    caplog: pytest.LogCaptureFixture) -> None:
    """A profile tuned on another machine warns once, naming what differs."""
    tune_workload(workload, tmp_path / "elsewhere.yaml", rounds=3, progress=False)
    path = tmp_path / "elsewhere.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["provenance"]["machine"]["cpu"] = "Imaginary CPU 9000"
    path.write_text(yaml.safe_dump(doc))
    with caplog.at_level(logging.WARNING, logger="astrai"):
        dispatch.load_tables(path)
        dispatch.load_tables(path)
    warned = [r.getMessage() for r in caplog.records if "tuned on another machine" in
              r.getMessage()]
    assert len(warned) == 1
    assert "cpu: " in warned[0] and "'Imaginary CPU 9000' there" in warned[0]


def test_verify_fails_loudly(workload: Workload, tmp_path: Path,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A profile that would not give a call its winner is an error, not a quiet file."""
    from astrai.tune import profile as tuned_profile

    def no_when(*args: object, **kwargs: object) -> dict[str, object]:
        return {"order": ["large", "small"], "enable": ["large"]}

    monkeypatch.setattr(tuned_profile, "_overlay", no_when)
    with pytest.raises(tuned_profile.TuneError, match="does not give 2 recorded calls"):
        tune_workload(workload, tmp_path / "bad.yaml", rounds=3, progress=False)
