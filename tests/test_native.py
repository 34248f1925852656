"""The compiled hot path (``astrai.native``): it answers a call only with the decision
the Python route took for that very call in the world in force, and declines (``None``)
every call it cannot read exactly as Python does - malformed ones included, which the
route then refuses as before.

The module is built once per session (about 15 s; conftest's ``built``) with the machine's
C++ compiler; without one these tests skip, saying so. The pure-Python path is what every
other test runs unless the module was built before the session (CI runs the suite both
ways)."""

from __future__ import annotations

import os
import random
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

import astrai.dispatch as d
from astrai import native, ops
from astrai.dispatch import state
from astrai.dispatch.facade import FACADES
from tests.conftest import python_child as _run


def _hot_args(name: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A facade call's arguments as the facade hands them to the compiled path."""
    return (*args, False, False) if name == "rms_norm" and len(args) == 3 else args


def _ask(hot: ModuleType, name: str, args: tuple[Any, ...]) -> Any:
    return hot.lookup(FACADES[name].last, *_hot_args(name, args))


def _full(name: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The route's full argument tuple of a hot call's arguments."""
    if name == "rms_norm":
        return (*args, {})
    if name == "attention":
        q, k, v, kv_cache, mask, fwd = args
        return (q, k, v, kv_cache, 0, mask, False, fwd, {})
    if name == "attention_heads_first":
        return (*args, False)
    return args


def _route(name: str, args: tuple[Any, ...]) -> Any:
    """What the Python route serves the call with, or the exception it raises."""
    try:
        return FACADES[name].plain(None, _full(name, args))
    except Exception as e:
        return e


def _agrees(hot: ModuleType, name: str, args: tuple[Any, ...]) -> bool:
    """Ask the route, then the compiled path: True when the compiled path answered. It
    must answer with the route's decision and never a call the route refuses."""
    served = _route(name, args)
    got = _ask(hot, name, args)
    if got is None:
        return False
    assert not isinstance(served, Exception), (name, args, served)
    assert got.call is served, (name, args)
    return True


def _t(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, **kw: Any) -> torch.Tensor:
    """A tensor of ``shape`` holding no memory of its own (one zero, expanded): only its
    metadata is read."""
    return torch.zeros((), dtype=dtype, **kw).expand(shape)


def _random_calls(rng: random.Random) -> Iterator[tuple[str, tuple[Any, ...]]]:
    """Calls of every facade: well-formed ones of many shapes, and each kind of
    malformed one the validation refuses, and odd arguments."""
    dtypes = [torch.float32, torch.bfloat16, torch.float64, torch.int64]

    def dim() -> int:
        return rng.choice([0, 1, 2, 3, 4, 7, 8, 64, 300])

    def dt() -> torch.dtype:
        return rng.choice(dtypes)

    for _ in range(150):
        f = dim() or 1
        lead = tuple(rng.choice([1, 2, 3, 300]) for _ in range(rng.choice([0, 1, 2, 3])))
        w_len = f if rng.random() < 0.8 else f + 1
        eps = rng.choice([1e-6, 0.0, -1.0, 1, True, float("nan"), None])
        w: Any = (_t((w_len,), dt()) if rng.random() < 0.85
                  else rng.choice([_t((f, 1)), None]))
        x: Any = _t((*lead, f), dt()) if rng.random() < 0.95 else "x"
        yield "rms_norm", (x, w, eps)

        i, o = dim() or 1, dim() or 1
        bias = rng.choice([None, _t((o,)), _t((o + 1,)), _t((o,), torch.float64), "b"])
        yield "linear", (_t((*lead, i), dt()), _t((o, i if rng.random() < 0.9 else i + 1),
                                                     rng.choice([torch.float32, dt()])), bias)

        b, s, h, dd = rng.choice([1, 2]), rng.choice([1, 5]), rng.choice([1, 8]), \
            rng.choice([0, 1, 2, 64])
        half = max(dd // 2, 0)
        x4 = _t((b, s, h, dd), dt())
        freqs = rng.choice([_t((s, half, 2)), _t((1, s, half, 2)), _t((b, s, half, 2)),
                            _t((s + 1, half, 2)), _t((s, half, 3)), _t((s, half, 2), torch.int64)])
        yield "rotary", (rng.choice([x4, _t((b * s, h, dd)), _t((dd,))]), freqs)

        q = _t((b, h, s, dd), dt())
        kh = rng.choice([1, h])
        k = _t((b, kh, s, dd), rng.choice([q.dtype, dt()]))
        cos = rng.choice([_t((1, s, dd)), _t((b, s, dd)), _t((b, s + 1, dd)), _t((s, dd))])
        sin = rng.choice([cos, _t(tuple(cos.shape)), _t((1, s, dd + 2))])
        yield "rotary_half", (q, k, cos, sin, rng.choice([1, 1, 1, -3, 2, True, 1.0]))

        kv = rng.choice([1, 2, 8]) if h == 8 else 1
        qa = _t((b, s, h, dd), dt())
        ka = _t((rng.choice([b, b + 1]), rng.choice([s, 7]), kv, dd), rng.choice([qa.dtype, dt()]))
        va = rng.choice([_t(tuple(ka.shape), ka.dtype), _t((ka.shape[0], ka.shape[1], kv, dd + 1))])
        yield "attention", (qa, ka, va, None, rng.choice([None, None, _t((1, 1, s, 7))]),
                            rng.choice([None, None, "prefill", "decode", "bad"]))
        yield "attention_heads_first", (qa.transpose(1, 2), ka.transpose(1, 2),
                                        rng.choice([va.transpose(1, 2), va]),
                                        rng.choice([None, None, _t((1, 1, s, 7)), "m"]))

        xn: Any = _t((*lead, f), dt()) if rng.random() < 0.95 else "x"
        xd = xn.dtype if isinstance(xn, torch.Tensor) else torch.float32
        wn = rng.choice([None, _t((f,), xd), _t((f,), xd), _t((w_len,), xd), _t((f,)),
                         _t((f, 1), xd)])
        yield "layer_norm", (xn, wn, rng.choice([None, _t((f,), xd), _t((f,), dt())]), eps)
        yield "activation", (xn, rng.choice(["silu", "gelu", "relu", "swish", 1, None]))
        un = rng.choice([xn, xn, _t((*lead, f), dt()), _t((*lead, f + 1), xd), "u"])
        yield "gated_activation", (xn, un, rng.choice(["silu", "gelu_tanh", "swish", None]))


def test_every_answer_is_the_routes_decision_and_no_refused_call_is_answered(
        hot: ModuleType) -> None:
    answered: dict[str, int] = {}
    with torch.no_grad():
        for name, args in _random_calls(random.Random(0)):
            answered[name] = answered.get(name, 0) + _agrees(hot, name, args)
    with torch.enable_grad():
        for name, args in _random_calls(random.Random(1)):
            answered[name] = answered.get(name, 0) + _agrees(hot, name, args)
    # Well-formed calls in the common forms are among the random ones: each facade
    # answers some (the forms only the route serves - an int eps, a mask, fwd without a
    # cache, v's own head_dim - it declines).
    assert sorted(answered) == sorted(NAMES) and min(answered.values()) >= 5, answered


def _common(name: str) -> tuple[Any, ...]:
    return {
        "rms_norm": (_t((1, 512)), _t((512,)), 1e-6),
        "layer_norm": (_t((1, 512)), _t((512,)), _t((512,)), 1e-5),
        "activation": (_t((1, 512)), "silu"),
        "gated_activation": (_t((1, 512)), _t((1, 512)), "silu"),
        "linear": (_t((3, 16)), _t((8, 16)), _t((8,))),
        "rotary": (_t((1, 2, 4, 8)), _t((2, 4, 2))),
        "rotary_half": (_t((1, 4, 2, 8)), _t((1, 2, 2, 8)), _t((1, 2, 8)), _t((1, 2, 8)), 1),
        "attention": (_t((1, 3, 8, 16)), _t((1, 5, 2, 16)), _t((1, 5, 2, 16)), None, None,
                      None),
        "attention_heads_first": (_t((1, 8, 3, 16)), _t((1, 2, 5, 16)), _t((1, 2, 5, 16)),
                                  None),
    }[name]


NAMES = ["rms_norm", "linear", "rotary", "rotary_half", "attention", "attention_heads_first",
         "layer_norm", "activation", "gated_activation"]


@pytest.mark.parametrize("name", NAMES)
def test_a_common_call_is_answered_once_its_route_decided_it(hot: ModuleType,
                                                             name: str) -> None:
    args = _common(name)
    assert _ask(hot, name, args) is None  # nothing decided yet
    assert _agrees(hot, name, args)


@pytest.mark.parametrize("name", NAMES)
def test_a_change_of_world_is_declined(hot: ModuleType, name: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    args = _common(name)
    assert _agrees(hot, name, args)

    def fn(last: Any, *args: Any) -> Any:
        return hot.lookup(last, *_hot_args(name, args))

    family = FACADES[name].call.family
    row = {"linear": "torch", "attention": "math"}.get(family, "reference")
    with d.op_backend(**{family: row}):
        assert fn(FACADES[name].last, *args) is None  # another scope
    assert fn(FACADES[name].last, *args) is not None
    monkeypatch.setenv("ASTR_OPS", f"{family}={row}")
    assert fn(FACADES[name].last, *args) is None  # another ASTR_OPS
    monkeypatch.delenv("ASTR_OPS")
    assert fn(FACADES[name].last, *args) is not None
    state.reset()  # another snapshot
    assert fn(FACADES[name].last, *args) is None


@pytest.mark.parametrize("asked", [{}, {"weight_offset": 1.0}, {"cast_before_weight": True},
                                   {"weight_offset": 0.5, "cast_before_weight": True}])
def test_an_rms_norm_form_is_answered_with_its_own_decision(hot: ModuleType,
                                                             asked: dict[str, Any]) -> None:
    x, w, eps = _common("rms_norm")
    last = FACADES["rms_norm"].last
    flags = ("weight_offset" in asked, "cast_before_weight" in asked)
    assert hot.lookup(last, x, w, eps, *flags) is None
    served = FACADES["rms_norm"].plain(None, (x, w, eps, asked))
    assert hot.lookup(last, x, w, eps, *flags).call is served
    assert hot.lookup(last, x, w, eps, 1, 0) is None  # the forms are booleans
    form = ops.rms_norm_form(**asked)
    d.reset_stats()
    torch.testing.assert_close(form(x, w, eps), ops.rms_norm(x, w, eps, **asked))
    assert sum(sum(v.values()) for v in d.stats().by_row()["rms_norm"].values()) == 2


class _Sub(torch.Tensor):
    pass


class _Mode(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def test_what_python_could_read_otherwise_is_declined(hot: ModuleType) -> None:
    x, w, eps = _common("rms_norm")
    assert _agrees(hot, "rms_norm", (x, w, eps))
    last = FACADES["rms_norm"].last
    assert hot.lookup(last, x.as_subclass(_Sub), w, eps, False, False) is None
    with _Mode():
        assert hot.lookup(last, x, w, eps, False, False) is None
    assert hot.lookup(last, x.to_sparse(), w, eps, False, False) is None
    assert hot.lookup(last, x, w, eps) is None  # a wrong arity is not answered
    assert hot.lookup(last, x, torch.nn.Parameter(w), eps, False, False) is not None
    assert hot.lookup([], x, w, eps, False, False) is None  # not a route's last world


def test_sizes_whose_product_overflows_are_declined(hot: ModuleType) -> None:
    # A zero size lets torch make a tensor whose other sizes multiply past 64 bits; its
    # tokens are exact in Python (the last interval), so the compiled path declines.
    w = torch.zeros(0)
    assert _agrees(hot, "rms_norm", (torch.zeros(1, 3, 0), w, 1e-6))
    big = torch.empty(2**31, 2**32, 0)
    assert not _agrees(hot, "rms_norm", (big, w, 1e-6))


def test_a_method_shadowed_on_the_tensor_changes_neither_reading(hot: ModuleType) -> None:
    """Both paths read only attributes an instance cannot shadow (shape, dtype)."""
    x, f = _common("rotary")
    assert _agrees(hot, "rotary", (x, f))
    odd = f.clone()
    odd.is_floating_point = lambda: False  # type: ignore[method-assign]
    odd.dim = lambda: 7  # type: ignore[method-assign]
    assert _agrees(hot, "rotary", (x, odd))


def test_facades_with_the_compiled_path_serve_count_and_refuse_as_before(
        hot: ModuleType) -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 16, generator=g), torch.randn(16, generator=g)
    lin = torch.randn(8, 16, generator=g)
    d.reset_stats()
    for _ in range(3):
        torch.testing.assert_close(ops.rms_norm(x, w), torch.nn.functional.rms_norm(
            x, (16,), w, 1e-6))
        torch.testing.assert_close(ops.linear(x, lin), x @ lin.T)
    rows = d.stats().by_row()
    assert sum(rows["rms_norm"]["torch"].values()) == 3
    assert sum(sum(v.values()) for v in rows["linear"].values()) == 3
    with pytest.raises(ValueError, match="weight"):
        ops.rms_norm(x, torch.randn(15))
    with pytest.raises(ValueError, match="linear expects"):
        ops.linear(x, torch.randn(8, 15))
    # an explicit backend= never takes the hot path
    assert ops.rms_norm(x, w, backend="reference").shape == x.shape
    assert "reference" in d.stats().by_row()["rms_norm"]


def test_a_recording_sees_every_call_with_the_compiled_path_loaded(hot: ModuleType) -> None:
    x, w = torch.randn(2, 16), torch.randn(16)
    ops.rms_norm(x, w)
    with d.record() as rec:
        assert FACADES["rms_norm"].lookup is None
        ops.rms_norm(x, w)
        ops.rms_norm(x, w)
    assert FACADES["rms_norm"].lookup is hot.lookup
    assert sum(c.count for c in rec.calls) == 2


def _user_family(write_yaml: Callable[[str, str], Path], when: str = "ndim == 3") -> None:
    d.load_tables(write_yaml("mine.yaml", f"""\
        version: 1
        family: mine
        fallback: ref
        rows:
          - name: big
            impl: tests._impls:fast
            when: {when}
          - name: ref
            impl: tests._impls:ref
        """))


@pytest.mark.parametrize("compiled", [False, True])
def test_ops_call_keeps_the_decision_of_a_first_tensor_call(
        compiled: bool, request: pytest.FixtureRequest,
        write_yaml: Callable[[str, str], Path]) -> None:
    impl = request.getfixturevalue("hot").lookup if compiled else ops._python_call_hot
    _user_family(write_yaml)
    x3, x2 = torch.zeros(1, 2, 3), torch.zeros(2, 2)
    assert ops.call("mine", x3) == "fast"
    assert ops.call("mine", x2) == "ref"
    last = ops._CALL_LAST["mine"]
    assert impl(last, x3).call is ops.call.__globals__["_CALL_LAST"]["mine"][0][1][
        (torch.float32, False, 3, torch.is_grad_enabled())].call
    assert impl(last, torch.zeros(1, 2, 3, dtype=torch.float64)) is None  # not seen
    assert impl(last, "x") is None
    with d.op_backend(mine="ref"):
        assert impl(last, x3) is None
        assert ops.call("mine", x3) == "ref"
    d.reset_stats()
    assert [ops.call("mine", x3) for _ in range(3)] == ["fast"] * 3
    assert d.stats().by_row()["mine"] == {"big": {"chain": 3}}
    with d.record() as rec:  # a recording notes every call: none is kept from it
        assert ops.call("mine", x3) == "fast"
        assert ops.call("mine", x3) == "fast"
    assert [c.count for c in rec.calls] == [2]


def test_ops_call_keeps_nothing_when_the_specs_read_a_lazy_axis(
        write_yaml: Callable[[str, str], Path]) -> None:
    _user_family(write_yaml, when="device == cpu")
    assert ops.call("mine", torch.zeros(2)) == "fast"
    last = ops._CALL_LAST.get("mine")
    assert last is None or ops._python_call_hot(last, torch.zeros(2)) is None


STATUS = "from astrai import native; print(native.status())"


def test_off_is_never_loaded_and_on_warns_when_it_cannot_build(tmp_path: Path) -> None:
    off = _run({"ASTR_NATIVE": "off"}, STATUS)
    assert "not loaded (ASTR_NATIVE=off)" in off.stdout, off.stderr
    on = _run({"ASTR_NATIVE": "on", "ASTR_NATIVE_DIR": str(tmp_path), "CXX": "/no/such/cxx"},
              STATUS + "\nimport torch; from astrai import ops\n"
                       "print(ops.rms_norm(torch.ones(1, 4), torch.ones(4)).shape)")
    assert "not loaded (failed:" in on.stdout, on.stdout
    assert on.stderr.count("ASTR_NATIVE=on, but the native extension is not available") == 1
    assert "torch.Size([1, 4])" in on.stdout  # the pure-Python path serves
    odd = _run({"ASTR_NATIVE": "maybe", "ASTR_NATIVE_DIR": str(tmp_path)}, STATUS)
    assert "ASTR_NATIVE='maybe' is not one of auto, on (1), off (0)" in odd.stderr


def _leftovers(folder: Path) -> list[str]:
    """What a failed build left in ``folder`` apart from its lock file."""
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith(".lock"))


def _fake_compiler(tmp_path: Path, body: str) -> Path:
    """An executable standing in for the C++ compiler: it notes each run, then ``body``."""
    script = tmp_path / "cxx"
    script.write_text(f"#!/bin/sh\necho run >> {tmp_path / 'runs'}\n{body}\n")
    script.chmod(0o755)
    return script


def test_a_compiler_that_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                        ) -> None:
    """CXX may carry arguments; a compiler that succeeds without writing anything is a
    failed build, leaving nothing behind; CXX that is not a command line is an error."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("ASTR_NATIVE_DIR", str(cache))
    monkeypatch.setenv("CXX", "true --no-such-flag")
    with pytest.raises(native.NativeBuildError, match="failed"):
        native.build()
    assert _leftovers(cache) == []
    monkeypatch.setenv("CXX", '"g++')
    with pytest.raises(native.NativeBuildError, match="is not a command line"):
        native.build()


def test_a_hung_compiler_is_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A build that takes longer than ASTR_NATIVE_BUILD_TIMEOUT is stopped with every
    process it started, and its work folder removed. The limit's clock starts when the
    compiler has started (the build's child imports torch first, which on a loaded machine
    can take longer than the limit), so the compiler is what the limit stops."""
    from astrai.native import building

    cache = tmp_path / "cache"
    runs = tmp_path / "runs"
    monkeypatch.setenv("ASTR_NATIVE_DIR", str(cache))
    monkeypatch.setenv("CXX", str(_fake_compiler(tmp_path, f"sleep 60; echo done >> {runs}")))
    monkeypatch.setenv("ASTR_NATIVE_BUILD_TIMEOUT", "3")
    real = time.monotonic
    began = real()
    compiling: list[float] = []

    def clock() -> float:
        """Seconds since the compiler started (0 until then; a compiler that never starts
        lets the clock run after two minutes, failing the test below)."""
        if not compiling and (runs.exists() or real() - began > 120):
            compiling.append(real())
        return real() - compiling[0] if compiling else 0.0

    monkeypatch.setattr(building, "_clock", clock)
    with pytest.raises(native.NativeBuildError, match="took more than 3 s and was stopped"):
        native.build()
    assert _leftovers(cache) == []
    assert runs.read_text().split() == ["run"]  # it started the compiler, which never ended
    gone = subprocess.run(["pgrep", "-f", str(tmp_path / "cxx")], capture_output=True)
    assert gone.returncode != 0, gone.stdout  # no compiler left running
    monkeypatch.setenv("ASTR_NATIVE_BUILD_TIMEOUT", "soon")
    with pytest.raises(native.NativeBuildError, match="is not a number of seconds"):
        native.build()


def test_concurrent_builds_build_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                      ) -> None:
    """A build waits for another process's build of the same version (the file lock) and
    then uses its file instead of compiling again."""
    import threading

    from astrai.native import building

    cache = tmp_path / "cache"
    monkeypatch.setenv("ASTR_NATIVE_DIR", str(cache))
    monkeypatch.setenv("CXX", str(_fake_compiler(tmp_path, "exit 1")))
    path = building.built_path()
    cache.mkdir()
    got: list[Any] = []
    with building._locked(cache / f".{path.name}.lock", 10):  # another builder at work
        waiter = threading.Thread(target=lambda: got.append(native.build()))
        waiter.start()
        time.sleep(1.0)
        assert waiter.is_alive() and not got  # it waits for the lock
        path.write_bytes(b"built by the other process")
        building.record_digest(path)
    waiter.join(20)
    assert got == [path]
    assert not (tmp_path / "runs").exists()  # it compiled nothing


def test_stale_builds_are_pruned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A build drops work folders older than a build may take and keeps the most recently
    used versions only."""
    from astrai.native import building

    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("ASTR_NATIVE_DIR", str(cache))
    monkeypatch.setenv("CXX", "true")
    monkeypatch.setenv("ASTR_NATIVE_BUILD_TIMEOUT", "60")
    stale, fresh = cache / ".build-dead", cache / ".build-alive"
    stale.mkdir()
    fresh.mkdir()
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    for i in range(12):
        f = cache / f"{building.NAME}-old{i:02d}.so"
        f.write_bytes(b"x")
        os.utime(f, (1_000_000 + i, 1_000_000 + i))
    with pytest.raises(native.NativeBuildError):
        native.build()
    names = sorted(p.name for p in cache.iterdir())
    assert ".build-dead" not in names and ".build-alive" in names
    kept = [n for n in names if n.startswith(f"{building.NAME}-old")]
    assert kept == [f"{building.NAME}-old{i:02d}.so" for i in range(12 - building._KEEP + 1, 12)]


def test_the_tag_covers_flags_and_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    from astrai.native import building

    monkeypatch.setenv("ASTR_NATIVE_DIR", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    base = building.built_path()
    monkeypatch.setattr(building, "EXTRA_CFLAGS", (*building.EXTRA_CFLAGS, "-DX"))
    flagged = building.built_path()
    monkeypatch.undo()
    monkeypatch.setenv("ASTR_NATIVE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(_fake_compiler(tmp_path, "exit 1")))
    other = building.built_path()
    assert len({base, flagged, other}) == 3


def test_importing_never_compiles(tmp_path: Path) -> None:
    """ASTR_NATIVE=on with nothing built: importing the facades runs no compiler; their
    first call makes the decision (builds, here failing: warned once, Python serves)."""
    cxx = _fake_compiler(tmp_path, "exit 1")
    env = {"ASTR_NATIVE": "on", "ASTR_NATIVE_DIR": str(tmp_path / "cache"), "CXX": str(cxx)}
    imported = _run(env, "import astrai, astrai.ops, astrai.dispatch, astrai.backends.native")
    assert imported.returncode == 0, imported.stderr
    assert not (tmp_path / "runs").exists()
    called = _run(env, "import torch; from astrai import ops, native\n"
                       "print(ops.rms_norm(torch.ones(1, 4), torch.ones(4)).shape)\n"
                       "print(native.status())")
    assert "torch.Size([1, 4])" in called.stdout, called.stderr
    assert (tmp_path / "runs").exists()
    assert called.stderr.count("ASTR_NATIVE=on, but the native extension is not available") == 1
    assert "not loaded (failed:" in called.stdout


def test_the_command_line_says_why_a_build_fails(tmp_path: Path) -> None:
    done = _run({"ASTR_NATIVE_DIR": str(tmp_path), "CXX": "/no/such/cxx"},
                "from astrai.cli import main; raise SystemExit(main(['native', '--build']))")
    assert done.returncode == 1
    assert "cannot build the native extension" in done.stderr
    assert _leftovers(tmp_path) == []  # nothing half-written left behind


def test_built_is_loaded_by_a_new_process(built: ModuleType) -> None:
    done = _run({"ASTR_NATIVE": ""}, STATUS)  # unset: auto
    assert "CPU kernels): loaded (built)" in done.stdout, done.stdout + done.stderr
    assert _said(done.stderr) == []  # nothing built, nothing to say


def _said(stderr: str) -> list[str]:
    """astrai's lines on a child's stderr (torch may add its own, e.g. without NumPy)."""
    return [line for line in stderr.splitlines() if line.startswith("astrai")]


#: A process whose build copies the extension the tests built (a real build takes half a
#: minute): what it says, and what the first facade call gets.
FIRST_USE = """\
import shutil, sys, torch
import astrai.native as n
from astrai.native import building

def build(*, force=False, progress=None):
    progress(1.0)
    path = building.built_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(sys.argv[1], path)
    building.record_digest(path)
    return path

n.build = build
from astrai import ops
print("imported:", n._decided == [])
print(ops.rms_norm(torch.ones(1, 4), torch.ones(4)).shape)
print(n.status())
"""


def test_a_fresh_install_builds_at_the_first_call_and_says_so(built: ModuleType,
                                                              tmp_path: Path) -> None:
    """Unset ASTR_NATIVE (a fresh install): importing builds nothing; the first facade call
    builds into the cache with a line before and after, and uses it; the next process
    loads what was built, silently."""
    env = {"ASTR_NATIVE": "", "ASTR_NATIVE_DIR": str(tmp_path)}
    first = _run(env, FIRST_USE, str(built.__file__))
    assert "imported: True" in first.stdout, first.stderr
    assert "torch.Size([1, 4])" in first.stdout
    assert "loaded (built for this process)" in first.stdout, first.stdout + first.stderr
    lines = _said(first.stderr)
    assert len(lines) == 2, first.stderr
    assert lines[0].startswith("astrai: building its native extension")
    assert str(tmp_path) in lines[0]
    assert "ASTR_NATIVE=off skips it" in lines[0]
    assert lines[1].startswith("astrai: native extension built in ")
    again = _run(env, STATUS)
    assert "loaded (built)" in again.stdout and _said(again.stderr) == [], again.stderr


def test_where_it_cannot_be_built_one_line_says_why(tmp_path: Path) -> None:
    """Unset ASTR_NATIVE: a machine without a compiler gets one line on stderr and the
    pure-Python path; a build that fails is tried once, and later processes say why at
    once without compiling again; ``astrai-ops native --build`` tries again."""
    call = (STATUS + "\nimport torch; from astrai import ops\n"
                     "print(ops.rms_norm(torch.ones(1, 4), torch.ones(4)).shape)")
    none = _run({"ASTR_NATIVE": "", "ASTR_NATIVE_DIR": str(tmp_path / "a"),
                 "CXX": "/no/such/cxx"}, call)
    assert "torch.Size([1, 4])" in none.stdout, none.stderr
    assert _said(none.stderr) == [
        "astrai: no native extension here (no C++ compiler '/no/such/cxx' found (set CXX, or "
        "install g++ or clang++)); the pure-Python path serves every call (ASTR_NATIVE=off "
        "silences this)"]
    assert "not loaded (failed: no C++ compiler" in none.stdout
    env = {"ASTR_NATIVE": "", "ASTR_NATIVE_DIR": str(tmp_path / "b"),
           "CXX": str(_fake_compiler(tmp_path, "echo 'error: broken' >&2; exit 1"))}
    failed = _run(env, call)
    assert "torch.Size([1, 4])" in failed.stdout, failed.stderr
    said = _said(failed.stderr)
    assert said[0].startswith("astrai: building its native extension"), failed.stderr
    assert said[-1].startswith("astrai: no native extension here (the build with"), failed.stderr
    assert (tmp_path / "runs").read_text().count("run") >= 1
    (tmp_path / "runs").unlink()
    later = _run(env, call)
    assert "torch.Size([1, 4])" in later.stdout, later.stderr
    assert len(_said(later.stderr)) == 1 and "an earlier build" in later.stderr, later.stderr
    assert not (tmp_path / "runs").exists()  # no compiler ran
    retry = _run(env, "from astrai.cli import main; raise SystemExit(main(['native', '--build']))")
    assert retry.returncode == 1 and (tmp_path / "runs").exists()
    off = _run({**env, "ASTR_NATIVE": "off"}, call)
    assert _said(off.stderr) == [] and "not loaded (ASTR_NATIVE=off)" in off.stdout


@pytest.mark.parametrize(("name", "table"), [
    ("rms_norm", """\
        version: 1
        family: rms_norm
        fallback: reference
        rows:
          - name: torch
            impl: astrai.backends.rms_norm:torch_rms_norm
            when: device == cpu and tokens < 64
          - name: reference
            impl: astrai.backends.rms_norm:reference_rms_norm
        """),
    ("attention", """\
        version: 1
        family: attention
        fallback: math
        rows:
          - name: torch_native
            impl: astrai.backends.attention.sdpa:sdpa_attention
            when: q_len < kv_len and heads >= 4 and device == cpu
          - name: math
            impl: astrai.backends.attention.math:math_attention
        """),
])
def test_tables_comparing_device_and_pairs_keep_the_compiled_path(
        hot: ModuleType, write_yaml: Callable[[str, str], Path], name: str, table: str) -> None:
    """A table comparing ``device``, or two lazy axes with each other, is read by the
    compiled path too (its key plan is data): such calls are answered, and
    ``astrai-ops native``'s per-facade line says so."""
    d.load_tables(write_yaml(f"{name}.yaml", table))
    args = _common(name)
    assert _ask(hot, name, args) is None
    assert _agrees(hot, name, args)
    assert ops.compiled_path()[name] is None
    for _ in range(3):
        assert _ask(hot, name, args) is not None


def test_a_recording_is_said_to_take_the_compiled_path_off(hot: ModuleType) -> None:
    with d.record():
        assert {why for name, why in ops.compiled_path().items()
                if FACADES[name].call.reading is not None} == {
            "a recording is in force (it takes every call through its route)"}
        text = d.explain("rms_norm", ops.context("rms_norm", torch.zeros(2, 4), torch.ones(4)))
        assert "the compiled hot path reads no rms_norm call here: a recording" in text
    assert {why for name, why in ops.compiled_path().items()
            if FACADES[name].call.reading is not None} == {None}
    assert "compiled hot path" not in d.explain(
        "rms_norm", ops.context("rms_norm", torch.zeros(2, 4), torch.ones(4)))


#: Python code run in the middle of a compiled call replaces the route's last world (the
#: rms_norm route keeps one decision, so a call of another signature replaces it) and
#: frees the one the call read, then fills the freed memory with a world whose decision
#: is ``Stale``. A call that kept reading what it read before is answered ``Stale``;
#: ``argv``: the built module, and where the Python code runs - ``key-object`` /
#: ``key-str``, the ``__eq__`` of a key in x's ``__dict__`` hashing as ``dim`` (an object,
#: a str subclass); ``gc-here`` / ``gc-thread``, a collection started by allocating the
#: call's key (a gc callback, the call made in this thread or another); ``gc-world``, the
#: same collection changing the world (``ASTR_OPS``), after which the call is declined.
MID_CALL = """\
import gc, itertools, os, sys, threading
from pathlib import Path

import torch

from astrai import native, ops
from astrai.dispatch import facade
from astrai.dispatch.facade import FACADES
from astrai.dispatch.resolution import set_max_decisions

hot = native.load_from(Path(sys.argv[1]))
facade.adopt(hot)
how = sys.argv[2]
x, w = torch.randn(2, 16), torch.randn(16)
want = FACADES["rms_norm"].plain(None, (x, w, 1e-6, {}))(x, w, 1e-6)
set_max_decisions(1)
last = FACADES["rms_norm"].last
ops.rms_norm(x, w)
world, decisions, plan = last[0][0], last[0][1], last[0][3]
assert plan is not None
(decided,) = decisions.values()


class Stale:
    counter = itertools.count()
    call = staticmethod(lambda *a, **k: "stale")


held = []


def replace_last_world():
    old = last[0]
    other = lambda: ops.rms_norm(torch.randn(3, 2, 8), torch.randn(8))
    if how == "gc-thread":
        t = threading.Thread(target=other)
        t.start()
        t.join()
    else:
        other()
    assert last[0] is not old
    stale = {k: Stale() for k in decisions}
    stale[(torch.float32, False, 2, torch.is_grad_enabled())] = Stale()
    drain = [(i, i, i, i) for i in range(3000)]  # no free tuple of four left
    del old  # freed: the next tuple of four takes its memory
    held.extend((world, stale, None, plan) for _ in range(100))
    held.append(drain)


if how.startswith("key"):
    class Key(str if how == "key-str" else object):
        armed = True

        def __hash__(self):
            return hash("dim")

        def __eq__(self, other):
            if Key.armed:
                Key.armed = False
                replace_last_world()
            return False

    odd = x.clone()
    odd.__dict__[Key()] = 1
    out = ops.rms_norm(odd, w)
    assert isinstance(out, torch.Tensor), out
    torch.testing.assert_close(out, want)
else:
    in_call, fired = [False], []

    def hook(phase, info):
        if phase == "start" and in_call[0] and not fired:
            fired.append(True)
            gc.set_threshold(*saved)
            if how == "gc-world":
                os.environ["ASTR_OPS"] = "rms_norm=reference"
            else:
                replace_last_world()

    saved = gc.get_threshold()
    gc.callbacks.append(hook)
    gc.collect()
    gc.set_threshold(10**6)
    drain5 = [(i, i, i, i, i) for i in range(3000)]  # the key, a tuple of five, is new:
    gc.set_threshold(1)  # allocating it starts a collection
    in_call[0] = True
    got = hot.lookup(last, x, w, 1e-6, False, False)
    in_call[0] = False
    gc.set_threshold(*saved)
    gc.callbacks.remove(hook)
    assert fired, "no collection in the call"
    if how == "gc-world":
        assert got is None, got
        assert FACADES["rms_norm"].plain(None, (x, w, 1e-6, {})) is not decided.call
    else:
        assert got is decided, got
        out = got.call(x, w, 1e-6)
        assert isinstance(out, torch.Tensor), out
        torch.testing.assert_close(out, want)
print("served as the Python path serves it")
"""


@pytest.mark.parametrize("how", ["key-object", "key-str", "gc-here", "gc-thread", "gc-world"])
def test_python_code_run_mid_call_cannot_make_it_read_a_freed_or_stale_world(
        built: ModuleType, how: str) -> None:
    done = _run({"ASTR_NATIVE": "off"}, MID_CALL, str(built.__file__), how)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-3000:])
    assert "served as the Python path serves it" in done.stdout


