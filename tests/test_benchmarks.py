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


def test_bench_hf_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """``--quick`` (a tiny model, few rounds): the machine first, then every configuration
    beside its target (the native path where it is loaded, the pure-Python path in a
    child), the decode step against the memory roofline, the prefill against the best
    GEMM, the rows and the per-family calls; then the whole bench again with the
    libraries held to AVX2 where this machine's ISA is above it. Compiling, tuning and the
    engine's figures are left to full runs (and the next test)."""
    pytest.importorskip("transformers")
    from astrai.dispatch.hardware import machine_facts

    bench = _script("bench_hf")
    threads = torch.get_num_threads()
    try:
        bench.main(["--quick", "--no-compile", "--no-engine", "--no-tune", "--emulate", "avx2"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith(bench._sibling("bench_linear_isa").machine_line())
    assert machine_facts().describe() in first and f"torch {torch.__version__}" in first
    assert "greedy tokens identical" in out and "DIFFER" not in out
    assert "routed, pure-Python path / plain" in out and ">= 1.00x" in out
    assert "routed, native extension / plain" in out
    assert "no profile tuned: --no-tune" in out
    assert "single-thread read bandwidth: " in out and "of the bandwidth" in out
    assert "weights a step multiplies by: " in out and "target >= 80%" in out
    assert "against the best GEMM" in out and "target >= 90%" in out
    for family in ("attention", "linear", "rms_norm", "rotary"):
        assert f"\n{family:<12} " in out
    assert "attention" in out and "target <= 1.00x" in out
    header = "==== the same bench, libraries held to AVX2"
    assert header in out
    emulated = out[out.index(header):].splitlines()
    if machine_facts().cpu_isa is not None and machine_facts().cpu_isa > "avx2":
        assert "cpu_isa=avx2" in emulated[1] and "ATEN_CPU_CAPABILITY" in emulated[1]
        assert "routed, native extension / plain" in "\n".join(emulated)
    else:
        assert emulated[1].startswith("skipped: ")


def test_bench_hf_skips_an_emulation_the_machine_is_not_above(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """On a machine whose ISA is AVX2 already, ``--emulate avx2`` runs nothing and says
    why."""
    from astrai.dispatch import hardware

    bench = _script("bench_hf")
    facts = hardware.assumed(cpu_isa="avx2")
    monkeypatch.setattr(hardware, "machine_facts", lambda: facts)
    monkeypatch.setattr(bench.subprocess, "run", lambda *a, **k: pytest.fail("ran a child"))
    assert bench.emulated("avx2", ["--quick", "--emulate", "avx2"])
    out = capsys.readouterr().out
    assert "skipped: this machine's ISA is avx2, not above avx2" in out


def test_bench_hf_measures_a_profile_tuned_in_the_run(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A profile tuned in the run (its measurements faked: every row alike, the model's
    own code slower, so the shipped order stays and every family stays routed) is
    measured as "routed, tuned profile" beside "routed" on every figure, its summary
    printed; the process-wide profiles are put back. The pure-Python child is left out
    (it tunes for real): its figures are this process's (under ASTR_NATIVE=off this
    process is that path, and no child runs)."""
    pytest.importorskip("transformers")
    from astrai.dispatch.scopes import process_profiles
    from astrai.tune import measure
    from astrai.tune import model as tuning
    from astrai.tune.measure import Timing

    bench = _script("bench_hf")
    monkeypatch.delenv("ASTR_TUNED", raising=False)
    monkeypatch.setattr(measure, "time_rows", lambda calls, rounds, *a, **k: {
        name: [5.0 + 0.001 * i for i in range(rounds)] for name in calls})
    monkeypatch.setattr(measure, "_warm", lambda fn, timer: 1)
    monkeypatch.setattr(tuning, "_time", lambda call, rounds, *a: (
        Timing.of([4.0 + 0.001 * i for i in range(7)]),
        Timing.of([1.0 + 0.001 * i for i in range(7)]), False))
    seen: dict[str, object] = {}
    real = bench.eager_ratios

    def recorded(model: object, configs: object) -> object:
        seen["figures"] = real(model, configs)
        return seen["figures"]

    monkeypatch.setattr(bench, "eager_ratios", recorded)
    monkeypatch.setattr(bench, "python_path", lambda tune_it: {
        "figures": seen["figures"], "tuning": "(this process's, in the test)"})
    before = process_profiles()
    threads = torch.get_num_threads()
    try:
        bench.main(["--quick", "--no-compile", "--no-engine"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert process_profiles() == before
    assert "astrai.tune_model, this run's profile" in out
    assert "left to the model's own code: nothing" in out
    assert "machine: " in out  # the summary says whether the machine was quiet
    from astrai import native

    paths = ["pure-Python path"] + (["native extension"] if native.status().loaded else [])
    for path in paths:
        assert f"routed, tuned profile, {path} / plain" in out
    tuned = [line for line in out.splitlines() if line.startswith("  routed, tuned profile ")]
    assert len(tuned) == 2  # the decode step and the prefill against the best GEMM
    assert all("target >= " in line for line in tuned)


def test_bench_train_runs(monkeypatch: pytest.MonkeyPatch,
                         capsys: pytest.CaptureFixture[str]) -> None:
    """A tiny model, two rounds: the machine first, then the memory and the time beside
    their targets, the loss served by the fused row, the gradients equal."""
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
    assert out.splitlines()[0] == bench._isa_bench().machine_line()
    assert "linear_cross_entropy rows ['chunked']" in out
    assert "peak memory of a step (torch.profiler)" in out and "(target <= 0.5: " in out
    assert "step time routed / plain: " in out and "(target <= 1.0: " in out
    assert got["grad_gap"] <= 1e-4 and 0 < got["memory"] < 1.0


def test_trace_call_path_sees_the_facade_and_the_decision(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The path script traces the dispatch of one call (not the row it hands over): a hit
    starts and ends in the family's module and passes the lookup only, and a miss also
    passes the evaluator. The path is
    deterministic (no timing), so its targets hold here: the script exits 0."""
    bench = _script("trace_call_path")
    threads = torch.get_num_threads()
    try:
        paths = bench.measure()
        assert bench.main(["--path"]) == 0
    finally:
        torch.set_num_threads(threads)
    hit, miss = paths["hit"], paths["miss"]
    assert hit[0] == hit[-1] == "astrai.families.rms_norm"
    # between, the lookup only: the compiled or the Python hot path, or the facade's route
    assert hit[1:-1] and set(hit[1:-1]) <= {"astrai.dispatch.facade", "astrai.dispatch.python_hot"}
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
