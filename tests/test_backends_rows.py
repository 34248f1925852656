"""The shipped rows are plain callables: eligibility is the table's ``when`` alone (contract §9).

An implementation object's own ``supports_call`` is for ad hoc objects passed explicitly;
no shipped row has one, so passing a shipped row object as ``backend=`` is decided once
per call signature and then served from the decision cache like a row name.
"""

from __future__ import annotations

import pytest
import torch

from astrai import dispatch, ops
from astrai.backends.attention.sdpa import sdpa_attention
from astrai.backends.linear import torch_linear
from astrai.backends.rms_norm import torch_rms_norm
from astrai.backends.rotary import complex_rotary, rotary_freqs
from astrai.dispatch import resolution
from tests.conftest import spy

FAMILIES = ("attention", "linear", "rms_norm", "rotary")


class TestShippedRows:
    @pytest.mark.parametrize("family", FAMILIES)
    def test_plain_callables_without_supports_call(self, family: str) -> None:
        """Every shipped row is callable and leaves eligibility to its ``when``."""
        rows = dispatch.current().family(family).rows
        assert rows
        for rec in rows:
            assert callable(rec.obj), (family, rec.name)
            assert not hasattr(rec.obj, "supports_call"), (family, rec.name)


def _count_evaluations(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The families ``resolution.evaluate`` is called for from now on (decision cache cleared)."""
    dispatch.refresh()  # drops the decisions earlier tests cached
    return spy(monkeypatch, resolution, "evaluate")


CALLS = {
    "attention": (sdpa_attention, lambda b: ops.attention(
        torch.randn(1, 1, 4, 8), torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8), backend=b)),
    "linear": (torch_linear, lambda b: ops.linear(torch.randn(2, 8), torch.randn(3, 8),
                                                  backend=b)),
    "rms_norm": (torch_rms_norm, lambda b: ops.rms_norm(torch.randn(2, 8), torch.ones(8),
                                                        backend=b)),
    "rotary": (complex_rotary, lambda b: ops.apply_rotary(torch.randn(1, 3, 2, 8),
                                                          rotary_freqs(3, 8), backend=b)),
}


class TestShippedRowObjectAsBackend:
    def test_attention_torch_native_object_five_calls_one_evaluation(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """``backend=`` the torch_native row's function, five times: evaluated once, then cached."""
        seen = _count_evaluations(monkeypatch)
        dispatch.reset_stats()
        obj, call = CALLS["attention"]
        for _ in range(5):
            call(obj)
        assert seen == ["attention"]
        got = dispatch.stats()
        assert (got.cache_misses, got.cache_hits) == (1, 4)
        assert got.served("attention", "torch_native", "explicit") == 5

    @pytest.mark.parametrize("family", list(CALLS))
    def test_each_family_caches_its_row_object(
        self, family: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The same holds for a shipped row object of every family."""
        seen = _count_evaluations(monkeypatch)
        obj, call = CALLS[family]
        outs = [call(obj) for _ in range(5)]
        assert seen == [family]
        assert all(o.shape == outs[0].shape for o in outs)
