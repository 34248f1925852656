"""What ``dispatch_model``'s report and ``stats()`` say is what happened: quantised layers
listed and counted, a share with nothing to count never shown as whole, the recognition
probes leaving no trace, calls a row handed back to torch counted apart from those its
rows computed, and tables that stay aligned and grammatical."""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import astrai.dispatch as d
from astrai.dispatch.stats import UsageStats, count_handoff, mark, since
from astrai.integrations.transformers import dispatch_model
from astrai.integrations.transformers.report import DispatchReport, Routed
from tests import _zoo
from tests.conftest import cpu_of


def _quantised(name: str = "llama") -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation
        return torch.ao.quantization.quantize_dynamic(_zoo.build(name), {nn.Linear},
                                                      dtype=torch.qint8)


class TestWeightsNotServed:
    def test_a_quantised_model_counts_its_packed_linears_and_lists_them(self) -> None:
        model = _quantised()
        quantised = [p for p, m in model.named_modules()
                     if type(m).__module__.startswith("torch.ao.nn.quantized.dynamic")]
        assert len(quantised) == 15
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = dispatch_model(model)
        got, total = report.matmul_flops
        assert got == 0 and total == sum(2 * m.in_features * m.out_features
                                         for m in model.modules()
                                         if type(m).__name__ == "Linear"
                                         and type(m).__module__.startswith("torch.ao"))
        assert report.shares()["matmul_flops"] == 0.0
        listed = {n.path: n for n in report.not_routed}
        assert set(quantised) <= set(listed)
        for path in quantised:
            assert listed[path].family == "quantised"
            assert "no astrai row computes on packed int8 weights" in listed[path].reason
        assert not any(p.endswith("_packed_params") for p in listed)  # the holders aside
        # their packed weights count among the parameters, none routed
        assert report.parameters[1] > sum(p.numel() for p in model.parameters())
        text = str(report)
        assert "0.0% of the weight matmul FLOPs" in text and "100.0%" not in text

    def test_a_cnn_has_no_weight_matmuls_to_count(self) -> None:
        cnn = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3))
        report = dispatch_model(cnn)
        assert report.matmul_flops == (0, 0)
        assert report.shares() == {"parameters": 0.0, "matmul_flops": None}
        text = str(report)
        assert "no weight matmuls to count" in text and "100.0%" not in text
        assert [n.path for n in report.not_routed] == ["0", "2"]

    def test_a_model_without_parameters_has_none_to_count(self) -> None:
        report = dispatch_model(nn.Sequential(nn.ReLU()))
        assert report.shares() == {"parameters": None, "matmul_flops": None}
        assert "no weight matmuls to count, no parameters to count" in str(report)


class TestProbesLeaveNoTrace:
    @pytest.mark.skipif(not _zoo.available("qwen2_moe"), reason="no qwen2_moe here")
    def test_dispatch_model_adds_nothing_to_stats_or_a_recording(self) -> None:
        model = _zoo.build("qwen2_moe")
        d.stats(reset=True)
        with d.record() as recording:
            report = dispatch_model(model)
        # its probes ran (transformers 4's Qwen2-MoE routes its experts' linears alone)
        family = "moe_router" if report.counts().get("moe_router") else "linear"
        assert report.counts()[family] > 0
        after = d.stats()
        assert after.calls == {} and after.handed == {}
        assert (after.cache_hits, after.cache_misses) == (0, 0)
        assert len(recording) == 0
        assert report.calls() == {}
        assert "calls since the dispatch: none yet" in str(report)
        # the model's own calls are counted and recorded as always
        with d.record() as recording, torch.no_grad():
            model(**_zoo.inputs(model))
        served = d.stats().served(family)
        assert served > 0 and len(recording) > 0
        assert report.calls()[family].rows == served

    def test_calls_made_outside_the_probes_are_kept(self) -> None:
        from astrai import ops
        from astrai.dispatch.stats import unobserved

        d.stats(reset=True)
        x, w = torch.randn(2, 4), torch.ones(4)
        ops.rms_norm(x, w)
        with d.record() as recording:
            with unobserved():
                ops.rms_norm(x, w)
                ops.rms_norm(x, w)
            ops.rms_norm(x, w)
        assert d.stats().served("rms_norm") == 2
        assert [c.count for c in recording.calls] == [1]


@pytest.fixture
def _transposed_row() -> Iterator[None]:
    """The ``transposed`` linear row available whatever the CPU (it asks for an Intel
    one, and a weight declared frozen in the process), so that a test can pin it: it
    hands a DTensor call to ``F.linear``."""
    from astrai.backends import frozen
    from astrai.backends import linear as rows

    held = torch.ones(1)
    frozen.freeze([held])
    try:
        with cpu_of("intel"):
            yield
    finally:
        frozen.thaw([held])
        rows.release_weight_copies()


