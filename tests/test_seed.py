"""Seed fidelity (contract §2-§3): code written against the seed's ``dispatch.py`` runs unchanged
on astrai and gets the same rows and origins.

The seed itself is the oracle: the same family is registered, the seed's way, in both, and
every call of a grid is resolved by both under every kind of selection.
"""

from __future__ import annotations

import importlib
import itertools
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import astrai.dispatch as astrai_dispatch
from tests import _impls

SEED_DIR = Path(__file__).resolve().parents[2] / "shared" / "seed"


@pytest.fixture(scope="module")
def seed() -> Iterator[ModuleType]:
    """The seed's ``dispatch.py``, imported from ``../shared/seed`` (skip where absent)."""
    if not (SEED_DIR / "seed_dispatch.py").is_file():
        pytest.skip(f"the seed is not at {SEED_DIR} (an sdist unpacked elsewhere)")
    sys.path.insert(0, str(SEED_DIR))
    try:
        yield importlib.import_module("seed_dispatch")
    finally:
        sys.path.remove(str(SEED_DIR))


def _unavailable() -> bool:
    return False


def register(d: Any, family: str = "seedfam") -> None:
    """Register one family the seed's way: priorities, a callable fallback, Spec
    constructors; ``d`` is either module (the seed's or astrai's)."""
    spec = d.Spec

    def provider() -> list[Any]:
        return [
            # listed out of order on purpose: the seed sorts ascending by priority
            d.ImplRecord(family, "generic", _impls.medium,
                         spec.dtype_in(torch.float16, torch.float32, torch.bfloat16), priority=50),
            d.ImplRecord(family, "paged", _impls.fast,
                         spec.fwd_in("prefill", "decode") & spec.has_cache() & spec.ndim(3),
                         priority=10),
            d.ImplRecord(family, "half", _impls.slow,
                         spec.dtype_in(torch.float16, torch.bfloat16) & spec.mask_free(),
                         priority=20),
            d.ImplRecord(family, "accel", _impls.fast, spec.cuda_device(), available=_unavailable,
                         priority=5),
            d.ImplRecord(family, "lowp", _impls.lowp, spec.inference(), priority=1,
                         faithful=False),
            d.ImplRecord(family, "train", _impls.medium, spec.training() & spec.ndim(4)
                         & ~spec.no_grad(), priority=50),
        ]

    reference = d.ImplRecord(family, "reference", _impls.ref, spec.always(), priority=1000)
    d.register_family(family, provider, lambda: reference)


CONTEXTS = [
    dict(fwd=fwd, dtype=dtype, ndim=ndim, has_cache=cache, has_mask=mask, grad_enabled=grad)
    for fwd, dtype, ndim, cache, mask, grad in itertools.product(
        (None, "prefill", "decode"), (torch.float16, torch.float32, torch.int64), (3, 4),
        (False, True), (False, True), (True, False))
]
HANDLES = ("generic", "paged", "half", "accel", "lowp", "train", "reference", "nosuchrow")


def outcome(d: Any, call: dict[str, Any], explicit: Any = None) -> tuple[str, ...]:
    """``(row, origin)`` or the error type's name."""
    try:
        res = d.resolve("seedfam", d.CallContext("seedfam", **call), explicit)
    except (ValueError, RuntimeError) as exc:
        kind = ("ExplicitSelectionError" if isinstance(exc, (astrai_dispatch.ExplicitSelectionError,
                                                             _seed_error()))
                else type(exc).__name__)
        return (kind,)
    return (res.record.name, res.origin)


_SEED: list[Any] = []


def _seed_error() -> type:
    return _SEED[0].ExplicitSelectionError if _SEED else RuntimeError


@contextmanager
def both_registered(seed: ModuleType) -> Iterator[None]:
    _SEED[:] = [seed]
    register(seed)
    register(astrai_dispatch)
    yield


