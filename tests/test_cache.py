"""The decision cache: hits and misses, invalidation, raw-call probes, bounds, threads, fork.

``resolve`` caches each decision on the table snapshot under a key made of the call's
signature, the explicit / scoped handles, the scoped profiles and the raw environment
values; every swap of the snapshot (reload, ``refresh``, registration) starts an empty
cache. These tests check that a cached decision is never served when any input changed.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as tmp

import astrai.ops
from astrai.dispatch import (
    CallContext,
    ExplicitSelectionError,
    ImplRecord,
    current,
    load_tables,
    op_backend,
    refresh,
    register_env_alias,
    register_family,
    reload_tables,
    reset_override,
    reset_stats,
    resolve,
    set_override,
    state,
    stats,
    use_profile,
)
from astrai.dispatch.resolution import Decision, decide, set_max_decisions
from astrai.ops import context as ops_context
from tests import _impls
from tests.conftest import TOY_TABLE, ctx, spy

attention_context = functools.partial(ops_context, "attention")
linear_context = functools.partial(ops_context, "linear")
rms_norm_context = functools.partial(ops_context, "rms_norm")
rotary_context = functools.partial(ops_context, "rotary")

#: ``TOY_TABLE`` with ``ref`` moved to the top: it then wins every call.
REF_FIRST = TOY_TABLE.replace(
    "rows:\n", "rows:\n  - name: ref\n    impl: tests._impls:ref\n", 1
).replace(
    "  - name: ref\n    impl: tests._impls:ref\n  - name: for_explicit", "  - name: for_explicit", 1
)

#: ``TOY_TABLE`` with a probed row (``counted_probe``, toggled by ``_impls.PROBE``) on top.
PROBED_TABLE = TOY_TABLE.replace(
    "rows:\n",
    "rows:\n  - name: probed\n    impl: tests._impls:medium\n"
    "    available: tests._impls:counted_probe\n",
    1,
)


def row(family: str = "toy", call: CallContext | None = None, explicit: Any = None) -> str:
    """The name of the row that serves ``call`` (default: a 3-d ``toy`` call)."""
    return resolve(family, call if call is not None else ctx(), explicit).name


def attention_call() -> CallContext:
    """A dense float32 attention call on the CPU (no cache)."""
    return CallContext("attention", dtype=torch.float32, ndim=4, head_dim=64)


class TestHitsAndMisses:
    """``resolve`` through the cache: a repeated signature hits, a new one misses."""

    def test_repeat_is_hit(self, toy: Path) -> None:
        """The second resolve of the same signature is a hit and counts no miss."""
        reset_stats()
        first = resolve("toy", ctx())
        s1 = stats()
        assert (s1.cache_hits, s1.cache_misses) == (0, 1)
        second = resolve("toy", ctx())
        s2 = stats()
        assert (s2.cache_hits, s2.cache_misses) == (1, 1)
        assert first == second
        assert second.name == "fast"

    def test_many_repeats(self, toy: Path) -> None:
        """Ten repeats give one miss and nine hits."""
        reset_stats()
        for _ in range(10):
            assert row() == "fast"
        assert (stats().cache_hits, stats().cache_misses) == (9, 1)

    def test_other_signature_misses(self, toy: Path) -> None:
        """A call with a different signature misses and gets its own decision."""
        reset_stats()
        assert row(call=ctx(3)) == "fast"
        assert row(call=ctx(2)) == "ref"
        assert (stats().cache_hits, stats().cache_misses) == (0, 2)
        assert row(call=ctx(3)) == "fast"
        assert row(call=ctx(2)) == "ref"
        assert (stats().cache_hits, stats().cache_misses) == (2, 2)

    def test_explicit_handle_is_part_of_key(self, toy: Path) -> None:
        """The explicit argument keys the decision: different handles never share one."""
        assert row(explicit="for_explicit") == "for_explicit"
        assert row() == "fast"
        assert row(explicit="for_env") == "for_env"
        assert row(explicit="for_explicit") == "for_explicit"

    def test_facade_calls_hit(self) -> None:
        """Repeated ``astrai.ops.linear`` calls of one signature are cache hits."""
        x, w = torch.randn(2, 4), torch.randn(3, 4)
        reset_stats()
        for _ in range(5):
            astrai.ops.linear(x, w)
        s = stats()
        assert (s.cache_hits, s.cache_misses) == (4, 1)
        assert s.served("linear") == 5


class TestDecide:
    """``decide``: the cached ``Decision`` object the facades call."""

    def test_same_decision_object(self) -> None:
        """A hit returns the very ``Decision`` the miss stored."""
        x, w = torch.randn(2, 4), torch.randn(3, 4)
        sig = linear_context(x, w).signature()
        d1 = decide("linear", sig, None, linear_context, (x, w, None))
        d2 = decide("linear", sig, None, linear_context, (x, w, None))
        assert isinstance(d1, Decision)
        assert d1 is d2
        assert d1.obj is d1.resolution.record.obj

    def test_build_called_only_on_miss(self) -> None:
        """The context builder runs on a miss and not on a hit."""
        calls = []

        def build(x: torch.Tensor, w: torch.Tensor, eps: float) -> CallContext:
            calls.append(1)
            return rms_norm_context(x, w, eps)

        x, w = torch.randn(2, 4), torch.ones(4)
        sig = rms_norm_context(x, w, 1e-6).signature()
        decide("rms_norm", sig, None, build, (x, w, 1e-6))
        decide("rms_norm", sig, None, build, (x, w, 1e-6))
        assert len(calls) == 1


class TestFacadeKey:
    """Every facade, ``ops.call`` and ``resolve`` take their decision through ``decide``."""

    @pytest.mark.parametrize("family", ["attention", "rotary", "rms_norm", "linear"])
    def test_facade_decides_once_per_signature(self, family: str) -> None:
        """The first facade call misses, leaving one decision; the next ones hit it. A
        ``resolve`` of the same call keys on the full context and gets its own entry."""
        q, kv = torch.randn(1, 2, 2, 8), torch.randn(1, 3, 2, 8)
        x, w = torch.randn(2, 4), torch.randn(3, 4)
        freqs = torch.randn(1, 2, 4, 2)
        calls: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]] = {
            "attention": (astrai.ops.attention, (q, kv, kv)),
            "rotary": (astrai.ops.apply_rotary, (q, freqs)),
            "rms_norm": (astrai.ops.rms_norm, (x, torch.ones(4), 1e-6)),
            "linear": (astrai.ops.linear, (x, w)),
        }
        facade, args = calls[family]
        reload_tables()
        reset_stats()
        facade(*args)
        state = current()
        assert len(state.decisions) == 1
        facade(*args)
        facade(*args)
        assert (stats().cache_hits, stats().cache_misses) == (2, 1)
        resolve(family, astrai.ops.context(family, *args))
        resolve(family, astrai.ops.context(family, *args))
        assert (stats().cache_hits, stats().cache_misses) == (3, 2)
        assert len(state.decisions) == 2

    def test_hits_counted_on_every_path(self) -> None:
        """Facade hits, ``resolve`` hits and misses all add up in ``stats``."""
        x, w = torch.randn(2, 4), torch.randn(3, 4)
        reset_stats()
        astrai.ops.linear(x, w)                    # miss
        astrai.ops.linear(x, w)                    # hit
        resolve("linear", linear_context(x, w))    # miss: resolve keys on the full context
        resolve("linear", linear_context(x, w))    # hit
        astrai.ops.linear(x, w, backend="torch")   # miss: another explicit handle
        astrai.ops.linear(x, w, backend="torch")   # hit (a row name is cacheable)
        s = stats()
        assert (s.cache_hits, s.cache_misses) == (3, 3)
        assert s.served("linear") == 4
        reset_stats()
        astrai.ops.linear(x, w)
        assert (stats().cache_hits, stats().cache_misses) == (1, 0)

    def test_bad_fwd_never_cached(self) -> None:
        """An invalid ``fwd`` raises every time, and leaves nothing in the cache."""
        q = torch.randn(3, 2, 8)
        reload_tables()
        for _ in range(2):
            with pytest.raises(ValueError, match="fwd must be one of"):
                astrai.ops.attention(q, q, q, fwd="decoding")
        assert not current().decisions

    def test_decision_call_is_bound_call(self) -> None:
        """``Decision.call`` runs the object's ``__call__``; plain functions are used as is."""
        x, w = torch.randn(2, 4), torch.randn(3, 4)
        d = decide("linear", linear_context(x, w).signature(), None, linear_context, (x, w, None))
        obj = d.obj
        if isinstance(obj, (types.FunctionType, types.BuiltinFunctionType)):
            assert d.call is obj  # (the linear row is F.linear itself)
        else:
            assert d.call.__self__ is obj
            assert d.call.__func__ is type(obj).__call__
        torch.testing.assert_close(d.call(x, w, None), obj(x, w, None))


