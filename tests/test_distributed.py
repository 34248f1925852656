"""Plan agreement across ranks (``astrai.distributed.agreement``, contract §12).

The multi-rank tests start 2 and 4 gloo processes on CPU (rendezvous through a
``file://`` store in ``tmp_path``, no ports). Each child runs every scenario in sequence
and writes what it saw to ``result-<rank>.json``; the parent asserts on those files.
Children are fresh processes from a ``forkserver`` that imported torch once (set
``ASTRAI_TEST_START_METHOD=spawn`` to start each one with ``spawn`` instead). Once more,
2 ranks run as plain interpreters in which NumPy cannot be imported, as on a machine with
only ``pip install torch``: the gather must not need it. Further 2-rank runs show that a
rank failing inside ``check_agreement`` (or never calling it, with ``timeout=``) makes
every rank raise within seconds instead of hanging until the process group's timeout;
every run is bounded, its processes killed when it overruns.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

import astrai.dispatch as dispatch
import astrai.distributed.agreement as distributed
from astrai.dispatch import (
    AgreedPlan,
    CallContext,
    ImplRecord,
    PlanMismatchError,
    Spec,
    Unavailable,
    UnknownFamilyError,
    check_agreement,
    current,
    load_tables,
    op_backend,
    refresh,
    register_family,
    resolve,
    use_profile,
)
from astrai.dispatch.axes import call_key
from astrai.dispatch.tables.model import table_revision
from astrai.distributed import collective
from astrai.distributed.comparison import PlanDifference, differences
from astrai.distributed.fingerprint import WIRE_FORMAT, CallPlan, Fingerprint, fingerprint
from tests import _impls

REPO = Path(__file__).resolve().parent.parent
#: ``fast`` serves ndim 3, ``medium`` ndim 3 and 4, ``ref`` (the fallback) only ndim 4.
#: A rank "lacks a backend" when ``LACKING`` names the row (its probe says unavailable).
DIST_TABLE = """\
version: 1
family: dist
fallback: ref
rows:
  - name: fast
    impl: tests._impls:fast
    when: ndim == 3
    available: tests.test_distributed:fast_probe
  - name: medium
    impl: tests._impls:medium
    when: ndim in {3, 4}
    available: tests.test_distributed:medium_probe
  - name: ref
    impl: tests._impls:ref
    when: ndim == 4