class TestHandedCallsCountedApart:
    @pytest.mark.usefixtures("_transposed_row")
    def test_dtensor_calls_are_handed_to_torch_and_said_so(self, one_rank: object) -> None:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        report = dispatch_model(model)
        parallelize_module(model, one_rank,  # type: ignore[arg-type]
                           {"0": ColwiseParallel(), "2": RowwiseParallel()})
        d.stats(reset=True)
        with torch.no_grad(), d.op_backend(linear="transposed"):
            model(torch.randn(6, 8))
        got = d.stats()
        assert got.served("linear") == 2  # the row was chosen for both
        assert got.handed_off("linear") == 2 and got.computed("linear") == 0
        assert got.computed("activation") == 1
        calls = report.calls()
        assert calls["linear"].rows == 0 and calls["linear"].handed_total == 2
        assert {(r, to) for r, to, _ in calls["linear"].handed} == {("transposed", "F.linear")}
        assert got.reasons == {("linear", "transposed", "F.linear",
                                "a tensor subclass (DTensor)"): 2}
        assert calls["activation"].rows == 1 and not calls["activation"].handed
        text = str(report)
        # the weights are routed (the share says so), the calls were not computed by rows
        assert "weights routed to astrai: 100.0% of the weight matmul FLOPs" in text
        assert "routed, not served" in text
        assert re.search(r"linear +0 computed by astrai's rows, 2 handed to torch "
                         r"\(2 to F\.linear by row transposed", text), text
        assert "linear: 0 computed by astrai's rows, 2 handed to torch" in got.table()
        assert report.as_dict()["calls"]["linear"]["handed"][0]["calls"] == 2

    def test_a_reason_given_is_kept_beside_the_count(self) -> None:
        d.stats(reset=True)
        count_handoff("linear", "onednn", "F.linear", "a DTensor")
        count_handoff("linear", "onednn", "F.linear", "a DTensor")
        count_handoff("linear", "onednn", "F.linear")
        got = d.stats()
        assert got.handed == {("linear", "onednn", "F.linear"): 3}
        assert got.reasons == {("linear", "onednn", "F.linear", "a DTensor"): 2}
        assert got.families()["linear"].handed == {("onednn", "F.linear", "a DTensor"): 2,
                                                  ("onednn", "F.linear", ""): 1}
        table = got.table()
        assert "2  of them handed to F.linear: a DTensor" in table
        assert "1  of them handed to F.linear\n" in table
        assert not d.stats(reset=True).calls and not d.stats().reasons

    def test_calls_since_a_mark_ignore_resets(self) -> None:
        from astrai import ops

        x, w = torch.randn(2, 4), torch.ones(4)
        ops.rms_norm(x, w)
        then = mark()
        ops.rms_norm(x, w)
        d.stats(reset=True)
        ops.rms_norm(x, w)
        assert since(then).served("rms_norm") == 2
        assert d.stats().served("rms_norm") == 1


class TestLayout:
    def test_long_family_names_stay_aligned_in_the_stats_table(self) -> None:
        got = UsageStats({("linear_cross_entropy", "chunked", "chain"): 1,
                          ("rms_norm", "a_row_with_a_long_name", "chain"): 12,
                          ("gated_activation", "torch", "explicit"): 3})
        rows = got.table().splitlines()[:4]
        columns = set()
        for line in rows:
            m = re.match(r"^\S+ +(\S+) +(\S+)", line)
            assert m is not None, line
            columns.add((m.start(1), m.end(2)))  # where the row starts, the count ends
        assert len(columns) == 1, rows

    def test_long_family_names_stay_aligned_in_the_report(self) -> None:
        report = dispatch_model(nn.Sequential(nn.Linear(4, 4), nn.SiLU()))
        lines = [line for line in str(report).splitlines()
                 if re.match(r"^  \S+ +\d+ (module|call site)s? routed$", line)]
        assert any(line.split()[0] == "gated_activation" for line in lines)
        ends = {len(re.match(r"^  \S+ +\d+", line).group(0))  # type: ignore[union-attr]
                for line in lines}
        assert len(ends) == 1, lines

    def test_one_is_singular(self) -> None:
        report = DispatchReport("M", (Routed("attention", "a", "A"), Routed("linear", "l", "L"),
                                      Routed("linear", "m", "L")), (), 1,
                                frozenset({"attention", "linear", "rms_norm"}),
                                order=("attention", "linear", "rms_norm"),
                                nouns={"attention": "call sites"})
        text = str(report)
        assert "1 call site routed" in text and "2 modules routed" in text
        assert "0 modules routed" in text and "1 modules" not in text
        assert "(1 module changed)" in text
