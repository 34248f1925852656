"""The linear rows ``transposed`` and ``transposed_one`` keep a copy of a weight only where
its owner declared it frozen (``dispatch_model(model, mode="inference")``): any other
weight, however it was changed, is read as it is now; a frozen weight's copy is remade
when the weight shows a change."""

from __future__ import annotations

import copy
import gc
import importlib.util
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import astrai.dispatch as dispatch
from astrai import ops
from astrai.backends import frozen, native
from astrai.backends import linear as rows
from astrai.integrations.transformers import dispatch_model, restore_model
from tests import _zoo
from tests.conftest import adopted, cpu_of

#: Each row, the CPU vendor it is available on, and the tokens the table gives it.
ROWS = {"transposed": ("GenuineIntel", 6), "transposed_one": ("AuthenticAMD", 1)}
FEATURES = 16  # square weights: a transposed ``.data`` fits the same calls


@pytest.fixture(params=["python", "native"])
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each hot path in force: the Python one, or the compiled one (the built extension)."""
    module: ModuleType | None = None
    if request.param == "native":
        module = request.getfixturevalue("built")
    with adopted(module):
        yield request.param


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    rows.release_weight_copies()
    dispatch.stats(reset=True)
    yield
    rows.release_weight_copies()


@pytest.fixture
def elsewhere_frozen() -> Iterator[torch.Tensor]:
    """Another model's weight declared frozen in this process: the rows serving frozen
    weights only are available, and a weight of a model in train mode meets them."""
    other = torch.ones(2, 2)
    frozen.freeze([other])
    yield other
    frozen.thaw([other])


@contextmanager
def on_cpu_of(vendor: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The machine taken for a CPU of ``vendor`` (AVX-512), the explicit-only
    ``transposed`` row enabled (as a tuned profile does where it wins); the native row,
    which precedes them for a few tokens, out of the way."""
    monkeypatch.setattr(native, "_kernels", lambda: None)
    try:
        with cpu_of({"GenuineIntel": "intel", "AuthenticAMD": "amd"}[vendor]):
            yield
    finally:
        monkeypatch.undo()
        dispatch.reload_tables()


# -- the ways a weight changes -----------------------------------------------------------


def _buffer_backed(w: nn.Parameter) -> bytearray:
    """Put ``w``'s values in a storage over a Python buffer, and return the buffer."""
    buf = bytearray(w.numel() * w.element_size())
    t = torch.frombuffer(buf, dtype=w.dtype).view(w.shape)
    t.copy_(w.data)
    w.data = t
    return buf


@dataclass(frozen=True)
class Change:
    """One way of changing a weight, after ``prepare`` (which may set it up) and the
    first call."""

    name: str
    change: Callable[[nn.Parameter, object], object]
    prepare: Callable[[nn.Parameter], object] = lambda w: None


