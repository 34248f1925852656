"""Recording a workload: ``record()``, the workload file, ``ASTR_RECORD``."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import astrai.dispatch as dispatch
from astrai import ops
from astrai.dispatch import FileFormatError, op_backend, record, use_profile
from astrai.dispatch.facade import FACADES
from astrai.models.llama import LlamaConfig, TinyLlama, generate_paged
from astrai.record.workload import (
    ObjectArg,
    PagedArg,
    RecordedCall,
    SeqArg,
    TensorArg,
    Workload,
)

SMALL = LlamaConfig(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64)
REPO = Path(__file__).resolve().parents[1]


def every_facade() -> None:
    """Calls of every built-in facade: dense attention, paged prefill and decode (through
    the tiny model: rotary, rms_norm, linear too), and a few shapes and flags more."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 4, 8, generator=g)
    kv = torch.randn(2, 6, 2, 8, generator=g)
    ops.attention(q, kv, kv, is_causal=True)
    ops.attention(q, kv, kv, attn_mask=torch.ones(6, 6, dtype=torch.bool))
    ops.attention(q, kv, kv, is_causal=True, scale=0.25, window=3)  # features asked
    ops.attention(q, kv, kv, sinks=torch.zeros(4), return_weights=True)
    ops.linear(torch.randn(3, 8, generator=g), torch.randn(5, 8, generator=g),
               torch.randn(5, generator=g))
    ops.rms_norm(torch.randn(2, 3, 8, dtype=torch.float64, generator=g),
                 torch.ones(8, dtype=torch.float64), 1e-5)
    generate_paged(TinyLlama(SMALL, seed=1), [[1, 2, 3], [4, 5, 6, 7, 8]], steps=3)