class TestTableReload:
    """A table swap (``load_tables`` / ``reload_tables``) invalidates every decision."""

    def test_load_tables_new_winner(
        self, toy: Path, write_yaml: Callable[[str, str], Path]
    ) -> None:
        """Loading a changed table that moves ``ref`` up returns ``ref`` on the next call."""
        assert row() == "fast"
        assert row() == "fast"
        load_tables(write_yaml("toy2.yaml", REF_FIRST))
        assert row() == "ref"
        assert row(call=ctx(2)) == "ref"

    def test_reload_tables_new_winner(
        self, monkeypatch: pytest.MonkeyPatch, write_yaml: Callable[[str, str], Path]
    ) -> None:
        """``reload_tables`` re-reads ``ASTR_TABLES``: an edited file's new winner serves."""
        path = write_yaml("env/toy.yaml", TOY_TABLE)
        monkeypatch.setenv("ASTR_TABLES", str(path))
        reload_tables()
        assert row() == "fast"
        assert row() == "fast"
        path.write_text(REF_FIRST)
        reload_tables()
        assert row() == "ref"

    def test_reload_gives_empty_cache(self, toy: Path) -> None:
        """After a reload the new snapshot's cache is empty, so the next call misses."""
        row()
        assert len(current().decisions) >= 1
        load_tables(toy)
        assert len(current().decisions) == 0
        reset_stats()
        assert row() == "fast"
        assert stats().cache_misses == 1


