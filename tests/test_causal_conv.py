"""Causal convolutions a layer hands to ``causal_conv1d_forward``: served in the layer's
rebuilt forward, whose copy of that function computes through ``ops.depthwise_conv1d``
(its own cache handling kept), only where the two functions it computes with are seen
to compute what astrai's do. This module's own functions stand for transformers' (the
same names, the same arguments), so the form is checked without any model library."""

from __future__ import annotations

import copy
import logging
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import astrai.dispatch as d
from astrai.integrations.transformers import dispatch_model, restore_model, verify_model

ACT2FN = {"silu": nn.functional.silu}
#: what this module's causal_conv1d_fn computes: set per test (a causal convolution, or
#: one that also reads the next sample)
LOOKAHEAD = {"on": False}


def causal_conv1d_update(hidden_states: torch.Tensor, conv_state: torch.Tensor,
                         weight: torch.Tensor, bias: torch.Tensor | None = None,
                         activation: str | None = None) -> torch.Tensor:
    seq = hidden_states.shape[-1]
    full = torch.cat([conv_state, hidden_states], dim=-1).to(weight.dtype)
    conv_state.copy_(full[:, :, -conv_state.shape[-1]:])
    out = nn.functional.conv1d(full, weight.unsqueeze(1), bias, groups=full.shape[1])
    out = out[:, :, -seq:]
    return (out if activation is None else ACT2FN[activation](out)).to(hidden_states.dtype)


def causal_conv1d_fn(hidden_states: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None, activation: str | None = None,
                     **kwargs: Any) -> torch.Tensor:
    seq = hidden_states.shape[-1]
    shift = 1 if LOOKAHEAD["on"] else 0
    out = nn.functional.conv1d(hidden_states.to(weight.dtype), weight.unsqueeze(1), bias,
                               padding=weight.shape[-1] - 1, groups=hidden_states.shape[1])
    out = out[:, :, shift:seq + shift]
    if shift:
        out = torch.cat([out, out[:, :, -1:]], dim=-1)[:, :, :seq]
    return (out if activation is None else ACT2FN[activation](out)).to(hidden_states.dtype)


class State:
    """A cache of one convolution state per layer, as transformers' keeps them."""

    def __init__(self) -> None:
        self.states: dict[int, torch.Tensor] = {}

    def update(self, x: torch.Tensor, layer_idx: int, size: int) -> torch.Tensor:
        state = self.states.get(layer_idx)
        full = x if state is None else torch.cat([state, x], dim=-1)
        kept = full[:, :, -size:]
        pad = size - kept.shape[-1]
        self.states[layer_idx] = nn.functional.pad(kept, (pad, 0)) if pad > 0 else kept.clone()
        return full


def causal_conv1d_forward(conv1d: nn.Conv1d, hidden_states: torch.Tensor, cache: State | None,
                          layer_idx: int, activation: str | None = None,
                          **kwargs: Any) -> torch.Tensor:
    seq = hidden_states.shape[-1]
    weight = conv1d.weight.squeeze(1)
    if cache is not None and seq == 1 and layer_idx in cache.states:
        return causal_conv1d_update(hidden_states, cache.states[layer_idx], weight,
                                    conv1d.bias, activation=activation)
    if cache is not None:
        hidden_states = cache.update(hidden_states, layer_idx, conv1d.kernel_size[0])
    out = causal_conv1d_fn(hidden_states, weight, conv1d.bias, activation=activation, **kwargs)
    return out[:, :, -seq:]


class ShortConv(nn.Module):
    """A short-convolution mixer (LFM2's form): it hands its conv to the function."""

    def __init__(self, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.in_proj = nn.Linear(8, 8)
        self.conv = nn.Conv1d(8, 8, 3, groups=8, padding=2)
        self.out_proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, cache: State | None = None) -> torch.Tensor:
        h = self.in_proj(x).transpose(1, 2)
        h = causal_conv1d_forward(self.conv, h, cache, self.layer_idx, activation="silu")
        return self.out_proj(h.transpose(1, 2))


class Packed(ShortConv):
    """Passes the sequence index of packed rows on (a kernel keeps the sequences apart)."""

    def forward(self, x: torch.Tensor, seq_idx: torch.Tensor | None = None,
                **kwargs: Any) -> torch.Tensor:
        h = self.in_proj(x).transpose(1, 2)
        h = causal_conv1d_forward(self.conv, h, None, self.layer_idx, seq_idx=seq_idx, **kwargs)
        return self.out_proj(h.transpose(1, 2))


