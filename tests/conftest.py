"""Shared fixtures: isolation of the engine's global state, markers, and small test tables.

A test citing "contract §N" checks that section of ``docs/contract.md``.

The dispatch engine keeps process-wide state (the loaded tables, parsed ``ASTR_OPS``
values, warn-once bookkeeping, usage counters). Every test starts from the snapshot in
force before it and leaves that snapshot in force after it, with the astrai variables
cleared from the environment.
"""

from __future__ import annotations

import os

# The tables' machine axes are taken for an AMD CPU with AVX-512 in every test and in the
# processes tests start, so which row a table chooses does not depend on the machine the
# suite runs on; the tests of the machine axes state their own (assume_machine, extra).
os.environ["ASTR_MACHINE"] = "cpu_vendor=amd,cpu_isa=avx512"

import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import astrai.dispatch as dispatch
from astrai.dispatch import state
from tests import _impls

#: A family for the precedence tests: one row per source, so each source picks its own row.
#: ``fast`` wins the chain when ``ndim == 3``; otherwise the chain reaches ``ref`` (the
#: fallback). ``lowp`` is non-faithful and ``gone`` is unavailable; both sit above ``ref``
#: so that skipping them is visible. Rows after ``ref`` are reachable only by name.
TOY_TABLE = """\
version: 1
family: toy
description: a family for the tests
fallback: ref
rows:
  - name: fast
    impl: tests._impls:fast
    when: ndim == 3
  - name: lowp
    impl: tests._impls:lowp
    faithful: false
  - name: gone
    impl: tests._impls:slow
    available: tests._impls:no_widget
  - name: ref
    impl: tests._impls:ref
  - name: for_explicit
    impl: tests._impls:for_explicit
  - name: for_context
    impl: tests._impls:for_context
  - name: for_env
    impl: tests._impls:for_env
  - name: for_profile
    impl: tests._impls:for_profile
"""