class TestSeedDifferential:
    """The seed and astrai answer alike, call by call."""

    def test_chain_and_fallback(self, seed: ModuleType) -> None:
        """With no selection: the same row and origin for every call of the grid."""
        with both_registered(seed):
            for call in CONTEXTS:
                assert outcome(astrai_dispatch, call) == outcome(seed, call), call

    @pytest.mark.parametrize("handle", HANDLES)
    def test_explicit(self, seed: ModuleType, handle: str) -> None:
        """An explicit row name: the same row, origin, or kind of error."""
        with both_registered(seed):
            for call in CONTEXTS:
                assert outcome(astrai_dispatch, call, handle) == outcome(seed, call, handle), call

    @pytest.mark.parametrize("handle", HANDLES[:-1])
    def test_context(self, seed: ModuleType, handle: str) -> None:
        """An ``op_backend`` scope: the same row, origin, or kind of error."""
        with both_registered(seed):
            for call in CONTEXTS:
                got = []
                for d in (seed, astrai_dispatch):
                    try:
                        with d.op_backend(seedfam=handle):
                            got.append(outcome(d, call))
                    except ValueError:  # refused on entering the scope
                        got.append(("ValueError on entry",))
                assert got[1] == got[0], call

    def test_context_unknown_name(self, seed: ModuleType) -> None:
        """Both refuse an unknown row name on entering the scope."""
        with both_registered(seed):
            for d in (seed, astrai_dispatch):
                with pytest.raises(ValueError), d.op_backend(seedfam="nosuchrow"):
                    pass

    @pytest.mark.parametrize("value", [*(f"seedfam={h}" for h in HANDLES), "profile=reference",
                                       "seedfam=half,profile=reference"])
    def test_env(self, seed: ModuleType, value: str, monkeypatch: pytest.MonkeyPatch,
                 caplog: pytest.LogCaptureFixture) -> None:
        """``ASTR_OPS``: the same row and origin (a soft choice never raises)."""
        monkeypatch.setenv("ASTR_OPS", value)
        with both_registered(seed), caplog.at_level(logging.CRITICAL):
            for call in CONTEXTS:
                assert outcome(astrai_dispatch, call) == outcome(seed, call), call

    def test_env_helpers(self, seed: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
        """``env_overrides()`` and ``env_selection()`` parse ``ASTR_OPS`` as the seed does."""
        monkeypatch.setenv("ASTR_OPS", "seedfam=half, profile=reference")
        with both_registered(seed):
            assert astrai_dispatch.env_overrides() == seed.env_overrides() == {
                "seedfam": "half", "profile": "reference"}
            assert astrai_dispatch.env_selection("seedfam") == seed.env_selection("seedfam")
            assert astrai_dispatch.env_selection("rotary") is seed.env_selection("rotary") is None

    def test_resolve_plan(self, seed: ModuleType) -> None:
        """``resolve_plan`` gives each family the row and origin ``resolve`` gives."""
        with both_registered(seed):
            for call in CONTEXTS[:12]:
                ours = astrai_dispatch.resolve_plan(
                    {"seedfam": astrai_dispatch.CallContext("seedfam", **call)})["seedfam"]
                theirs = seed.resolve_plan({"seedfam": seed.CallContext("seedfam", **call)})
                assert (ours.record.name, ours.origin) == (theirs["seedfam"].record.name,
                                                           theirs["seedfam"].origin)


    def test_legacy_alias_value_in_any_case(self, seed: ModuleType,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
        """A legacy alias variable's value is lower-cased, as the seed reads it:
        ``SEEDFAM_BACKEND=GENERIC`` selects ``generic`` in both."""
        with both_registered(seed):
            for d in (seed, astrai_dispatch):
                d.register_env_alias("seedfam", "SEEDFAM_BACKEND")
            monkeypatch.setenv("SEEDFAM_BACKEND", "  GENERIC ")
            astrai_dispatch.refresh()
            for call in CONTEXTS[:12]:
                assert outcome(astrai_dispatch, call) == outcome(seed, call), call
            assert outcome(astrai_dispatch, CONTEXTS[0])[1] == "env"

    def test_ad_hoc_object_with_only_supports_call(self, seed: ModuleType) -> None:
        """An explicit handle that has ``supports_call`` but no ``__call__`` is an ad hoc
        row in both, decided by its probe."""

        class Probe:
            def supports_call(self, *args: Any, **kwargs: Any) -> bool:
                return True

        handle = Probe()
        with both_registered(seed):
            for call in CONTEXTS[:6]:
                got = outcome(astrai_dispatch, call, handle)
                assert got[1] == outcome(seed, call, handle)[1] == "explicit", call
                ours = astrai_dispatch.resolve(
                    "seedfam", astrai_dispatch.CallContext("seedfam", **call), handle)
                assert ours.record.obj is handle


    @pytest.mark.parametrize("handle", [object(), 42, ("a", "tuple")],
                             ids=["object", "int", "tuple"])
    def test_ad_hoc_object_with_neither_call_nor_probe(self, seed: ModuleType,
                                                       handle: Any) -> None:
        """An explicit or scoped handle that has neither ``__call__`` nor ``supports_call``
        is an ad hoc row that matches every call, in both: the same name and origin, the
        object itself as the row's implementation."""
        with both_registered(seed):
            for call in CONTEXTS[:6]:
                mine = outcome(astrai_dispatch, call, handle)
                assert mine == outcome(seed, call, handle) == (type(handle).__name__,
                                                               "explicit"), call
                for d in (seed, astrai_dispatch):
                    with d.op_backend(seedfam=handle):
                        res = d.resolve("seedfam", d.CallContext("seedfam", **call))
                    assert (res.record.obj, res.origin) == (handle, "context")


class TestSeedShapes:
    """The seed's API shapes, without the oracle."""

    def test_priority_default_and_order(self) -> None:
        """``priority`` defaults to 100 and a lower number is tried first."""
        assert astrai_dispatch.ImplRecord("f", "a", _impls.fast).priority == 100
        register(astrai_dispatch)
        names = astrai_dispatch.current().families["seedfam"].row_names()
        assert names == ["lowp", "accel", "paged", "half", "generic", "train"]

    def test_fallback_row_matched_by_chain_is_chain(self) -> None:
        """A fallback row the chain reaches reports ``chain`` (the seed's origin)."""
        astrai_dispatch.register_family(
            "seedfam", lambda: [astrai_dispatch.ImplRecord("seedfam", "ref", _impls.ref)],
            lambda: astrai_dispatch.ImplRecord("seedfam", "ref", _impls.ref))
        res = astrai_dispatch.resolve("seedfam", astrai_dispatch.CallContext("seedfam"))
        assert (res.name, res.origin) == ("ref", "chain")