#: The built module imported as it is, its ``setup`` never called: each function that
#: reads the process state raises a RuntimeError saying so (a bad ``setup`` leaves it so).
NOT_SET_UP = """\
import importlib.util, sys

import torch

from astrai import native
from astrai.dispatch.reading import Layout, encode
from astrai.families.rms_norm import RMS_NORM_READING

path = native._path()
assert path.exists(), path
spec = importlib.util.spec_from_file_location("_astrai_hot", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
x, w = torch.zeros(2, 8), torch.zeros(8)
q, c = torch.zeros(1, 2, 3, 8), torch.zeros(1, 3, 8)
plan = module.plan(*encode(RMS_NORM_READING, Layout()))  # a plan reads no process state
last = [((None,) * 5, {}, None, plan)]
calls = {
    "lookup": (last, x, w, 1e-6, False, False), "key": (plan, x, w, 1e-6, False, False),
    "rms_norm_kernel": (x, w, 1e-6, 0.0, False), "rotary_half_kernel": (q, q, c, c, 1),
}


def every_call_raises():
    for name, args in calls.items():
        try:
            getattr(module, name)(*args)
        except RuntimeError as e:
            assert "never set up" in str(e), (name, e)
        else:
            raise AssertionError(f"{name} answered without setup")


every_call_raises()
try:
    module.setup({}, None, {}, b"ASTR_OPS", torch.Tensor, torch.nn.Parameter)
except TypeError:
    pass
else:
    raise AssertionError("setup took a scope variable that is not a ContextVar")
every_call_raises()
print("every function raised")
"""


def test_a_module_never_set_up_raises_instead_of_crashing(built: ModuleType) -> None:
    done = _run({"ASTR_NATIVE": "off"}, NOT_SET_UP)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-3000:])
    assert "every function raised" in done.stdout


def test_a_kernel_given_an_object_whose_class_raises_raises(built: ModuleType) -> None:
    done = _run({"ASTR_NATIVE": "off"}, """\
import sys
from pathlib import Path

import torch

from astrai import native

kernels = native.load_from(Path(sys.argv[1]))


class Odd:
    @property
    def __class__(self):
        raise ValueError("no class")


for call in (lambda: kernels.rms_norm_kernel(Odd(), torch.zeros(4), 1e-6, 0.0, False),
             lambda: kernels.rotary_half_kernel(Odd(), Odd(), Odd(), Odd(), 1)):
    try:
        call()
    except TypeError as e:
        assert "must be a tensor" in str(e), e
    else:
        raise AssertionError("a kernel took an object that is not a tensor")
print("refused")
""", str(built.__file__))
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-3000:])
    assert "refused" in done.stdout
