"""What a module of a model is, told by what it does rather than by its class's name.

``dispatch_model`` routes only what it has checked. Each check answers either with what
the facade needs to serve the module (a ``NormForm``, a ``RotarySite``, an
``AttentionSite``) or with the reason it cannot, which the report shows:

- **RMS norms** (``rms_norm_form``): a module whose class is an RMS norm by name (or
  ``torch.nn.RMSNorm``), with one weight vector and an epsilon attribute, is run - its
  class's own ``forward``, on a copy holding a random weight, hooks left out - on a few
  small inputs (float32; bfloat16 with a bfloat16 and with a float32 weight; one row
  small enough that epsilon matters), and compared with each form the facade computes
  (weight applied in float32 or after the cast back; ``weight`` or ``1 + weight``).
  The form that equals it, within float32 tolerance in float32 and within one rounding
  in bfloat16 (the closest in bfloat16 when two pass), is the module's; none that does
  is a reason.
- **Rotary call sites** (``rotary_sites``): a global function a layer's ``forward``
  calls whose name says it applies a rotary embedding (``apply_...rotary...``,
  ``apply_...rope...``, ``...rotary_pos_emb...``) is called on random inputs (on the CPU,
  whatever the ambient device) - ``(q, k, cos, sin)``, or for a function of three
  arguments ``(q, k, freqs_cis)`` and ``(x, sin, cos)`` - and must compute one of the
  layouts astrai serves (``ROTARY_LAYOUTS``); a function that computes anything else
  (Cohere's, which relies on each angle appearing twice in ``cos``; a multimodal
  variant) is a reason. Its parameters are read through any wrapper
  (``call_signature``): ``functools.wraps`` decorators, bound methods, and HF
  ``kernels``' function modules, which transformers puts around
  ``apply_rotary_pos_emb`` when ``kernels`` is installed.
- **Attention call sites** (``attention_site``): a ``forward`` that looks its attention
  function up in transformers' ``ALL_ATTENTION_FUNCTIONS``, in a model whose masks the
  adapter reads (``attn_implementation`` ``sdpa``, ``eager`` or ``astrai``).
- **Linear layers** (``linear_form``): ``torch.nn.Linear`` and subclasses that keep its
  ``forward``, and any other module holding a 2-d weight (and a bias) whose own
  ``forward``, run on random weights, computes ``x @ W.T + b`` (Falcon's
  ``FalconLinear``) or ``x @ W + b`` with the weight stored ``[in, out]`` (GPT-2's
  ``Conv1D``, served with a transposed view of the weight, never a copy).

A module whose instance ``forward`` was already replaced by someone else (accelerate's
offloading hooks do this) is never routed: its replacement stays in charge.
"""

from __future__ import annotations

__all__ = [
    "ATTENTION_INTERFACE",
    "EAGER_ATTENTION",
    "EPS_NAMES",
    "READABLE_MASKS",
    "ROTARY_LAYOUTS",
    "AttentionSite",
    "LinearForm",
    "NormForm",
    "RotarySite",
    "attention_site",
    "call_signature",
    "deinterleave",
    "is_linear_kind",
    "is_norm_kind",
    "is_rms_kind",
    "linear_form",
    "own_forward",
    "rms_norm_form",
    "rotary_in_layout",
    "rotary_sites",
]

import copy
import inspect
import math
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from astrai.backends.rms_norm import reference_rms_norm
from astrai.backends.rotary import reference_rotary, reference_rotary_half
from astrai.integrations.transformers.rebind import global_names

#: The epsilon attributes RMS norms carry, in the order they are tried.
EPS_NAMES = ("variance_epsilon", "eps", "epsilon", "rms_norm_eps", "norm_eps")
#: The global through which transformers' attention layers find their attention function.
ATTENTION_INTERFACE = "ALL_ATTENTION_FUNCTIONS"
#: The eager attention function older layers call directly for ``"eager"``.
EAGER_ATTENTION = "eager_attention_forward"
#: The ``attn_implementation`` values whose masks the adapter reads (sdpa's boolean or
#: none, eager's additive, astrai's own: sdpa's).
READABLE_MASKS = ("sdpa", "eager", "astrai")

_TORCH_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase,
                nn.LocalResponseNorm)