#: Profiles over ``toy``: force a row, force a row that rejects some calls, enable the
#: non-faithful row, disable the chain's winner.
TOY_PROFILES = {
    "toy-force": "families:\n  toy:\n    force: for_profile\n",
    "toy-force-fast": "families:\n  toy:\n    force: fast\n",
    "toy-enable": "families:\n  toy:\n    enable: [lowp]\n",
    "toy-disable": "families:\n  toy:\n    disable: [fast]\n",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``gpu`` tests without CUDA and ``fuzz`` tests unless ``ASTR_FUZZ=1``."""
    no_gpu = pytest.mark.skip(reason="needs a CUDA device")
    no_fuzz = pytest.mark.skip(reason="long fuzzing run; set ASTR_FUZZ=1 to enable")
    has_cuda = torch.cuda.is_available()
    fuzz = os.environ.get("ASTR_FUZZ") == "1"
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(no_gpu)
        if "fuzz" in item.keywords and not fuzz:
            item.add_marker(no_fuzz)


@pytest.fixture(scope="session", autouse=True)
def _native_decided() -> None:
    """The process's native-extension decision, taken before the first test: where
    nothing is built yet, the first facade call builds it (as it does for a user), and a
    test that happened to make that call would see the facades switch paths mid-test."""
    from astrai import ops

    ops.rms_norm(torch.ones(1, 4), torch.ones(4))


@pytest.fixture(autouse=True)
def _isolate_engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Run each test against the tables in force before it, with a clean environment."""
    for var in ("ASTR_OPS", "ASTR_BACKEND", "ASTR_TABLES", "ASTR_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ASTR_TUNED", "off")  # no profile from the user's cache (tune_model)
    state.reset()
    saved = state.snapshot
    _impls.PROBE.update(available=True, calls=0)
    try:
        yield
    finally:
        for family in list(dispatch.current_overrides()):
            dispatch.set_override(family, None)  # a test that forgot its reset_override
        state.snapshot = saved
        state.reset()


@pytest.fixture(scope="session")
def built() -> ModuleType:
    """astrai's native extension, built once (about 15 s) with the machine's C++ compiler
    and loaded; the test skips, saying why, where it cannot be built."""
    from astrai import native

    try:
        path = native.build()
    except native.NativeBuildError as e:
        pytest.skip(f"astrai's native extension cannot be built here: {e}")
    return native.load_from(path)


@pytest.fixture
def kernels(built: ModuleType, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The native rows with the extension's kernels, available to the tables."""
    from astrai.backends import native as rows

    monkeypatch.setattr(rows, "_kernels", lambda: built)
    dispatch.refresh()
    yield built
    monkeypatch.undo()
    dispatch.refresh()


#: The repository's root: the children of ``python_child`` run there.
ROOT = Path(__file__).resolve().parents[1]


def python_child(env: Mapping[str, str], code: str,
                 *argv: str) -> subprocess.CompletedProcess[str]:
    """``python -c code *argv`` in a new process, in the repository's root, with ``env``
    over this process's environment; its output captured (two minutes at most)."""
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          env={**os.environ, **env}, cwd=ROOT, timeout=120, check=False)


@contextmanager
def adopted(module: ModuleType | None) -> Iterator[None]:
    """Within: the facades on ``module``'s hot path (``None``: the Python one, as in a
    process without the extension), on a new snapshot whose routes make their plans with
    it; the process's hot path and snapshot are given back after."""
    from astrai.dispatch import facade, state

    was = facade.HOT.native, facade.HOT.lookup, facade.HOT.call_lookup
    facade.adopt(module)
    state.reset()
    try:
        yield
    finally:
        facade.adopt(was[0])
        facade.HOT.lookup, facade.HOT.call_lookup = was[1], was[2]
        for f in facade.FACADES.values():
            f.lookup = was[1]
        state.reset()


@pytest.fixture
def hot(built: ModuleType) -> Iterator[ModuleType]:
    """The facades with the compiled hot path in force (plans made from now on)."""
    with adopted(built):
        yield built



@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[object]:
    """A one-process gloo group and its one-device CPU mesh (skips where torch has no
    gloo)."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.fixture
def write_yaml(tmp_path: Path) -> Callable[[str, str], Path]:
    """Write ``text`` (dedented) to ``tmp_path/name`` and return the path."""

    def write(name: str, text: str) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
        return path

    return write


@pytest.fixture
def toy(write_yaml: Callable[[str, str], Path]) -> Path:
    """Load the ``toy`` family and its profiles; returns the table's path."""
    path = write_yaml("toy.yaml", TOY_TABLE)
    profiles = [
        write_yaml(f"profiles/{name}.yaml", f"version: 1\nprofile: {name}\n{body}")
        for name, body in TOY_PROFILES.items()
    ]
    dispatch.load_tables(path, *profiles)
    return path


def ctx(ndim: int | None = 3, **axes: object) -> dispatch.CallContext:
    """A ``toy`` call context (``ndim=3`` lets ``fast`` win the chain)."""
    return dispatch.CallContext("toy", ndim=ndim, **axes)  # type: ignore[arg-type]


def spy(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> list[Any]:
    """Replace ``owner.name`` (a function) by one that records its first argument, then
    calls it; returns the record."""
    seen: list[Any] = []
    real = getattr(owner, name)

    def recorded(first: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(first)
        return real(first, *args, **kwargs)

    monkeypatch.setattr(owner, name, recorded)
    return seen


#: A profile putting the explicit-only ``transposed`` linear row in the implicit chain, as
#: a profile tuned on a machine where it wins does.
TRANSPOSED_ON = """version: 1
profile: transposed-on
description: the transposed linear row in the implicit chain
families:
  linear:
    enable: [transposed]
"""


@contextmanager
def cpu_of(vendor: str, isa: str = "avx512", *, transposed: bool = True) -> Iterator[None]:
    """The machine axes taken for a CPU of ``vendor`` (``intel``, ``amd``) with ``isa``,
    and (``transposed``) the explicit-only ``transposed`` linear row enabled by a profile;
    the shipped tables are read again on the way out."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder, \
            dispatch.assume_machine(cpu_vendor=vendor, cpu_isa=isa):
        try:
            if not transposed:
                yield
                return
            path = Path(folder) / "transposed-on.yaml"
            path.write_text(TRANSPOSED_ON)
            dispatch.load_tables(path)
            with dispatch.use_profile("transposed-on"):
                yield
        finally:
            dispatch.reload_tables()
