"""RMS norms in a model: which modules compute one, told by what they compute, and
the forward that sends their calls to ``ops.rms_norm``.

A module whose class is an RMS norm by name (or ``torch.nn.RMSNorm``), with one weight
vector and an epsilon attribute, is run - its class's own ``forward``, on a copy holding
a random weight, hooks left out - on a few small inputs (float32; bfloat16 with a
bfloat16 and with a float32 weight; one row small enough that epsilon matters), and
compared with each form the facade computes (weight applied in float32 or after the
cast back; ``weight`` or ``1 + weight``). The form that equals it, within float32
tolerance in float32 and within one rounding in bfloat16 (the closest in bfloat16 when
two pass), is the module's; none that does is a reason.
"""

from __future__ import annotations

__all__ = ["EPS_NAMES", "RECOGNITION", "NormForm", "is_rms_kind", "rms_norm_form"]

import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from astrai.backends.rms_norm import reference_rms_norm
from astrai.families.recognition import Installed, ModelRecognition
from astrai.families.rms_norm import rms_norm_form as rms_norm_call
from astrai.recognition.inspection import further_inputs
from astrai.recognition.probe import probe_copy

#: The epsilon attributes RMS norms carry, in the order they are tried.
EPS_NAMES = ("variance_epsilon", "eps", "epsilon", "rms_norm_eps", "norm_eps")
_TORCH_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase,
                nn.LocalResponseNorm)
_RMS_NAME = re.compile(r"rms.?norm|t5layernorm|l2.?norm", re.IGNORECASE)


@dataclass(frozen=True)
class NormForm:
    """How to serve one RMS norm module through ``astrai.ops.rms_norm``."""

    eps_attr: str  # the attribute holding epsilon, read on every call
    weight_offset: float  # 0.0, or 1.0 for Gemma's (1 + weight)
    cast_before_weight: bool  # LlamaRMSNorm: weight * normed.to(input dtype)
    eps_from_dtype: bool = False  # torch.nn.RMSNorm with eps=None: torch's default_eps
    weightless: bool = False  # no weight at all (Llama 4's QK norm): no scaling

    def describe(self) -> str:
        """The form in words, for the report."""
        parts = ["no weight" if self.weightless
                 else "weight after the cast back (LlamaRMSNorm)" if self.cast_before_weight
                 else "weight in float32"]
        if self.weight_offset:
            parts.append(f"{self.weight_offset:g} + weight")
        parts.append("eps as torch's rms_norm takes eps=None" if self.eps_from_dtype
                     else f"eps from .{self.eps_attr}")
        return ", ".join(parts)

    def keywords(self) -> dict[str, Any]:
        """The facade's feature keywords for this form."""
        out: dict[str, Any] = {}
        if self.weight_offset:
            out["weight_offset"] = self.weight_offset
        if self.cast_before_weight:
            out["cast_before_weight"] = True
        return out


def is_rms_kind(module: nn.Module) -> bool:
    """Whether ``module`` is an RMS norm by class (``torch.nn.RMSNorm``, or a class named
    ``...RMSNorm...``) - not a module composed of others holding weights (AXK2's gated
    norm wraps its RMS norm and a gate MLP, which are served on their own)."""
    if isinstance(module, nn.RMSNorm):
        return True
    return bool(_RMS_NAME.search(type(module).__name__)) and not any(
        next(child.parameters(), None) is not None for child in module.children())



#: The forms tried, as ``(weight_offset, cast_before_weight)``.
_FORMS = ((0.0, True), (0.0, False), (1.0, False), (1.0, True))
_FP32_TOL = 1e-5
_BF16_TOL = 2.0 ** -7  # one rounding of bfloat16 (8 bits of mantissa), relative


