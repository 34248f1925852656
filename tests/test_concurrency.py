"""Resolution under concurrent reloads, profile switches and overrides (contract §12).

Two table directories define the same ``race`` family and ``race-pick`` profile with the
winners swapped: in ``A`` the chain picks ``alpha`` and ``race-pick`` forces ``beta``; in
``B`` the reverse. A writer thread reloads the tables 100 times, alternating ``ASTR_TABLES``
between the two, and switches ``ASTR_OPS`` between its states in between. Eight reader
threads resolve continuously (``resolve`` on a ``CallContext`` and the ``astrai.ops``
facades on small CPU tensors), each under its own, changing ``set_override`` /
``use_profile`` scope.

Validity without racing ourselves: the writer publishes a generation number that is odd
while it changes something and even when the configuration is settled, and it records the
configuration of each even generation. A reader that sees the same even generation before
and after a decision knows exactly which configuration was in force, and checks the row
and origin against a model of contract §3 (itself checked single-threaded first) and against
an uncached ``evaluate`` on the snapshot it holds; any other decision must at least be one
that some configuration gives, never a mix.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from astrai import ops
from astrai.backends.rotary import rotary_freqs
from astrai.dispatch import (
    CallContext,
    Resolution,
    current,
    current_profiles,
    get_override,
    load_tables,
    op_backend,
    reload_tables,
    reset_override,
    resolve,
    set_override,
    use_profile,
)
from astrai.dispatch.resolution import evaluate
from tests import _impls

RELOADS = 100
READERS = 8
TASKS = 64
DEPTH = 4

TABLE = """\
version: 1
family: race
description: two orders of the same rows, swapped on every reload
fallback: ref
rows:
  - name: {first}
    impl: tests._impls:{first_impl}
  - name: {second}
    impl: tests._impls:{second_impl}
  - name: ref
    impl: tests._impls:ref