class TestRecord:
    """``with record() as wl:`` collects the distinct calls the facades see."""

    def test_counts_every_call_once(self) -> None:
        """The counts add up to the calls the facades served (``stats``)."""
        dispatch.stats(reset=True)
        with record() as wl:
            every_facade()
        served = sum(dispatch.stats().calls.values())
        assert wl.workload().total == served > 0
        assert {c.family for c in wl.calls} == {"attention", "rotary", "rms_norm", "linear"}

    def test_a_call_is_its_axes_and_arguments(self) -> None:
        """A call's record holds every axis (raw) and its arguments' shapes and flags."""
        q = torch.randn(2, 6, 4, 8)
        kv = torch.randn(2, 5, 2, 8)
        with record() as wl:
            ops.attention(q, kv, kv, is_causal=True)
        (call,) = wl.calls
        assert call.family == "attention" and call.count == 1
        assert call.axes["dtype"] == "float32" and call.axes["fwd"] is None
        assert (call.axes["batch"], call.axes["q_len"], call.axes["kv_len"]) == (2, 6, 5)
        assert (call.axes["heads"], call.axes["kv_heads"], call.axes["head_dim"]) == (4, 2, 8)
        assert set(call.axes) == set(dispatch.CallContext.__dataclass_fields__) - {
            "family", "extra", "raw", "raw_kwargs"}
        assert call.args == (TensorArg((2, 6, 4, 8), "float32", "cpu"),
                             TensorArg((2, 5, 2, 8), "float32", "cpu"),
                             TensorArg((2, 5, 2, 8), "float32", "cpu"))
        assert call.kwargs == {"kv_cache": None, "layer_id": 0, "attn_mask": None,
                               "is_causal": True, "fwd": None}

    def test_features_asked_are_keywords(self) -> None:
        """The features a call asks for are recorded as the keywords its row gets."""
        q = torch.randn(1, 4, 2, 8)
        with record() as wl:
            ops.attention(q, q, q, is_causal=True, scale=0.25, window=2)
            ops.attention(q, q, q, scale=8 ** -0.5)  # the default scale: asks for nothing
        first, second = wl.calls
        assert (first.kwargs["scale"], first.kwargs["window"]) == (0.25, 2)
        assert first.axes["scale"] is True and first.axes["window"] == 2
        assert "scale" not in second.kwargs and second.axes["scale"] is False

    def test_alike_calls_are_counted_together(self) -> None:
        """Calls that differ only in the layer they come from are one call; another
        length or flag is another call."""
        q = torch.randn(1, 4, 2, 8)
        with record() as wl:
            for layer in range(3):
                ops.attention(q, q, q, layer_id=layer, is_causal=True)
            ops.attention(q, q, q, is_causal=False)
            ops.attention(q[:, :3], q[:, :3], q[:, :3], is_causal=True)
        assert [c.count for c in wl.calls] == [3, 1, 1]
        assert wl.calls[0].kwargs["layer_id"] == 0  # the first value seen

    def test_paged_batch_is_described(self) -> None:
        """A paged call records its batch: each request's cached and new tokens, and
        the pool's sizes."""
        with record() as wl:
            generate_paged(TinyLlama(SMALL, seed=1), [[1, 2, 3], [4, 5, 6, 7, 8]], steps=2)
        paged = [c.kwargs["kv_cache"] for c in wl.calls if c.family == "attention"]
        # the model's pool: 2 layers, 2 KV heads of 8, 2 requests of up to 5 + 2 + 1 tokens
        assert paged == [
            PagedArg("prefill", (0, 0), (3, 5), 2, paged[0].slots, 2, 8, 2, 8, "float32",
                     "cpu"),
            PagedArg("decode", (3, 5), (1, 1), 2, paged[0].slots, 2, 8, 2, 8, "float32",
                     "cpu")]

    def test_conditions_are_the_recorded_ones(self) -> None:
        """``conditions()`` restores the call's grad mode, row and profiles."""
        call = RecordedCall("rms_norm", {"grad_enabled": False}, scope_backend="torch",
                            scope_profiles=("reference",))
        with call.conditions():
            assert not torch.is_grad_enabled()
            assert dispatch.current_overrides() == {"rms_norm": "torch"}
            assert dispatch.current_profiles() == ("reference",)
        assert torch.is_grad_enabled() and dispatch.current_overrides() == {}

    def test_selection_is_recorded(self) -> None:
        """``backend=``, the ``op_backend`` row and ``use_profile`` profiles are part of
        a call (a row's object is written as the row's name)."""
        from astrai.backends.attention.math import math_attention

        x = torch.randn(3, 8)
        w = torch.ones(8)
        q = torch.randn(1, 2, 2, 8)
        with record() as wl:
            ops.rms_norm(x, w, backend="reference")
            with op_backend(rms_norm="torch"), use_profile("reference"):
                ops.rms_norm(x, w)
            ops.attention(q, q, q, backend=math_attention)
        first, second, third = wl.calls
        assert (first.backend, first.scope_backend, first.scope_profiles) == (
            "reference", None, ())
        assert (second.backend, second.scope_backend, second.scope_profiles) == (
            None, "torch", ("reference",))
        assert third.backend == "math"

    def test_refused_calls_are_not_recorded(self) -> None:
        """A malformed call raises before any row runs, and is not recorded."""
        with record() as wl, pytest.raises(ValueError):
            ops.rms_norm(torch.randn(3, 8), torch.ones(7))
        assert wl.calls == ()

    def test_generic_family_through_ops_call(self, toy: Path) -> None:
        """``ops.call`` of a family without a facade is recorded with its arguments (an
        object astrai cannot describe by its type)."""

        class Thing:
            pass

        with record() as wl:
            ops.call("toy", torch.zeros(2, 3, 4), 7, flag=True, thing=Thing())
        (call,) = wl.calls
        assert call.family == "toy" and call.axes["ndim"] == 3
        assert call.args == (TensorArg((2, 3, 4), "float32", "cpu"), 7)
        assert call.kwargs["flag"] is True
        assert call.kwargs["thing"] == ObjectArg(f"{__name__}:TestRecord."
                                                 "test_generic_family_through_ops_call.<locals>.Thing")
        with pytest.raises(ValueError, match="cannot rebuild an argument of type"):
            call.arguments()

    def test_nested_recordings_each_get_every_call(self) -> None:
        """Two recordings in force both get a call; the outer one keeps recording."""
        x, w = torch.randn(2, 8), torch.ones(8)
        with record() as outer:
            ops.rms_norm(x, w)
            with record() as inner:
                ops.rms_norm(x, w)
            ops.rms_norm(x, w)
        assert [c.count for c in outer.calls] == [3]
        assert [c.count for c in inner.calls] == [1]

    def test_every_thread_is_recorded(self) -> None:
        """A recording is process-wide: a call in another thread is recorded too."""
        with record() as wl:
            t = threading.Thread(target=lambda: ops.rms_norm(torch.randn(2, 8), torch.ones(8)))
            t.start()
            t.join()
        assert [c.family for c in wl.calls] == ["rms_norm"]

    def test_full_recording_counts_what_it_drops(self) -> None:
        """Past ``max_calls`` distinct calls, new ones are counted as dropped."""
        w = torch.ones(8)
        with record(max_calls=2) as wl:
            for n in (1, 2, 3, 4, 1):
                ops.rms_norm(torch.randn(n, 8), w)
        workload = wl.workload()
        assert [c.count for c in workload.calls] == [2, 1]
        assert workload.dropped == 2