_NORM_NAME = re.compile(r"norm", re.IGNORECASE)
_RMS_NAME = re.compile(r"rms.?norm|t5layernorm", re.IGNORECASE)
#: The names of functions that apply a rotary embedding (apply_rotary_pos_emb,
#: apply_rotary_emb, apply_multimodal_rotary_pos_emb, apply_rope, ...).
_ROTARY_NAME = re.compile(r"^apply_.*(rotary|rope)|rotary_pos_emb", re.IGNORECASE)


def own_forward(module: nn.Module) -> Any:
    """The ``forward`` set on the instance itself, or ``None``."""
    return module.__dict__.get("forward")


# -- RMS norms -------------------------------------------------------------------


@dataclass(frozen=True)
class NormForm:
    """How to serve one RMS norm module through ``astrai.ops.rms_norm``."""

    eps_attr: str  # the attribute holding epsilon, read on every call
    weight_offset: float  # 0.0, or 1.0 for Gemma's (1 + weight)
    cast_before_weight: bool  # LlamaRMSNorm: weight * normed.to(input dtype)
    eps_from_dtype: bool = False  # torch.nn.RMSNorm with eps=None: finfo(x.dtype).eps

    def describe(self) -> str:
        """The form in words, for the report."""
        parts = ["weight after the cast back (LlamaRMSNorm)" if self.cast_before_weight
                 else "weight in float32"]
        if self.weight_offset:
            parts.append(f"{self.weight_offset:g} + weight")
        parts.append("eps = finfo(dtype).eps" if self.eps_from_dtype
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
    ``...RMSNorm...``)."""
    return isinstance(module, nn.RMSNorm) or bool(_RMS_NAME.search(type(module).__name__))


def is_norm_kind(module: nn.Module) -> bool:
    """Whether the report must account for ``module`` as a norm: an RMS norm by class,
    or any class named ``...Norm...``."""
    return isinstance(module, nn.RMSNorm) or bool(_NORM_NAME.search(type(module).__name__))


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
    weight = module._parameters.get("weight")
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


_NO_EPS: Any = object()


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
_Probe = tuple[torch.Tensor, torch.Tensor, float, Any]
#: The dtypes of (input, weight) a norm is probed in.
_PROBE_DTYPES = ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                 (torch.bfloat16, torch.float32))


def _probes(module: nn.Module, eps_attr: str, eps_from_dtype: bool) -> list[_Probe]:
    """The module's own forward on each probe (run once, whatever forms it is compared
    with), a random weight in its copy."""
    weight = module._parameters["weight"]
    assert weight is not None
    device, hidden = torch.device("cpu"), weight.shape[0]  # a meta weight is probed too
    g = torch.Generator().manual_seed(hidden + 1)
    random_weight = torch.randn(hidden, generator=g, device=device)
    probes: list[_Probe] = []
    for x_dtype, w_dtype in _PROBE_DTYPES:
        eps = torch.finfo(x_dtype).eps if eps_from_dtype else float(getattr(module, eps_attr))
        x = _probe_inputs(hidden, eps, x_dtype, device)
        w = random_weight.to(w_dtype)
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
            return f"with {x.dtype} input and {w.dtype} weight it returns {what}"
        tol = _FP32_TOL if x.dtype == torch.float32 else _BF16_TOL
        err = ((want.float() - got.float()).abs() / (got.float().abs() + tol)).max().item()
        if not err <= tol * 2:
            return f"with {x.dtype} input and {w.dtype} weight its output differs by " \
                   f"{err:.2g} (relative)"
        ran += 1
        if x.dtype != torch.float32:
            bf16_error += err
    if ran < 2:
        return "it runs on fewer than two of the dtypes astrai checks it in"
    return bf16_error


def _own_forward(module: nn.Module, weight: torch.Tensor, x: torch.Tensor) -> Any:
    """The class's ``forward`` of a shallow copy of ``module`` holding ``weight``."""
    probe = copy.copy(module)
    probe._parameters = dict(module._parameters)
    probe._parameters["weight"] = nn.Parameter(weight, requires_grad=False)
    with torch.no_grad():
        return type(module).forward(probe, x)


# -- rotary --------------------------------------------------------------------


def call_signature(fn: Any) -> inspect.Signature | None:
    """The parameters a call of ``fn`` takes, read through the wrappers models put
    around their functions: ``functools.wraps`` decorators (``__wrapped__``), bound
    methods, and a module that is called like a function and states its parameters on
    its ``forward`` (HF ``kernels``' function modules, whose ``__call__`` takes
    ``(*args, **kwargs)``). ``None`` when no layer of it says more than ``(*args,
    **kwargs)``."""
    candidates = [fn]
    if isinstance(fn, nn.Module):
        candidates.append(fn.forward)
    for candidate in candidates:
        try:
            signature = inspect.signature(candidate)
        except (TypeError, ValueError):
            continue
        if any(p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
               for p in signature.parameters.values()):
            return signature
    return None


