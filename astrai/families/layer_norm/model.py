"""Layer norms in a model: which modules compute one, told by what they compute, and the
forward that sends their calls to ``ops.layer_norm``.

A module without children that is ``torch.nn.LayerNorm`` or whose class is named a layer
norm (``...LayerNorm...``, not an RMS norm such as T5's), holding at most a weight and a
bias vector, is run - its class's own ``forward``, on a copy holding random parameters,
hooks left out - on small inputs (float32, and bfloat16 where it takes it; one row whose
variance is small enough that epsilon matters) and compared with ``layer_norm`` of its
weight and bias. Epsilon is read from the module's attribute (``eps``,
``variance_epsilon``, ``epsilon``, ``layer_norm_eps``) or, for a module that writes it
into its forward (OLMo's), found among the usual values by the same comparison. It is
served when it matches within float32 tolerance in float32 and one rounding in bfloat16:
``nn.LayerNorm`` in any dtype, the float32-upcast forms (OLMo's weightless norm,
Cohere's norm without a bias), and a norm scaling by ``1 + weight`` (Nemotron's
``LayerNorm1P``), whose forward adds the one on every call as the model's does.
"""

from __future__ import annotations

__all__ = ["RECOGNITION", "LayerNormForm", "is_layer_norm_kind", "layer_norm_form"]

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from astrai.backends.layer_norm import reference_layer_norm
from astrai.families.layer_norm import layer_norm
from astrai.families.recognition import Installed, ModelRecognition, Refused
from astrai.families.rms_norm.model import is_rms_kind
from astrai.recognition.inspection import further_inputs
from astrai.recognition.probe import probe_copy

#: The epsilon attributes layer norms carry, in the order they are tried.
EPS_NAMES = ("eps", "variance_epsilon", "epsilon", "layer_norm_eps", "norm_eps")
#: The epsilons tried for a module that holds none (it writes one into its forward).
_USUAL_EPS = (1e-5, 1e-6, 1e-12, 1e-8)
_LAYER_NAME = re.compile(r"layer.?norm", re.IGNORECASE)
_FP32_TOL = 1e-5
_BF16_TOL = 2.0 ** -7


@dataclass(frozen=True)
class LayerNormForm:
    """How to serve one layer norm module through ``astrai.ops.layer_norm``."""

    eps_attr: str | None  # the attribute holding epsilon, read on every call; or None:
    eps: float  # the epsilon its forward writes
    weight: bool  # it holds a weight (read on every call)
    bias: bool  # it holds a bias
    offset: float = 0.0  # it scales by ``offset + weight`` (Nemotron's LayerNorm1P: 1)

    def describe(self) -> str:
        """The form in words, for the report."""
        scale = f"{self.offset:g} + weight" if self.offset else "weight"
        held = [n for n, has in ((scale, self.weight), ("bias", self.bias)) if has]
        eps = f"eps from .{self.eps_attr}" if self.eps_attr else f"eps {self.eps:g} (fixed)"
        return f"{' and '.join(held) or 'no weight'}, {eps}"


def is_layer_norm_kind(module: nn.Module) -> bool:
    """Whether ``module`` may compute a layer norm: ``nn.LayerNorm``, or a class named
    ``...LayerNorm...`` that is no RMS norm, without children."""
    if module._modules:
        return False
    if isinstance(module, nn.LayerNorm):
        return True
    name = type(module).__name__
    return bool(_LAYER_NAME.search(name)) and not is_rms_kind(module)


def _eps_value(module: nn.Module, name: str) -> float | None:
    value = module.__dict__.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        return None
    return float(value)


