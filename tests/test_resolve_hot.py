"""``resolve`` answers a context it answered before by identity checks: in C++ where the
compiled hot path is in use, in Python elsewhere, with the same answers and counts."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from astrai.dispatch import op_backend, refresh, resolve, state, stats
from astrai.dispatch.facade import python_path
from astrai.ops import context as ops_context
from tests.conftest import adopted, python_child


@pytest.fixture(params=["python", "native"])
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each path in force: the compiled hot path (the built extension) or the Python one."""
    if request.param == "python":
        with adopted(None):
            assert state.hot_resolved is None
            yield "python"
        return
    built: ModuleType = request.getfixturevalue("built")
    with adopted(built):
        assert state.hot_resolved is built.resolved
        yield "native"


def test_the_same_object_follows_every_change(path: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """ASTR_OPS, an op_backend scope, an explicit row, reset() and refresh() each reach
    an object answered from its memo."""
    x, w = torch.randn(2, 4), torch.ones(4)
    call = ops_context("rms_norm", x, w)
    first = [resolve("rms_norm", call) for _ in range(3)]
    assert first[1] is first[2] and first[2].origin == "chain"
    monkeypatch.setenv("ASTR_OPS", "rms_norm=reference")
    assert (resolve("rms_norm", call).name, resolve("rms_norm", call).origin) == (
        "reference", "env")
    monkeypatch.delenv("ASTR_OPS")
    assert resolve("rms_norm", call).origin == "chain"
    with op_backend(rms_norm="reference"):
        assert resolve("rms_norm", call).origin == "context"
    assert resolve("rms_norm", call).origin == "chain"
    assert resolve("rms_norm", call, "reference").origin == "explicit"
    state.reset()
    assert resolve("rms_norm", call).origin == "chain"
    assert stats().cache_misses == 1
    refresh()
    assert resolve("rms_norm", call).origin == "chain"
    assert stats().cache_misses == 2


def test_a_context_of_another_family_still_raises(path: str) -> None:
    call = ops_context("rms_norm", torch.randn(2, 4), torch.ones(4))
    for _ in range(3):
        resolve("rms_norm", call)
    with pytest.raises(ValueError, match="got a context for 'rms_norm'"):
        resolve("linear", call)


def test_both_paths_count_the_same_hits() -> None:
    counts = []
    for module in (None, "built"):
        with adopted(None if module is None else _built()):
            call = ops_context("rms_norm", torch.randn(2, 4), torch.ones(4))
            stats(reset=True)
            for _ in range(5):
                resolve("rms_norm", call)
            counts.append((stats().cache_hits, stats().cache_misses))
    assert counts[0] == counts[1] == (4, 1)


def _built() -> ModuleType:
    from astrai import native

    try:
        return native.load_from(native.build())
    except native.NativeBuildError as e:
        pytest.skip(f"astrai's native extension cannot be built here: {e}")


def test_its_check_declines_what_it_was_not_left(built: ModuleType) -> None:
    with adopted(built):
        call = ops_context("rms_norm", torch.randn(2, 4), torch.ones(4))
        for _ in range(3):
            got = resolve("rms_norm", call)
        memo = call._resolved
        assert memo is not None
        quiet = state.QUIET
        assert built.resolved(memo, "rms_norm", None, quiet) is got
        assert built.resolved(memo, "linear", None, quiet) is None
        assert built.resolved(memo, "rms_norm", "reference", quiet) is None
        assert built.resolved(memo[:7], "rms_norm", None, quiet) is None
        assert built.resolved(list(memo), "rms_norm", None, quiet) is None
        assert built.resolved(memo, "rms_norm", None) is None
        with pytest.raises(TypeError, match="iterator"):
            built.resolved(memo, "rms_norm", None, [])
        refresh()
        assert built.resolved(memo, "rms_norm", None, quiet) is None


def test_python_path_takes_resolve_off_the_compiled_path(built: ModuleType) -> None:
    with adopted(built):
        with python_path():
            assert state.hot_resolved is None
        assert state.hot_resolved is built.resolved


def _child(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    code = ("import torch\n"
            "import astrai.dispatch as d\n"
            "from astrai.dispatch import state\n"
            "call = d.CallContext('rms_norm', dtype=torch.float32, ndim=2)\n"
            "for _ in range(3): d.resolve('rms_norm', call)\n"
            "from astrai import native\n"
            "print(state.hot_resolved is not None, native.pending())\n")
    return python_child(env, code)


def test_a_process_using_resolve_alone_takes_up_a_built_extension(built: ModuleType) -> None:
    done = _child({"ASTR_NATIVE": ""})
    assert done.stdout.split() == ["True", "False"], done.stderr


def test_resolve_never_builds_the_extension(tmp_path: Path) -> None:
    done = _child({"ASTR_NATIVE": "", "ASTR_NATIVE_DIR": str(tmp_path)})
    assert done.stdout.split() == ["False", "True"], done.stderr  # still to build
    assert not [line for line in done.stderr.splitlines() if line.startswith("astrai")]
    assert list(tmp_path.iterdir()) == []