class Mixer(ShortConv):
    """The same with a parameter of its own that no family serves (a state-space decay)."""

    def __init__(self) -> None:
        super().__init__()
        self.A_log = nn.Parameter(torch.zeros(8))

    def forward(self, x: torch.Tensor, cache: State | None = None) -> torch.Tensor:
        h = self.in_proj(x).transpose(1, 2)
        h = causal_conv1d_forward(self.conv, h, cache, self.layer_idx) * self.A_log.exp()[:, None]
        return self.out_proj(h.transpose(1, 2))


@pytest.fixture
def lookahead(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This module's causal_conv1d_fn reads the next sample too; a fresh copy of
    causal_conv1d_forward (what stands in for a function is made once per object)."""
    fresh = types.FunctionType(causal_conv1d_forward.__code__, globals(),
                               "causal_conv1d_forward", causal_conv1d_forward.__defaults__)
    monkeypatch.setitem(globals(), "causal_conv1d_forward", fresh)
    LOOKAHEAD["on"] = True
    try:
        yield
    finally:
        LOOKAHEAD["on"] = False


def test_a_handed_convolution_is_served_through_its_parent() -> None:
    torch.manual_seed(0)
    plain = ShortConv()
    model = copy.deepcopy(plain)
    report = dispatch_model(model, ["depthwise_conv1d"])
    assert [(r.path, r.detail) for r in report.routed] == [
        ("(the model)", "causal_conv1d_forward (conv)")]
    assert not [n for n in report.not_routed if n.family == "depthwise_conv1d"]
    assert report.parameters[0] == sum(p.numel() for p in plain.conv.parameters())

    x = torch.randn(2, 6, 8)
    with torch.no_grad():
        assert torch.equal(model(x), plain(x))
        # a sequence, then one step at a time with the state: the step's own function
        mine, theirs = State(), State()
        for chunk in (x[:, :4], x[:, 4:5], x[:, 5:6]):
            torch.testing.assert_close(model(chunk, mine), plain(chunk, theirs),
                                       atol=1e-6, rtol=1e-6)
        for layer in theirs.states:
            assert torch.equal(mine.states[layer], theirs.states[layer])
    assert verify_model(model, x)["depthwise_conv1d"] == 1
    assert verify_model(model, x[:, :1], State())["depthwise_conv1d"] == 1
    assert restore_model(model) == 1
    assert model.forward.__func__ is ShortConv.forward  # type: ignore[attr-defined]


def test_a_layer_computing_more_with_its_own_parameters_is_still_named() -> None:
    report = dispatch_model(Mixer(), ["depthwise_conv1d"])
    assert report.paths("depthwise_conv1d") == ["(the model)"]
    (other,) = [n for n in report.not_routed if n.path == "(the model)"]
    assert other.family == "other" and "A_log [8]" in other.reason
    assert report.parameters[0] == sum(p.numel() for p in Mixer().conv.parameters())


@pytest.mark.usefixtures("lookahead")
def test_a_function_computing_something_else_is_left_with_the_reason() -> None:
    model = ShortConv()
    x = torch.randn(2, 6, 8)
    want = model(x)
    report = dispatch_model(model, ["depthwise_conv1d"])
    assert report.paths("depthwise_conv1d") == []
    reasons = [n.reason for n in report.not_routed if n.family == "depthwise_conv1d"]
    assert any("causal_conv1d_fn (activation None): it computes something else than a "
               "causal depthwise convolution" in r for r in reasons), reasons
    assert torch.equal(model(x), want)


def test_a_call_given_packed_sequences_runs_the_models_own_function(
        caplog: pytest.LogCaptureFixture) -> None:
    model = Packed()
    plain = copy.deepcopy(model)
    assert dispatch_model(model, ["depthwise_conv1d"]).paths("depthwise_conv1d") == [
        "(the model)"]
    x = torch.randn(1, 6, 8)
    seq_idx = torch.tensor([[0, 0, 0, 1, 1, 1]], dtype=torch.int32)
    d.reset_stats()
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="astrai"):
        assert torch.equal(model(x), plain(x))  # no index: the family serves it
        # keywords a layer passes on, which the function ignores: served too
        positions = torch.arange(6)[None]
        assert torch.equal(model(x, position_ids=positions), plain(x, position_ids=positions))
        assert d.stats().served("depthwise_conv1d", origin="model") == 0
        assert torch.equal(model(x, seq_idx), plain(x, seq_idx))
    assert d.stats().served("depthwise_conv1d", origin="model") == 1
    assert any("given seq_idx runs the model's own causal_conv1d_fn" in r.getMessage()
               for r in caplog.records)