class TestCost:
    """Recording costs nothing while nothing records."""

    def test_facades_take_their_plain_route_unless_recording(self) -> None:
        """The facades switch to recording routes only while a recording is in force."""
        attention = FACADES["attention"]
        assert attention.route is attention.plain
        with record():
            assert attention.route is not attention.plain
            with record():
                assert attention.route is not attention.plain
            assert attention.route is not attention.plain
        assert all(f.route is f.plain for f in FACADES.values())

    def test_stopped_recording_stays_empty(self) -> None:
        """Calls after the block are not recorded."""
        with record() as wl:
            pass
        ops.rms_norm(torch.randn(2, 8), torch.ones(8))
        assert wl.calls == () and not wl.active


@pytest.fixture
def recorded() -> Iterator[Workload]:
    """The workload of ``every_facade``."""
    with record() as wl:
        every_facade()
    yield wl.workload()


class TestRoundTrip:
    """Facade calls -> workload -> file -> workload -> the same calls."""

    def test_file_round_trip(self, recorded: Workload, tmp_path: Path) -> None:
        """A saved workload loads back equal: calls, counts, machine."""
        path = recorded.save(tmp_path / "wl.yaml")
        assert Workload.load(path) == recorded
        text = path.read_text()
        assert text.startswith("# astrai workload:")
        assert "yaml-language-server: $schema=" in text

    def test_replay_repeats_the_calls(self, recorded: Workload, tmp_path: Path) -> None:
        """Inputs rebuilt from the file and passed to ``ops.call`` make the same calls."""
        loaded = Workload.load(recorded.save(tmp_path / "wl.yaml"))
        with record() as again:
            for call in loaded.calls:
                args, kwargs = call.arguments(generator=torch.Generator().manual_seed(0))
                with call.conditions():
                    ops.call(call.family, *args, backend=call.backend, **kwargs)
        assert again.calls == tuple(dataclasses.replace(c, count=1) for c in loaded.calls)

    def test_rebuilt_tensor_keeps_strides_and_grad(self) -> None:
        """A non-contiguous tensor comes back with its strides; requires_grad is kept."""
        base = torch.randn(2, 8, 3, 4)
        t = base.transpose(1, 2)
        arg = TensorArg.of(t)
        assert arg.stride == t.stride()
        built = arg.build()
        assert built.shape == t.shape and built.stride() == t.stride()
        grad = TensorArg.of(torch.ones(3, requires_grad=True)).build()
        assert grad.requires_grad and grad.is_leaf

    def test_context_is_the_recorded_one(self, recorded: Workload) -> None:
        """``RecordedCall.context()`` is the context the call was resolved with."""
        call = next(c for c in recorded.calls if c.kwargs.get("fwd") == "decode")
        ctx = call.context()
        assert ctx.fwd == "decode" and ctx.dtype is torch.float32 and ctx.has_cache
        assert dispatch.resolve("attention", ctx).name == "torch_native"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "wl.yaml"
    path.write_text(textwrap.dedent(text))
    return path


GOOD_CALL = """\
    - family: rms_norm
      count: 2
      axes: {dtype: float32, ndim: 2}
      args:
      - tensor: {shape: [3, 8], dtype: float32, device: cpu}
      - tensor: {shape: [8], dtype: float32, device: cpu}
      - 1.0e-06
"""


