"""``astrai-ops tune`` under ``torch.distributed``: every rank measures, the
timings are combined (median across ranks), every rank writes the same profile, byte for
byte, and ``check_agreement`` confirms the plan.

Two gloo ranks on CPU (``_run_ranks`` of ``test_distributed``: a ``file://`` store, each
rank writing what it saw to ``result-<rank>.json``) tune the ``ranked`` family, whose
``skewed`` row is the fastest on rank 0 and slowed down on rank 1 alone, and whose
``flaky`` row is right on rank 0 and wrong on rank 1.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import yaml

import astrai.dispatch as dispatch
from astrai import ops
from astrai.dispatch import check_agreement, record, use_profile
from astrai.record.workload import Workload
from astrai.tune.measure import CallTiming, Timing
from astrai.tune.profile import TuneError
from astrai.tune.ranks import combine, init_from_environment
from astrai.tune.run import tune_workload
from tests.test_distributed import REPO, _run_ranks

TABLE = """\
version: 1
family: ranked
context: tests._tune_impls:context
fallback: reference
rows:
  - name: flaky
    impl: tests._tune_impls:flaky
  - name: skewed
    impl: tests._tune_impls:skewed
  - name: steady
    impl: tests._tune_impls:steady
  - name: reference
    impl: tests._tune_impls:reference