#: The rotary layouts a call site may compute, each served through astrai's rotary
#: facades (``half`` for ``ops.apply_rotary_half``, ``pairs`` for ``ops.apply_rotary``):
#: ``half`` - ``x * cos + rotate_half(x) * sin`` over the whole head_dim;
#: ``partial`` - the same over the first ``cos.shape[-1]`` features of each head, the
#: rest passed through (GPT-NeoX's ``rotary_pct``, ``partial_rotary_factor``); a
#: function that does this also computes ``half`` when ``cos`` covers head_dim;
#: ``interleaved`` - adjacent pairs ``(2i, 2i+1)`` turned by the angle in ``cos[i]`` /
#: ``sin[i]`` (the first half of transformers' ``cat(freqs, freqs)``), over the first
#: ``cos.shape[-1]`` features, the rest passed through (GLM, GLM-4);
#: ``deinterleaved`` - adjacent pairs regrouped into halves, then turned by the angles
#: of the first half of ``cos`` (DeepSeek's ``apply_rotary_pos_emb_interleave``);
#: ``pairwise`` - ``x * cos + rotate_pairs(x) * sin``, where ``rotate_pairs`` turns each
#: adjacent pair ``(a, b)`` into ``(-b, a)`` (Cohere, whose ``cos`` holds each angle twice),
#: over the first ``cos.shape[-1]`` features, served as the half layout on features
#: regrouped into halves. A function seen to compute in float32 whatever its inputs'
#: precision (``RotarySite.upcast``) is served the same way.
#: Two more are called otherwise: ``complex`` - ``(q, k, freqs_cis)``, adjacent pairs
#: multiplied by complex ``freqs_cis [batch, seq, head_dim/2]`` (Llama 4), q and k
#: ``[batch, seq, heads, head_dim]``; ``pairs`` - one tensor ``(x, sin, cos)``, adjacent
#: pairs turned by ``sin``/``cos [batch, seq, head_dim/2]`` (GPT-J); both through
#: ``ops.apply_rotary``.
ROTARY_LAYOUTS = ("half", "partial", "interleaved", "deinterleaved", "pairwise", "complex",
                  "pairs")


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """``x``'s last dim regrouped from adjacent pairs ``(2i, 2i+1)`` to halves
    ``(i, i + d/2)``: ``[x0, x2, x4, ..., x1, x3, ...]``."""
    d = x.shape[-1]
    return x.reshape(*x.shape[:-1], d // 2, 2).transpose(-1, -2).reshape(x.shape)


def _first_half(t: torch.Tensor) -> torch.Tensor:
    return t[..., : t.shape[-1] // 2]


def interleave(x: torch.Tensor) -> torch.Tensor:
    """The inverse of ``deinterleave``: halves ``(i, i + d/2)`` back to adjacent pairs."""
    d = x.shape[-1]
    return x.reshape(*x.shape[:-1], 2, d // 2).transpose(-1, -2).reshape(x.shape)


def rotary_in_layout(layout: str, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, dim: int, half: Any,
                     pairs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``layout`` computed through ``half(q, k, cos, sin, dim)`` (the half layout) or
    ``pairs(x, freqs_cis)`` (adjacent pairs, ``x`` ``[batch, seq, heads, head_dim]``)."""
    if layout == "deinterleaved":
        c, s = _first_half(cos), _first_half(sin)
        return half(deinterleave(q), deinterleave(k),  # type: ignore[no-any-return]
                    torch.cat((c, c), -1), torch.cat((s, s), -1), dim)
    rot = cos.shape[-1]
    if layout == "pairwise":
        q_out, k_out = half(deinterleave(q[..., :rot]), deinterleave(k[..., :rot]),
                            deinterleave(cos), deinterleave(sin), dim)
        return _rest(interleave(q_out), q, rot), _rest(interleave(k_out), k, rot)
    if layout == "interleaved":
        freqs = torch.stack((_first_half(cos), _first_half(sin)), -1)
        heads = dim % q.dim()
        outs = []
        for x in (q, k):
            turned = pairs(x[..., :rot].movedim(heads, -2), freqs).movedim(-2, heads)
            outs.append(_rest(turned, x, rot))
        return outs[0], outs[1]
    if layout == "partial" and rot < q.shape[-1]:
        q_rot, k_rot = half(q[..., :rot], k[..., :rot], cos, sin, dim)
        return (torch.cat((q_rot, q[..., rot:]), dim=-1),
                torch.cat((k_rot, k[..., rot:]), dim=-1))
    return half(q, k, cos, sin, dim)  # type: ignore[no-any-return]


def _rest(turned: torch.Tensor, x: torch.Tensor, rot: int) -> torch.Tensor:
    """``turned`` (``x``'s first ``rot`` features rotated) with the rest of ``x`` after it."""
    return torch.cat((turned, x[..., rot:]), -1) if rot < x.shape[-1] else turned


@dataclass(frozen=True)
class RotarySite:
    """A rotary function a layer's ``forward`` calls by its global name."""

    name: str  # the global name the forward reads
    owner: dict[str, Any]  # the globals it is read from
    function: Any  # what the name holds: the model's own function (or its wrapper)
    unsqueeze_dim: int  # the default of its unsqueeze_dim
    signature: inspect.Signature  # the function's, to read the arguments of a call
    layout: str = "half"  # one of ROTARY_LAYOUTS
    upcast: bool = False  # it computes in float32 and casts back to q's dtype
    partial: bool = False  # seen to rotate part of a head when cos covers part of it

    @property
    def label(self) -> str:
        """``module.function`` as the report names it."""
        return _label(self.function, self.name)


def _label(fn: Any, name: str) -> str:
    """``module.function`` of ``fn``, found under the global ``name``."""
    qualname = getattr(fn, "__qualname__", None)
    if not isinstance(qualname, str) or "<locals>" in qualname:
        qualname = name  # a wrapper class made in a function: the name it is called by
    return f"{getattr(fn, '__module__', '?')}.{qualname}"


def rotary_sites(forward: Any) -> tuple[list[RotarySite], list[tuple[str, str]]]:
    """The rotary functions ``forward`` calls that compute a layout astrai serves
    (``ROTARY_LAYOUTS``), and ``(label, reason)`` for those that compute something else."""
    sites: list[RotarySite] = []
    refused: list[tuple[str, str]] = []
    for name, owner in global_names(forward):
        value = owner[name]
        if not _ROTARY_NAME.search(name) or isinstance(value, type) or not callable(value):
            continue
        site = _rotary_site(name, owner, value)
        if isinstance(site, str):
            refused.append((_label(value, name), site))
        else:
            sites.append(site)
    return sites, refused


def _rotary_probe(dim: int, rot: int) -> tuple[torch.Tensor, ...]:
    """Random ``(q, k, cos, sin)``: q and k ``[2, heads, 5, 8]`` with heads at ``dim``,
    ``cos`` and ``sin`` ``[2, 5, rot]``, on the CPU in float32 whatever the ambient
    default device and dtype."""
    g = torch.Generator().manual_seed(7 + rot)
    made = [torch.randn(shape, generator=g, device="cpu", dtype=torch.float32)
            for shape in ((2, 3, 5, 8), (2, 1, 5, 8), (2, 5, rot), (2, 5, rot))]
    q, k, cos, sin = made
    if dim != 1:  # heads where unsqueeze_dim puts them
        q, k = q.movedim(1, dim), k.movedim(1, dim)
    return q, k, cos, sin


def _rotary_gap(fn: Any, layout: str, dim: int, rot: int,
                dtype: torch.dtype = torch.float32, upcast: bool = False) -> float | str:
    """How far ``fn`` is from ``layout`` on a random call with ``cos`` of ``rot``
    features in ``dtype`` (computed in float32 and cast back when ``upcast``), or why it
    could not be compared."""
    q, k, cos, sin = _rotary_probe(dim, rot)
    q, k, cos, sin = (t.to(dtype) for t in (q, k, cos, sin))
    try:
        with torch.no_grad():
            got = fn(q, k, cos, sin)
    except Exception as exc:
        return f"called as (q, k, cos, sin) it raised {type(exc).__name__}: {exc}"
    if upcast:
        want = tuple(t.to(dtype) for t in rotary_in_layout(
            layout, q.float(), k.float(), cos.float(), sin.float(), dim,
            reference_rotary_half, reference_rotary))
    else:
        want = rotary_in_layout(layout, q, k, cos, sin, dim, reference_rotary_half,
                                reference_rotary)
    if not (isinstance(got, (tuple, list)) and len(got) == 2
            and all(isinstance(t, torch.Tensor) and t.shape == w.shape
                    for t, w in zip(got, want, strict=True))):
        return "it does not return (q, k) rotated"
    return max(float((a.float() - b.float()).abs().max().item())
               for a, b in zip(got, want, strict=True))


def _rotary_site(name: str, owner: dict[str, Any], fn: Any) -> RotarySite | str:
    signature = call_signature(fn)
    if signature is None:
        return "its signature cannot be read, through any wrapper"
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if len(required) == 3 and len(positional) == 3:
        return _three_argument_site(name, owner, fn, signature)
    if len(positional) < 4:
        return "it does not take (q, k, cos, sin), (q, k, freqs_cis) or (x, sin, cos)"
    rest = params[4:] if params[:4] == positional[:4] else []
    if any(p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
           for p in rest):
        return "it needs more arguments than (q, k, cos, sin)"
    dim_param = next((p for p in rest if p.name == "unsqueeze_dim"), None)
    dim = dim_param.default if dim_param is not None else 1
    if isinstance(dim, bool) or not isinstance(dim, int):
        return f"its unsqueeze_dim default is {dim!r}"
    gaps: dict[str, float | str] = {}
    for layout in ("half", "interleaved", "deinterleaved", "pairwise"):
        gaps[layout] = gap = _rotary_gap(fn, layout, dim, 8)
        if isinstance(gap, str):
            return gap
        if gap <= 1e-5:
            if layout == "half":  # does it also rotate part of a head, as cos says?
                partial = _rotary_gap(fn, "partial", dim, 4)
                if isinstance(partial, float) and partial <= 1e-5:
                    layout = "partial"
            part = layout == "partial"
            if layout in ("interleaved", "pairwise"):  # part of a head, as cos says?
                partial = _rotary_gap(fn, layout, dim, 4)
                part = isinstance(partial, float) and partial <= 1e-5
            return RotarySite(name, owner, fn, dim, signature, layout,
                              _upcasts(fn, layout, dim), part)
    return (f"it computes none of the rotary layouts astrai serves ({', '.join(ROTARY_LAYOUTS)}"
            f"; differs from the half split by {gaps['half']:.2g} on random inputs)")


def _upcasts(fn: Any, layout: str, dim: int) -> bool:
    """Whether ``fn`` computes ``layout`` in float32 on bfloat16 inputs (closer to that than
    to computing in bfloat16), as Cohere's function does."""
    native = _rotary_gap(fn, layout, dim, 8, torch.bfloat16)
    wide = _rotary_gap(fn, layout, dim, 8, torch.bfloat16, upcast=True)
    return isinstance(native, float) and isinstance(wide, float) and wide < native


def _three_argument_probe(layout: str) -> tuple[tuple[torch.Tensor, ...],
                                               tuple[torch.Tensor, ...]]:
    """Random arguments of a three-argument rotary call in ``layout``, and what it must
    return (through ``reference_rotary``, the pairs layout), on the CPU."""
    g = torch.Generator().manual_seed(17)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g, device="cpu", dtype=torch.float32)

    if layout == "complex":
        q, k = rand(2, 5, 3, 8), rand(2, 5, 1, 8)
        freqs = torch.complex(rand(2, 5, 4), rand(2, 5, 4))
        table = torch.view_as_real(freqs)
        return (q, k, freqs), (reference_rotary(q, table), reference_rotary(k, table))
    x, sin, cos = rand(2, 5, 3, 8), rand(2, 5, 4), rand(2, 5, 4)
    return (x, sin, cos), (reference_rotary(x, torch.stack((cos, sin), -1)),)


def _three_argument_site(name: str, owner: dict[str, Any], fn: Any,
                         signature: inspect.Signature) -> RotarySite | str:
    """A rotary function of three arguments: ``complex`` ``(q, k, freqs_cis)`` or ``pairs``
    ``(x, sin, cos)``, told apart by what it returns on random inputs."""
    failures: list[str] = []
    for layout in ("complex", "pairs"):
        args, want = _three_argument_probe(layout)
        try:
            with torch.no_grad():
                got = fn(*args)
        except Exception as exc:
            failures.append(f"as {layout} it raised {type(exc).__name__}")
            continue
        outs = tuple(got) if isinstance(got, (tuple, list)) else (got,)
        if len(outs) != len(want) or not all(
                isinstance(o, torch.Tensor) and o.shape == w.shape
                for o, w in zip(outs, want, strict=True)):
            failures.append(f"as {layout} it returns another shape")
            continue
        gap = max(float((o.float() - w).abs().max()) for o, w in zip(outs, want, strict=True))
        if gap <= 1e-5:
            return RotarySite(name, owner, fn, 2, signature, layout)
        failures.append(f"as {layout} it differs by {gap:.2g}")
    return (f"it computes none of the rotary layouts astrai serves "
            f"({'; '.join(failures)} on random inputs)")


# -- attention -----------------------------------------------------------------


@dataclass(frozen=True)
class AttentionSite:
    """An attention layer's ``forward`` that finds its attention function by global name."""

    owner: dict[str, Any]  # the forward's globals
    names: tuple[str, ...]  # which of ATTENTION_INTERFACE / EAGER_ATTENTION it reads


def attention_site(forward: Any, implementation: Any,
                   config: Any = None) -> AttentionSite | str | None:
    """The site, the reason it cannot be routed, or ``None`` when ``forward`` does not use
    transformers' attention interface at all. ``config`` is the layer's (or the model's)
    configuration, read for what the layer asks of its attention function."""
    found = [(n, g) for n, g in global_names(forward) if n in (ATTENTION_INTERFACE,
                                                                  EAGER_ATTENTION)]
    if not found:
        return None
    if implementation not in READABLE_MASKS:
        return (f"the model's attn_implementation is {implementation!r}, whose masks "
                f"astrai's adapter does not read; build the model with "
                f"attn_implementation='sdpa' (or 'astrai')")
    owners = {id(g): g for _, g in found}
    if len(owners) > 1:
        return "its forward reads the attention interface from more than one module"
    owner = found[0][1]
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None and implementation == "sdpa" and _drops(owner, "softcap"):
        return (f"the model's sdpa attention ignores the soft-capping ({softcap}) the layer "
                f"asks for (this transformers' sdpa_attention_forward never reads softcap), "
                f"and astrai would apply it, changing the model's output; build it with "
                f"attn_implementation='eager' to have it applied")
    return AttentionSite(owner, tuple(dict.fromkeys(n for n, _ in found)))


def _drops(owner: dict[str, Any], keyword: str) -> bool:
    """Whether the ``sdpa`` function of the interface ``owner`` reads never reads
    ``keyword`` (neither a parameter nor a name or constant of its code)."""
    interface = owner.get(ATTENTION_INTERFACE)
    try:
        fn = interface["sdpa"]  # type: ignore[index]
    except Exception:
        return False
    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    return keyword not in code.co_varnames and keyword not in code.co_consts and (
        keyword not in code.co_names)


# -- linear --------------------------------------------------------------------


@dataclass(frozen=True)
class LinearForm:
    """How to serve one linear-like module through ``astrai.ops.linear``."""

    transposed: bool  # the weight is stored [in, out] (GPT-2's Conv1D): passed as W.T

    def describe(self) -> str:
        """The form in words, for the report."""
        return ("x @ W + b, weight stored [in, out] (passed as a transposed view)"
                if self.transposed else "")


_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)


def is_linear_kind(module: nn.Module) -> bool:
    """Whether ``module`` may compute a linear layer: an ``nn.Linear``, or any module
    without children (no embedding, no norm) that holds a 2-d ``weight`` of its own."""
    if isinstance(module, nn.Linear):
        return True
    if isinstance(module, _EMBEDDINGS) or is_norm_kind(module) or module._modules:
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
    probe = copy.copy(module)
    probe._parameters = dict(module._parameters)
    probe._parameters["weight"] = nn.Parameter(w, requires_grad=False)
    if bias is not None:
        probe._parameters["bias"] = nn.Parameter(b, requires_grad=False)  # type: ignore[arg-type]
    probe._forward_hooks, probe._forward_pre_hooks = type(probe._forward_hooks)(), type(
        probe._forward_pre_hooks)()
    try:
        with torch.no_grad():
            got = type(module).forward(probe, x)
    except Exception as exc:
        return f"called on [..., {features}] it raised {type(exc).__name__}"
    want = torch.nn.functional.linear(x, w.t() if transposed else w, b)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return "it does not return one tensor of the linear's shape"
    return float((got - want).abs().max().item()) / (1.0 + float(want.abs().max().item()))