class TestLoad:
    """``Workload.load`` validates the file and locates every problem."""

    def test_minimal_file(self, tmp_path: Path) -> None:
        """Axes not written take their defaults; ``kwargs`` may be left out."""
        path = write(tmp_path, "version: 1\nkind: workload\nrecorded: now\ncalls:\n"
                     + GOOD_CALL)
        (call,) = Workload.load(path).calls
        assert call == RecordedCall("rms_norm", {"dtype": "float32", "ndim": 2},
                                    (TensorArg((3, 8), "float32", "cpu"),
                                     TensorArg((8,), "float32", "cpu"), 1e-06), {}, 2)
        assert call.context() == dispatch.CallContext("rms_norm", dtype=torch.float32, ndim=2)

    def test_error_every_problem_located(self, tmp_path: Path) -> None:
        """A bad dtype, a bad axis value and an unknown key are each reported at their
        line and column, all at once."""
        path = write(tmp_path, """\
            version: 1
            kind: workload
            recorded: now
            calls:
            - family: rms_norm
              count: 1
              axes: {dtype: bfloat61, ndim: 2}
              args:
              - tensor: {shape: [3, 8], dtype: float33, device: cpu}
              colour: red
            """)
        with pytest.raises(FileFormatError) as info:
            Workload.load(path)
        lines = str(info.value).splitlines()
        assert lines[0] == (f"{path}:9:36: calls.0.args.0.tensor.dtype: unknown dtype "
                            "'float33'; expected a torch dtype name such as float16, bfloat16, "
                            "float32")
        assert lines[1] == f"{path}:10:3: unknown key 'colour' in calls.0"
        assert len(lines) == 2  # axes are checked once the structure is valid
        path.write_text(path.read_text().replace("float33", "float32")
                        .replace("  colour: red\n", ""))
        with pytest.raises(FileFormatError) as info:
            Workload.load(path)
        assert str(info.value) == (f"{path}:7:17: calls.0.axes.dtype: unknown dtype "
                                   f"'bfloat61' (did you mean 'bfloat16'?)")

    def test_error_a_lock_is_not_a_workload(self, tmp_path: Path) -> None:
        """A file of the other kind says what it is."""
        path = write(tmp_path, "version: 1\nkind: lock\n")
        with pytest.raises(FileFormatError, match=r"wl.yaml:2:7: this is a lock file, not a "
                                                  r"workload file"):
            Workload.load(path)

    def test_error_newer_version(self, tmp_path: Path) -> None:
        """A newer version says which one this astrai reads."""
        path = write(tmp_path, "version: 2\nkind: workload\nrecorded: now\ncalls: []\n")
        with pytest.raises(FileFormatError, match="workload version 2 is newer than this "
                                                  r"astrai supports \(version 1\)"):
            Workload.load(path)

    def test_error_not_yaml_or_missing(self, tmp_path: Path) -> None:
        """Invalid YAML and a missing file are located errors, not tracebacks."""
        path = write(tmp_path, "calls: [\n")
        with pytest.raises(FileFormatError, match=r"wl.yaml:2:1: invalid YAML"):
            Workload.load(path)
        with pytest.raises(FileFormatError, match="cannot read file"):
            Workload.load(tmp_path / "missing.yaml")