"""


def _tune_child(rank: int, world: int, root: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    results: dict[str, Any] = {}
    try:
        dispatch.load_tables(Path(root, "ranked.yaml"))
        workload = Workload.load(Path(root, "wl.yaml"))
        out = Path(root, f"rank{rank}", "tuned.yaml")
        out.parent.mkdir()
        tuned = tune_workload(workload, out, rounds=3, progress=False)
        results["local"] = [{r: t.median_us for r, t in c.timings.items()} for c in tuned.local]
        results["local_excluded"] = [sorted(c.excluded) for c in tuned.local]
        results["combined"] = [{r: t.median_us for r, t in c.timings.items()}
                               for c in tuned.timings]
        results["excluded"] = [dict(c.excluded) for c in tuned.timings]
        results["winners"] = {b.condition: b.winner for b in tuned.buckets}
        assert tuned.plan is not None
        results["plan"] = [tuned.plan.digest, tuned.ranks]
        with use_profile("tuned"):  # the check a job runs after loading the profile
            plan = check_agreement([c.context() for c in workload.calls])
        results["check"] = [plan.digest, sorted(set(plan.rows.values()))]
        # Rank 0 alone cannot tune (its file's stem is no profile name): every rank raises.
        bad = Path(root, f"rank{rank}", "1bad.yaml" if rank == 0 else "fine.yaml")
        try:
            tune_workload(workload, bad, rounds=1, progress=False)
        except TuneError as exc:
            results["bad_name"] = str(exc)
    except Exception:
        results["raised"] = traceback.format_exc()
    finally:
        Path(root, f"result-{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


def test_two_ranks_one_profile(write_yaml: Callable[[str, str], Path], tmp_path: Path) -> None:
    """Rank 0 alone would pick ``skewed``, rank 1 ``steady``; the median across ranks picks
    ``steady`` on both, ``flaky`` (wrong on rank 1) is excluded on both, both ranks write
    the same bytes, and ``check_agreement`` passes."""
    dispatch.load_tables(write_yaml("ranked.yaml", TABLE))
    with record() as wl:
        for n in (2, 4):
            ops.call("ranked", torch.randn(n, 8))
    wl.save(tmp_path / "wl.yaml")
    results = _run_ranks(_tune_child, 2, tmp_path, limit=120)
    for rank, got in enumerate(results):
        assert "raised" not in got, f"rank {rank}:\n{got['raised']}"
    first, second = (tmp_path / f"rank{r}" / "tuned.yaml" for r in (0, 1))
    assert first.read_bytes() == second.read_bytes()
    doc = yaml.safe_load(first.read_text())
    assert doc["provenance"]["ranks"] == 2
    assert doc["families"]["ranked"]["order"] == ["steady"]
    # Among the rows right on both ranks, each rank alone would have chosen differently.
    zero, one = results[0]["local"], results[1]["local"]
    assert "flaky" in zero[0] and "flaky" not in one[0]
    assert all(min(c.keys() - {"flaky"}, key=c.__getitem__) == "skewed" for c in zero)
    assert all(min(c, key=c.__getitem__) == "steady" for c in one)
    # The combined time is the median across ranks (of 2: the mean), the same on both.
    assert results[0]["combined"] == results[1]["combined"]
    for i, combined in enumerate(results[0]["combined"]):
        assert set(combined) == {"skewed", "steady", "reference"}
        for row, us in combined.items():
            assert us == statistics.median([zero[i][row], one[i][row]])
        assert min(combined, key=combined.__getitem__) == "steady"
    assert results[0]["winners"] == results[1]["winners"] == {"always": "steady"}
    # flaky agreed with the reference on rank 0 only: excluded everywhere, rank 1 named.
    assert results[0]["local_excluded"] == [[], []]
    assert results[1]["local_excluded"] == [["flaky"], ["flaky"]]
    for got in results:
        assert all(e["flaky"].startswith("rank 1: differs from the reference")
                   for e in got["excluded"])
    # The plan: confirmed inside tune and again by the job.
    assert results[0]["plan"] == results[1]["plan"]
    assert results[0]["check"] == results[1]["check"]
    assert results[0]["check"][1] == ["steady"]
    for got in results:
        assert got["bad_name"].startswith("1 of the 2 ranks failed to measure the workload")
        assert "rank 0: TuneError: the profile is named after its file, and '1bad'" in \
            got["bad_name"]
    assert not (tmp_path / "rank1" / "fine.yaml").exists()


def _wire(timings: dict[str, tuple[float, float]], excluded: dict[str, str] | None = None,
          skipped: str | None = None) -> dict[str, Any]:
    """One rank's measurement of a call: per row median and spread, the median's
    interval a tenth either side, from 7 samples."""
    return {"family": "twice", "skipped": skipped, "excluded": excluded or {},
            "shipped": None,
            "timings": {r: [m, s, m * 0.9, m * 1.1, 7] for r, (m, s) in timings.items()}}


def test_combine_median_and_exclusions(write_yaml: Callable[[str, str], Path]) -> None:
    """Median across ranks per row and call; an exclusion or a missing row on one rank
    excludes the row everywhere; a call skipped on one rank is skipped."""
    dispatch.load_tables(write_yaml("ranked.yaml", TABLE))
    with record() as wl:
        ops.call("ranked", torch.randn(2, 8))
    call = wl.workload().calls[0]
    got = combine([call, call], [
        [_wire({"a": (10.0, 1.0), "b": (5.0, 2.0), "c": (1.0, 0.0)}), _wire({"a": (1.0, 0.0)})],
        [_wire({"a": (20.0, 3.0), "c": (1.0, 0.0)}, {"b": "raised X"}),
         _wire({}, skipped="family not loaded")],
        [_wire({"a": (40.0, 5.0), "b": (5.0, 2.0)}), _wire({"a": (2.0, 0.0)})],
    ])
    assert got[0].timings == {"a": Timing(20.0, 3.0, 18.0, 22.0, 7)}
    assert got[0].excluded == {"b": "rank 1: raised X", "c": "rank 2: not a candidate there"}
    assert got[0].skipped is None and got[0].winner == "a"
    assert got[1] == CallTiming(call, skipped="rank 1: family not loaded", index=1)


def test_one_rank_is_the_plain_path(write_yaml: Callable[[str, str], Path],
                                    tmp_path: Path) -> None:
    """Without a process group (and without torchrun's variables) tune is a world of one:
    ``ranks: 1``, no plan, the local timings are the timings."""
    assert not init_from_environment({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "x",
                                      "MASTER_PORT": "1"})
    assert not init_from_environment({})
    dispatch.load_tables(write_yaml("ranked.yaml", TABLE))
    with record() as wl:
        ops.call("ranked", torch.randn(2, 8))
    tuned = tune_workload(wl.workload(), tmp_path / "one.yaml", rounds=3, progress=False)
    assert tuned.ranks == 1 and tuned.plan is None and tuned.local == tuned.timings
    assert tuned.document["provenance"]["ranks"] == 1
    assert tuned.buckets[0].winner == "flaky"  # right on a single rank 0, and fastest


def test_cli_starts_the_group_from_torchrun_variables(write_yaml: Callable[[str, str], Path],
                                                     tmp_path: Path) -> None:
    """``astrai-ops tune`` in two processes given torchrun's variables (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) starts a gloo group itself: both
    write the same bytes, rank 0 prints the table, both print the agreed plan."""
    table = write_yaml("ranked.yaml", TABLE)
    dispatch.load_tables(table)
    with record() as wl:
        ops.call("ranked", torch.randn(2, 8))
    wl.save(tmp_path / "wl.yaml")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {**os.environ, "PYTHONPATH": str(REPO), "ASTR_TABLES": str(table),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
               "RANK": str(rank), "LOCAL_RANK": str(rank)}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "astrai", "tune", "wl.yaml", "-o", f"r{rank}.yaml",
             "--rounds", "3"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=90)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, (proc, out) in enumerate(zip(procs, outs, strict=True)):
        assert proc.returncode == 0, f"rank {rank}:\n{out}"
        assert "on 2 ranks (median across ranks)" in out and "agreed by 2 ranks" in out
    assert "family     calls  winner" in outs[0] and "family " not in outs[1]
    assert "excluded ranked.flaky" in outs[0]
    # Rank 0's document (its path in the head comment, its stem the profile's name).
    assert "activate: ASTR_TABLES=r1.yaml ASTR_OPS=profile=r0" in outs[1]
    assert (tmp_path / "r0.yaml").read_bytes() == (tmp_path / "r1.yaml").read_bytes()