def rms_norm_form(module: nn.Module) -> NormForm | str:
    """``module``'s ``NormForm``, or why it cannot be served as an RMS norm."""
    cls = type(module)
    if isinstance(module, _TORCH_NORMS):
        return f"torch.nn.{cls.__name__} is not an RMS norm (astrai has no family for it)"
    if not (isinstance(module, nn.RMSNorm) or _RMS_NAME.search(cls.__name__)):
        return ("not an RMS norm by its class name, so astrai does not try to serve it "
                "(astrai has no family for other norms)")
    more = further_inputs(module)
    if more:
        return (f"its forward takes {', '.join(more)} besides its input (called as "
                f"norm(x, {more[0]})): astrai's rms_norm serves norm(x) alone")
    weight = module._parameters.get("weight")
    held = [n for n, _ in module.named_parameters(recurse=True)]
    buffers = [n for n, b in module.named_buffers(recurse=False) if b is not None]
    if weight is None and not held and not module._modules:
        # buffers it holds (Falcon-Mamba's unused ones) are filled with noise in the
        # probes: a norm that reads them does not match
        return _weightless_form(module)
    held += buffers
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return "it has no weight vector (astrai's rms_norm scales by a weight of [features])"
    extra = [n for n, p in module.named_parameters(recurse=True) if n != "weight"]
    extra += [n for n, b in module.named_buffers(recurse=True) if b is not None]
    if extra:
        return f"it holds more than a weight ({', '.join(extra)}), which astrai would ignore"
    if not weight.is_floating_point():
        return f"its weight is {weight.dtype}, so what it computes cannot be checked"
    if isinstance(module, nn.RMSNorm) and tuple(module.normalized_shape) != tuple(weight.shape):
        return f"it normalises over {tuple(module.normalized_shape)}, more than the last dim"
    eps_names = [n for n in EPS_NAMES if _eps_value(module, n) is not _NO_EPS]
    if not eps_names:
        return (f"no epsilon attribute astrai knows ({', '.join(EPS_NAMES)}) holds a "
                f"number")
    best: tuple[float, NormForm] | None = None
    failures: list[str] = []
    for name in eps_names:
        from_dtype = _eps_value(module, name) is None
        probes = _probes(module, name, from_dtype)
        for offset, cast in _FORMS:
            form = NormForm(name, offset, cast, from_dtype)
            got = _compare(probes, form)
            if isinstance(got, str):
                failures.append(got)
            elif best is None or got < best[0]:
                best = (got, form)
    if best is None:
        reason = min(failures, key=len) if failures else "no probe ran"
        return f"its output matches no RMS norm form astrai serves ({reason})"
    return best[1]


def _weightless_form(module: nn.Module) -> NormForm | str:
    """The form of an RMS norm that holds no weight (Llama 4's ``L2Norm``): normalised,
    not scaled."""
    eps_names = [n for n in EPS_NAMES if _eps_value(module, n) is not _NO_EPS]
    if not eps_names:
        return (f"no epsilon attribute astrai knows ({', '.join(EPS_NAMES)}) holds a "
                f"number")
    failures: list[str] = []
    for name in eps_names:
        from_dtype = _eps_value(module, name) is None
        form = NormForm(name, 0.0, False, from_dtype, weightless=True)
        got = _compare(_probes(module, name, from_dtype, weightless=True), form)
        if not isinstance(got, str):
            return form
        failures.append(got)
    return f"its output matches no RMS norm form astrai serves ({min(failures, key=len)})"


_NO_EPS: Any = object()


@functools.cache
def default_eps(dtype: torch.dtype) -> float:
    """The epsilon torch's ``rms_norm`` takes for ``eps=None`` on ``dtype`` inputs,
    measured once per dtype (the machine epsilon of the input's dtype in some torch
    versions, of the float type it computes in - float32 for the half types - in
    others)."""
    candidates = dict.fromkeys(torch.finfo(d).eps for d in (dtype, torch.float32,
                                                           torch.float64))
    for eps in candidates:  # a row whose mean square is eps tells them apart
        x = torch.full((2, 16), math.sqrt(eps), dtype=torch.float64)
        x[1] = 1.0
        x = x.to(dtype)
        with torch.no_grad():
            plain = torch.nn.functional.rms_norm(x, (16,), None, None)
            if torch.equal(plain, torch.nn.functional.rms_norm(x, (16,), None, eps)):
                return eps
    return torch.finfo(dtype).eps


def _eps_value(module: nn.Module, name: str) -> Any:
    """The epsilon ``module.name`` holds (``None`` only for ``torch.nn.RMSNorm``'s
    default), or ``_NO_EPS``."""
    value = module.__dict__.get(name, _NO_EPS)
    if value is None and isinstance(module, nn.RMSNorm) and name == "eps":
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        return _NO_EPS
    return float(value)


def _probe_inputs(hidden: int, eps: float, dtype: torch.dtype, device: torch.device
                  ) -> torch.Tensor:
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(4, hidden, generator=g, device="cpu")
    x[0] *= math.sqrt(eps) if eps > 0 else 1e-3  # a row whose mean square is about eps
    return x.to(device=device, dtype=dtype)


#: One probe: the input, the weight, epsilon, and the module's own output (or ``None``
#: when it does not take that dtype combination).
_Probe = tuple[torch.Tensor, torch.Tensor | None, float, Any]
#: The dtypes of (input, weight) a norm is probed in.
_PROBE_DTYPES = ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                 (torch.bfloat16, torch.float32))


