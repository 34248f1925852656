"""The ``gated_rms_norm`` family: an RMS norm gated by ``silu(gate)``, the norm of
state-space and gated-delta-net mixers' outputs (``RMSNormGated``).

Its declaration is its schema: the facade ``gated_rms_norm(x, weight, gate=None,
eps=1e-6, gate_first=False, backend=None)`` with ``x [..., groups, size]``, ``gate`` of ``x``'s
shape and ``weight [groups, size]`` (see ``astrai.backends.gated_rms_norm``), its checks,
its axes (``dtype``, ``device_cuda``, ``ndim``, ``grad_enabled``; lazily ``device``,
``sm`` and ``tokens``) and the compiled path's reading follow from it
(``astrai.dispatch.schema``).

Its model recognition, here too: a module without children whose class is an RMS norm
and whose ``forward`` takes ``(x, gate)``, holding one weight vector, an epsilon
(``variance_epsilon``, ``eps``) and a group size where it normalises groups of features
(``group_size``; ``n_groups``), whose own ``forward`` - run on a copy holding a random
weight, in float32 and bfloat16, with a gate and without one where it takes none - equals
one of the two forms (gate after the norm or before it) within one rounding. Its calls
go to the facade with ``x`` and ``gate`` viewed ``[..., groups, size]`` and the weight
``[groups, size]``, read on every call; a call the facade cannot take as the module would
(a weight of another dtype than ``x``, a gate of another shape) runs the module's own
forward, warned once and counted under the origin ``model``.
"""

from __future__ import annotations

__all__ = ["FAMILY", "GATED_RMS_NORM", "RECOGNITION", "SCHEMA", "gated_rms_norm"]

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from astrai.backends.gated_rms_norm import reference_gated_rms_norm
from astrai.dispatch.log import warn_once
from astrai.dispatch.schema import Scalar, Schema, Tensor
from astrai.dispatch.stats import count_model_own
from astrai.families import Family, declare
from astrai.families.recognition import Installed, ModelRecognition
from astrai.families.rms_norm.model import is_rms_kind
from astrai.recognition.inspection import further_inputs
from astrai.recognition.probe import gap, probe_copy

SCHEMA = Schema("gated_rms_norm", {
    "x": Tensor("..., g, s", floating=True),
    "weight": Tensor("g, s", dtype="x"),
    "gate": Tensor("..., g, s", optional=True, dtype="x", like="x"),
    "eps": Scalar("float", ge=0, default=1e-6),
    "gate_first": Scalar("bool", default=False),
}, doc="An RMS norm over the last dimension of ``x``, scaled by ``weight`` and gated by "
       "``silu(gate)`` after the norm (or before it: ``gate_first``), through the "
       "``gated_rms_norm`` table.", module=__name__)
GATED_RMS_NORM = SCHEMA.facade()
gated_rms_norm: Callable[..., torch.Tensor] = GATED_RMS_NORM.function

_EPS_NAMES = ("variance_epsilon", "eps", "epsilon")
_FP32_TOL = 1e-5
_BF16_TOL = 2.0 ** -7


def _claims(module: nn.Module) -> bool:
    """An RMS norm class without children whose forward takes a gate besides its input."""
    return (not module._modules and is_rms_kind(module)
            and further_inputs(module)[:1] == ["gate"])


def _eps(module: nn.Module) -> str | None:
    for name in _EPS_NAMES:
        value = module.__dict__.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
            return name
    return None


def _group(module: nn.Module, features: int) -> int | str:
    """The size of the groups ``module`` normalises (``features``: one group)."""
    size = module.__dict__.get("group_size")
    groups = module.__dict__.get("n_groups")
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        got = size
    elif isinstance(groups, int) and not isinstance(groups, bool) and groups > 0:
        if features % groups:
            return f"its {groups} groups do not divide its {features} features"
        got = features // groups
    else:
        got = features
    if features % got:
        return f"its group size {got} does not divide its {features} features"
    return got


def _form(module: nn.Module) -> tuple[str, int, bool, bool] | str:
    """``(epsilon attribute, group size, gate_first, ungated)``, or why the family cannot
    serve ``module``; ``ungated``: called without a gate it computes the norm alone (else
    such a call runs its own forward)."""
    extra = further_inputs(module)
    if extra != ["gate"]:
        return f"its forward takes {', '.join(extra)} besides its input, not a gate alone"
    weight = module._parameters.get("weight")
    held = [n for n, _ in module.named_parameters() if n != "weight"]
    held += [n for n, b in module.named_buffers() if b is not None]
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or held:
        return "it holds no single weight vector (or more than one)"
    eps_attr = _eps(module)
    if eps_attr is None:
        return f"no epsilon attribute astrai knows ({', '.join(_EPS_NAMES)}) holds a number"
    group = _group(module, weight.shape[0])
    if isinstance(group, str):
        return group
    failures = []
    for gate_first in (False, True):
        why = _compare(module, eps_attr, group, gate_first)
        if why is None:
            return eps_attr, group, gate_first, _ungated(module, eps_attr, group)
        failures.append(why)
    return (f"its output matches neither gated RMS norm form (gate after the norm: "
            f"{failures[0]}; before it: {failures[1]})")


