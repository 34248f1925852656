"""Whether a parent calls its child at all: a module whose parent only reads its weight,
or hands it to a function, is not routed (nothing of it would reach astrai)."""

from __future__ import annotations

import torch
from torch import nn

from astrai.integrations.transformers import dispatch_model
from astrai.recognition.callers import not_called


def conv_with(conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    return nn.functional.conv1d(x, conv.weight, conv.bias, padding=2, groups=x.shape[1])


class Mixer(nn.Module):
    """Reads dt_proj's weight, hands conv1d to a function, calls out_proj."""

    def __init__(self) -> None:
        super().__init__()
        self.dt_proj = nn.Linear(8, 8)
        self.conv1d = nn.Conv1d(8, 8, 3, groups=8, padding=2)
        self.out_proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.dt_proj.weight.T
        h = conv_with(self.conv1d, h.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)
        return self.out_proj(h)


def test_not_called_reads_the_parents_source() -> None:
    mixer = Mixer()
    assert not_called(mixer, "dt_proj") == (
        "its parent (Mixer) never calls it: its code reads its weight directly")
    assert not_called(mixer, "conv1d") == (
        "its parent (Mixer) never calls it: its code hands the module to conv_with(), "
        "which reads what it holds")
    assert not_called(mixer, "out_proj") is None
    assert not_called(nn.Sequential(nn.Linear(2, 2)), "0") is None  # a container calls
    assert not_called(nn.Linear(2, 2), "weight") is None  # torch's own class: not read


def test_dispatch_model_reports_what_the_parent_never_calls() -> None:
    model = Mixer()
    x = torch.randn(2, 5, 8)
    want = model(x)
    report = dispatch_model(model, ["linear", "depthwise_conv1d"])
    assert report.paths("linear") == ["out_proj"]
    reasons = {n.path: (n.family, n.reason) for n in report.not_routed}
    assert reasons["dt_proj"] == ("linear", "its parent (Mixer) never calls it: its code "
                                            "reads its weight directly")
    assert reasons["conv1d"][0] == "depthwise_conv1d"
    assert "hands the module to conv_with()" in reasons["conv1d"][1]
    torch.testing.assert_close(model(x), want, atol=1e-6, rtol=1e-6)
