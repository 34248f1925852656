"""Resolution order end to end (contract §3): the one file that covers precedence.

The ``toy`` family (see ``conftest.TOY_TABLE``) has one row per source, so every source
picks a row of its own and the winner shows which source decided.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import threading
import weakref
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch

from astrai.dispatch import (
    PRECEDENCE,
    CallContext,
    ExplicitSelectionError,
    Resolution,
    current,
    list_families,
    load_tables,
    op_backend,
    refresh,
    register_env_alias,
    reload_tables,
    reset_override,
    resolve,
    resolve_plan,
    set_override,
    use_profile,
)
from tests import _impls
from tests.conftest import TOY_TABLE, ctx

pytestmark = pytest.mark.usefixtures("toy")

ORDER = ("explicit", "context", "env", "profile", "chain", "fallback")
#: The row each source selects in the ``toy`` family.
ROW_FOR = {
    "explicit": "for_explicit",
    "context": "for_context",
    "env": "for_env",
    "profile": "for_profile",
    "chain": "fast",
    "fallback": "ref",
}
#: The origin each source reports. A YAML table's fallback row is part of its chain, so a
#: call the chain hands to it has origin ``chain``, as in the seed; origin ``fallback``
#: (nothing in the chain matched) is covered with seed-style families in test_seed.py.
ORIGIN_FOR = {s: "chain" if s == "fallback" else s for s in ORDER}
TOY_ROWS = "fast, lowp, gone, ref, for_explicit, for_context, for_env, for_profile"


def resolve_with(sources: set[str], monkeypatch: pytest.MonkeyPatch) -> Resolution:
    """Resolve a ``toy`` call with exactly the given sources set.

    ``chain`` set means a call the chain's first row accepts (``ndim == 3``); without it
    the chain reaches the fallback row.
    """
    with ExitStack() as stack:
        if "context" in sources:
            stack.enter_context(op_backend(toy=ROW_FOR["context"]))
        if "env" in sources:
            monkeypatch.setenv("ASTR_OPS", f"toy={ROW_FOR['env']}")
        else:
            monkeypatch.delenv("ASTR_OPS", raising=False)
        if "profile" in sources:
            stack.enter_context(use_profile("toy-force"))
        explicit = ROW_FOR["explicit"] if "explicit" in sources else None
        return resolve("toy", ctx(3 if "chain" in sources else 2), explicit)


def toy_row(name: str) -> object:
    """The loaded ``toy`` row called ``name``."""
    row = current().families["toy"].row(name)
    assert row is not None
    return row


class TestPRECEDENCE:
    """The resolution order, stated once as data."""

    def test_order(self) -> None:
        """The sources are explicit, context, env, profile, chain, fallback, in that order."""
        assert tuple(s.origin for s in PRECEDENCE) == ORDER

    def test_strictness(self) -> None:
        """Only the explicit argument and the op_backend scope are strict."""
        assert {s.origin for s in PRECEDENCE if s.strict} == {"explicit", "context"}


class TestResolve:
    """``resolve``: which row serves a call, and which source decided."""

    # -- every source alone, and every pair ----------------------------------

    @pytest.mark.parametrize("source", ORDER)
    def test_each_source_alone(self, source: str, monkeypatch: pytest.MonkeyPatch) -> None:
        """A source set on its own decides, with its own origin."""
        res = resolve_with({source}, monkeypatch)
        assert (res.name, res.origin) == (ROW_FOR[source], ORIGIN_FOR[source])

    @pytest.mark.parametrize(
        ("higher", "lower"),
        list(itertools.combinations(ORDER, 2)),
        ids=[f"{h}>{lo}" for h, lo in itertools.combinations(ORDER, 2)],
    )
    def test_pair(self, higher: str, lower: str, monkeypatch: pytest.MonkeyPatch) -> None:
        """With two sources set, the higher one wins and is the origin."""
        res = resolve_with({higher, lower}, monkeypatch)
        assert (res.name, res.origin) == (ROW_FOR[higher], higher)

    def test_ladder(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Removing sources from the top, one at a time, hands the decision down the order."""
        got = [
            (res.name, res.origin)
            for i in range(len(ORDER))
            for res in [resolve_with(set(ORDER[i:]), monkeypatch)]
        ]
        assert got == [(ROW_FOR[s], ORIGIN_FOR[s]) for s in ORDER]

    def test_resolution_fields(self) -> None:
        """A resolution carries the row itself, its name and its object."""
        res = resolve("toy", ctx(3))
        assert res.record is toy_row("fast")
        assert (res.name, res.obj, res.origin) == ("fast", _impls.fast, "chain")

    # -- strict sources --------------------------------------------------------

    def test_error_explicit_unknown_name(self) -> None:
        """An explicit name that is no row is a ValueError listing the rows."""
        with pytest.raises(ValueError) as err:
            resolve("toy", ctx(3), "fsat")
        assert str(err.value) == (
            f"Unknown toy implementation: 'fsat' (did you mean 'fast'?); rows: {TOY_ROWS}"
        )

    def test_error_explicit_rejecting_row(self) -> None:
        """An explicit row whose spec rejects the call names the row and the failed clause."""
        with pytest.raises(ExplicitSelectionError) as err:
            resolve("toy", ctx(2), "fast")
        assert str(err.value) == (
            "toy implementation 'fast' selected by the explicit argument cannot serve this "
            "call: requires ndim == 3 (call has 2)"
        )
        assert (err.value.family, err.value.row) == ("toy", "fast")

    def test_error_explicit_unavailable_row(self) -> None:
        """An explicit row that cannot run here names the row and the probe's reason."""
        with pytest.raises(ExplicitSelectionError) as err:
            resolve("toy", ctx(3), "gone")
        assert str(err.value) == (
            "toy implementation 'gone' selected by the explicit argument cannot serve this "
            "call: unavailable (no widget on this machine)"
        )

    def test_error_context_rejecting_row(self) -> None:
        """A scoped row that rejects the call is an error, not a fall-through."""
        with op_backend(toy="fast"), pytest.raises(ExplicitSelectionError) as err:
            resolve("toy", ctx(2))
        assert str(err.value) == (
            "toy implementation 'fast' selected by an op_backend scope cannot serve this "
            "call: requires ndim == 3 (call has 2)"
        )

    def test_error_context_unavailable_row(self) -> None:
        """A scoped row that cannot run here is an error naming the reason."""
        with op_backend(toy="gone"), pytest.raises(ExplicitSelectionError) as err:
            resolve("toy", ctx(3))
        assert str(err.value) == (
            "toy implementation 'gone' selected by an op_backend scope cannot serve this "
            "call: unavailable (no widget on this machine)"
        )

    def test_error_context_name_gone_after_reload(
        self, write_yaml: Callable[[str, str], Path]
    ) -> None:
        """A scoped name whose row a later load removed is an unknown name: a ValueError."""
        without = TOY_TABLE.replace(
            "  - name: for_context\n    impl: tests._impls:for_context\n", ""
        )
        with op_backend(toy="for_context"):
            load_tables(write_yaml("without.yaml", without))
            with pytest.raises(ValueError) as err:
                resolve("toy", ctx(3))
        assert str(err.value) == (
            "Unknown toy implementation: 'for_context' (did you mean 'for_explicit'?); "
            "rows: fast, lowp, gone, ref, for_explicit, for_env, for_profile"
        )

    def test_explicit_beats_failing_context(self) -> None:
        """A usable explicit row wins even when the scoped row could not serve the call."""
        with op_backend(toy="gone"):
            res = resolve("toy", ctx(3), "for_explicit")
        assert (res.name, res.origin) == ("for_explicit", "explicit")

    # -- soft source -----------------------------------------------------------

    def test_env_unknown_name_warns_once(
        self, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        """An env entry naming no row warns once on the astrai logger and is ignored."""
        monkeypatch.setenv("ASTR_OPS", "toy=nope")
        with caplog.at_level(logging.WARNING, logger="astrai"):
            results = [resolve("toy", ctx(n)) for n in (3, 2, 3, 2)]
        assert [(r.name, r.origin) for r in results] == [
            ("fast", "chain"), ("ref", "chain"), ("fast", "chain"), ("ref", "chain")
        ]
        assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
            ("astrai", logging.WARNING,
             f"Unknown toy implementation: 'nope' from ASTR_OPS (toy=nope); ignored; "
             f"rows: {TOY_ROWS}")
        ]

    def test_env_rejecting_row_falls_through(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """An env row whose spec rejects the call falls through to the chain."""
        monkeypatch.setenv("ASTR_OPS", "toy=fast")
        res = resolve("toy", ctx(2))
        assert (res.name, res.origin) == ("ref", "chain")

    def test_env_unavailable_row_falls_through(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """An env row that cannot run here falls through to the chain."""
        monkeypatch.setenv("ASTR_OPS", "toy=gone")
        res = resolve("toy", ctx(3))
        assert (res.name, res.origin) == ("fast", "chain")

    def test_env_incapable_row_skips_profile_force(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """An env handle that cannot serve the call goes to the chain, not to the forced row."""
        monkeypatch.setenv("ASTR_OPS", "toy=gone")
        with use_profile("toy-force"):
            res = resolve("toy", ctx(3))
        assert (res.name, res.origin) == ("fast", "chain")

    def test_env_unknown_name_leaves_profile_force(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """An env entry that is ignored as unknown does not stop a profile from forcing."""
        monkeypatch.setenv("ASTR_OPS", "toy=nope")
        with use_profile("toy-force"):
            res = resolve("toy", ctx(3))
        assert (res.name, res.origin) == ("for_profile", "profile")

    # -- profiles ----------------------------------------------------------------

    def test_profile_force_from_env(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A forcing profile activated through ASTR_OPS decides with origin 'profile'."""
        monkeypatch.setenv("ASTR_OPS", "profile=toy-force")
        res = resolve("toy", ctx(3))
        assert (res.name, res.origin) == ("for_profile", "profile")

    def test_profile_force_rejecting_row_falls_through(self) -> None:
        """A forced row that cannot serve the call leaves the decision to the chain."""
        with use_profile("toy-force-fast"):
            rejected = resolve("toy", ctx(2))
            accepted = resolve("toy", ctx(3))
        assert (rejected.name, rejected.origin) == ("ref", "chain")
        assert (accepted.name, accepted.origin) == ("fast", "profile")

    @pytest.mark.parametrize("how", ["use_profile", "ASTR_OPS"])
    def test_reference_profile(self, how: str, monkeypatch: pytest.MonkeyPatch) -> None:
        """The shipped 'reference' profile routes every family to its fallback (origin profile)."""
        with ExitStack() as stack:
            if how == "use_profile":
                stack.enter_context(use_profile("reference"))
            else:
                monkeypatch.setenv("ASTR_OPS", "profile=reference")
            toy = resolve("toy", ctx(3))
            rotary = resolve("rotary", CallContext("rotary", dtype=torch.float32, ndim=4))
        assert (toy.name, toy.origin) == ("ref", "profile")
        assert rotary.origin == "profile"
        assert rotary.name == current().families["rotary"].fallback

    def test_reference_profile_yields_to_explicit(self) -> None:
        """A handle beats the reference profile's forcing."""
        with use_profile("reference"), op_backend(toy="fast"):
            res = resolve("toy", ctx(3))
        assert (res.name, res.origin) == ("fast", "context")

    def test_later_profile_force_wins(self) -> None:
        """Of two forcing profiles, the one applied last decides."""
        with use_profile("toy-force", "toy-force-fast"):
            last_fast = resolve("toy", ctx(3))
        with use_profile("toy-force-fast", "toy-force"):
            last_profile = resolve("toy", ctx(3))
        assert last_fast.name == "fast"
        assert last_profile.name == "for_profile"

    def test_profile_disable(self) -> None:
        """A row disabled by a profile is skipped by the chain."""
        with use_profile("toy-disable"):
            res = resolve("toy", ctx(3))
        assert (res.name, res.origin) == ("ref", "chain")

    def test_disabled_row_still_selectable_explicitly(self) -> None:
        """Disabling a row keeps it out of the chain, not out of explicit selection."""
        with use_profile("toy-disable"):
            res = resolve("toy", ctx(3), "fast")
        assert (res.name, res.origin) == ("fast", "explicit")

    # -- non-faithful rows -------------------------------------------------------

    def test_non_faithful_never_implicit(self) -> None:
        """The chain skips a non-faithful row even when it would match first."""
        res = resolve("toy", ctx(2))
        assert (res.name, res.origin) == ("ref", "chain")

    def test_non_faithful_explicit(self) -> None:
        """A non-faithful row is selectable by name with the explicit argument."""
        res = resolve("toy", ctx(2), "lowp")
        assert (res.name, res.origin) == ("lowp", "explicit")

    def test_non_faithful_context(self) -> None:
        """A non-faithful row is selectable by an op_backend scope."""
        with op_backend(toy="lowp"):
            res = resolve("toy", ctx(2))
        assert (res.name, res.origin) == ("lowp", "context")

    def test_non_faithful_by_object(self) -> None:
        """Passing a non-faithful row's object selects that row."""
        res = resolve("toy", ctx(2), _impls.lowp)
        assert res.record is toy_row("lowp")
        assert res.origin == "explicit"

    def test_non_faithful_enabled_by_profile(self) -> None:
        """A profile's ``enable`` lets the chain pick a non-faithful row, in table order."""
        with use_profile("toy-enable"):
            low = resolve("toy", ctx(2))
            first = resolve("toy", ctx(3))
        assert (low.name, low.origin) == ("lowp", "chain")
        assert (first.name, first.origin) == ("fast", "chain")

    # -- ad hoc objects ----------------------------------------------------------

    def test_adhoc_object_without_probe(self) -> None:
        """An object no table names, without ``supports_call``, serves any call."""
        res = resolve("toy", ctx(None), _impls.adhoc)
        assert (res.name, res.origin) == ("adhoc", "explicit")
        assert res.obj is _impls.adhoc

    def test_adhoc_object_probe_gets_raw_call(self) -> None:
        """``supports_call`` is called with the call's own positional and keyword arguments."""
        picky = _impls.Picky()
        call = ctx(3).evolve(raw=(1, "two"), raw_kwargs={"ok": True, "scale": 0.5})
        res = resolve("toy", call, picky)
        assert (res.name, res.origin, res.obj) == ("picky", "explicit", picky)
        assert picky.probes == [((1, "two"), {"ok": True, "scale": 0.5})]

    def test_error_adhoc_object_probe_refuses(self) -> None:
        """An ad hoc object whose ``supports_call`` refuses is a strict error naming it."""
        with pytest.raises(ExplicitSelectionError) as err:
            resolve("toy", ctx(3).evolve(raw_kwargs={"ok": False}), _impls.Picky())
        assert str(err.value) == (
            "toy implementation 'picky' selected by the explicit argument cannot serve this "
            "call: requires picky.supports_call(...)"
        )

    def test_adhoc_object_via_op_backend(self) -> None:
        """An ad hoc object in an op_backend scope decides with origin 'context'."""
        picky = _impls.Picky()
        with op_backend(toy=picky):
            res = resolve("toy", ctx(3).evolve(raw=(7,), raw_kwargs={"ok": True}))
            with pytest.raises(ExplicitSelectionError) as err:
                resolve("toy", ctx(3).evolve(raw=(8,), raw_kwargs={"ok": False}))
        assert (res.obj, res.origin) == (picky, "context")
        assert picky.probes == [((7,), {"ok": True}), ((8,), {"ok": False})]
        assert "selected by an op_backend scope" in str(err.value)

    def test_adhoc_plain_object_via_op_backend(self) -> None:
        """A plain ad hoc object in a scope serves any call."""
        with op_backend(toy=_impls.adhoc):
            res = resolve("toy", ctx(None))
        assert (res.name, res.obj, res.origin) == ("adhoc", _impls.adhoc, "context")

    def test_row_object_is_that_row(self) -> None:
        """A table row's own object passed explicitly is that row, with its spec."""
        res = resolve("toy", ctx(3), _impls.fast)
        assert res.record is toy_row("fast")
        with pytest.raises(ExplicitSelectionError) as err:
            resolve("toy", ctx(2), _impls.fast)
        assert str(err.value).endswith("requires ndim == 3 (call has 2)")
        assert err.value.row == "fast"

    def test_row_object_via_op_backend(self) -> None:
        """A table row's own object in an op_backend scope is that row."""
        with op_backend(toy=_impls.for_context):
            res = resolve("toy", ctx(2))
        assert (res.record, res.origin) == (toy_row("for_context"), "context")

    def test_adhoc_object_not_retained(self) -> None:
        """Resolving with a temporary ad hoc object does not keep it alive."""
        picky = _impls.Picky()
        ref = weakref.ref(picky)
        for _ in range(3):
            resolve("toy", ctx(3).evolve(raw_kwargs={"ok": True}), picky)
        del picky
        gc.collect()
        assert ref() is None

    # -- unknown family ----------------------------------------------------------

    def test_error_unknown_family(self) -> None:
        """An unknown family is a KeyError naming it and listing the known families."""
        with pytest.raises(KeyError) as err:
            resolve("toys", CallContext("toys", ndim=3))
        assert str(err.value) == (
            f"Unknown family: 'toys' (did you mean 'toy'?); known families: "
            f"{', '.join(list_families())}"
        )

    # -- concurrency ---------------------------------------------------------------

    def test_threads_have_independent_scopes(self) -> None:
        """Each thread's op_backend scope is its own; other threads and the caller see theirs."""
        barrier = threading.Barrier(3)
        seen: dict[str, set[tuple[str, str]]] = {}

        def worker(key: str, row: str | None) -> None:
            with op_backend(toy=row):
                barrier.wait(timeout=10)
                got = {(r.name, r.origin) for r in (resolve("toy", ctx(3)) for _ in range(200))}
                barrier.wait(timeout=10)
            seen[key] = got

        threads = [
            threading.Thread(target=worker, args=("a", "for_context")),
            threading.Thread(target=worker, args=("b", "for_env")),
            threading.Thread(target=worker, args=("c", None)),
        ]
        with op_backend(toy="lowp"):
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=30)
            mine = resolve("toy", ctx(3))
        assert seen == {
            "a": {("for_context", "context")},
            "b": {("for_env", "context")},
            "c": {("fast", "chain")},
        }
        assert (mine.name, mine.origin) == ("lowp", "context")

    def test_set_override_in_thread_does_not_leak(self) -> None:
        """``set_override`` in a thread leaves the caller's context untouched."""
        done = threading.Event()

        def worker() -> None:
            set_override("toy", "for_env")
            done.set()

        t = threading.Thread(target=worker)
        t.start()
        t.join(timeout=10)
        assert done.is_set()
        assert resolve("toy", ctx(3)).name == "fast"

    def test_asyncio_tasks_have_independent_scopes(self) -> None:
        """Concurrent asyncio tasks with different op_backend scopes each see their own."""

        async def task(row: str | None) -> set[tuple[str, str]]:
            got: set[tuple[str, str]] = set()
            with op_backend(toy=row):
                for _ in range(20):
                    await asyncio.sleep(0)
                    res = resolve("toy", ctx(3))
                    got.add((res.name, res.origin))
            return got

        async def main() -> list[set[tuple[str, str]]]:
            return list(await asyncio.gather(task("for_context"), task("lowp"), task(None)))

        assert asyncio.run(main()) == [
            {("for_context", "context")}, {("lowp", "context")}, {("fast", "chain")}
        ]

    def test_asyncio_tasks_have_independent_profiles(self) -> None:
        """Concurrent tasks with different use_profile scopes each see their own."""

        async def task(profile: str | None) -> set[str]:
            got: set[str] = set()
            with ExitStack() as stack:
                if profile:
                    stack.enter_context(use_profile(profile))
                for _ in range(20):
                    await asyncio.sleep(0)
                    got.add(resolve("toy", ctx(3)).name)
            return got

        async def main() -> list[set[str]]:
            return list(await asyncio.gather(task("toy-force"), task("toy-disable"), task(None)))

        assert asyncio.run(main()) == [{"for_profile"}, {"ref"}, {"fast"}]

    # -- the decision cache ----------------------------------------------------------

    def test_cache_follows_op_backend(self) -> None:
        """A cached decision does not outlive an op_backend scope, nor precede one."""
        before = [resolve("toy", ctx(3)).name for _ in range(2)]
        with op_backend(toy="for_context"):
            inside = [resolve("toy", ctx(3)).name for _ in range(2)]
            with op_backend(toy=None):
                cleared = [resolve("toy", ctx(3)).name for _ in range(2)]
        after = [resolve("toy", ctx(3)).name for _ in range(2)]
        assert (before, inside, cleared, after) == (
            ["fast"] * 2, ["for_context"] * 2, ["fast"] * 2, ["fast"] * 2
        )

    def test_cache_follows_set_override(self) -> None:
        """Decisions follow ``set_override`` and ``reset_override``."""
        assert resolve("toy", ctx(3)).name == "fast"
        token = set_override("toy", "for_context")
        try:
            assert resolve("toy", ctx(3)).name == "for_context"
        finally:
            reset_override(token)
        assert resolve("toy", ctx(3)).name == "fast"

    def test_cache_follows_adhoc_objects(self) -> None:
        """Different ad hoc objects in the same scope shape are told apart."""
        with op_backend(toy=_impls.adhoc):
            a = resolve("toy", ctx(3))
        with op_backend(toy=_impls.Picky("other")):
            b = resolve("toy", ctx(3).evolve(raw_kwargs={"ok": True}))
        with op_backend(toy=_impls.adhoc):
            c = resolve("toy", ctx(3))
        assert (a.name, b.name, c.name) == ("adhoc", "other", "adhoc")

    def test_cache_follows_raw_call_for_probed_objects(self) -> None:
        """Calls that differ only in their raw arguments are re-probed, not served from cache."""
        picky = _impls.Picky()
        with op_backend(toy=picky):
            assert resolve("toy", ctx(3).evolve(raw_kwargs={"ok": True})).obj is picky
            with pytest.raises(ExplicitSelectionError):
                resolve("toy", ctx(3).evolve(raw_kwargs={"ok": False}))
            assert resolve("toy", ctx(3).evolve(raw_kwargs={"ok": True})).obj is picky

    def test_cache_follows_env(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A changed ASTR_OPS value takes effect on the next call."""
        got = []
        for value in ("", "toy=for_env", "toy=for_explicit", "", "toy=for_env"):
            monkeypatch.setenv("ASTR_OPS", value)
            got += [resolve("toy", ctx(3)).name for _ in range(2)]
        monkeypatch.delenv("ASTR_OPS")
        got.append(resolve("toy", ctx(3)).name)
        assert got == ["fast", "fast", "for_env", "for_env", "for_explicit", "for_explicit",
                       "fast", "fast", "for_env", "for_env", "fast"]

    def test_cache_follows_env_profile(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A profile switched on and off through ASTR_OPS is honoured at once."""
        first = [resolve("toy", ctx(3)).name for _ in range(2)]
        monkeypatch.setenv("ASTR_OPS", "profile=toy-force")
        forced = [resolve("toy", ctx(3)).name for _ in range(2)]
        monkeypatch.setenv("ASTR_OPS", "profile=toy-disable")
        disabled = [resolve("toy", ctx(3)).name for _ in range(2)]
        monkeypatch.delenv("ASTR_OPS")
        assert (first, forced, disabled, resolve("toy", ctx(3)).name) == (
            ["fast"] * 2, ["for_profile"] * 2, ["ref"] * 2, "fast"
        )

    def test_cache_follows_legacy_alias(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A changed legacy alias value takes effect on the next call."""
        register_env_alias("toy", "ASTR_TEST_TOY")
        assert resolve("toy", ctx(3)).name == "fast"
        monkeypatch.setenv("ASTR_TEST_TOY", "for_env")
        assert resolve("toy", ctx(3)).name == "for_env"
        monkeypatch.setenv("ASTR_TEST_TOY", "for_context")
        assert resolve("toy", ctx(3)).name == "for_context"

    def test_cache_follows_use_profile(self) -> None:
        """Decisions made inside a use_profile scope do not leak out of it."""
        outside = resolve("toy", ctx(3)).name
        with use_profile("toy-disable"):
            inside = [resolve("toy", ctx(3)).name for _ in range(2)]
        assert (outside, inside, resolve("toy", ctx(3)).name) == ("fast", ["ref", "ref"], "fast")

    def test_cache_follows_load_tables(self, write_yaml: Callable[[str, str], Path]) -> None:
        """Loading a reordered table changes the next decision."""
        assert [resolve("toy", ctx(3)).name for _ in range(2)] == ["fast", "fast"]
        moved = TOY_TABLE.replace(
            "rows:\n", "rows:\n  - name: first\n    impl: tests._impls:medium\n"
        )
        load_tables(write_yaml("moved.yaml", moved))
        assert resolve("toy", ctx(3)).name == "first"

    def test_cache_follows_reload_tables(
        self, write_yaml: Callable[[str, str], Path], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """``reload_tables`` replaces the decisions made under the old tables."""
        assert resolve("toy", ctx(3)).name == "fast"
        moved = TOY_TABLE.replace("when: ndim == 3", "when: ndim == 4")
        monkeypatch.setenv("ASTR_TABLES", str(write_yaml("env/toy.yaml", moved)))
        reload_tables()
        assert resolve("toy", ctx(3)).name == "ref"

    def test_cache_follows_refresh(self, write_yaml: Callable[[str, str], Path]) -> None:
        """After ``refresh()`` a row whose probe now fails is no longer chosen."""
        probed = TOY_TABLE.replace(
            "rows:\n",
            "rows:\n  - name: probed\n    impl: tests._impls:medium\n"
            "    available: tests._impls:counted_probe\n",
        )
        load_tables(write_yaml("probed.yaml", probed))
        assert [resolve("toy", ctx(3)).name for _ in range(2)] == ["probed", "probed"]
        _impls.PROBE["available"] = False
        assert resolve("toy", ctx(3)).name == "probed"  # probes are cached until refresh()
        refresh()
        assert resolve("toy", ctx(3)).name == "fast"


class TestResolvePlan:
    """``resolve_plan``: several families in one snapshot."""

    def test_plan(self) -> None:
        """Each family in the plan is resolved as ``resolve`` would."""
        attention = CallContext("attention", dtype=torch.float32, ndim=4)
        plan = resolve_plan({"toy": ctx(3), "attention": attention})
        assert list(plan) == ["toy", "attention"]
        for family, c in (("toy", ctx(3)), ("attention", attention)):
            single = resolve(family, c)
            assert (plan[family].record, plan[family].origin) == (single.record, single.origin)
        assert (plan["toy"].name, plan["toy"].origin) == ("fast", "chain")

    def test_plan_explicit(self) -> None:
        """Explicit handles are given per family."""
        plan = resolve_plan({"toy": ctx(3)}, {"toy": "for_explicit"})
        assert (plan["toy"].name, plan["toy"].origin) == ("for_explicit", "explicit")

    def test_plan_follows_scopes(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """The plan honours scopes, the environment and profiles like ``resolve``."""
        monkeypatch.setenv("ASTR_OPS", "toy=for_env")
        with op_backend(toy="for_context"):
            scoped = resolve_plan({"toy": ctx(3)})["toy"]
        from_env = resolve_plan({"toy": ctx(3)})["toy"]
        assert (scoped.origin, from_env.origin) == ("context", "env")

    def test_error_plan_unknown_family(self) -> None:
        """An unknown family in the plan is a KeyError naming it."""
        with pytest.raises(KeyError) as err:
            resolve_plan({"toy": ctx(3), "nofamily": CallContext("nofamily")})
        assert "Unknown family: 'nofamily'" in str(err.value)

    def test_error_plan_family_mismatch(self) -> None:
        """A context filed under another family's name is refused, not resolved."""
        with pytest.raises(ValueError, match="the context under 'attention' is for 'toy'"):
            resolve_plan({"attention": ctx(3)})

    def test_error_plan_strict_failure(self) -> None:
        """A strict failure for one family raises for the whole plan."""
        with pytest.raises(ExplicitSelectionError):
            resolve_plan({"toy": ctx(3)}, {"toy": "gone"})