def _compare(module: nn.Module, eps_attr: str, group: int, gate_first: bool) -> str | None:
    """Why ``module``'s own forward differs from the form, or ``None``."""
    features = module._parameters["weight"].shape[0]  # type: ignore[union-attr]
    eps = float(module.__dict__[eps_attr])
    g = torch.Generator().manual_seed(features)
    weight = torch.randn(features, generator=g)
    x = torch.randn(3, features, generator=g)
    x[0] *= math.sqrt(eps) if eps > 0 else 1e-3
    gate = torch.randn(3, features, generator=g) * 2
    probe = probe_copy(module)
    for dtype in (torch.float32, torch.bfloat16):
        w = nn.Parameter(weight.to(dtype), requires_grad=False)
        probe._parameters["weight"] = w
        xd, gd = x.to(dtype), gate.to(dtype)
        try:
            with torch.no_grad():
                got = type(module).forward(probe, xd, gd)
        except Exception as exc:
            return f"its forward raised {type(exc).__name__} on a {dtype} input"
        want = _serve(reference_gated_rms_norm, xd, gd, w, eps, group, gate_first)
        if not isinstance(got, torch.Tensor) or got.dtype != dtype:
            return f"with {dtype} input it does not return a {dtype} tensor"
        tol = _FP32_TOL if dtype == torch.float32 else _BF16_TOL
        if not gap(got, want) <= 4 * tol:
            return f"with {dtype} input it differs by {gap(got, want):.2g}"
    return None


def _ungated(module: nn.Module, eps_attr: str, group: int) -> bool:
    """Whether ``module`` called without a gate returns the norm alone (Mamba-2's does;
    Qwen3-Next's needs its gate)."""
    features = module._parameters["weight"].shape[0]  # type: ignore[union-attr]
    g = torch.Generator().manual_seed(features + 1)
    weight = torch.randn(features, generator=g)
    x = torch.randn(3, features, generator=g)
    probe = probe_copy(module, parameters={"weight": weight})
    try:
        with torch.no_grad():
            got = type(module).forward(probe, x, None)
    except Exception:
        return False
    want = _serve(reference_gated_rms_norm, x, None, weight,
                  float(module.__dict__[eps_attr]), group, False)
    return gap(got, want) <= 4 * _FP32_TOL


def _serve(row: Callable[..., torch.Tensor], x: torch.Tensor, gate: torch.Tensor | None,
           weight: torch.Tensor, eps: float, group: int, gate_first: bool) -> torch.Tensor:
    """``row`` on ``x`` and ``gate`` viewed ``[..., groups, group]``, the result back in
    ``x``'s shape."""
    shape = (*x.shape[:-1], x.shape[-1] // group, group)
    out = row(x.reshape(shape), weight.view(-1, group),
              None if gate is None else gate.reshape(shape), eps, gate_first)
    return out.reshape(x.shape)


def _forward(eps_attr: str, group: int, gate_first: bool, ungated: bool
             ) -> Callable[..., Any]:
    def gated_rms_norm_forward(self: nn.Module, hidden_states: torch.Tensor,
                               gate: torch.Tensor | None = None) -> Any:
        weight: Any = self._parameters.get("weight")
        if weight is None:  # parametrized since: its parameters are properties
            weight = self.weight
        if not (isinstance(hidden_states, torch.Tensor) and isinstance(weight, torch.Tensor)
                and weight.dtype == hidden_states.dtype and hidden_states.dim() >= 1
                and hidden_states.shape[-1] % group == 0
                and ((gate is None and ungated)
                     or (isinstance(gate, torch.Tensor) and gate.shape == hidden_states.shape
                         and gate.dtype == hidden_states.dtype))):
            warn_once(f"astrai: a call of {type(self).__name__} runs its own forward: its "
                      f"input, gate and weight are not of one dtype and shape (or it was "
                      f"given no gate, which it was not seen to take)")
            count_model_own("gated_rms_norm")
            return type(self).forward(self, hidden_states, gate)
        return _serve(gated_rms_norm, hidden_states, gate, weight,
                      self.__dict__[eps_attr], group, gate_first)

    return gated_rms_norm_forward


def _route(module: nn.Module) -> Installed | str:
    form = _form(module)
    if isinstance(form, str):
        return form
    eps_attr, group, gate_first, ungated = form
    features = module._parameters["weight"].shape[0]  # type: ignore[union-attr]
    detail = (f"gate {'before' if gate_first else 'after'} the norm, eps from .{eps_attr}"
              + (f", groups of {group}" if group != features else ""))
    return Installed(_forward(eps_attr, group, gate_first, ungated), detail, form)


#: Gated RMS norms: whole modules, whose weight reaches astrai.
RECOGNITION = ModelRecognition(claims=_claims, module=_route, holds_weights=True,
                               plain_row="transformers")
FAMILY = declare(Family("gated_rms_norm", (GATED_RMS_NORM,), model=RECOGNITION))