class TestProfiles:
    """Profile changes (``use_profile``, ``ASTR_OPS=profile=``) take effect at once."""

    def test_use_profile(self, toy: Path) -> None:
        """Entering and leaving ``use_profile`` switches the decision both ways."""
        for _ in range(2):
            assert row() == "fast"
            with use_profile("toy-force"):
                assert resolve("toy", ctx()).origin == "profile"
                assert row() == "for_profile"
            assert row() == "fast"
            with use_profile("toy-disable"):
                assert row() == "ref"

    def test_ops_env_profile(self, toy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """``ASTR_OPS=profile=...`` set and unset between calls switches the decision."""
        for _ in range(2):
            assert row() == "fast"
            monkeypatch.setenv("ASTR_OPS", "profile=toy-force")
            assert row() == "for_profile"
            monkeypatch.setenv("ASTR_OPS", "profile=toy-disable")
            assert row() == "ref"
            monkeypatch.delenv("ASTR_OPS")


class TestOpsEnvChange:
    """``ASTR_OPS`` is read raw on every call: a change applies to the next call."""

    def test_setenv_delenv(self, toy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """Setting, changing and removing ``ASTR_OPS`` gives the new decision at once."""
        for _ in range(2):
            assert row() == "fast"
            monkeypatch.setenv("ASTR_OPS", "toy=for_env")
            assert resolve("toy", ctx()).origin == "env"
            assert row() == "for_env"
            monkeypatch.setenv("ASTR_OPS", "toy=for_context")
            assert row() == "for_context"
            monkeypatch.delenv("ASTR_OPS")
            assert row() == "fast"

    def test_facade_sees_change(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """``astrai.ops.rms_norm`` follows ``ASTR_OPS`` changes between calls."""
        x, w = torch.randn(2, 4), torch.ones(4)
        astrai.ops.rms_norm(x, w)
        reset_stats()
        monkeypatch.setenv("ASTR_OPS", "rms_norm=reference")
        astrai.ops.rms_norm(x, w)
        assert stats().served("rms_norm", "reference", "env") == 1
        monkeypatch.delenv("ASTR_OPS")
        astrai.ops.rms_norm(x, w)
        assert stats().served("rms_norm", "reference", "env") == 1
        assert stats().served("rms_norm") == 2


class TestLegacyAlias:
    """Legacy single-value variables (``ASTR_BACKEND``) are part of the key."""

    def test_shipped_attention_alias(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """``ASTR_BACKEND`` set and unset between attention calls switches the decision."""
        default = row("attention", attention_call())
        assert default != "math"
        for _ in range(2):
            monkeypatch.setenv("ASTR_BACKEND", "math")
            assert row("attention", attention_call()) == "math"
            monkeypatch.delenv("ASTR_BACKEND")
            assert row("attention", attention_call()) == default

    def test_registered_alias_value_change(
        self, toy: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A registered alias's value changes between calls are seen at once."""
        register_env_alias("toy", "ASTR_BACKEND")
        assert row() == "fast"
        monkeypatch.setenv("ASTR_BACKEND", "for_env")
        assert row() == "for_env"
        monkeypatch.setenv("ASTR_BACKEND", "for_context")
        assert row() == "for_context"
        monkeypatch.delenv("ASTR_BACKEND")
        assert row() == "fast"


class TestOverrides:
    """``op_backend`` and ``set_override`` scopes are part of the key."""

    def test_op_backend_enter_exit(self, toy: Path) -> None:
        """Entering and leaving ``op_backend`` switches the decision both ways."""
        for _ in range(2):
            assert row() == "fast"
            with op_backend(toy="for_context"):
                assert row() == "for_context"
                with op_backend(toy="for_env"):
                    assert row() == "for_env"
                assert row() == "for_context"
            assert row() == "fast"

    def test_set_reset_override(self, toy: Path) -> None:
        """``set_override`` / ``reset_override`` switch the decision both ways."""
        for _ in range(2):
            assert row() == "fast"
            token = set_override("toy", "for_context")
            try:
                assert row() == "for_context"
            finally:
                reset_override(token)
            assert row() == "fast"

    def test_object_override(self, toy: Path) -> None:
        """Two different objects in ``op_backend`` never share a decision."""
        assert row() == "fast"
        with op_backend(toy=_impls.adhoc):
            assert resolve("toy", ctx()).obj is _impls.adhoc
        with op_backend(toy=_impls.for_env):
            assert resolve("toy", ctx()).name == "for_env"
        assert row() == "fast"


class TestRefresh:
    """``refresh()`` forgets availability probes and cached decisions."""

    def test_toggled_probe(self, toy: Path, write_yaml: Callable[[str, str], Path]) -> None:
        """A probe turned off (then on) is seen after ``refresh()`` on the next call."""
        load_tables(write_yaml("probed.yaml", PROBED_TABLE))
        assert row() == "probed"
        _impls.PROBE["available"] = False
        # Documented: probes are cached per snapshot until refresh().
        assert row() == "probed"
        refresh()
        assert row() == "fast"
        _impls.PROBE["available"] = True
        assert row() == "fast"
        refresh()
        assert row() == "probed"

    def test_refresh_empties_cache(self, toy: Path) -> None:
        """``refresh()`` starts a new snapshot with an empty decision cache."""
        row()
        before = current()
        refresh()
        assert current() is not before
        assert current().epoch > before.epoch
        assert len(current().decisions) == 0


class TestRegisterEnvAlias:
    """``register_env_alias`` takes effect on the next call, cached decisions or not."""

    def test_alias_registered_after_cached_decision(
        self, toy: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A variable that was ignored starts selecting rows once registered."""
        monkeypatch.setenv("ASTR_TEST_TOY", "for_env")
        assert row() == "fast"
        assert row() == "fast"
        register_env_alias("toy", "ASTR_TEST_TOY")
        assert row() == "for_env"

    def test_alias_moved_to_other_variable(
        self, toy: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Re-registering the alias under another variable follows the new variable."""
        monkeypatch.setenv("ASTR_TEST_A", "for_env")
        monkeypatch.setenv("ASTR_TEST_B", "for_context")
        register_env_alias("toy", "ASTR_TEST_A")
        assert row() == "for_env"
        register_env_alias("toy", "ASTR_TEST_B")
        assert row() == "for_context"


class TestRegisterFamily:
    """``register_family`` swaps the snapshot: its own and other families re-decide."""

    def test_reregister_new_winner(self) -> None:
        """Re-registering a family with other priorities returns the new winner."""
        register_family(
            "prog",
            [
                ImplRecord("prog", "a", _impls.fast, priority=1),
                ImplRecord("prog", "b", _impls.ref, priority=2),
            ],
            "b",
        )
        call = CallContext("prog")
        assert row("prog", call) == "a"
        assert row("prog", call) == "a"
        register_family(
            "prog",
            [
                ImplRecord("prog", "a", _impls.fast, priority=2),
                ImplRecord("prog", "b", _impls.ref, priority=1),
            ],
            "b",
        )
        assert row("prog", call) == "b"

    def test_other_family_misses_after_register(self, toy: Path) -> None:
        """Registering any family empties the cache: a cached toy call misses once."""
        row()
        reset_stats()
        register_family("prog", [ImplRecord("prog", "only", _impls.ref)], "only")
        assert row() == "fast"
        assert (stats().cache_hits, stats().cache_misses) == (0, 1)


class _LongOnly:
    """An attention object that accepts only calls whose ``q`` has more than 4 positions."""

    name = "long_only"

    def __init__(self) -> None:
        self.probes = 0

    def supports_call(self, q: torch.Tensor, *args: Any, **kwargs: Any) -> bool:
        self.probes += 1
        return q.shape[1] > 4

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor:
        return torch.full((*q.shape[:-2], q.shape[-2] * q.shape[-1]), 7.0)


class TestRawCallProbes:
    """Objects whose ``supports_call`` reads the raw call are never cached wrongly."""

    @staticmethod
    def qkv(seq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = torch.randn(1, seq, 2, 8)
        return q, q.clone(), q.clone()

    def test_scope_alternating(self) -> None:
        """Same signature, short and long calls alternate: short raises, long is served."""
        obj = _LongOnly()
        short, long = self.qkv(3), self.qkv(6)
        with op_backend(attention=obj):
            for _ in range(3):
                with pytest.raises(ExplicitSelectionError):
                    astrai.ops.attention(*short)
                out = astrai.ops.attention(*long)
                assert torch.equal(out, torch.full((1, 6, 16), 7.0))
        assert obj.probes == 6

    def test_explicit_alternating(self) -> None:
        """The same holds for the object passed as ``backend=``."""
        obj = _LongOnly()
        short, long = self.qkv(2), self.qkv(5)
        for _ in range(3):
            assert torch.equal(
                astrai.ops.attention(*long, backend=obj), torch.full((1, 5, 16), 7.0)
            )
            with pytest.raises(ExplicitSelectionError):
                astrai.ops.attention(*short, backend=obj)

    def test_scope_object_does_not_leak_into_cache(self) -> None:
        """After the scope, the plain call resolves through the table again."""
        obj = _LongOnly()
        long = self.qkv(6)
        plain = astrai.ops.attention(*long)
        with op_backend(attention=obj):
            astrai.ops.attention(*long)
        torch.testing.assert_close(astrai.ops.attention(*long), plain)

    def test_picky_kwargs(self, toy: Path) -> None:
        """``Picky`` accepts by ``raw_kwargs``: alternating verdicts for one signature."""
        picky = _impls.Picky()
        yes = CallContext("toy", ndim=3, raw_kwargs={"ok": True})
        no = CallContext("toy", ndim=3, raw_kwargs={"ok": False})
        assert yes.signature() == no.signature()
        for _ in range(3):
            assert resolve("toy", yes, picky).obj is picky
            with pytest.raises(ExplicitSelectionError):
                resolve("toy", no, picky)


class TestBounded:
    """``set_max_decisions`` bounds each snapshot's cache."""

    def test_bound_holds(self, toy: Path) -> None:
        """With room for 8, 50 distinct signatures leave at most 8 entries, all correct."""
        saved = state.max_decisions
        set_max_decisions(8)
        try:
            for n in range(50):
                call = CallContext("toy", ndim=n % 5 + 1, head_dim=n)
                assert row(call=call) == ("fast" if n % 5 + 1 == 3 else "ref")
                assert len(current().decisions) <= 8
            for n in range(50):  # evicted ones are decided again, correctly
                call = CallContext("toy", ndim=n % 5 + 1, head_dim=n)
                assert row(call=call) == ("fast" if n % 5 + 1 == 3 else "ref")
            assert len(current().decisions) <= 8
        finally:
            set_max_decisions(saved)
        assert state.max_decisions == saved

    def test_rejects_zero(self) -> None:
        """A bound below 1 is refused."""
        with pytest.raises(ValueError, match="at least 1"):
            set_max_decisions(0)


class TestThreads:
    """Concurrent resolution in threads with different scopes."""

    def test_scopes_per_thread(self, toy: Path) -> None:
        """Eight threads with their own ``op_backend`` scopes all get their own rows."""
        plan: list[tuple[str | None, int, str]] = [
            ("for_context", 3, "for_context"),
            ("for_env", 2, "for_env"),
            ("for_explicit", 3, "for_explicit"),
            ("for_profile", 2, "for_profile"),
            ("ref", 3, "ref"),
            ("fast", 3, "fast"),
            (None, 3, "fast"),
            (None, 2, "ref"),
        ]
        errors: list[BaseException] = []
        counts = [0] * len(plan)
        barrier = threading.Barrier(len(plan))

        def work(i: int) -> None:
            handle, ndim, want = plan[i]
            try:
                barrier.wait()
                # At least 20 rounds each (a loaded machine may schedule a thread late),
                # then until half a second has passed since the threads met.
                stop = time.monotonic() + 0.5
                while counts[i] < 20 or time.monotonic() < stop:
                    with op_backend(toy=handle):
                        got = resolve("toy", ctx(ndim)).name
                        if got != want:
                            raise AssertionError(f"thread {i}: {got} != {want}")
                    counts[i] += 1
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(plan))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert not any(t.is_alive() for t in threads)
        assert errors == []
        assert min(counts) >= 20


# -- processes -------------------------------------------------------------------


def _mp_worker(queue: Any) -> None:
    """Run ``linear`` and ``rms_norm`` three times each; report rows and counts."""
    try:
        x, w, g = torch.randn(2, 4), torch.randn(3, 4), torch.ones(4)
        lin = resolve("linear", linear_context(x, w)).name
        rms = resolve("rms_norm", rms_norm_context(x, g)).name
        before = (stats().served("linear", lin), stats().served("rms_norm", rms))
        for _ in range(3):
            astrai.ops.linear(x, w)
            astrai.ops.rms_norm(x, g)
        after = (stats().served("linear", lin), stats().served("rms_norm", rms))
        queue.put({"linear": lin, "rms_norm": rms, "before": before, "after": after})
    except BaseException as exc:
        queue.put({"error": repr(exc)})


def _expected_rows() -> tuple[str, str]:
    x, w, g = torch.randn(2, 4), torch.randn(3, 4), torch.ones(4)
    return (
        resolve("linear", linear_context(x, w)).name,
        resolve("rms_norm", rms_norm_context(x, g)).name,
    )


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (POSIX)")
class TestFork:
    """``os.fork``: the child resolves correctly; its counters and caches start from zero."""

    def test_child_resolves_and_counts(self, toy: Path) -> None:
        """In a forked child resolve is correct and scopes work; stats start from zero
        (reset at fork) and count only the child's own calls."""
        x, w = torch.randn(2, 4), torch.randn(3, 4)
        for _ in range(4):
            astrai.ops.linear(x, w)
        parent_linear = stats().served("linear")
        assert parent_linear == 4
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:  # child
            code = 1
            try:
                os.close(rfd)
                report: dict[str, Any] = {}
                report["toy3"] = row(call=ctx(3))
                report["toy2"] = row(call=ctx(2))
                with op_backend(toy="for_context"):
                    report["scoped"] = row()
                report["inherited"] = stats().served("linear")
                for _ in range(2):
                    astrai.ops.linear(x, w)
                report["after"] = stats().served("linear")
                os.write(wfd, json.dumps(report).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(wfd)
        with os.fdopen(rfd, "rb") as f:
            data = f.read()
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, data
        report = json.loads(data)
        assert report["toy3"] == "fast"
        assert report["toy2"] == "ref"
        assert report["scoped"] == "for_context"
        # Counters are reset in the child at fork.
        assert report["inherited"] == 0
        assert report["after"] == 2
        # The child's calls do not show in the parent.
        assert stats().served("linear") == parent_linear


class TestMultiprocessing:
    """``torch.multiprocessing`` workers (fork and spawn) dispatch and count correctly."""

    @pytest.mark.parametrize("method", ["fork", "spawn"])
    def test_worker(self, method: str) -> None:
        """A worker resolves the same rows as the parent and counts its own calls
        (its counters start from zero under both fork and spawn)."""
        if method not in tmp.get_all_start_methods():
            pytest.skip(f"start method {method!r} unavailable")
        x, w = torch.randn(2, 4), torch.randn(3, 4)
        astrai.ops.linear(x, w)
        astrai.ops.linear(x, w)
        want_lin, want_rms = _expected_rows()
        inherited = stats().served("linear", want_lin)
        assert inherited == 2
        mp: Any = tmp.get_context(method)
        queue = mp.Queue()
        proc = mp.Process(target=_mp_worker, args=(queue,))
        proc.start()
        try:
            got = queue.get(timeout=60)
        finally:
            proc.join(60)
        assert "error" not in got, got
        assert proc.exitcode == 0
        assert (got["linear"], got["rms_norm"]) == (want_lin, want_rms)
        start = (0, 0)
        assert tuple(got["before"]) == start
        assert tuple(got["after"]) == (start[0] + 3, start[1] + 3)


class TestCountsAndBounds:
    """Failed lookups, ad hoc objects and odd callables (review of the restructuring)."""

    def test_failed_lookups_do_not_lower_hits(self) -> None:
        """A lookup that raises is a miss, never a negative hit."""
        x, w = torch.randn(2, 4), torch.ones(4)
        reset_stats()
        for _ in range(3):
            astrai.ops.rms_norm(x, w)
        for _ in range(3):
            with pytest.raises(ValueError, match="Unknown rms_norm implementation"):
                astrai.ops.rms_norm(x, w, backend="nonesuch")
        assert (stats().cache_hits, stats().cache_misses) == (2, 4)
        reset_stats()
        for _ in range(2):
            with pytest.raises(ValueError):
                resolve("rms_norm", astrai.ops.context("rms_norm", x, w), "nonesuch")
        assert (stats().cache_hits, stats().cache_misses) == (0, 2)

    def test_ad_hoc_objects_do_not_grow_without_bound(self) -> None:
        """A fresh object as ``backend=`` on every call: both per-snapshot caches stay within
        the decision bound."""
        x, w = torch.randn(2, 4), torch.ones(4)
        saved = state.max_decisions
        set_max_decisions(20)
        try:
            for i in range(200):
                astrai.ops.rms_norm(x, w, backend=lambda x, w, eps, i=i: x + i)
            snap = current()
            assert len(snap.decisions) <= 20 and len(snap.made) <= 20
        finally:
            set_max_decisions(saved)

    def test_staticmethod_call_object(self) -> None:
        """An object whose ``__call__`` is a staticmethod is called as written."""

        class Doubler:
            @staticmethod
            def __call__(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
                return x * 2

        x, w = torch.randn(2, 4), torch.ones(4)
        torch.testing.assert_close(astrai.ops.rms_norm(x, w, backend=Doubler()), x * 2)


class TestResolveMemo:
    """``resolve`` asked again with the same context object answers from the object."""

    def test_copies_carry_nothing(self) -> None:
        """A copy is a new context: it carries nothing ``resolve`` left on the original."""
        import copy

        call = CallContext("rms_norm", dtype=torch.float32, ndim=2)
        for _ in range(3):
            resolve("rms_norm", call)
        other = copy.copy(call)
        assert "_resolved" not in other.__dict__
        assert other == call
        assert resolve("rms_norm", other) == resolve("rms_norm", call)


#: An ``rms_norm`` table of one row, the reference.
REFERENCE_ONLY = """\
version: 1
family: rms_norm
fallback: reference
rows:
  - name: reference
    impl: astrai.backends.rms_norm:reference_rms_norm
"""


class TestFacadeLastWorld:
    """A facade keeps its family's decisions of the last world (snapshot, scope, raw
    variables) by the call's values: the same world skips ``decide``; any change of
    world goes back through it, so the answer always follows the change."""

    @staticmethod
    def counting(monkeypatch: pytest.MonkeyPatch) -> list[str]:
        """The families ``decide`` is called for by a facade from now on."""
        from astrai.dispatch import facade as _facade

        return spy(monkeypatch, _facade, "decide")

    def test_same_world_skips_decide_and_every_change_reaches_it(
            self, monkeypatch: pytest.MonkeyPatch) -> None:
        x, w = torch.randn(2, 4), torch.ones(4)
        astrai.ops.rms_norm(x, w)
        seen = self.counting(monkeypatch)
        reset_stats()
        for _ in range(3):
            astrai.ops.rms_norm(x, w)
        assert seen == [] and stats().served("rms_norm") == 3
        assert stats().cache_hits == 3

        monkeypatch.setenv("ASTR_OPS", "rms_norm=reference")
        astrai.ops.rms_norm(x, w)
        astrai.ops.rms_norm(x, w)
        assert len(seen) == 1 and stats().served("rms_norm", "reference", "env") == 2
        monkeypatch.delenv("ASTR_OPS")
        astrai.ops.rms_norm(x, w)
        assert len(seen) == 2 and stats().served("rms_norm", "reference", "env") == 2
        with op_backend(rms_norm="reference"):
            astrai.ops.rms_norm(x, w)
            assert stats().served("rms_norm", "reference", "context") == 1
        astrai.ops.rms_norm(x, w)
        assert len(seen) == 4
        state.reset()  # a new decision cache: a new world
        astrai.ops.rms_norm(x, w)
        astrai.ops.rms_norm(x, w)
        assert len(seen) == 5 and stats().cache_misses == 1
        assert stats().served("rms_norm", "reference") == 0  # (counts since reset)

    def test_other_values_and_backend_go_through_decide(
            self, monkeypatch: pytest.MonkeyPatch) -> None:
        x, w = torch.randn(2, 4), torch.ones(4)
        astrai.ops.rms_norm(x, w)
        seen = self.counting(monkeypatch)
        astrai.ops.rms_norm(x.double(), w.double())  # other values: decided, then kept
        astrai.ops.rms_norm(x.double(), w.double())
        assert len(seen) == 1
        astrai.ops.rms_norm(x, w, backend="reference")  # never from the last world
        astrai.ops.rms_norm(x, w, backend="reference")
        assert len(seen) == 3
        astrai.ops.rms_norm(x, w)
        assert len(seen) == 3

    def test_legacy_alias_is_part_of_the_world(self, monkeypatch: pytest.MonkeyPatch) -> None:
        q = torch.randn(1, 3, 2, 8)
        astrai.ops.attention(q, q, q)
        reset_stats()
        for _ in range(2):
            monkeypatch.setenv("ASTR_BACKEND", "math")
            astrai.ops.attention(q, q, q)
            monkeypatch.delenv("ASTR_BACKEND")
            astrai.ops.attention(q, q, q)
        assert stats().served("attention", "math", "env") == 2
        assert stats().served("attention") == 4

    def test_a_reload_is_a_new_world(self, write_yaml: Callable[[str, str], Path]) -> None:
        x, w = torch.randn(2, 4), torch.ones(4)
        astrai.ops.rms_norm(x, w)
        astrai.ops.rms_norm(x, w)
        path = write_yaml("rms_norm.yaml", REFERENCE_ONLY)
        load_tables(path)
        reset_stats()
        astrai.ops.rms_norm(x, w)
        assert stats().served("rms_norm", "reference") == 1

    def test_uncacheable_scope_is_never_kept(self) -> None:
        """Under a scope whose object reads the raw call, every call is probed."""
        obj = _LongOnly()
        q = torch.randn(1, 6, 2, 8)
        with op_backend(attention=obj):
            for _ in range(3):
                astrai.ops.attention(q, q, q)
        assert obj.probes == 3
        plain = astrai.ops.attention(q, q, q)
        assert not torch.equal(plain, torch.full((1, 6, 16), 7.0))

    def test_a_change_while_deciding_is_not_filed_under_the_new_world(
            self, monkeypatch: pytest.MonkeyPatch) -> None:
        """``ASTR_OPS`` set while a decision is taken (here by the probe of a row the chain
        asks about): the decision, taken under the old value, is not kept for the new."""
        from astrai.dispatch import register_impl, unregister_impl

        def probe() -> bool:
            os.environ["ASTR_OPS"] = "rms_norm=reference"
            return False

        def never(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
            raise AssertionError("an unavailable row ran")

        monkeypatch.delenv("ASTR_OPS", raising=False)
        register_impl(ImplRecord("rms_norm", "probing", never, available=probe),
                      before="inductor_large")
        try:
            x, w = torch.randn(2, 4), torch.ones(4)
            astrai.ops.rms_norm(x, w)  # decided under no ASTR_OPS; the probe sets it
            reset_stats()
            for _ in range(3):
                astrai.ops.rms_norm(x, w)
            assert stats().served("rms_norm", "reference", "env") == 3
        finally:
            os.environ.pop("ASTR_OPS", None)
            unregister_impl("rms_norm", "probing")

    def test_snapshot_put_back_by_hand_is_a_new_world(
            self, write_yaml: Callable[[str, str], Path]) -> None:
        """Tables saved and restored by assigning ``state.snapshot`` (as the tests' own
        fixture does): neither a facade nor ``resolve`` answers from the other tables."""
        x, w = torch.randn(2, 4), torch.ones(4)
        call = rms_norm_context(x, w)
        default = resolve("rms_norm", call).name
        assert default != "reference"
        saved = state.snapshot
        load_tables(write_yaml("rms_norm.yaml", REFERENCE_ONLY))
        for _ in range(3):
            astrai.ops.rms_norm(x, w)
            assert resolve("rms_norm", call).name == "reference"
        state.snapshot = saved
        reset_stats()
        astrai.ops.rms_norm(x, w)
        assert stats().served("rms_norm", default) == 1
        assert resolve("rms_norm", call).name == default

    def test_the_fast_path_comes_back_after_a_reset_or_an_equal_value(
            self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A world is checked by identity: after ``reset()`` or ``ASTR_OPS`` set again to
        the same text, the new world is kept (one ``decide``, then none)."""
        x, w = torch.randn(2, 4), torch.ones(4)
        astrai.ops.rms_norm(x, w)
        seen = self.counting(monkeypatch)
        state.reset()
        for _ in range(5):
            astrai.ops.rms_norm(x, w)
        assert len(seen) == 1
        monkeypatch.setenv("ASTR_OPS", "rms_norm=torch")
        astrai.ops.rms_norm(x, w)
        monkeypatch.setenv("ASTR_OPS", "rms_norm=torch")  # the same text, a new object
        for _ in range(5):
            astrai.ops.rms_norm(x, w)
        assert len(seen) == 3


def test_the_decision_cache_keeps_nothing_the_collector_tracks() -> None:
    """Thousands of never-seen signatures, through resolve and through a facade, leave
    no collector-tracked object per cache entry: Python's full collections do not grow
    with the cache, so they cannot land in decisions as pauses."""
    import gc

    contexts = [CallContext("attention", dtype=torch.float32, ndim=4, head_dim=1000 + i)
                for i in range(3000)]
    heads = [torch.zeros(1, 1, 1, 2 * (i + 1)) for i in range(1000)]

    def tracked_after(decide: Callable[[], None]) -> int:
        gc.collect()
        before = len(gc.get_objects())
        decide()
        gc.collect()
        return len(gc.get_objects()) - before

    resolve("attention", contexts[0])
    grew = tracked_after(lambda: [resolve("attention", c) for c in contexts[1:]] and None)
    assert grew < 30, f"{grew} tracked objects for 2 999 cached decisions"
    astrai.ops.attention(heads[0], heads[0], heads[0])
    grew = tracked_after(lambda: [astrai.ops.attention(q, q, q) for q in heads[1:]] and None)
    assert grew < 30, f"{grew} tracked objects for 999 cached facade decisions"
    assert stats().cache_misses >= 3998
