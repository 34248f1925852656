"""The ``depthwise_conv1d`` family: each channel convolved with its own kernel over time
(the causal convolution of state-space, gated-delta-net and short-convolution mixers).

Its declaration is its schema: the facade ``depthwise_conv1d(x, weight, bias=None,
padding=0, backend=None)`` with ``x [batch, channels, time]``, ``weight [channels, 1,
taps]`` and ``bias [channels]``, its checks, its axes (``dtype``, ``device_cuda``,
``ndim``, ``grad_enabled``; lazily ``device`` and ``sm``) and the compiled path's reading
follow from it (``astrai.dispatch.schema``). Its model recognition, here too: a
``torch.nn.Conv1d`` with one group per channel (as many groups as input and output
channels), stride and dilation 1 and zero padding of a fixed size, whose own ``forward``
on a random input equals the row's; its calls go to the facade with the module's weight,
bias and padding, read on every call.
"""

from __future__ import annotations

__all__ = ["DEPTHWISE_CONV1D", "FAMILY", "RECOGNITION", "SCHEMA", "depthwise_conv1d"]

from collections.abc import Callable

import torch
from torch import nn

from astrai.backends.depthwise_conv1d import reference_depthwise_conv1d
from astrai.dispatch.schema import Scalar, Schema, Tensor
from astrai.families import Family, declare
from astrai.families.depthwise_conv1d.causal import causal_sites
from astrai.families.recognition import Installed, ModelRecognition
from astrai.recognition.probe import gap, probe_copy

SCHEMA = Schema("depthwise_conv1d", {
    "x": Tensor("b, c, t", floating=True),
    "weight": Tensor("c, 1, k", dtype="x"),
    "bias": Tensor("c", optional=True, dtype="x"),
    "padding": Scalar("int", ge=0, default=0),
}, doc="Each channel of ``x`` convolved with its own kernel after ``padding`` zeros on "
       "both sides of time, plus ``bias``, through the ``depthwise_conv1d`` table.",
    module=__name__)
DEPTHWISE_CONV1D = SCHEMA.facade()
depthwise_conv1d: Callable[..., torch.Tensor] = DEPTHWISE_CONV1D.function


def _claims(module: nn.Module) -> bool:
    """A ``torch.nn.Conv1d`` with one group per channel."""
    return (isinstance(module, nn.Conv1d) and module.groups > 1
            and module.groups == module.in_channels == module.out_channels)


def _form(module: nn.Conv1d) -> int | str:
    """The padding the row takes for ``module``, or why the row cannot serve it."""
    if module.stride != (1,) or module.dilation != (1,):
        return f"stride {module.stride[0]} and dilation {module.dilation[0]}: the row " \
               f"steps one sample at a time"
    if module.padding_mode != "zeros":
        return f"it pads with {module.padding_mode!r}, the row with zeros"
    padding = module.padding
    if isinstance(padding, str):
        if padding != "valid":
            return f"padding {padding!r}: the row pads both sides by one size"
        size = 0
    else:
        size = int(padding[0])
    weight = module.weight
    g = torch.Generator().manual_seed(module.in_channels)
    taps = weight.shape[-1]
    w = torch.randn(weight.shape, generator=g)
    b = None if module.bias is None else torch.randn(module.in_channels, generator=g)
    probe = probe_copy(module, parameters={"weight": w, "bias": b})
    x = torch.randn(2, module.in_channels, taps + 3, generator=g)
    with torch.no_grad():
        try:
            got = type(module).forward(probe, x)  # type: ignore[arg-type]
        except Exception as exc:
            return f"its forward raised {type(exc).__name__} on a random input"
        want = reference_depthwise_conv1d(x, w, b, size)
    if not gap(got, want) <= 1e-5:
        return (f"its forward computes something else (differs by {gap(got, want):.2g} on "
                f"a random input)")
    return size


def _forward(padding: int) -> Callable[..., torch.Tensor]:
    def depthwise_conv1d_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
        return depthwise_conv1d(input, self.weight, self.bias, padding)

    return depthwise_conv1d_forward


def _route(module: nn.Module) -> Installed | str:
    assert isinstance(module, nn.Conv1d)
    form = _form(module)
    if isinstance(form, str):
        return form
    taps = module.weight.shape[-1]
    return Installed(_forward(form), f"{taps} taps, padding {form}", form)


#: Depthwise 1-d convolutions: whole modules, whose parameters reach astrai, and those a
#: layer hands to ``causal_conv1d_forward`` (``causal``).
RECOGNITION = ModelRecognition(claims=_claims, module=_route,
                               sites=causal_sites(depthwise_conv1d, _claims),
                               holds_weights=True, plain_row="torch")
FAMILY = declare(Family("depthwise_conv1d", (DEPTHWISE_CONV1D,), model=RECOGNITION))
