"""What ``dispatch_model`` reaches beyond the plain decoder: linear-like modules of any
class, attention weights transformers collects, models built on the meta device, models
built with ``use_kernels=True``, and a report that names every weight it leaves."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import astrai.dispatch as dispatch
from astrai.integrations.transformers import dispatch_model, restore_model, verify_model
from astrai.integrations.transformers.routing import model_families
from tests import _zoo


class MatmulLinear(nn.Module):
    """A linear layer that is no ``nn.Linear``: Falcon's ``x @ W.T + b`` written out."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in))
        self.bias = nn.Parameter(torch.randn(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T + self.bias


class InOutLinear(nn.Module):
    """GPT-2's ``Conv1D``: the weight stored ``[in, out]``, ``x @ W + b``."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out))
        self.bias = nn.Parameter(torch.randn(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(
            *x.shape[:-1], -1)


class ScaledLinear(nn.Module):
    """Holds a 2-d weight but computes more than a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.weight.T).relu()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = MatmulLinear(8, 16)
        self.b = InOutLinear(16, 8)
        self.c = ScaledLinear()
        self.experts = nn.Parameter(torch.randn(4, 8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x))) + self.experts.sum((0, 1))


class TestLinearLike:
    def test_routed_by_what_they_compute(self) -> None:
        torch.manual_seed(0)
        net = Net()
        x = torch.randn(2, 3, 8)
        want = net(x)
        report = dispatch_model(net, ["linear"])
        assert report.paths("linear") == ["a", "b"]
        (b,) = [r for r in report.routed if r.path == "b"]
        assert "[in, out]" in b.detail
        reasons = {n.path: (n.family, n.reason) for n in report.not_routed}
        assert reasons["c"][0] == "linear"
        assert "computes neither x @ W.T + b nor x @ W + b" in reasons["c"][1]
        assert reasons["(the model)"][0] == "experts"  # a 3-d weight of its own
        dispatch.reset_stats()
        torch.testing.assert_close(net(x), want, atol=1e-5, rtol=1e-5)
        assert dispatch.stats().served("linear") == 2

    def test_the_transposed_weight_is_read_live_never_copied(self) -> None:
        torch.manual_seed(0)
        layer = InOutLinear(4, 6)
        dispatch_model(layer, ["linear"])
        x = torch.randn(3, 4)
        with torch.no_grad():
            layer.weight.mul_(2)  # in place: a copy taken at dispatch would miss it
        torch.testing.assert_close(layer(x), x @ layer.weight + layer.bias)
        out = layer(x)
        out.sum().backward()
        assert layer.weight.grad is not None and layer.weight.grad.shape == (4, 6)

    def test_shares(self) -> None:
        torch.manual_seed(0)
        net = Net()
        report = dispatch_model(net, ["linear"])
        got, total = report.parameters
        assert total == sum(p.numel() for p in net.parameters())
        assert got == 8 * 16 + 16 + 16 * 8 + 8
        flops, all_flops = report.matmul_flops
        assert flops == 2 * (8 * 16 + 16 * 8)
        assert all_flops == flops + 2 * 64 + 2 * 4 * 64  # ScaledLinear; experts: all (no k)
        assert "weights routed to astrai:" in str(report)


class TestAttentionWeights:
    def test_output_attentions_from_the_config(self) -> None:
        from transformers import AutoModelForCausalLM
        config = _zoo._config("llama")
        config.output_attentions = True
        torch.manual_seed(0)
        plain = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
        routed = copy.deepcopy(plain)
        dispatch_model(routed)
        feed = _zoo.inputs(plain)
        with torch.no_grad():
            want, got = plain(**feed), routed(**feed)
        assert len(want.attentions) == len(got.attentions) == 2
        for a, b in zip(want.attentions, got.attentions, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)

    def test_retained_gradients_of_the_weights(self) -> None:
        from transformers import AutoModelForCausalLM
        config = _zoo._config("llama")
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        dispatch_model(model)
        out = model(**_zoo.inputs(model), output_attentions=True)
        weights = out.attentions[0]
        weights.retain_grad()
        out.logits.sum().backward()
        assert weights.grad is not None


class TestMetaDevice:
    def test_built_on_meta_then_loaded(self) -> None:
        from transformers import AutoModelForCausalLM
        plain = _zoo.build("llama")
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(_zoo._config("llama"))
            report = dispatch_model(model)  # the ambient default device is meta too
        counts = report.counts()
        assert {f: n for f, n in counts.items() if n} == {
            "attention": 2, "rotary": 2, "rms_norm": 5, "linear": 15, "gated_activation": 2,
            "cross_entropy": 1}
        assert set(counts) == set(model_families())  # every family, 0 where none
        model.to_empty(device="cpu")
        model.load_state_dict(plain.state_dict())
        buffers = dict(plain.named_buffers())
        with torch.no_grad():
            for name, buffer in model.named_buffers():  # not in the state dict: rotary's
                buffer.copy_(buffers[name])
        model.eval()
        feed = _zoo.inputs(plain)
        torch.testing.assert_close(_zoo.logits(model, feed), _zoo.logits(plain, feed),
                                   atol=1e-5, rtol=1e-5)
        assert verify_model(model, **feed)["rms_norm"] == 5
        assert restore_model(model) == 25  # 24 modules and the loss


class TestHubKernels:
    def test_use_kernels_is_reported(self) -> None:
        pytest.importorskip("kernels")
        model = _zoo.build("llama")
        if not hasattr(model, "set_use_kernels"):
            pytest.skip("this transformers has no use_kernels")
        model.set_use_kernels(True)
        report = dispatch_model(model)
        (note,) = report.notes
        assert "use_kernels=True" in note and "0 module(s) run a hub kernel" in note
        assert report.counts()["rotary"] == 2
        assert verify_model(model, **_zoo.inputs(model))["rotary"] == 2

    def test_a_hub_kernel_forward_stays_in_charge(self) -> None:
        model = _zoo.build("llama")
        norm = model.model.norm
        norm.forward = type(norm).forward.__get__(norm)
        norm.__dict__["_kernel_repo"] = "kernels-community/liger-kernels"
        report = dispatch_model(model)
        (refused,) = [n for n in report.not_routed if n.path == "model.norm"]
        assert "use_kernels=True put a hub kernel" in refused.reason