class TestProcess:
    """``ASTR_RECORD`` and ``astrai-ops demo --record``."""

    def test_astr_record_writes_at_exit(self, tmp_path: Path) -> None:
        """A process run with ``ASTR_RECORD=path`` writes its workload when it exits."""
        out = tmp_path / "process.yaml"
        script = ("import torch\nfrom astrai import ops\n"
                  "for n in (1, 2, 2):\n    ops.rms_norm(torch.randn(n, 8), torch.ones(8))\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith("ASTR_")}
        env.update(ASTR_RECORD=str(out), PYTHONPATH=str(REPO))
        subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=120)
        workload = Workload.load(out)
        assert [(c.family, c.axes["tokens"], c.count) for c in workload.calls] == [
            ("rms_norm", 1, 1), ("rms_norm", 2, 2)]
        assert workload.machine is not None and workload.machine.cores == os.cpu_count()

    def test_demo_record(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """``astrai-ops demo --record`` writes the demo's workload and says so."""
        from astrai.cli import main

        out = tmp_path / "demo.yaml"
        assert main(["demo", "--record", str(out)]) == 0
        printed = capsys.readouterr().out
        workload = Workload.load(out)
        assert f"({workload.total} calls) to {out}" in printed
        # the demo generates twice (cold, then warm), then runs a training step
        assert workload.families()["attention"] == 2 * 2 * (1 + 31) + 2
        assert set(workload.families()) == {"attention", "rotary", "rms_norm", "linear"}


class TestNeverBreaks:
    """Recording never makes a call fail, and never loses the calls it could record."""

    def test_a_list_that_holds_itself(self, toy: Path) -> None:
        loop: list[Any] = [1]
        loop.append(loop)
        with record() as wl:
            ops.call("toy", torch.zeros(2, 3, 4), loop)
        (call,) = wl.calls
        assert call.args[1] == SeqArg((1, ObjectArg("builtins:list")))

    def test_a_nested_tensor_is_recorded_by_type(self, toy: Path) -> None:
        nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])  # strided
        with record() as wl:
            ops.call("toy", torch.zeros(2, 3, 4), nested)
        (call,) = wl.calls
        assert call.args[1] == ObjectArg("torch:Tensor")

    def test_a_call_no_file_can_hold_is_left_out_with_a_warning(
            self, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
        """A call whose axes hold a value no file can hold (a symbolic size) is left out
        (with a warning), and the file of the others is written and loads."""
        from astrai.dispatch import state
        from astrai.dispatch.axes import CallContext

        with caplog.at_level("WARNING", logger="astrai"), record() as wl:
            assert state.note_call is not None
            state.note_call(CallContext("linear", dtype=torch.float32, ndim=2,
                                        tokens=object()), None)  # type: ignore[arg-type]
            ops.linear(torch.randn(2, 8), torch.randn(4, 8))
        assert any("is not recorded" in r.getMessage() for r in caplog.records)
        loaded = Workload.load(wl.save(tmp_path / "wl.yaml"))
        assert [c.axes["tokens"] for c in loaded.calls] == [2]

    def test_a_jagged_call_is_served_and_recorded_without_a_token_count(
            self, tmp_path: Path) -> None:
        """A jagged nested tensor's row count is no number: its call is served (by a row
        that does not ask for one) and recorded with ``tokens`` none."""
        jagged = torch.nested.nested_tensor([torch.randn(2, 8), torch.randn(3, 8)],
                                            layout=torch.jagged)
        with record() as wl, torch.no_grad():
            out = ops.linear(jagged, torch.randn(4, 8))
            ops.linear(torch.randn(2, 8), torch.randn(4, 8))
        assert out.is_nested and out.shape[-1] == 4
        loaded = Workload.load(wl.save(tmp_path / "wl.yaml"))
        assert sorted(c.axes["tokens"] or 0 for c in loaded.calls) == [0, 2]


class TestChildren:
    def test_processes_it_starts_write_files_of_their_own(self, tmp_path: Path) -> None:
        """Under ``ASTR_RECORD`` a process it starts inherits the variable: it writes
        ``<stem>.<pid><suffix>`` beside the parent's file, and the parent's own calls are
        not overwritten."""
        out = tmp_path / "wl.yaml"
        child = ("import torch\nfrom astrai import ops\n"
                 "ops.rms_norm(torch.randn(5, 8), torch.ones(8))\n")
        script = ("import subprocess, sys, torch\nfrom astrai import ops\n"
                  "ops.rms_norm(torch.randn(3, 8), torch.ones(8))\n"
                  f"subprocess.run([sys.executable, '-c', {child!r}], check=True)\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith("ASTR_")}
        env.update(ASTR_RECORD=str(out), PYTHONPATH=str(REPO))
        subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=240)
        assert [c.axes["tokens"] for c in Workload.load(out).calls] == [3]
        (mine,) = [p for p in tmp_path.glob("wl.*.yaml")]
        assert [c.axes["tokens"] for c in Workload.load(mine).calls] == [5]
