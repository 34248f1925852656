"""The ``transposed`` linear row: one product with a kept ``[in, out]`` copy of the weight."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import astrai.dispatch as dispatch
from astrai import ops
from astrai.backends import linear as rows
from astrai.backends.frozen import freeze, thaw

ENABLE = """version: 1
profile: transposed-on
description: the transposed row in the implicit chain (a tuned profile enables it where it wins)
families:
  linear:
    enable: [transposed]
"""


@pytest.fixture(autouse=True)
def _fresh(tmp_path: Path) -> Iterator[None]:
    """The row on any machine: it is explicit-only, so a profile enables it (as tuning
    does where it wins); its availability asks for a weight declared frozen in the
    process, so the tests declare one. The machine is taken for an Intel CPU with
    AVX-512 (where no other CPU row takes these calls)."""
    rows.release_weight_copies()
    held = torch.ones(1)
    freeze([held])
    path = tmp_path / "transposed-on.yaml"
    path.write_text(ENABLE)
    with dispatch.assume_machine(cpu_vendor="intel", cpu_isa="avx512"):
        dispatch.load_tables(path)
        try:
            with dispatch.use_profile("transposed-on"):
                yield
        finally:
            thaw([held])
            dispatch.reload_tables()
            rows.set_weight_copy_budget(1 << 30)
            rows.release_weight_copies()


def _w(out_f: int = 24, in_f: int = 16, seed: int = 0) -> torch.Tensor:
    """A weight declared frozen (as ``dispatch_model(model, mode="inference")`` declares a
    model's parameters): the row keeps a copy of such a weight only."""
    w = torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed))
    freeze([w])
    return w


def test_it_is_available_wherever_a_weight_is_declared_frozen() -> None:
    assert rows.transposed_available() is True
    assert rows.transposed_one_row_available() is True
    with dispatch.assume_machine(cpu_vendor="amd"):
        assert rows.transposed_available() is True  # where it wins is the table's to say


def test_it_is_explicit_only_in_the_shipped_table() -> None:
    dispatch.reload_tables()  # the fixture's profile is gone: the shipped table alone
    text = dispatch.explain("linear", dispatch.CallContext(
        family="linear", dtype=torch.float32, tokens=8, ndim=2, grad_enabled=False,
        device="cpu"))
    line = next(t for t in text.splitlines() if t.strip().startswith("transposed:"))
    assert "SKIP explicit-only" in line


@pytest.mark.parametrize("shape", [(16,), (5, 16), (2, 7, 16), (3, 2, 4, 16)])
@pytest.mark.parametrize("bias", [False, True])
def test_it_computes_f_linear(shape: tuple[int, ...], bias: bool) -> None:
    _computes_f_linear(rows.transposed_linear, shape, bias, 1e-6)


def _computes_f_linear(row: Callable[..., torch.Tensor], shape: tuple[int, ...], bias: bool,
                       tolerance: float) -> None:
    """``row`` on an input of ``shape`` and a ``[24, 16]`` weight equals ``F.linear``."""
    w, b = _w(), (torch.randn(24) if bias else None)
    x = torch.randn(*shape)
    with torch.no_grad():
        got = row(x, w, b)
    assert got.shape == (*shape[:-1], 24)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=tolerance, atol=tolerance)


def test_a_strided_input_is_served() -> None:
    w = _w()
    x = torch.randn(16, 9)[:, ::2].t()  # [5, 16], not contiguous
    with torch.no_grad():
        torch.testing.assert_close(ops.linear(x, w, backend="transposed"), F.linear(x, w))


def test_the_table_gives_it_cpu_float32_calls_of_four_tokens_and_more() -> None:
    w = _w()
    dispatch.stats(reset=True)
    with torch.no_grad():
        ops.linear(torch.randn(3, 16), w)  # 3 tokens: torch (native only below AVX-512)
        ops.linear(torch.randn(1, 5, 16), w)  # 5 tokens: transposed
        ops.linear(torch.randn(4, 16, dtype=torch.float64), w.double())  # float64: torch
    ops.linear(torch.randn(8, 16), w)  # autograd on: torch
    assert dispatch.stats().by_row()["linear"] == {"torch": {"chain": 3},
                                                    "transposed": {"chain": 1}}


