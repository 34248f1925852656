"""Linear layers in a model: which modules compute ``x @ W.T + b``, told by what they
compute, and the forwards that send their calls to ``ops.linear``.

``torch.nn.Linear`` and subclasses that keep its ``forward`` are linear by definition;
any other module without children holding a 2-d weight (and at most a bias) is run - its
class's own ``forward``, on a copy holding random weights on the CPU - and compared with
``x @ W.T + b`` (Falcon's ``FalconLinear``) and ``x @ W + b`` with the weight stored
``[in, out]`` (GPT-2's ``Conv1D``, served with a transposed view of the weight, never a
copy).
"""

from __future__ import annotations

__all__ = ["RECOGNITION", "LinearForm", "is_linear_kind", "linear_form"]

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from astrai.families.linear import linear
from astrai.families.recognition import Installed, ModelRecognition
from astrai.recognition.inspection import EMBEDDINGS, is_norm_kind
from astrai.recognition.probe import gap, probe_copy


@dataclass(frozen=True)
class LinearForm:
    """How to serve one linear-like module through ``astrai.ops.linear``."""

    transposed: bool  # the weight is stored [in, out] (GPT-2's Conv1D): passed as W.T

    def describe(self) -> str:
        """The form in words, for the report."""
        return ("x @ W + b, weight stored [in, out] (passed as a transposed view)"
                if self.transposed else "")



def is_linear_kind(module: nn.Module) -> bool:
    """Whether ``module`` may compute a linear layer: an ``nn.Linear``, or any module
    without children (no embedding, no norm) that holds a 2-d ``weight`` of its own."""
    if isinstance(module, nn.Linear):
        return True
    if isinstance(module, EMBEDDINGS) or is_norm_kind(module) or module._modules:
        return False
    weight = module._parameters.get("weight")
    return isinstance(weight, torch.Tensor) and weight.dim() == 2


def linear_form(module: nn.Module) -> LinearForm | str:
    """``module``'s ``LinearForm`` (``x @ W.T + b`` as ``nn.Linear``, or ``x @ W + b`` with
    the weight stored ``[in, out]``), or why it cannot be served by ``ops.linear``.

    ``nn.Linear`` and subclasses that keep its ``forward`` are linear by definition; any
    other module holding a 2-d weight (and at most a bias) is run - its class's own
    ``forward``, on a copy holding random weights on the CPU - and compared with both
    forms."""
    weight = module._parameters.get("weight")
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        what = weight.dtype if isinstance(weight, torch.Tensor) else type(weight).__name__
        return f"its weight is {what}, not floating point"
    if isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward:
        return LinearForm(False)
    extra = [n for n, p in module.named_parameters(recurse=True) if n not in ("weight", "bias")]
    extra += [n for n, b in module.named_buffers(recurse=True) if b is not None]
    bias = module._parameters.get("bias")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.dim() != 1):
        extra.append("bias")
    who = (f"{type(module).__qualname__} overrides nn.Linear.forward and"
           if isinstance(module, nn.Linear) else type(module).__qualname__)
    if extra:
        return (f"{who} holds more than a weight and a bias ({', '.join(extra)}), so "
                f"astrai cannot tell what it computes")
    failures: list[str] = []
    for transposed in (False, True):
        got = _linear_gap(module, transposed)
        if isinstance(got, float) and got <= 1e-5:
            return LinearForm(transposed)
        failures.append(got if isinstance(got, str) else f"differs by {got:.2g}")
    return (f"{who} computes neither x @ W.T + b nor x @ W + b "
            f"({'; '.join(dict.fromkeys(failures))}): a quantized, adapted or routing "
            f"layer?")


def _linear_gap(module: nn.Module, transposed: bool) -> float | str:
    """How far ``module``'s forward is from the form on a random call, or why it could
    not be compared."""
    weight = module._parameters["weight"]
    assert weight is not None
    g = torch.Generator().manual_seed(11)
    w = torch.randn(tuple(weight.shape), generator=g, device="cpu", dtype=torch.float32)
    bias = module._parameters.get("bias")
    b = None if bias is None else torch.randn(tuple(bias.shape), generator=g, device="cpu",
                                               dtype=torch.float32)
    features = w.shape[0] if transposed else w.shape[1]
    x = torch.randn(2, 3, features, generator=g, device="cpu", dtype=torch.float32)
    probe = probe_copy(module, parameters={"weight": w, **({} if b is None else {"bias": b})})
    try:
        with torch.no_grad():
            got = type(module).forward(probe, x)
    except Exception as exc:
        return f"called on [..., {features}] it raised {type(exc).__name__}"
    want = torch.nn.functional.linear(x, w.t() if transposed else w, b)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return "it does not return one tensor of the linear's shape"
    return gap(got, want)


def _linear_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` through ``ops.linear``."""
    params = self._parameters
    try:
        return linear(input, params["weight"], params.get("bias"))  # type: ignore[arg-type]
    except KeyError:  # parametrized since: its weight is a property
        return linear(input, self.weight, getattr(self, "bias", None))  # type: ignore[arg-type]


def _transposed_linear_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    """``x @ W + b`` (the weight stored ``[in, out]``, GPT-2's ``Conv1D``) through
    ``ops.linear``, with a transposed view of the weight."""
    params = self._parameters
    weight: Any
    try:
        weight = params["weight"]
    except KeyError:  # parametrized since: its weight is a property
        weight = self.weight
    return linear(input, weight.t(), params.get("bias"))


def _route(module: nn.Module) -> Installed | str:
    form = linear_form(module)
    if isinstance(form, str):
        return form
    forward = _transposed_linear_forward if form.transposed else _linear_forward
    return Installed(forward, form.describe(), form)


#: Linear layers: whole modules, whose parameters reach astrai; the ``torch`` row computes
#: what the modules do (``F.linear``).
RECOGNITION = ModelRecognition(claims=is_linear_kind, module=_route, holds_weights=True,
                               plain_row="torch")
