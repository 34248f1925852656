"""The decision's world is one value, read once per decision: a variable that changes
while a decision is taken cannot put a decision made under one value into the cache (or
a facade's last world, or ``resolve``'s memo) under another."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import astrai.dispatch as dispatch
from astrai import ops
from astrai.dispatch import state as process
from astrai.dispatch.axes import CallContext
from astrai.dispatch.resolution import decide
from astrai.dispatch.world import in_force, world_now
from astrai.ops import context as ops_context


def linear_context(x: torch.Tensor, w: torch.Tensor, b: Any = None) -> CallContext:
    """The ``CallContext`` the ``linear`` facade makes for ``(x, w, b)``."""
    return ops_context("linear", x, w, b)


@pytest.fixture
def no_ops_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("ASTR_OPS", raising=False)
    dispatch.refresh()
    yield
    os.environ.pop("ASTR_OPS", None)
    dispatch.refresh()


def _flipping_build(value: str | None) -> Any:
    """A ``build`` for ``decide`` that changes ``ASTR_OPS`` between the cache key being
    made and the evaluator running (what another thread can do at any moment)."""

    def build(x: torch.Tensor, w: torch.Tensor, b: Any) -> CallContext:
        if value is None:
            os.environ.pop("ASTR_OPS", None)
        else:
            os.environ["ASTR_OPS"] = value
        return linear_context(x, w, b)

    return build


def test_a_change_during_a_miss_is_not_cached_under_the_old_value(no_ops_env: None) -> None:
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    sig = linear_context(x, w).signature()
    d = decide("linear", sig, None, _flipping_build("linear=bf16"), (x, w, None))
    # Decided in the world read first (ASTR_OPS unset): the table's faithful row.
    assert d.resolution.name == "torch"
    # The variable is set now: a new world, a new decision.
    assert dispatch.resolve("linear", linear_context(x, w)).name == "bf16"
    os.environ.pop("ASTR_OPS")
    assert decide("linear", sig, None, linear_context, (x, w, None)).resolution.name == "torch"


def test_the_reverse_change_too(no_ops_env: None) -> None:
    os.environ["ASTR_OPS"] = "linear=bf16"
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    sig = linear_context(x, w).signature()
    d = decide("linear", sig, None, _flipping_build(None), (x, w, None))
    assert d.resolution.name == "bf16"  # the world the key was made in asked for bf16
    assert "ASTR_OPS" not in os.environ
    assert dispatch.resolve("linear", linear_context(x, w)).name == "torch"


def test_world_in_force_by_identity(no_ops_env: None) -> None:
    state = dispatch.current()
    world = world_now(state, "linear")
    assert in_force(world)
    with dispatch.op_backend(linear="torch"):
        assert not in_force(world)
    os.environ["ASTR_OPS"] = "linear=torch"
    assert not in_force(world)
    os.environ.pop("ASTR_OPS")
    assert in_force(world)
    dispatch.refresh()
    assert not in_force(world)  # a new snapshot


def test_flipping_threads_never_serve_bf16_unasked(no_ops_env: None) -> None:
    """Four threads call ``ops.linear`` while a fifth flips ``ASTR_OPS=linear=bf16`` on
    and off, with the interpreter switching threads every microsecond. Afterwards, with
    the variable unset, every decision the caches hold for the calls gives ``F.linear``'s
    exact result: none made under bf16 was kept under the unset value."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    stop = threading.Event()
    shapes = [(n, 16) for n in (1, 2, 3, 5, 8, 13)]
    w = torch.randn(32, 16)
    xs = [torch.randn(*s) for s in shapes]

    def flip() -> None:
        while not stop.is_set():
            os.environ["ASTR_OPS"] = "linear=bf16"
            os.environ.pop("ASTR_OPS", None)

    def call() -> None:
        while not stop.is_set():
            for x in xs:
                ops.linear(x, w)

    threads = [threading.Thread(target=flip), *(threading.Thread(target=call) for _ in range(4))]
    try:
        for t in threads:
            t.start()
        stop.wait(1.5)
    finally:
        stop.set()
        for t in threads:
            t.join()
        sys.setswitchinterval(interval)
    os.environ.pop("ASTR_OPS", None)
    assert process.snapshot is not None and process.snapshot.decisions  # decisions were cached
    for x in xs:
        assert torch.equal(ops.linear(x, w), F.linear(x, w))
        assert dispatch.resolve("linear", linear_context(x, w)).name == "torch"


def test_the_view_a_world_remembers_serves_only_that_world(no_ops_env: None) -> None:
    """The environment's selections and the family's view, remembered on the snapshot
    for the next miss in the same world, are never reused in another: a profile named by
    ``ASTR_OPS`` or by a scope, set after a decision was taken without it, decides the
    next call, and the plain world's view serves again once it is gone."""
    x, w = torch.randn(1, 3, 16), torch.ones(16)
    plain = process.snapshot or dispatch.current()
    fallback = plain.families["rms_norm"].fallback

    def row_of(t: torch.Tensor) -> str:
        return dispatch.resolve("rms_norm", ops_context("rms_norm", t, w, 1e-6)).name

    first = row_of(x)
    assert first != fallback  # the table's chain serves a plain call
    os.environ["ASTR_OPS"] = "profile=reference"
    assert row_of(torch.randn(1, 5, 16)) == fallback  # a new signature, a new world
    assert row_of(x) == fallback  # a signature decided before, in another world
    del os.environ["ASTR_OPS"]
    assert row_of(torch.randn(1, 7, 16)) == first
    with dispatch.use_profile("reference"):
        assert row_of(torch.randn(1, 9, 16)) == fallback
    assert row_of(torch.randn(1, 11, 16)) == first
    assert dispatch.current() is plain  # all of it on one snapshot