"""
PROFILE = "version: 1\nprofile: race-pick\nfamilies:\n  race:\n    force: {forced}\n"
#: Per directory: the chain's winner and the row ``race-pick`` forces.
WINNER = {"A": "alpha", "B": "beta"}
PICKED = {"A": "beta", "B": "alpha"}
IMPLS: dict[str, Callable[..., str]] = {"alpha": _impls.fast, "beta": _impls.medium,
                                        "ref": _impls.ref}
#: ``ASTR_OPS`` states the writer switches between (``None``: unset).
OPS_STATES: list[str | None] = [None, "profile=reference", "profile=race-pick", "race=ref"]
OVERRIDES: list[str | None] = [None, "ref", "beta"]
SCOPED_PROFILES: list[str | None] = [None, "reference", "race-pick"]
CALL = CallContext("race", ndim=3)

Config = tuple[str, str | None]  # (tables directory, ASTR_OPS value)


def expected(tables: str, ops_value: str | None, override: str | None,
             scoped: list[str]) -> tuple[str, str]:
    """``(row, origin)`` that contract §3 gives for ``race`` in this configuration."""
    if override is not None:
        return override, "context"
    if ops_value == "race=ref":
        return "ref", "env"
    env_profiles = [ops_value.removeprefix("profile=")] if ops_value else []
    forced = None
    for name in [*env_profiles, *scoped]:  # ASTR_OPS first, then scopes; the last wins
        forced = {"reference": "ref", "race-pick": PICKED[tables]}.get(name, forced)
    if forced is not None:
        return forced, "profile"
    return WINNER[tables], "chain"


def any_config(override: str | None, scoped: list[str]) -> set[tuple[str, str]]:
    """Every ``(row, origin)`` some configuration gives under this scope."""
    return {expected(t, o, override, scoped) for t in WINNER for o in OPS_STATES}


@pytest.fixture
def race_dirs(tmp_path: Path) -> dict[str, Path]:
    """The two table directories, ``A`` and ``B``."""
    dirs = {}
    for name, (first, second) in {"A": ("alpha", "beta"), "B": ("beta", "alpha")}.items():
        root = tmp_path / name
        (root / "profiles").mkdir(parents=True)
        (root / "race.yaml").write_text(TABLE.format(
            first=first, second=second, first_impl=IMPLS[first].__name__,
            second_impl=IMPLS[second].__name__))
        (root / "profiles" / "race-pick.yaml").write_text(PROFILE.format(forced=PICKED[name]))
        dirs[name] = root
    return dirs


def set_ops(value: str | None) -> None:
    """Set or unset ``ASTR_OPS`` (the test's monkeypatch restores it afterwards)."""
    if value is None:
        os.environ.pop("ASTR_OPS", None)
    else:
        os.environ["ASTR_OPS"] = value


@contextmanager
def scope(override: str | None, profile: str | None) -> Iterator[None]:
    """``set_override`` for ``race`` (when given) and ``use_profile`` (when given)."""
    token = set_override("race", override) if override is not None else None
    try:
        with use_profile(*([profile] if profile else [])):
            yield
    finally:
        if token is not None:
            reset_override(token)


class Facades:
    """Small CPU calls of every facade, with outputs computed single-threaded beforehand."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(2, 5, 8, generator=gen)
        w = torch.randn(6, 8, generator=gen)
        g = torch.rand(8, generator=gen) + 0.5
        q, k, v = (torch.randn(1, 4, 2, 8, generator=gen) for _ in range(3))
        xr = torch.randn(1, 4, 2, 8, generator=gen)
        freqs = rotary_freqs(torch.arange(4)[None, :], 8)
        self.calls: list[Callable[[], torch.Tensor]] = [
            lambda: ops.rms_norm(x, g),
            lambda: ops.linear(x, w),
            lambda: ops.apply_rotary(xr, freqs),
            lambda: ops.attention(q, k, v, is_causal=True),
        ]
        self.want = [call() for call in self.calls]

    def check(self, i: int) -> None:
        """Run call ``i`` and compare it with its single-threaded output."""
        got = self.calls[i % len(self.calls)]()
        want = self.want[i % len(self.calls)]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


class TestThreadsUnderReload:
    """Eight resolving threads while another reloads the tables and switches the environment."""

    def test_model_matches_single_threaded(self, race_dirs: dict[str, Path],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
        """The model of the expected decisions agrees with ``resolve`` for every
        configuration, one thread at a time (so the concurrent test checks real rules)."""
        for tables, root in race_dirs.items():
            monkeypatch.setenv("ASTR_TABLES", str(root))
            reload_tables()
            for ops_value in OPS_STATES:
                set_ops(ops_value)
                for override in OVERRIDES:
                    for profile in SCOPED_PROFILES:
                        with scope(override, profile):
                            res = resolve("race", CALL)
                        scoped = [profile] if profile else []
                        assert (res.name, res.origin) == expected(
                            tables, ops_value, override, scoped), (tables, ops_value, override,
                                                                   profile)
                        assert res.obj is IMPLS[res.name]

    def test_readers_during_reloads(self, race_dirs: dict[str, Path],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
        """No thread raises, and every decision is the one its configuration gives."""
        monkeypatch.setenv("ASTR_TABLES", str(race_dirs["A"]))
        monkeypatch.delenv("ASTR_OPS", raising=False)
        reload_tables()
        facades = Facades()
        gen = [0]  # odd while the writer changes something
        configs: dict[int, Config] = {0: ("A", None)}
        stop = threading.Event()
        errors: list[tuple[str, BaseException]] = []
        counts = {"decisions": 0, "exact": 0, "facade_calls": 0, "reloads": 0,
                  "ops_switches": 0}
        count_lock = threading.Lock()
        start = threading.Barrier(READERS + 1)

        def check(override: str | None, profile: str | None, res: Resolution,
                  fresh: Resolution, g1: int, g2: int, s1: Any, s2: Any) -> bool:
            """Check one decision (``fresh``: uncached, on snapshot ``s1``, same window)."""
            scoped = [profile] if profile else []
            assert res.record.family == "race"
            assert res.obj is IMPLS[res.name], f"{res.name} served by {res.obj}"
            if s1 is s2:
                assert any(res.record is r for r in s1.families["race"].rows), (
                    "the decision's row is not a row of the snapshot in force")
            if g1 == g2 and g1 % 2 == 0:
                want = expected(*configs[g1], override, scoped)
                assert (res.name, res.origin) == want, (configs[g1], override, profile)
                assert (fresh.name, fresh.origin) == want
                assert fresh.record is res.record
                return True
            assert (res.name, res.origin) in any_config(override, scoped), (
                f"torn decision {(res.name, res.origin)} under {override=} {profile=}")
            return False

        def reader(i: int) -> None:
            rng = random.Random(i)
            decisions = exact = calls = 0
            try:
                start.wait()
                while not stop.is_set():
                    override = rng.choice(OVERRIDES)
                    profile = rng.choice(SCOPED_PROFILES)
                    with scope(override, profile):
                        for _ in range(4):
                            g1 = gen[0]
                            s1 = current()
                            res = resolve("race", CALL)
                            fresh = evaluate("race", CALL, state=s1)
                            s2 = current()
                            g2 = gen[0]
                            exact += check(override, profile, res, fresh, g1, g2, s1, s2)
                            decisions += 1
                        facades.check(decisions + i)
                        calls += 1
            except BaseException as exc:  # reported by the main thread
                errors.append((f"reader {i}", exc))
                stop.set()
            with count_lock:
                counts["decisions"] += decisions
                counts["exact"] += exact
                counts["facade_calls"] += calls

        def writer() -> None:
            rng = random.Random(1234)
            tables, ops_value = "A", None
            try:
                start.wait()
                for n in range(RELOADS):
                    if stop.is_set():
                        break
                    for _ in range(rng.randint(1, 3)):  # ASTR_OPS switches between reloads
                        gen[0] += 1
                        ops_value = rng.choice(OPS_STATES)
                        set_ops(ops_value)
                        configs[gen[0] + 1] = (tables, ops_value)
                        gen[0] += 1
                        counts["ops_switches"] += 1
                        time.sleep(0.001)
                    gen[0] += 1
                    tables = "B" if tables == "A" else "A"
                    os.environ["ASTR_TABLES"] = str(race_dirs[tables])
                    reload_tables()
                    configs[gen[0] + 1] = (tables, ops_value)
                    gen[0] += 1
                    counts["reloads"] += 1
                    # The writer's own override is its own: readers never see it.
                    token = set_override("race", "alpha" if n % 2 else "ref")
                    try:
                        assert resolve("race", CALL).name == ("alpha" if n % 2 else "ref")
                    finally:
                        reset_override(token)
                    time.sleep(0.001)
            except BaseException as exc:
                errors.append(("writer", exc))
            finally:
                stop.set()

        threads = [threading.Thread(target=reader, args=(i,), daemon=True)
                   for i in range(READERS)]
        threads.append(threading.Thread(target=writer, daemon=True))
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a thread did not finish"
        assert errors == [], errors
        assert counts["reloads"] == RELOADS
        assert counts["exact"] > 0 and counts["facade_calls"] >= READERS
        print(f"threads: {READERS} readers + 1 writer; {counts}")


class TestAsyncioScopes:
    """Many asyncio tasks with nested ``op_backend`` / ``use_profile`` scopes across awaits."""

    def test_each_task_sees_its_innermost_scope(self, race_dirs: dict[str, Path]) -> None:
        """Every task, at every nesting level and after every await, resolves to its own
        innermost scope's row, while the tables are swapped underneath (by another task
        between steps, and by another thread)."""
        load_tables(race_dirs["A"])
        stop = threading.Event()
        swaps = [0]

        def swapper() -> None:
            while not stop.is_set():
                load_tables(race_dirs["B" if swaps[0] % 2 == 0 else "A"])
                swaps[0] += 1
                time.sleep(0)

        checked = [0]

        def check(override: str | None, profiles: list[str]) -> None:
            res = resolve("race", CALL)
            assert get_override("race") == override
            assert list(current_profiles()) == profiles
            if override is not None:  # a context selection wins whatever the tables
                assert (res.name, res.origin) == (override, "context")
            else:
                assert (res.name, res.origin) in {expected(t, None, None, profiles)
                                                  for t in WINNER}
            assert res.obj is IMPLS[res.name]
            checked[0] += 1

        async def nest(rng: random.Random, depth: int, override: str | None,
                       profiles: list[str]) -> None:
            if depth == DEPTH:
                return
            for _ in range(2):
                handle = rng.choice(["alpha", "beta", "ref", None])
                profile = rng.choice([None, None, "race-pick", "reference"])
                inner = [*profiles, profile] if profile else profiles
                with ExitStack() as stack:
                    if rng.random() < 0.5:
                        stack.enter_context(op_backend(race=handle))
                    else:
                        token = set_override("race", handle)
                        stack.callback(reset_override, token)
                    if profile:
                        stack.enter_context(use_profile(profile))
                    await asyncio.sleep(rng.choice([0, 0.001]))
                    check(handle, inner)
                    await nest(rng, depth + 1, handle, inner)
                    await asyncio.sleep(rng.choice([0, 0.001]))
                    check(handle, inner)
                check(override, profiles)

        async def task(i: int) -> None:
            await nest(random.Random(i), 0, None, [])

        async def swap_between_steps(done: asyncio.Event) -> None:
            while not done.is_set():  # interleaved with the tasks' steps, on the loop itself
                load_tables(race_dirs["B" if swaps[0] % 2 == 0 else "A"])
                swaps[0] += 1
                await asyncio.sleep(0)

        async def main() -> None:
            done = asyncio.Event()
            swapping = asyncio.create_task(swap_between_steps(done))
            await asyncio.gather(*(task(i) for i in range(TASKS)))
            done.set()
            await swapping

        thread = threading.Thread(target=swapper, daemon=True)
        thread.start()
        try:
            asyncio.run(main())
        finally:
            stop.set()
            thread.join(10)
        assert checked[0] >= TASKS * 2
        print(f"asyncio: {TASKS} tasks, {checked[0]} checks, {swaps[0]} table swaps")