def _probes(module: nn.Module, eps_attr: str, eps_from_dtype: bool,
            weightless: bool = False) -> list[_Probe]:
    """The module's own forward on each probe (run once, whatever forms it is compared
    with), a random weight in its copy (none for a weightless norm)."""
    weight = None if weightless else module._parameters["weight"]
    device = torch.device("cpu")
    shape = getattr(module, "normalized_shape", None)
    if weight is not None:
        hidden = weight.shape[0]  # a meta weight is probed too
    elif isinstance(shape, (tuple, list)) and len(shape) == 1 and isinstance(shape[0], int):
        hidden = shape[0]  # a weightless torch.nn.RMSNorm takes only its own size
    else:
        hidden = 64
    g = torch.Generator().manual_seed(hidden + 1)
    random_weight = torch.randn(hidden, generator=g, device=device)
    probes: list[_Probe] = []
    for x_dtype, w_dtype in _PROBE_DTYPES:
        eps = default_eps(x_dtype) if eps_from_dtype else float(getattr(module, eps_attr))
        x = _probe_inputs(hidden, eps, x_dtype, device)
        w = None if weightless else random_weight.to(w_dtype)
        try:
            want = _own_forward(module, w, x)
        except Exception:  # a dtype combination the module does not take: not compared
            want = None
        probes.append((x, w, eps, want))
    return probes


def _compare(probes: list[_Probe], form: NormForm) -> float | str:
    """The bfloat16 error of ``form`` against the module's outputs in ``probes`` (float32
    must pass), or why it does not match."""
    bf16_error = 0.0
    ran = 0
    for x, w, eps, want in probes:
        if want is None:
            continue
        got = reference_rms_norm(x, w, eps, weight_offset=form.weight_offset,
                                 cast_before_weight=form.cast_before_weight)
        if not isinstance(want, torch.Tensor) or want.dtype != got.dtype or (
                want.shape != got.shape):
            what = (f"{want.dtype} {tuple(want.shape)}" if isinstance(want, torch.Tensor)
                    else type(want).__name__)
            return f"with {x.dtype} input and {_dtype(w)} weight it returns {what}"
        tol = _FP32_TOL if x.dtype == torch.float32 else _BF16_TOL
        err = ((want.float() - got.float()).abs() / (got.float().abs() + tol)).max().item()
        if not err <= tol * 2:
            return f"with {x.dtype} input and {_dtype(w)} weight its output differs by " \
                   f"{err:.2g} (relative)"
        ran += 1
        if x.dtype != torch.float32:
            bf16_error += err
    if ran < 2:
        return "it runs on fewer than two of the dtypes astrai checks it in"
    return bf16_error


def _dtype(w: torch.Tensor | None) -> str:
    return "no" if w is None else str(w.dtype)


def _own_forward(module: nn.Module, weight: torch.Tensor | None, x: torch.Tensor) -> Any:
    """The class's ``forward`` of a shallow copy of ``module`` holding ``weight`` (of the
    module itself when it holds none)."""
    if weight is None:
        g = torch.Generator().manual_seed(3)
        noise = {n: torch.randn(b.shape, generator=g).to(b.dtype)
                 for n, b in module._buffers.items()
                 if b is not None and b.is_floating_point() and b.device.type != "meta"}
        with torch.no_grad():
            return type(module).forward(probe_copy(module, buffers=noise) if noise
                                        else module, x)
    with torch.no_grad():
        return type(module).forward(probe_copy(module, parameters={"weight": weight}), x)



def _rms_norm_forward(form: NormForm) -> Callable[..., Any]:
    """An RMS norm module's forward in ``form``, through ``ops.rms_norm``: the weight read
    from the module's parameters and epsilon from its attribute, on every call. Holds no
    module (a copy of the model binds it to the copy)."""
    call = rms_norm_call(**form.keywords())
    eps_attr, from_dtype = form.eps_attr, form.eps_from_dtype

    weightless = form.weightless

    def rms_norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        weight: Any = None
        if not weightless:
            try:
                weight = self._parameters["weight"]
            except KeyError:  # parametrized since: its weight is a property
                weight = self.weight
        eps = (default_eps(hidden_states.dtype) if from_dtype
               else self.__dict__[eps_attr])
        return call(hidden_states, weight, eps)

    return rms_norm_forward


def _route(module: nn.Module) -> Installed | str:
    form = rms_norm_form(module)
    if isinstance(form, str):
        return form
    return Installed(_rms_norm_forward(form), form.describe(), form)


#: RMS norms: whole modules, whose parameters reach astrai.
RECOGNITION = ModelRecognition(claims=is_rms_kind, module=_route, holds_weights=True)