"""
NOFAST_PROFILE = "version: 1\nprofile: dist-nofast\nfamilies:\n  dist:\n    disable: [fast]\n"
C3 = CallContext("dist", ndim=3)
C4 = CallContext("dist", ndim=4)
K3, K4 = "dist[ndim=3]", "dist[ndim=4]"

LACKING: set[str] = set()


def fast_probe() -> bool | Unavailable:
    """``fast`` is available unless this rank lacks it."""
    return Unavailable("no fast kernel on this rank") if "fast" in LACKING else True


def medium_probe() -> bool | Unavailable:
    """``medium`` is available unless this rank lacks it."""
    return Unavailable("no medium kernel on this rank") if "medium" in LACKING else True


def _write_tables(root: Path) -> dict[str, str]:
    paths = {"table": root / "dist.yaml", "variant": root / "variant" / "dist.yaml",
             "profile": root / "dist-nofast.yaml"}
    paths["variant"].parent.mkdir(parents=True, exist_ok=True)
    paths["table"].write_text(DIST_TABLE)
    paths["variant"].write_text(DIST_TABLE.replace("ndim in {3, 4}", "ndim in {3, 4, 5}"))
    paths["profile"].write_text(NOFAST_PROFILE)
    return {k: str(v) for k, v in paths.items()}


# -- what each spawned rank runs -------------------------------------------------------

def _lacking(which: set[str]) -> None:
    LACKING.clear()
    LACKING.update(which)
    refresh()  # forget cached probe results


def _error(exc: PlanMismatchError) -> dict[str, Any]:
    return {"error": str(exc), "kinds": [d.kind for d in exc.differences]}


def _plan(plan: AgreedPlan) -> dict[str, Any]:
    return {"rows": dict(plan.rows), "overrides": dict(plan.overrides), "digest": plan.digest,
            "world": plan.world_size, "rank": plan.rank}


def _scenarios(rank: int, world: int, paths: dict[str, str]) -> dict[str, Callable[[], Any]]:
    last = world - 1

    def agree() -> Any:
        _lacking(set())
        return _plan(check_agreement([C3, C4]))

    def bad_context() -> Any:  # rank 1 alone fails before the collective: still joins it
        _lacking(set())
        return check_agreement([C3, "dist"] if rank == 1 else [C3])  # type: ignore[list-item]

    def lacks() -> Any:  # rank 1 lacks fast: it resolves ndim 3 to medium
        _lacking({"fast"} if rank == 1 else set())
        return check_agreement({"dist": C3})

    def consensus() -> Any:
        _lacking({"fast"} if rank == 1 else set())
        plan = check_agreement([C3, C4], consensus=True)
        out = _plan(plan)
        with plan.apply():
            out["inside"] = [resolve("dist", C3).name, resolve("dist", C4).name]
            out["again"] = _plan(check_agreement([C3, C4]))
        out["after"] = resolve("dist", C3).name
        return out

    def scope_error() -> Any:  # only rank 1 cannot honour the strict scope
        _lacking({"fast"} if rank == 1 else set())
        with op_backend(dist="fast"):
            return check_agreement([C3])

    def no_common() -> Any:
        _lacking({"medium"} if rank == 0 else {"fast"} if rank == 1 else set())
        return check_agreement([C3], consensus=True)

    def profiles() -> Any:
        _lacking(set())
        if rank == 0:
            with use_profile("dist-nofast"):
                return check_agreement([C3], consensus=True)
        return check_agreement([C3], consensus=True)

    def same_error() -> Any:
        return check_agreement([CallContext("no_such_family")])

    def table() -> Any:  # the last rank has another revision of the table
        _lacking(set())
        if rank == last:
            load_tables(paths["variant"])
        return check_agreement([C3], consensus=True)

    def subgroup() -> Any:  # global ranks 1 and 3 only; every rank must create the group
        import torch.distributed as dist

        _lacking({"fast"} if rank == 1 else set())
        group = dist.new_group([1, 3]) if world == 4 else None
        if rank not in (1, 3) or group is None:
            return {"skipped": True}
        return check_agreement([C3], group)

    return {f.__name__: f for f in (agree, bad_context, lacks, consensus, scope_error,
                                    no_common, profiles, same_error, subgroup, table)}


def _child(rank: int, world: int, root: str, paths: dict[str, str]) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    results: dict[str, Any] = {}
    try:
        load_tables(paths["table"], paths["profile"])
        for name, run in _scenarios(rank, world, paths).items():
            try:
                got = run()
                results[name] = got if isinstance(got, dict) else {"returned": repr(got)}
            except PlanMismatchError as exc:
                results[name] = _error(exc)
            except Exception as exc:
                results[name] = {"raised": type(exc).__name__, "detail": traceback.format_exc()}
    finally:
        Path(root, f"result-{rank}.json").write_text(json.dumps(results, indent=1))
        dist.destroy_process_group()


def _run_ranks(target: Callable[..., None], world: int, tmp_path: Path, *args: Any,
               limit: float = 240) -> list[dict[str, Any]]:
    """Run ``target(rank, world, root, *args)`` in ``world`` fresh processes; return what
    each wrote to ``result-<rank>.json``. Past ``limit`` seconds every rank is killed and
    the test fails: a hang costs ``limit``, never the process group's 30 minutes."""
    from torch.multiprocessing.spawn import start_processes

    method = os.environ.get("ASTRAI_TEST_START_METHOD", "forkserver")
    if method == "forkserver" and method in multiprocessing.get_all_start_methods():
        # A clean server imports torch once and forks each rank from that: fresh processes
        # like spawn's, without paying torch's import per rank (2 cores in CI).
        multiprocessing.get_context(method).set_forkserver_preload([__name__])
    else:
        method = "spawn"
    ctx = start_processes(  # type: ignore[no-untyped-call]
        target, args=(world, str(tmp_path), *args), nprocs=world, join=False,
        start_method=method)
    deadline = time.monotonic() + limit
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
            for proc in ctx.processes:
                proc.join(timeout=10)
            pytest.fail(f"the {world} ranks of {target.__name__} did not finish in {limit:g} s")
    return [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(world)]


def _spawn(world: int, tmp_path: Path) -> list[dict[str, Any]]:
    return _run_ranks(_child, world, tmp_path, _write_tables(tmp_path))