def _address_reused(w: nn.Parameter, buf: object) -> None:
    """Two ``.data`` swaps: the first storage is freed, the second one is a new storage at
    the same address holding other values (the version and shape unchanged)."""
    assert isinstance(buf, bytearray)
    address = w.data_ptr()
    w.data = torch.empty(0)
    gc.collect()
    torch.frombuffer(buf, dtype=torch.float32).copy_(  # other values, through a view freed
        torch.randn(len(buf) // 4, generator=torch.Generator().manual_seed(7)))
    w.data = torch.frombuffer(buf, dtype=torch.float32).view(FEATURES, FEATURES)
    assert w.data_ptr() == address


def _in_wider_storage(w: nn.Parameter) -> None:
    """Put ``w``'s values in every other column of a wider storage (strides ``(2n, 1)``)."""
    wide = torch.zeros(w.shape[0], 2 * w.shape[1])
    wide[:, : w.shape[1]] = w.data
    w.data = wide[:, : w.shape[1]]


_NUMPY = importlib.util.find_spec("numpy") is not None

#: Every way of changing a weight the rows are tested against.
CHANGES = [
    Change("data.mul_", lambda w, _: w.data.mul_(2)),
    Change("data.copy_", lambda w, _: w.data.copy_(torch.randn(w.shape))),
    Change("data.normal_", lambda w, _: w.data.normal_()),
    Change("data[i] =", lambda w, _: w.data.__setitem__(3, 7.0)),
    *([Change("numpy view", lambda w, _: w.detach().numpy().__setitem__(5, -3.0))]
      if _NUMPY else []),  # torch's .numpy() needs NumPy installed
    Change("in place", lambda w, _: w.mul_(-1)),
    Change("data = data.t()", lambda w, _: setattr(w, "data", w.data.t())),
    Change("data = new", lambda w, _: setattr(w, "data", torch.randn(w.shape))),
    Change("data restrided", lambda w, _: setattr(w, "data", w.data.as_strided(
        w.shape, (w.shape[1], 1))), _in_wider_storage),
    Change("address reused", _address_reused, _buffer_backed),
]
#: The changes a weight declared frozen may still see (each one shows on the weight).
SHOWN = ("in place", "data = data.t()", "data = new", "data restrided", "address reused")


def _layer(seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(FEATURES, FEATURES)


def _served(row: str) -> int:
    return dispatch.stats().served("linear", row)


Runner = Callable[[torch.Tensor, nn.Linear], torch.Tensor]


def _row_function(row: str) -> Runner:
    fn = rows.transposed_linear if row == "transposed" else rows.transposed_one_linear
    return lambda x, layer: fn(x, layer.weight, layer.bias)


def _op_backend(row: str) -> Runner:
    def run(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        with dispatch.op_backend(linear=row):
            return ops.linear(x, layer.weight, layer.bias)

    return run


def _model(row: str) -> Runner:
    return lambda x, layer: layer(x)


RUNNERS = {"row function": _row_function, "op_backend": _op_backend, "model": _model}


# -- train mode: never a copy -------------------------------------------------------------


@pytest.mark.usefixtures("elsewhere_frozen")
@pytest.mark.parametrize("how", list(RUNNERS))
@pytest.mark.parametrize("row", list(ROWS))
@pytest.mark.parametrize("change", CHANGES, ids=[c.name for c in CHANGES])
def test_a_weight_not_declared_frozen_is_read_as_it_is_after_any_change(
        path: str, row: str, how: str, change: Change,
        monkeypatch: pytest.MonkeyPatch) -> None:
    vendor, tokens = ROWS[row]
    layer = _layer()
    if how == "model":
        dispatch_model(layer, ("linear",))  # mode="train", the default
    run = RUNNERS[how](row)
    x = torch.randn(tokens, FEATURES)
    with on_cpu_of(vendor, monkeypatch), torch.no_grad():
        state = change.prepare(layer.weight)
        torch.testing.assert_close(run(x, layer), F.linear(x, layer.weight, layer.bias))
        change.change(layer.weight, state)
        got = run(x, layer)
        torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias))
    if how != "row function":  # the row called as a function is no decision
        assert _served(row) == 2
    # A weight stored [in, out] (a transposed .data) is read as its own transpose.
    handed = 1 + (not layer.weight.t().is_contiguous())
    assert dispatch.stats().handed == {("linear", row, "F.linear"): handed}
    assert rows.weight_copies() == (0, 0)


@pytest.mark.usefixtures("elsewhere_frozen")
def test_a_routed_model_in_train_mode_keeps_no_copy(
        path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Sequential(_layer(1), nn.ReLU(), _layer(2))
    report = dispatch_model(model)
    assert report.mode == "train" and "  mode: train" in str(report).splitlines()
    x = torch.randn(2, 5, FEATURES)
    with on_cpu_of("GenuineIntel", monkeypatch), torch.no_grad():
        want = F.linear(F.relu(F.linear(x, model[0].weight, model[0].bias)),
                        model[2].weight, model[2].bias)
        torch.testing.assert_close(model(x), want)
    assert _served("transposed") == 2 and rows.weight_copies() == (0, 0)
    assert dispatch.stats().handed_off("linear", "transposed") == 2


@pytest.mark.usefixtures("elsewhere_frozen")
@pytest.mark.parametrize("mode", ["train", "inference"])
def test_a_transformers_model_follows_its_weights_in_either_mode(
        mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny Llama, routed, against the same model unrouted, before and after its linear
    weights change: through ``.data`` in train mode, through the parameters themselves
    (in place) in inference mode."""
    plain = _zoo.build("llama")
    routed = copy.deepcopy(plain)
    dispatch_model(routed, mode=mode)
    feed = _zoo.inputs(plain)
    with on_cpu_of("GenuineIntel", monkeypatch), torch.no_grad():
        torch.testing.assert_close(_zoo.logits(routed, feed), _zoo.logits(plain, feed))
        for model in (plain, routed):
            for module in model.modules():
                if isinstance(module, nn.Linear):
                    (module.weight.data if mode == "train" else module.weight).mul_(-0.5)
        torch.testing.assert_close(_zoo.logits(routed, feed), _zoo.logits(plain, feed))
    assert _served("transposed") > 0
    assert (rows.weight_copies()[0] > 0) == (mode == "inference")


@pytest.mark.parametrize("row", list(ROWS))
def test_with_no_weight_frozen_the_rows_are_unavailable_and_say_why(
        row: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No model in inference mode: the table passes the rows by (a train-mode model's
    calls go to ``torch``, nothing handed on), ``explain`` says why; the first weight
    declared frozen makes them available, the last withdrawn unavailable again."""
    gc.collect()  # the models of tests before, frozen, gone with their weights
    vendor, tokens = ROWS[row]
    layer = _layer()
    dispatch_model(layer)
    x = torch.randn(tokens, FEATURES)
    with on_cpu_of(vendor, monkeypatch), torch.no_grad():
        assert not frozen.any_frozen()
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        assert _served(row) == 0 and dispatch.stats().served("linear", "torch") == 1
        assert not dispatch.stats().handed
        text = dispatch.explain("linear", ops.context("linear", x, layer.weight, None))
        assert "no weight is declared frozen in this process" in str(text)
        dispatch_model(layer, mode="inference")
        layer(x)
        assert _served(row) == 1 and rows.weight_copies()[0] == 1
        restore_model(layer)
        assert not frozen.any_frozen()
        report = dispatch_model(layer)  # train mode: no copy to use, no row to gain by
        layer(x)
        # on the Intel CPU no other row can serve a call either: the family is left to
        # the model's own code, and said so; on the AMD one onednn may serve others
        left = "linear" in dict(report.model_code)
        assert left == (vendor == "GenuineIntel")
        assert _served(row) == 1 and dispatch.stats().served("linear", "torch") == 2 - left


# -- inference mode: the copy, checked --------------------------------------------------


def test_inference_mode_keeps_one_copy_per_weight_and_uses_it(
        path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Sequential(_layer(1), nn.ReLU(), _layer(2))
    report = dispatch_model(model, mode="inference")
    assert report.mode == "inference" and report.as_dict()["mode"] == "inference"
    assert "  mode: inference (every parameter declared frozen)" in str(report).splitlines()
    assert all(frozen.is_frozen(p) for p in model.parameters())
    x = torch.randn(6, FEATURES)
    with on_cpu_of("GenuineIntel", monkeypatch), torch.no_grad():
        want = F.linear(F.relu(F.linear(x, model[0].weight, model[0].bias)),
                        model[2].weight, model[2].bias)
        for _ in range(3):
            torch.testing.assert_close(model(x), want)
    nbytes = model[0].weight.nbytes + model[2].weight.nbytes
    assert rows.weight_copies() == (2, nbytes)
    kept = rows._copy_of(model[0].weight)  # the copy made at the first call, kept
    assert isinstance(kept, torch.Tensor) and kept is rows._copy_of(model[0].weight)
    assert _served("transposed") == 6 and not dispatch.stats().handed


@pytest.mark.parametrize("how", ["row function", "op_backend", "model"])
@pytest.mark.parametrize("row", list(ROWS))
@pytest.mark.parametrize("name", SHOWN)
def test_a_frozen_weights_copy_is_remade_when_the_weight_shows_a_change(
        path: str, row: str, how: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    change = next(c for c in CHANGES if c.name == name)
    vendor, tokens = ROWS[row]
    layer = _layer()
    dispatch_model(layer, ("linear",), mode="inference")
    run = RUNNERS[how](row)
    x = torch.randn(tokens, FEATURES)
    with on_cpu_of(vendor, monkeypatch), torch.no_grad():
        state = change.prepare(layer.weight)
        torch.testing.assert_close(run(x, layer), F.linear(x, layer.weight, layer.bias))
        assert rows.weight_copies()[0] == 1
        change.change(layer.weight, state)
        torch.testing.assert_close(run(x, layer), F.linear(x, layer.weight, layer.bias))
    assert rows.weight_copies() == (1, layer.weight.nbytes)
    assert not dispatch.stats().handed


def test_restore_model_and_train_mode_withdraw_the_declaration_and_drop_the_copies(
        monkeypatch: pytest.MonkeyPatch) -> None:
    layer = _layer()
    x = torch.randn(6, FEATURES)
    with on_cpu_of("GenuineIntel", monkeypatch), torch.no_grad():
        for undo in (restore_model, lambda m: dispatch_model(m, mode="train")):
            dispatch_model(layer, mode="inference")
            layer(x)
            assert rows.weight_copies() == (1, layer.weight.nbytes)
            undo(layer)
            assert rows.weight_copies() == (0, 0)
            assert not any(frozen.is_frozen(p) for p in layer.parameters())
        layer.weight.data.mul_(3)  # not frozen now: read as it is
        dispatch_model(layer)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


def test_an_unknown_mode_is_refused_naming_the_modes() -> None:
    layer = _layer()
    with pytest.raises(ValueError, match=r"'bogus'.*'train', 'inference'"):
        dispatch_model(layer, mode="bogus")
    assert "forward" not in layer.__dict__ and not frozen.is_frozen(layer.weight)


# -- inference tensors, in_features == 0 -------------------------------------------------


@pytest.mark.usefixtures("elsewhere_frozen")
@pytest.mark.parametrize("declared", [False, True])
@pytest.mark.parametrize("row", list(ROWS))
def test_inference_tensors_are_served(row: str, declared: bool,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    vendor, tokens = ROWS[row]
    with torch.inference_mode():
        layer = _layer()
        x = torch.randn(tokens, FEATURES)
    assert layer.weight.is_inference()
    dispatch_model(layer, mode="inference" if declared else "train")
    with on_cpu_of(vendor, monkeypatch):
        with torch.inference_mode():
            inside = layer(x)
        with torch.no_grad():
            outside = layer(x)
            with dispatch.op_backend(linear=row):
                explicit = ops.linear(x, layer.weight, layer.bias)
    want = F.linear(x, layer.weight, layer.bias)
    for got in (inside, outside, explicit):
        torch.testing.assert_close(got, want)
    assert _served(row) == 3
    assert rows.weight_copies()[0] == (1 if declared else 0)


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
@pytest.mark.usefixtures("elsewhere_frozen")
@pytest.mark.parametrize("declared", [False, True])
@pytest.mark.parametrize("row", list(ROWS))
def test_no_input_features_is_f_linear(row: str, declared: bool,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    vendor, tokens = ROWS[row]
    layer = nn.Linear(0, 5)
    dispatch_model(layer, mode="inference" if declared else "train")
    x = torch.randn(tokens, 0)
    with on_cpu_of(vendor, monkeypatch), torch.no_grad():
        got = layer(x)
        with dispatch.op_backend(linear=row):
            explicit = ops.linear(x, layer.weight, layer.bias)
    for out in (got, explicit):
        torch.testing.assert_close(out, layer.bias.detach().expand(tokens, 5))
    assert dispatch.stats().handed == {("linear", row, "F.linear"): 2}
    assert rows.weight_copies() == (0, 0)
