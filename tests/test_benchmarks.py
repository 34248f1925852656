"""The benchmark scripts still run against the current engine (a cut-down run of each
one that is cheap enough; their figures are read from full runs, never asserted here)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _script(name: str) -> ModuleType:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # a dataclass in the script looks its module up
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_bench_shapes_gate(monkeypatch: pytest.MonkeyPatch,
                           capsys: pytest.CaptureFixture[str]) -> None:
    """50 distinct lengths: the cut-point table decides twice, the raw-keyed one 50 times."""
    bench = _script("bench_shapes")
    monkeypatch.setattr(bench, "LENGTHS", range(1, 51))
    threads = torch.get_num_threads()
    try:
        assert bench.main() == 0
    finally:
        torch.set_num_threads(threads)
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()
            if line.split() and line.split()[0] in ("shipped", "cut", "raw")}
    assert rows["cut"][2] == "2"  # "cut points" is two words
    assert rows["raw"][1] == "50"


def test_bench_hf_runs(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
                       ) -> None:
    """A tiny model, few rounds: every configuration prints beside its target (the native
    path where it is loaded, the pure-Python path in a child), with the rows and the
    per-family calls; compiling and the engine's figures are left to full runs."""
    pytest.importorskip("transformers")
    bench = _script("bench_hf")
    monkeypatch.setattr(bench, "CONFIG", {**bench.CONFIG, "hidden_size": 64,
                                          "intermediate_size": 128, "num_hidden_layers": 2,
                                          "vocab_size": 128})
    monkeypatch.setattr(bench, "NEW_TOKENS", 4)
    monkeypatch.setattr(bench, "PREFILL", 32)
    monkeypatch.setattr(bench, "ROUNDS", {"generate": 3, "prefill": 3})
    threads = torch.get_num_threads()
    try:
        bench.main(["--no-compile", "--no-engine"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "greedy tokens identical" in out and "DIFFER" not in out
    assert "routed, pure-Python path / plain" in out and ">= 1.00x" in out
    assert "routed, native extension / plain" in out
    for family in ("attention", "linear", "rms_norm", "rotary"):
        assert f"\n{family:<12} " in out
    assert "attention" in out and "target <= 1.00x" in out


def test_bench_train_runs(monkeypatch: pytest.MonkeyPatch,
                         capsys: pytest.CaptureFixture[str]) -> None:
    """A tiny model, two rounds: the memory and the time print beside their targets, the
    loss served by the fused row, the gradients equal."""
    pytest.importorskip("transformers")
    bench = _script("bench_train")
    monkeypatch.setattr(bench, "CONFIG", {**bench.CONFIG, "hidden_size": 64,
                                          "intermediate_size": 128, "num_hidden_layers": 2,
                                          "vocab_size": 2048})
    threads = torch.get_num_threads()
    try:
        got = bench.main(["--rounds", "2", "--tokens", "512", "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "linear_cross_entropy rows ['chunked']" in out
    assert "peak memory of a step (torch.profiler)" in out and "(target <= 0.5: " in out
    assert "step time routed / plain: " in out and "(target <= 1.0: " in out
    assert got["grad_gap"] <= 1e-4 and 0 < got["memory"] < 1.0


def test_trace_call_path_sees_the_facade_and_the_decision(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The path script traces the dispatch of one call (not the row it hands over): a hit
    starts and ends in the facade module, and a miss also passes the evaluator. The path is
    deterministic (no timing), so its targets hold here: the script exits 0."""
    bench = _script("trace_call_path")
    threads = torch.get_num_threads()
    try:
        paths = bench.measure()
        assert bench.main(["--path"]) == 0
    finally:
        torch.set_num_threads(threads)
    hit, miss = paths["hit"], paths["miss"]
    assert hit[0] == hit[-1] == "astrai.families.rms_norm" and "astrai.dispatch.facade" in hit
    assert not any(m.startswith("astrai.backends") for m in hit)
    assert "astrai.dispatch.resolution" in miss and "astrai.dispatch.resolution" not in hit
    out = capsys.readouterr().out
    for label in ("miss: astrai modules entered: ", "miss: moves between them: ",
                  "hit: moves between modules: "):
        assert label in out and "target <= " in out


def test_bench_workload_io_round_trips(capsys: pytest.CaptureFixture[str]) -> None:
    """A small workload saves and loads back (the round trip is checked by the step)."""
    bench = _script("bench_workload_io")
    assert bench.main(["--calls", "300"]) == 0
    out = capsys.readouterr().out
    assert "save 300 calls" in out and "load 300 calls" in out and "FAIL" not in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_the_gpu_check_says_it_skipped_without_cuda(tmp_path: Path) -> None:
    import subprocess

    out = tmp_path / "gpu.txt"
    got = subprocess.run(["bash", str(BENCHMARKS / "gpu_check.sh"), str(out)],
                         capture_output=True, text=True, env={**os.environ,
                                                              "PYTHON": sys.executable})
    assert got.returncode == 0, got.stderr
    assert out.read_text() == "no CUDA device: skipped\n"


def test_bench_rows_moves_a_bucket_to_the_device_asked() -> None:
    bench = _script("bench_rows")
    bucket = bench.Bucket("rms_norm", "x", (torch.zeros(2, 4).t(), 3), {"w": torch.ones(2)})
    (moved,) = bench.on([bucket], torch.device("meta"))
    assert moved.args[0].device.type == "meta" and moved.args[1] == 3
    assert moved.args[0].stride() == bucket.args[0].stride()
    assert moved.kwargs["w"].device.type == "meta"
    assert bench.on([bucket], torch.device("cpu")) == [bucket]