def layer_norm_form(module: nn.Module) -> LayerNormForm | str:
    """``module``'s ``LayerNormForm``, or why ``ops.layer_norm`` cannot serve it."""
    more = further_inputs(module)
    if more:
        return (f"its forward takes {', '.join(more)} besides its input (called as "
                f"norm(x, {more[0]})): astrai's layer_norm serves norm(x) alone")
    params = {n: p for n, p in module._parameters.items() if p is not None}
    extra = sorted(set(params) - {"weight", "bias"})
    extra += [n for n, b in module.named_buffers(recurse=False) if b is not None]
    if extra:
        return f"it holds more than a weight and a bias ({', '.join(extra)})"
    shape = getattr(module, "normalized_shape", None)
    if isinstance(shape, (tuple, list)) and len(shape) != 1:
        return f"it normalises over {tuple(shape)}, more than the last dimension"
    for name, p in params.items():
        if p.dim() != 1 or not p.is_floating_point():
            return f"its {name} is {p.dtype} {list(p.shape)}, not a vector of floats"
    sizes = {p.shape[0] for p in params.values()}
    if isinstance(shape, (tuple, list)):
        sizes.add(int(shape[0]))
    if len(sizes) != 1:
        return ("it says no feature size (no weight, no normalized_shape)" if not sizes
                else f"its parameters disagree on the feature size ({sorted(sizes)})")
    features = sizes.pop()
    candidates: list[tuple[str | None, float]] = [
        (n, v) for n in EPS_NAMES if (v := _eps_value(module, n)) is not None]
    candidates = candidates or [(None, e) for e in _USUAL_EPS]
    failures: list[str] = []
    offsets = (0.0, 1.0) if "weight" in params else (0.0,)
    for attr, eps in candidates:
        for offset in offsets:
            form = LayerNormForm(attr, eps, "weight" in params, "bias" in params, offset)
            got = _compare(module, form, features)
            if got is None:
                return form
            failures.append(got)
    return (f"its output matches layer_norm of its weight and bias for no epsilon "
            f"({min(failures, key=len)})")


def _compare(module: nn.Module, form: LayerNormForm, features: int) -> str | None:
    """Why ``module``'s own forward differs from ``form``, or ``None`` when it does not."""
    g = torch.Generator().manual_seed(features)
    weight = torch.randn(features, generator=g) if form.weight else None
    bias = torch.randn(features, generator=g) if form.bias else None
    probe = probe_copy(module, parameters={n: v for n, v in (("weight", weight), ("bias", bias))
                                           if v is not None})
    ran = 0
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(4, features, generator=g)
        x[0] = x[0] * math.sqrt(form.eps)  # a row whose variance is about eps
        x = x.to(dtype)
        probe._parameters = {n: None if p is None else nn.Parameter(p.to(dtype),
                                                                    requires_grad=False)
                             for n, p in probe._parameters.items()}
        try:
            with torch.no_grad():
                got = type(module).forward(probe, x)
        except Exception as exc:
            if dtype == torch.float32:
                return f"its forward raised {type(exc).__name__} on a float32 input"
            continue
        w, b = probe._parameters.get("weight"), probe._parameters.get("bias")
        scale = None if not form.weight or w is None else (w + form.offset if form.offset
                                                            else w)
        want = reference_layer_norm(x, scale, b if form.bias else None, form.eps)
        if not isinstance(got, torch.Tensor) or got.shape != want.shape or (
                got.dtype != want.dtype):
            return f"with a {dtype} input it does not return a {dtype} tensor of x's shape"
        tol = _FP32_TOL if dtype == torch.float32 else _BF16_TOL
        err = ((got.float() - want.float()).abs() / (want.float().abs() + 1.0)).max().item()
        if not err <= 2 * tol:
            return f"with a {dtype} input it differs by {err:.2g}"
        ran += 1
    return None if ran else "it ran on no input"


def _layer_norm_forward(form: LayerNormForm) -> Callable[..., Any]:
    """A layer norm module's forward through ``ops.layer_norm``: its weight and bias read
    from its parameters, epsilon from its attribute (or the one its forward writes), on
    every call. Holds no module (a copy of the model binds it to the copy)."""
    attr, fixed, has_weight, has_bias = form.eps_attr, form.eps, form.weight, form.bias
    offset = form.offset

    def layer_norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        params = self._parameters
        weight: Any
        bias: Any
        try:
            weight = params["weight"] if has_weight else None
            bias = params["bias"] if has_bias else None
        except KeyError:  # parametrized since: its parameters are properties
            weight = self.weight if has_weight else None
            bias = self.bias if has_bias else None
        eps = self.__dict__[attr] if attr is not None else fixed
        if offset and weight is not None:
            weight = weight + offset
        return layer_norm(hidden_states, weight, bias, eps)

    return layer_norm_forward


def _route(module: nn.Module) -> Installed | Refused:
    form = layer_norm_form(module)
    if isinstance(form, str):
        return Refused(form)
    return Installed(_layer_norm_forward(form), form.describe(), form)


#: Layer norms: whole modules, whose parameters reach astrai.
RECOGNITION = ModelRecognition(claims=is_layer_norm_kind, module=_route, holds_weights=True)