#: A rank on a machine without NumPy (a plain ``pip install torch`` does not install it):
#: ``numpy`` is made unimportable before torch is imported, in a fresh interpreter, so
#: torch itself starts without it (``Tensor.numpy()`` then raises "Numpy is not
#: available", which is what ``all_gather_object`` calls). Arguments: rank, world, root,
#: the table paths as JSON.
NO_NUMPY_RANK = """\
import sys
sys.modules["numpy"] = None  # "import numpy" now raises ImportError, as if not installed
import json, pathlib, torch
try:
    torch.zeros(1).numpy()
    state = "numpy is available"
except RuntimeError as exc:
    state = str(exc)
rank, world, root, paths = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
pathlib.Path(root, f"numpy-{rank}.txt").write_text(state)
from tests.test_distributed import _child
_child(rank, world, root, json.loads(paths))
"""


def _spawn_without_numpy(world: int, tmp_path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Like ``_spawn``, each rank a fresh interpreter in which NumPy cannot be imported;
    also returns what each rank saw when it asked torch for NumPy."""
    paths = _write_tables(tmp_path)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    procs = [subprocess.Popen([sys.executable, "-c", NO_NUMPY_RANK, str(rank), str(world),
                               str(tmp_path), json.dumps(paths)],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
             for rank in range(world)]
    deadline = time.monotonic() + 240
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(out.decode(errors="replace"))
    except subprocess.TimeoutExpired:
        pytest.fail(f"the {world} ranks without NumPy did not finish in time")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, (proc, text) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{text}"
    results = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(world)]
    return results, [(tmp_path / f"numpy-{r}.txt").read_text() for r in range(world)]


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_agree_or_say_why(world: int, tmp_path: Path) -> None:
    """2 and 4 gloo ranks on CPU; rank 1 lacks a backend in most scenarios."""
    _assert_scenarios(world, _spawn(world, tmp_path))


def test_ranks_agree_without_numpy(tmp_path: Path) -> None:
    """Two gloo ranks on machines without NumPy run every scenario as with it: the
    fingerprints are gathered as bytes in tensors, not with ``all_gather_object``, which
    needs NumPy to turn the received tensor back into bytes."""
    results, numpy = _spawn_without_numpy(2, tmp_path)
    assert numpy == ["Numpy is not available"] * 2  # the ranks really ran without it
    _assert_scenarios(2, results)


def _assert_scenarios(world: int, results: list[dict[str, Any]]) -> None:
    """What every rank of ``_scenarios`` must have seen."""
    others = "rank 0" if world == 2 else "ranks 0,2,3"
    for rank, got in enumerate(results):
        unexpected = {k: v["detail"] for k, v in got.items() if "detail" in v
                      and k != "same_error"}
        assert not unexpected, f"rank {rank}: {unexpected}"

        # Everything agrees: a plan, the same on every rank.
        agree = got["agree"]
        assert agree["rows"] == {K3: "fast", K4: "medium"}
        assert agree["overrides"] == {}
        assert (agree["world"], agree["rank"]) == (world, rank)
        assert agree["digest"] == results[0]["agree"]["digest"]

        # Rank 1 alone fails before the all-gather: it still takes part, and every rank
        # raises the same error naming it (and the next scenarios show the group in step).
        bad = got["bad_context"]
        assert bad["kinds"] == ["failed"]
        assert ("rank 1 could not compute its plan: TypeError: expected CallContext objects, "
                "got str: 'dist'") in bad["error"]
        assert f"1 of the {world} ranks of the process group could not compute" in bad["error"]
        assert bad["error"] == results[0]["bad_context"]["error"]

        # Rank 1 lacks fast: every rank raises, naming the ranks, both rows and the reason.
        lacks = got["lacks"]
        assert lacks["kinds"] == ["row"]
        assert f"{K3}: {others} -> fast; rank 1 -> medium" in lacks["error"]
        assert "fast is unavailable (no fast kernel on this rank)" in lacks["error"]
        assert lacks["error"] == results[0]["lacks"]["error"]

        # Consensus: the first row every rank can run for both calls, pinned by apply().
        cons = got["consensus"]
        assert cons["overrides"] == {"dist": "medium"}
        assert cons["rows"] == {K3: "medium", K4: "medium"}
        assert cons["inside"] == ["medium", "medium"]
        assert cons["again"]["overrides"] == {}
        assert cons["again"]["rows"] == {K3: "medium", K4: "medium"}
        assert cons["after"] == ("medium" if rank == 1 else "fast")
        assert cons["digest"] == results[0]["consensus"]["digest"]

        # A strict scope that fails on rank 1 alone is reported, not a hang.
        scope = got["scope_error"]
        assert scope["kinds"] == ["call"]
        assert "rank 1 -> error: ExplicitSelectionError" in scope["error"]

        # No row that every rank can run for ndim 3: consensus gives up and says so.
        none = got["no_common"]
        assert none["kinds"] == ["row", "consensus"]
        assert "consensus found no common row" in none["error"]
        expected = "rank 0 -> fast; rank 1 -> medium"
        if world == 4:
            expected += "; ranks 2,3 -> fast, medium"
        assert f"dist: no row every rank can run for all its dist calls (rows each rank can " \
               f"run): {expected}" in none["error"]

        # Different active profiles: consensus cannot settle that.
        prof = got["profiles"]
        assert prof["kinds"] == ["profiles", "row"]
        rest = "rank 1" if world == 2 else "ranks 1-3"
        assert f"active profiles: rank 0 -> dist-nofast; {rest} -> (none)" in prof["error"]
        assert "consensus cannot settle differing tables, profiles" in prof["error"]

        # A subgroup names global ranks.
        if world == 4 and rank in (1, 3):
            assert got["subgroup"]["kinds"] == ["row"]
            assert f"{K3}: rank 1 -> medium; rank 3 -> fast" in got["subgroup"]["error"]

        # The same failure everywhere is the caller's own error, raised on every rank.
        assert got["same_error"]["raised"] == "UnknownFamilyError"

        # Another table revision on the last rank: named, and not settled by consensus.
        table = got["table"]
        assert table["kinds"] == ["table"]
        assert f"rank {world - 1} -> revision" in table["error"]
        first = "rank 0" if world == 2 else "ranks 0-2"
        assert f"table dist: {first} -> revision" in table["error"]


# -- a rank that fails inside check_agreement, or never calls it -------------------------

#: Not YAML: a node whose ``ASTR_TABLES`` names this file cannot load its tables at all.
BROKEN_TABLE = "version: 1\nfamily: dist\nrows: [\n"
#: Every rank's own process group timeout: far above what the failing checks may take.
GROUP_TIMEOUT = timedelta(seconds=60)


def _attempt(results: dict[str, Any], name: str, call: Callable[[], AgreedPlan]) -> None:
    """Record what ``call`` returned or raised, and how long it took."""
    start = time.monotonic()
    try:
        out: dict[str, Any] = {"plan": _plan(call())}
    except PlanMismatchError as exc:
        cause = exc.__cause__
        out = {**_error(exc), "cause": None if cause is None else type(cause).__name__}
    except Exception as exc:
        out = {"raised": type(exc).__name__, "message": str(exc)}
    out["seconds"] = time.monotonic() - start
    results[name] = out


def _failing_child(rank: int, world: int, root: str, paths: dict[str, str], case: str) -> None:
    """``bad_context``: rank 1 passes a string among its contexts. ``bad_tables``: rank 1's
    ``ASTR_TABLES`` names a broken file, so its tables fail to load inside the check."""
    import torch.distributed as dist

    from astrai.dispatch import state

    if case == "bad_tables" and rank == 1:
        assert state.snapshot is None, "tables already loaded: ASTR_TABLES would be ignored"
        os.environ["ASTR_TABLES"] = paths["broken"]
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank,
                            world_size=world, timeout=GROUP_TIMEOUT)
    results: dict[str, Any] = {}
    try:
        if case == "bad_context":
            load_tables(paths["table"])
            bad: list[Any] = [C3, "dist"]
            _attempt(results, "one", lambda: check_agreement(bad if rank == 1 else [C3]))
            _attempt(results, "every", lambda: check_agreement(["dist"]))  # type: ignore[list-item]
        else:
            if rank != 1:
                load_tables(paths["table"])
            _attempt(results, "one", lambda: check_agreement([C3]))
            # rank 0 fails too, differently: both failures are named.
            bad = ["dist"] if rank == 0 else [C3]
            _attempt(results, "two", lambda: check_agreement(bad))
            if rank == 1:  # the node is fixed: the group is still in step
                del os.environ["ASTR_TABLES"]
                load_tables(paths["table"])
        _attempt(results, "after", lambda: check_agreement([C3]))
    finally:
        Path(root, f"result-{rank}.json").write_text(json.dumps(results, indent=1))
        dist.destroy_process_group()


@pytest.mark.parametrize("case", ["bad_context", "bad_tables"])
def test_one_rank_failing_inside_check_agreement(case: str, tmp_path: Path) -> None:
    """2 gloo ranks, rank 1 fails inside ``check_agreement`` (a non-CallContext
    in its list; its own ``ASTR_TABLES`` broken). It still joins the all-gather, sending
    its error, so both ranks raise the same ``PlanMismatchError`` naming rank 1 and the
    error within seconds; before the fix rank 0 waited for the group's timeout."""
    paths = _write_tables(tmp_path)
    broken = tmp_path / "broken" / "dist.yaml"
    broken.parent.mkdir()
    broken.write_text(BROKEN_TABLE)
    paths["broken"] = str(broken.parent)
    start = time.monotonic()
    results = _run_ranks(_failing_child, 2, tmp_path, paths, case, limit=60)
    elapsed = time.monotonic() - start
    if case == "bad_context":
        error = "TypeError: expected CallContext objects, got str: 'dist'"
    else:
        error = f"TableError: {broken}:4:1: invalid YAML"
    for rank, got in enumerate(results):
        one = got["one"]
        assert one.get("kinds") == ["failed"], f"rank {rank}: {one}"
        assert f"rank 1 could not compute its plan: {error}" in one["error"]
        assert "1 of the 2 ranks of the process group could not compute" in one["error"]
        assert one["error"] == results[0]["one"]["error"]  # the same error on every rank
        assert one["cause"] == (error.split(":")[0] if rank == 1 else None)
        assert one["seconds"] < 15, f"rank {rank} took {one['seconds']:.1f} s"
        if case == "bad_context":
            # Every rank fails alike: each raises its own error, as a failed call does.
            assert got["every"]["raised"] == "TypeError", got["every"]
        else:
            two = got["two"]
            assert two["kinds"] == ["failed", "failed"], two
            assert "2 of the 2 ranks" in two["error"]
            assert "rank 0 could not compute its plan: TypeError: expected CallContext" \
                in two["error"]
            assert f"rank 1 could not compute its plan: {error}" in two["error"]
            assert two["error"] == results[0]["two"]["error"]
        # The collectives stayed in step: the next check agrees.
        assert got["after"]["plan"]["rows"] == {K3: "fast"}, got["after"]
    assert elapsed < 60


def _timeout_child(rank: int, world: int, root: str, paths: dict[str, str]) -> None:
    """Rank 0 checks with ``timeout=2``; rank 1 never calls ``check_agreement``: it waits
    for rank 0's result (60 s at most), then leaves the group and exits normally."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank,
                            world_size=world, timeout=GROUP_TIMEOUT)
    results: dict[str, Any] = {}
    mine = Path(root, f"result-{rank}.json")
    try:
        load_tables(paths["table"])
        if rank == 0:
            _attempt(results, "timeout", lambda: check_agreement([C3], timeout=2))
        else:
            done = Path(root, "result-0.json")
            deadline = time.monotonic() + 60
            while not done.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            results["saw_rank_0"] = done.exists()
    finally:
        mine.write_text(json.dumps(results, indent=1))
        dist.destroy_process_group()


def test_timeout_bounds_the_wait_for_other_ranks(tmp_path: Path) -> None:
    """Rank 1 never calls ``check_agreement``: with ``timeout=2`` rank 0 raises a
    ``PlanMismatchError`` within seconds naming the all-gather and the time waited,
    instead of waiting for the group's timeout; both processes then exit cleanly."""
    start = time.monotonic()
    results = _run_ranks(_timeout_child, 2, tmp_path, _write_tables(tmp_path), limit=60)
    elapsed = time.monotonic() - start
    got = results[0]["timeout"]
    assert got.get("kinds") == ["timeout"], got
    assert "check_agreement timed out on rank 0 (of a group of 2)" in got["error"]
    assert "(timeout=2 s) waiting for the other ranks in the all-gather of the payload " \
           "lengths" in got["error"]
    assert got["cause"] == "RuntimeError"  # the backend's own error, chained
    assert 1.9 <= got["seconds"] < 10, got
    assert results[1] == {"saw_rank_0": True}
    assert elapsed < 60


# -- single process ----------------------------------------------------------------------

@pytest.fixture
def dist_table(tmp_path: Path) -> Iterator[dict[str, str]]:
    paths = _write_tables(tmp_path)
    load_tables(paths["table"], paths["profile"])
    LACKING.clear()
    refresh()
    yield paths
    LACKING.clear()


def test_revision_is_content_not_path(tmp_path: Path, dist_table: dict[str, str]) -> None:
    """The same table text loaded from another path has the same revision; a changed
    ``when`` gives another."""
    first = table_revision(current().family("dist"))
    copy = tmp_path / "elsewhere" / "copy.yaml"
    copy.parent.mkdir()
    copy.write_text(DIST_TABLE)
    load_tables(copy)
    assert table_revision(current().family("dist")) == first
    load_tables(dist_table["variant"])
    assert table_revision(current().family("dist")) != first


def test_revision_of_programmatic_family() -> None:
    """A ``register_family`` table's revision hashes its rows, not object identities."""
    def rows(when: str) -> list[ImplRecord]:
        return [ImplRecord("prog", "fast", _impls.fast, Spec.parse(when)),
                ImplRecord("prog", "ref", _impls.ref, available=_impls.always_available)]

    register_family("prog", rows("ndim == 3"), "ref")
    first = table_revision(current().family("prog"))
    register_family("prog", rows("ndim == 3"), "ref")
    assert table_revision(current().family("prog")) == first
    register_family("prog", rows("ndim == 4"), "ref")
    assert table_revision(current().family("prog")) != first


@pytest.mark.usefixtures("dist_table")
def test_without_process_group_is_a_world_of_one() -> None:
    """No initialized process group: the check runs locally and returns the plan."""
    assert not (torch.distributed.is_available() and torch.distributed.is_initialized())
    plan = check_agreement({"dist": C3}, consensus=True)
    assert (plan.ranks, plan.rank, plan.world_size) == ((0,), 0, 1)
    assert dict(plan.rows) == {K3: "fast"}
    assert dict(plan.overrides) == {}
    with plan.apply():
        assert resolve("dist", C3).name == "fast"
    assert "dist[ndim=3] -> fast" in plan.summary()
    assert plan.digest == check_agreement([C3]).digest


@pytest.mark.usefixtures("dist_table")
def test_fingerprint_follows_what_resolve_would_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scope, ``ASTR_OPS`` and profiles all show in the fingerprint, as they would in resolve."""
    assert fingerprint([C3]).calls[0] == CallPlan(K3, "dist", "fast", "chain", None,
                                                  ("fast", "medium"))
    with op_backend(dist="medium"):
        assert (fingerprint([C3]).calls[0].row, fingerprint([C3]).calls[0].origin) == \
            ("medium", "context")
    monkeypatch.setenv("ASTR_OPS", "dist=medium,profile=dist-nofast")
    got = fingerprint([C3])
    assert (got.calls[0].row, got.calls[0].origin) == ("medium", "env")
    assert [name for name, _ in got.profiles] == ["dist-nofast"]
    assert got.calls[0].candidates == ("medium",)  # fast is disabled by the profile


@pytest.mark.usefixtures("dist_table")
def test_contexts_argument() -> None:
    """A mapping or an iterable; duplicates count once; mistakes are reported up front."""
    assert [c.key for c in fingerprint([C3, C4, C3.evolve()]).calls] == [K3, K4]
    assert [c.key for c in fingerprint({"dist": C4}).calls] == [K4]
    with pytest.raises(ValueError, match="is a context for 'dist'"):
        check_agreement({"attention": C3})
    with pytest.raises(TypeError, match="expected CallContext"):
        check_agreement(["dist"])  # type: ignore[list-item]
    key = call_key(CallContext("attention", fwd="decode", dtype=torch.bfloat16, ndim=3,
                               has_cache=True, grad_enabled=False))
    assert key == "attention[fwd=decode dtype=bfloat16 ndim=3 has_cache=true grad_enabled=false]"


@pytest.mark.usefixtures("dist_table")
def test_same_error_everywhere_is_reraised() -> None:
    """A call that fails on every rank alike raises the caller's own error."""
    with pytest.raises(UnknownFamilyError):
        check_agreement([CallContext("no_such_family")])


def _print(rows: dict[str, tuple[str, tuple[str, ...]]], *, revision: str = "r1",
           profiles: tuple[tuple[str, str], ...] = ()) -> Fingerprint:
    calls = tuple(CallPlan(key, "dist", row, "chain", None, cands)
                  for key, (row, cands) in sorted(rows.items()))
    return Fingerprint("0.1.0", "host", (("dist", revision),), profiles, calls,
                       (("dist", ("fast", "medium", "ref")),))


def test_differences_group_ranks() -> None:
    """Ranks holding the same value are grouped, runs of ranks shortened."""
    prints = [_print({K3: ("fast", ("fast",))}) for _ in range(8)]
    prints[4] = _print({K3: ("medium", ("medium",))}, revision="r2")
    diffs = differences(prints, range(8))
    assert [d.kind for d in diffs] == ["table", "row"]
    assert str(diffs[0]) == "table dist: ranks 0-3,5-7 -> revision r1; rank 4 -> revision r2"
    assert str(diffs[1]) == f"{K3}: ranks 0-3,5-7 -> fast; rank 4 -> medium"
    assert diffs[1].ranks_of("medium") == (4,)


def test_consensus_needs_one_row_for_every_call_of_the_family() -> None:
    """``op_backend`` pins a family, not a call: the row must serve all its calls on all ranks.

    ``medium`` would settle ndim 3, but it cannot serve the other call on rank 1, so
    consensus takes ``ref``, the first row that serves everything everywhere.
    """
    from astrai.distributed.comparison import consensus_rows as consensus

    prints = [_print({K3: ("fast", ("fast", "medium", "ref")), K4: ("medium", ("medium", "ref"))}),
              _print({K3: ("medium", ("medium", "ref")), K4: ("ref", ("ref",))})]
    diffs = differences(prints, [0, 1])
    assert [d.item for d in diffs] == [K3, K4]
    assert consensus(prints, [0, 1], diffs) == {"dist": "ref"}


def test_error_carries_differences_and_pickles() -> None:
    """``PlanMismatchError`` is an ``AstraiError`` and ``RuntimeError`` and survives pickling."""
    diff = PlanDifference("row", K3, (("fast", (0,)), ("medium", (1,))))
    exc = PlanMismatchError("ranks differ", [diff])
    assert isinstance(exc, dispatch.AstraiError) and isinstance(exc, RuntimeError)
    back = pickle.loads(pickle.dumps(exc))
    assert str(back) == "ranks differ"
    assert back.differences == (diff,)


def _full_print() -> Fingerprint:
    """A fingerprint with every field filled: profiles, a failed call, unavailable rows."""
    calls = (CallPlan(K3, "dist", "fast", "chain", None, ("fast", "medium")),
             CallPlan(K4, "dist", None, None, "UnknownFamilyError: no \udcff family"))
    return Fingerprint("0.1.0", "höst", (("dist", "r1"), ("toy", "py-0f")),
                       (("dist-nofast", "abc"),), calls,
                       (("dist", ("fast", "medium", "ref")),),
                       (("dist", "fast", "no fast kernel on this rank"),))


def test_wire_format_round_trip() -> None:
    """What is gathered is builtins only and survives JSON, which turns tuples into lists:
    the fingerprint read back equals (and hashes like) the one sent."""
    fp = _full_print()
    assert Fingerprint.from_wire(pickle.loads(pickle.dumps(fp.to_wire()))) == fp
    raw = collective.encode_payload(fp.to_wire())
    assert raw.isascii()
    back = Fingerprint.from_wire(collective.decode_payload(raw))
    assert back == fp and hash(back) == hash(fp)
    assert Fingerprint.from_wire(json.loads(json.dumps(_print({K3: ("fast", ())}).to_wire()))) \
        == _print({K3: ("fast", ())})


@pytest.mark.parametrize("damage", [
    lambda w: w.update(wire=999),
    lambda w: w.pop("fingerprint"),
    lambda w: w["fingerprint"].pop("orders"),
    lambda w: w["fingerprint"].update(extra=1),
    lambda w: w["fingerprint"].update(host=7),
    lambda w: w["fingerprint"].update(tables=[["dist", "r1", "extra"]]),
    lambda w: w["fingerprint"].update(tables="dist"),
    lambda w: w["fingerprint"]["calls"][0].update(row=["fast"]),
    lambda w: w["fingerprint"]["calls"][0].update(candidates=[1, 2]),
    lambda w: w["fingerprint"]["calls"][0].pop("origin"),
    lambda w: w["fingerprint"].update(orders=[["dist"]]),
    lambda w: w["fingerprint"].update(unavailable=[["dist", "fast"]]),
])
def test_wire_format_rejects_other_shapes(damage: Callable[[dict[str, Any]], Any]) -> None:
    """A payload of another shape or type is not ours (``None``), never a crash later."""
    wire = json.loads(json.dumps(_full_print().to_wire()))
    damage(wire)
    assert Fingerprint.from_wire(wire) is None
    assert Fingerprint.from_wire("garbage") is None
    assert Fingerprint.from_wire(None) is None


@pytest.mark.usefixtures("dist_table")
def test_unreadable_payload_is_named_not_unpickled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes that are not JSON (say, a pickle from an older astrai) are never unpickled:
    the check raises ``PlanMismatchError`` with a ``format`` difference."""
    monkeypatch.setattr(collective, "encode_payload", pickle.dumps)
    with pytest.raises(PlanMismatchError) as err:
        check_agreement([C3])
    assert [d.kind for d in err.value.differences] == ["format"]
    assert "fingerprint format: rank 0 -> unreadable (astrai ?)" in str(err.value)
    assert collective.decode_payload(pickle.dumps({"wire": 1})) is None
    assert collective.decode_payload(b"[" * 100_000) is None  # too deep for json: still None


@pytest.mark.parametrize(("backend", "expected"), [("gloo", "cpu"), ("mpi", "cpu"),
                                                    ("nccl", "cuda:3")])
def test_gather_device_follows_backend(backend: str, expected: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL gathers on this rank's current CUDA device, any other backend on the CPU."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_backend", lambda group=None: dist.Backend(backend))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert str(collective.collective_device(None)) == expected



@pytest.mark.usefixtures("dist_table")
def test_timeout_argument() -> None:
    """``timeout=`` takes seconds or a ``timedelta``; a bad one is this rank's failure
    (in a world of one, every rank's alike: the error itself)."""
    assert dict(check_agreement([C3], timeout=5).rows) == {K3: "fast"}
    assert dict(check_agreement([C3], timeout=timedelta(seconds=0.5)).rows) == {K3: "fast"}
    for bad in (0, -1, float("nan"), float("inf"), timedelta(0)):
        with pytest.raises(ValueError, match="timeout must be a positive"):
            check_agreement([C3], timeout=bad)
    for wrong in ("5", True):
        with pytest.raises(TypeError, match="timeout must be seconds"):
            check_agreement([C3], timeout=wrong)  # type: ignore[arg-type]


def _fake_world(monkeypatch: pytest.MonkeyPatch, others: list[dict[str, Any]]) -> None:
    """Pretend this process is rank 0 of a group whose other ranks sent ``others``."""
    def gather(payload: dict[str, Any], group: Any, timeout: float | None = None
               ) -> tuple[list[Any], tuple[int, ...], int]:
        gathered = [collective.decode_payload(collective.encode_payload(p))
                    for p in [payload, *others]]
        return gathered, tuple(range(len(gathered))), 0

    monkeypatch.setattr(distributed, "gather_payloads", gather)


@pytest.mark.usefixtures("dist_table")
def test_failed_rank_is_data(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that could not compute its plan sends its error; every rank raises one
    ``PlanMismatchError`` naming the failed ranks, the failing one chaining its error."""
    good = fingerprint([C3]).to_wire()
    broken = collective.failed_payload(ValueError("bad \udcff table"))
    _fake_world(monkeypatch, [broken, good, broken])
    with pytest.raises(PlanMismatchError) as err:
        check_agreement([C3])
    assert [d.kind for d in err.value.differences] == ["failed"]
    assert err.value.differences[0].ranks_of("ValueError: bad \udcff table") == (1, 3)
    message = str(err.value)
    assert message.startswith("2 of the 4 ranks of the process group could not compute")
    assert "ranks 1,3 could not compute their plan: ValueError: bad \udcff table" in message
    assert err.value.__cause__ is None

    # This rank fails (a bad context), the others are fine: its own error is the cause.
    _fake_world(monkeypatch, [good])
    with pytest.raises(PlanMismatchError) as err:
        check_agreement([C3, 3])  # type: ignore[list-item]
    assert "rank 0 could not compute its plan: TypeError: expected CallContext objects, " \
           "got int: 3" in str(err.value)
    assert isinstance(err.value.__cause__, TypeError)

    # A failed rank and an unreadable payload: both named.
    _fake_world(monkeypatch, [broken, {"wire": 99}])
    with pytest.raises(PlanMismatchError) as err:
        check_agreement([C3])
    assert [d.kind for d in err.value.differences] == ["failed", "format"]
    assert "rank 2 -> unreadable (astrai ?)" in str(err.value)


def test_failed_payload_is_bounded_and_safe() -> None:
    """An error whose message is huge or cannot be formatted still makes a payload."""
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    text = collective.failed_text(collective.failed_payload(Unprintable()))
    assert text == "Unprintable: (the error's message could not be formatted)"
    huge = collective.failed_text(collective.failed_payload(ValueError("x" * 100_000)))
    assert huge is not None and len(huge) < 9000 and huge.endswith(" [...]")
    assert collective.failed_text({"wire": WIRE_FORMAT, "failed": 3}) is None
    assert collective.failed_text(fingerprint([]).to_wire()) is None