def test_one_copy_per_weight_kept_across_calls() -> None:
    w = _w()
    with torch.no_grad():
        for _ in range(3):
            ops.linear(torch.randn(6, 16), w, backend="transposed")
    assert rows.weight_copies() == (1, w.nbytes)


def test_a_weight_changed_in_place_or_replaced_gets_a_new_copy() -> None:
    layer = torch.nn.Linear(16, 24)
    freeze(layer.parameters())
    x = torch.randn(6, 16)
    with torch.no_grad():
        ops.linear(x, layer.weight, layer.bias, backend="transposed")
        layer.weight.mul_(2)  # in place: its version moves
        torch.testing.assert_close(ops.linear(x, layer.weight, layer.bias, backend="transposed"),
                                   layer(x))
        layer.weight.data = torch.randn(24, 16)  # replaced storage
        torch.testing.assert_close(ops.linear(x, layer.weight, layer.bias, backend="transposed"),
                                   layer(x))
    assert rows.weight_copies()[0] == 1


def test_a_freed_weight_takes_its_copy_along() -> None:
    w = _w()
    with torch.no_grad():
        ops.linear(torch.randn(6, 16), w, backend="transposed")
    assert rows.weight_copies()[0] == 1
    del w
    gc.collect()
    assert rows.weight_copies() == (0, 0)


def test_past_the_budget_a_call_runs_f_linear_counted_and_said_once(
        caplog: pytest.LogCaptureFixture) -> None:
    first, second = _w(seed=1), _w(seed=2)
    rows.set_weight_copy_budget(first.nbytes)
    dispatch.stats(reset=True)
    x = torch.randn(6, 16)
    with torch.no_grad(), caplog.at_level("WARNING"):
        ops.linear(x, first)
        got = ops.linear(x, second)
        ops.linear(x, second)
    said = [r.getMessage() for r in caplog.records if "set_weight_copy_budget" in r.getMessage()]
    assert len(said) == 1 and f"may hold {first.nbytes}" in said[0]
    torch.testing.assert_close(got, F.linear(x, second))
    assert rows.weight_copies() == (1, first.nbytes)
    assert dispatch.stats().handed == {("linear", "transposed", "F.linear"): 2}
    assert rows.release_weight_copies() == first.nbytes and rows.weight_copies() == (0, 0)


def test_the_budget_is_a_byte_count() -> None:
    for bad in (-1, 1.5, True, "1G"):
        with pytest.raises(ValueError, match="number of bytes"):
            rows.set_weight_copy_budget(bad)  # type: ignore[arg-type]


def test_with_autograd_it_hands_the_call_to_f_linear_and_the_gradient_flows() -> None:
    w = _w().requires_grad_()
    x = torch.randn(6, 16)
    with pytest.raises(dispatch.ExplicitSelectionError, match="not grad_enabled"):
        ops.linear(x, w, backend="transposed")  # the table does not give it such a call
    rows.transposed_linear(x, w).sum().backward()  # called as it is: F.linear
    assert w.grad is not None and rows.weight_copies() == (0, 0)
    torch.testing.assert_close(w.grad, x.sum(0).expand(24, 16))


def test_traced_it_is_f_linear_and_keeps_no_copy() -> None:
    w, x = _w(), torch.randn(6, 16)

    @torch.compile(backend="eager", fullgraph=True)
    def fn(x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, w, backend="transposed")

    with torch.no_grad():
        torch.testing.assert_close(fn(x), F.linear(x, w))
    assert rows.weight_copies() == (0, 0)


def test_a_weight_stored_in_out_is_used_as_it_is() -> None:
    """GPT-2's ``Conv1D`` keeps ``[in, out]`` and is served as ``weight.t()``: no copy."""
    stored = torch.randn(16, 24)  # [in, out]
    x = torch.randn(6, 16)
    dispatch.stats(reset=True)
    with torch.no_grad():
        got = ops.linear(x, stored.t(), backend="transposed")
    torch.testing.assert_close(got, x @ stored)
    assert rows.weight_copies() == (0, 0) and not dispatch.stats().handed


def test_a_view_made_for_the_call_gets_no_copy() -> None:
    """A slice of a weight is a new tensor at every call, not declared frozen (its weight
    is): the call runs F.linear (counted)."""
    w = _w(48)
    x = torch.randn(6, 16)
    dispatch.stats(reset=True)
    with torch.no_grad():
        got = ops.linear(x, w[:24], backend="transposed")
    torch.testing.assert_close(got, F.linear(x, w[:24]))
    assert rows.weight_copies() == (0, 0)
    assert dispatch.stats().handed == {("linear", "transposed", "F.linear"): 1}


