"""The ``xielu`` family: xIELU, the activation with two trainable coefficients of
Apertus (transformers' ``XIELUActivation``).

Its declaration is its schema: the facade ``xielu(x, alpha_p, alpha_n, beta=0.5,
eps=-1e-6, backend=None)`` with ``x`` of any shape and the module's raw one-element
parameters (see ``astrai.backends.xielu``), its checks, its axes (``dtype``,
``device_cuda``, ``ndim``, ``grad_enabled``; lazily ``device``, ``sm`` and ``tokens``)
and the compiled path's reading follow from it (``astrai.dispatch.schema``).

Its model recognition, here too: a module without children holding exactly two
one-element parameters ``alpha_p`` and ``alpha_n``, with ``beta`` and ``eps`` held as
numbers or one-element tensors, whose own ``forward`` - run on a copy holding random
coefficients, in float32 and bfloat16, over [-8, 8] - equals the facade's within one
rounding. Its calls go to the facade with the module's parameters, read on every call,
and ``beta`` and ``eps`` as they were read at dispatch (the module keeps them fixed).
"""

from __future__ import annotations

__all__ = ["FAMILY", "RECOGNITION", "SCHEMA", "XIELU", "xielu"]

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from astrai.backends.xielu import reference_xielu
from astrai.dispatch.schema import Scalar, Schema, Tensor
from astrai.families import Family, declare
from astrai.families.recognition import Installed, ModelRecognition
from astrai.recognition.probe import gap, probe_copy

SCHEMA = Schema("xielu", {
    "x": Tensor("...", floating=True),
    "alpha_p": Tensor("1", floating=True),
    "alpha_n": Tensor("1", floating=True),
    "beta": Scalar("float", default=0.5),
    "eps": Scalar("float", le=0, default=-1e-6),
}, doc="xIELU of ``x`` with the raw coefficients ``alpha_p`` and ``alpha_n`` (softplus is "
       "applied to each), through the ``xielu`` table.", module=__name__)
XIELU = SCHEMA.facade()
xielu: Callable[..., torch.Tensor] = XIELU.function

_COEFFICIENTS = ("alpha_p", "alpha_n")
_FP32_TOL = 1e-5
_BF16_TOL = 2.0 ** -7  # one rounding of bfloat16, relative


def _claims(module: nn.Module) -> bool:
    """A module without children holding the two one-element coefficients."""
    params = dict(module.named_parameters(recurse=False))
    return (not module._modules and set(params) == set(_COEFFICIENTS)
            and all(p.numel() == 1 for p in params.values()))


def _number(module: nn.Module, name: str) -> float | None:
    """``module``'s ``beta`` or ``eps`` as a number: an attribute or a one-element buffer."""
    value = getattr(module, name, None)
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_meta:
            return None
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _form(module: nn.Module) -> tuple[float, float] | str:
    """``(beta, eps)`` for ``module``, or why the facade does not compute what it does."""
    beta, eps = _number(module, "beta"), _number(module, "eps")
    if beta is None or eps is None:
        return "it holds alpha_p and alpha_n but no beta and eps as numbers astrai reads"
    if eps > 0:
        return f"its eps ({eps:g}) is positive: xIELU's bounds the negative branch below 0"
    g = torch.Generator().manual_seed(11)
    for dtype, tol in ((torch.float32, _FP32_TOL), (torch.bfloat16, _BF16_TOL)):
        coefficients = {n: (torch.randn(1, generator=g) * 0.5).to(dtype) for n in _COEFFICIENTS}
        probe = probe_copy(module, parameters=coefficients)
        x = (torch.rand(4, 64, generator=g) * 16 - 8).to(dtype)
        with torch.no_grad():
            try:
                got = type(module).forward(probe, x)
            except Exception as exc:
                return f"its forward raised {type(exc).__name__} on a random input"
            want = reference_xielu(x, coefficients["alpha_p"], coefficients["alpha_n"], beta,
                                   eps)
        if not gap(got, want) <= tol:
            return (f"its forward computes something else than xIELU (differs by "
                    f"{gap(got, want):.2g} in {str(dtype).removeprefix('torch.')})")
    return beta, eps


def _forward(beta: float, eps: float) -> Callable[..., torch.Tensor]:
    def xielu_forward(self: nn.Module, input: torch.Tensor, *args: Any, **kwargs: Any
                      ) -> torch.Tensor:
        return xielu(input, self.alpha_p, self.alpha_n, beta, eps)

    return xielu_forward


def _route(module: nn.Module) -> Installed | str:
    form = _form(module)
    if isinstance(form, str):
        return form
    beta, eps = form
    return Installed(_forward(beta, eps), f"beta {beta:g}, eps {eps:g}", form)


#: xIELU activations: whole modules, whose coefficients reach astrai.
RECOGNITION = ModelRecognition(claims=_claims, module=_route, holds_weights=True,
                               plain_row="torch")
FAMILY = declare(Family("xielu", (XIELU,), model=RECOGNITION))
