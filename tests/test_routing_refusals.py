"""What ``dispatch_model`` cannot serve it refuses when it routes, never at the model's
first forward: a norm its callers give more than the input and a gate (``norm(x,
residual)``; ``norm(x, gate)`` is the gated_rms_norm family's), attention a model
computes with its own eager function alone (Inkling 2's per-token sinks); and it names a
module for what it is (a convolution is no stack of experts)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from astrai.integrations.transformers import dispatch_model, restore_model, verify_model

transformers = pytest.importorskip("transformers")

_TINY: dict[str, Any] = dict(vocab_size=128, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                             eos_token_id=2)


class GatedRMSNorm(nn.Module):
    """Mamba-2's gated norm: ``norm(x)`` is an RMS norm, ``norm(x, gate)`` another thing."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(features) + 0.5)
        self.variance_epsilon = 1e-6

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None
                ) -> torch.Tensor:
        if gate is not None:
            hidden_states = hidden_states * nn.functional.silu(gate)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class ResidualRMSNorm(GatedRMSNorm):
    """Takes a residual besides its input: no family serves ``norm(x, residual)``."""

    def forward(self, hidden_states: torch.Tensor,  # type: ignore[override]
                residual: torch.Tensor | None = None) -> torch.Tensor:
        if residual is not None:
            hidden_states = hidden_states + residual
        return super().forward(hidden_states)


class Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.norm = nn.Linear(8, 8), GatedRMSNorm(8)
        self.add_norm = ResidualRMSNorm(8)
        self.conv = nn.Conv1d(8, 8, 4, groups=8, padding=3)
        self.mix = nn.Conv1d(8, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x.transpose(1, 2))[..., :x.shape[1]]
        x = self.mix(x).transpose(1, 2)
        return self.add_norm(self.norm(x, self.gate_proj(x)), x)


def test_a_norm_called_with_more_than_its_input_is_served_or_refused_when_routing() -> None:
    """``norm(x, gate)`` is the gated_rms_norm family's; ``norm(x, residual)`` no family's,
    refused at dispatch rather than failing at the first forward."""
    torch.manual_seed(0)
    model, x = Mixer(), torch.randn(2, 5, 8)
    with torch.no_grad():
        want = model(x)
        report = dispatch_model(model)
        torch.testing.assert_close(model(x), want)
    assert report.paths("gated_rms_norm") == ["norm"]
    assert report.paths("depthwise_conv1d") == ["conv"]
    (norm,) = [n for n in report.not_routed if n.path == "add_norm"]
    assert norm.family == "rms_norm"
    assert norm.reason == ("its forward takes residual besides its input (called as "
                           "norm(x, residual)): astrai's rms_norm serves norm(x) alone")
    (conv,) = [n for n in report.not_routed if n.path == "mix"]
    assert conv.family == "convolution" and conv.kind == "Conv1d"
    assert conv.reason == ("a convolution (weight [8, 8, 1], bias [8], 8 output channels), "
                           "which no astrai family serves")
    restore_model(model)


class LowRankGatedRMSNorm(nn.Module):
    """Named an RMS norm, composed of one and a gate MLP: ``norm(x) * sigmoid(mlp(norm(x)))``."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(features, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(features, 2, bias=False),
                                 nn.Linear(2, features, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return y * torch.sigmoid(self.mlp(y))


def test_a_module_named_a_norm_composed_of_others_is_served_through_them() -> None:
    """It holds no weight of its own: its norm and its gate's linears are served, and it
    is no RMS norm left out (the sigmoid gating is its own glue, like a residual add)."""
    torch.manual_seed(0)
    model, x = LowRankGatedRMSNorm(8), torch.randn(2, 5, 8)
    with torch.no_grad():
        want = model(x)
        report = dispatch_model(model, ["rms_norm", "linear"])
        torch.testing.assert_close(model(x), want)
    assert report.paths("rms_norm") == ["norm"]
    assert sorted(report.paths("linear")) == ["mlp.0", "mlp.1"]
    assert report.not_routed == ()
    restore_model(model)


def _build(name: str, **extra: Any) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.for_model(name)
    except (KeyError, ValueError):
        pytest.skip(f"this transformers has no {name}")
    for key, value in {**_TINY, **extra}.items():
        if hasattr(config, key):
            setattr(config, key, value)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize(("name", "extra"), [
    ("bamba", dict(attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16)),
    ("inkling2_text", {}),
])
def test_models_routing_once_broke_run_and_agree(name: str, extra: dict[str, Any]) -> None:
    """The plain model runs, so the routed one runs too and gives the same logits; what
    astrai leaves to the model's own code is in the report with the reason."""
    model = _build(name, **extra)
    ids = torch.randint(3, 100, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
        report = dispatch_model(model)
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    reasons = [n.reason for n in report.not_routed]
    if name == "bamba":
        assert report.paths("gated_rms_norm")  # its mixers' norm(x, gate)
        # its convolution: served where the mixer hands it to causal_conv1d_forward
        # (transformers 5), else named as never called by it
        assert report.paths("depthwise_conv1d") or any(
            r.startswith("its parent (BambaMixer) never calls it") for r in reasons)
        assert any(n.kind == "BambaMixer" and n.family == "other" for n in report.not_routed)
        assert not any("MoE experts" in r for r in reasons)
    else:
        assert any("computes attention with its own eager function alone" in r
                   and "sinks=" in r for r in reasons)
    restore_model(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torch_rms_norm_with_its_default_epsilon_is_served(dtype: torch.dtype) -> None:
    """``torch.nn.RMSNorm(features)`` (``eps=None``): torch's own epsilon for the dtype,
    whichever rule this torch follows."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.RMSNorm(8)).to(dtype)
    x = torch.randn(3, 8).to(dtype)
    x[0] *= 3e-4  # a row whose mean square is about float32's epsilon
    with torch.no_grad():
        want = model(x)
        report = dispatch_model(model, ["rms_norm"])
        got = model(x)
    assert report.paths("rms_norm") == ["1"]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    restore_model(model)


def test_verify_model_names_the_loss_unreached_without_labels() -> None:
    from tests import _zoo

    model = _zoo.build("llama")
    dispatch_model(model)
    ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(2))
    got = verify_model(model, ids)
    assert got["rms_norm"] > 0 and got["cross_entropy"] == 0
    assert got.unreached == {"cross_entropy ((the model) LlamaForCausalLM)":
                             "called with arguments that do not reach cross_entropy (only a "
                             "call with labels reaches it: the model computes its loss then)"}
    labelled = verify_model(model, ids, labels=ids)
    assert labelled["cross_entropy"] == 1 and not labelled.unreached
    restore_model(model)