def test_on_amd_cpus_one_token_takes_the_copy_and_more_tokens_do_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the copy was measured to win for one token only (``transposed_one``); the
    native row, which wins more, is out of the way."""
    from astrai.backends import native

    monkeypatch.setattr(native, "_kernels", lambda: None)
    w = _w()
    dispatch.stats(reset=True)
    with torch.no_grad(), dispatch.assume_machine(cpu_vendor="amd", cpu_isa="avx512"), \
            dispatch.use_profile():
        dispatch.reload_tables()  # the shipped table, without the fixture's profile
        one = ops.linear(torch.randn(1, 1, 16), w)
        ops.linear(torch.randn(1, 2, 16), w)
        ops.linear(torch.randn(8, 16), w)
    assert dispatch.stats().by_row()["linear"] == {"transposed_one": {"chain": 1},
                                                    "torch": {"chain": 2}}
    assert rows.weight_copies()[0] == 1
    assert one.shape == (1, 1, 24)


def test_the_one_token_row_counts_its_own_hand_offs() -> None:
    dispatch.stats(reset=True)
    x, w = torch.randn(1, 16), _w()
    torch.testing.assert_close(rows.transposed_one_linear(x, w), F.linear(x, w))  # autograd on
    assert dispatch.stats().handed == {("linear", "transposed_one", "F.linear"): 1}
    text = dispatch.explain("linear", dispatch.CallContext(
        family="linear", dtype=torch.float32, tokens=1, ndim=2, grad_enabled=False,
        device="cpu"))  # the fixture's CPU is an Intel one
    assert "transposed_one: reject (cpu_vendor == amd (this machine has intel))" in text


@pytest.mark.parametrize("shape", [(16, 16), (2, 9, 16), (5, 16)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_onednn_row_computes_f_linear(shape: tuple[int, ...], bias: bool) -> None:
    _computes_f_linear(rows.onednn_linear, shape, bias, 1e-5)


def test_the_onednn_row_hands_autograd_calls_to_f_linear() -> None:
    dispatch.stats(reset=True)
    x, w = torch.randn(16, 16, requires_grad=True), _w()
    out = rows.onednn_linear(x, w)
    out.sum().backward()
    assert x.grad is not None
    assert dispatch.stats().handed == {("linear", "onednn", "F.linear"): 1}


def test_the_onednn_row_is_available_wherever_torch_has_onednn() -> None:
    answer = rows.onednn_available()
    if not torch.backends.mkldnn.is_available():
        assert "oneDNN" in str(answer)
        return
    assert answer is True


@pytest.mark.parametrize(("vendor", "isa", "serves"), [
    ("amd", "avx512", True), ("amd", "avx2", False), ("intel", "avx512", False),
    ("intel", "amx", False)])
def test_the_table_gives_onednn_where_it_was_measured_to_win(vendor: str, isa: str,
                                                             serves: bool) -> None:
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    call = dispatch.CallContext(family="linear", dtype=torch.float32, tokens=16, ndim=2,
                                grad_enabled=False, device="cpu")
    with dispatch.assume_machine(cpu_vendor=vendor, cpu_isa=isa):
        assert (dispatch.resolve("linear", call).name == "onednn") == serves
    stated = dispatch.CallContext(family="linear", dtype=torch.float32, tokens=16, ndim=2,
                                  grad_enabled=False, device="cpu",
                                  extra={"cpu_vendor": vendor, "cpu_isa": isa})
    assert (dispatch.resolve("linear", stated).name == "onednn") == serves


def test_on_amd_cpus_the_table_gives_onednn_calls_of_sixteen_tokens_and_more() -> None:
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    w = _w()
    dispatch.stats(reset=True)
    with torch.no_grad(), dispatch.assume_machine(cpu_vendor="amd", cpu_isa="avx512"):
        ops.linear(torch.randn(1, 16, 16), w)
        ops.linear(torch.randn(15, 16), w)
    by_row = dispatch.stats().by_row()["linear"]
    assert by_row["onednn"] == {"chain": 1}
    assert sum(n for r, o in by_row.items() if r != "onednn" for n in o.values()) == 1
