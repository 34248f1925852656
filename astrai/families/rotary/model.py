"""Rotary call sites in a model: the functions an attention layer's ``forward`` calls
by global name that apply a rotary embedding, told by what they compute, and the routers
that stand for them in the layer's rebuilt forward.

A global function a layer's ``forward`` calls whose name says it applies a rotary
embedding (``apply_...rotary...``, ``apply_...rope...``, ``...rotary_pos_emb...``) is
called on random inputs (on the CPU, whatever the ambient device) - ``(q, k, cos,
sin)``, or for a function of three arguments ``(q, k, freqs_cis)`` and ``(x, sin,
cos)`` - and must compute one of the layouts astrai serves (``ROTARY_LAYOUTS``); a
function that computes anything else (a multimodal variant) is a reason. Its parameters
are read through any wrapper (``call_signature``): ``functools.wraps`` decorators, bound
methods, and HF ``kernels``' function modules, which transformers puts around
``apply_rotary_pos_emb`` when ``kernels`` is installed.

In the rebuilt forward the name stands for a router to ``ops.apply_rotary_half`` in the
site's layout (or ``ops.apply_rotary`` for the pairs and complex layouts). A call its
layout cannot express (a ``cos`` shorter than ``head_dim`` for a function not seen to
rotate part of a head; an argument it does not know) runs the model's own function,
warns once naming the function, and is counted as row and origin ``model``.
"""

from __future__ import annotations

__all__ = ["RECOGNITION", "ROTARY_LAYOUTS", "RotarySite", "deinterleave", "interleave",
           "rotary_in_layout", "rotary_sites"]

import functools
import inspect
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from astrai.backends.rotary import reference_rotary, reference_rotary_half
from astrai.dispatch.log import warn_once
from astrai.dispatch.stats import count_model_own
from astrai.families.recognition import ModelRecognition, Note, Sites
from astrai.families.rotary import apply_rotary, apply_rotary_half
from astrai.recognition.guards import ruled_out
from astrai.recognition.inspection import call_signature, label, stand_in
from astrai.recognition.rebind import global_names

#: The names of functions that apply a rotary embedding (apply_rotary_pos_emb,
#: apply_rotary_emb, apply_multimodal_rotary_pos_emb, apply_rope, ...).
_ROTARY_NAME = re.compile(r"^apply_.*(rotary|rope)|rotary_pos_emb", re.IGNORECASE)


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
#: regrouped into halves; ``reversed`` - the half layout turned the other way,
#: ``x * cos + cat(x2, -x1) * sin`` (NanoChat's ``rotate_half``), served as the half layout
#: with ``sin`` negated. A function seen to compute in float32 whatever its inputs'
#: precision (``RotarySite.upcast``) is served the same way.
#: Two more are called otherwise: ``complex`` - ``(q, k, freqs_cis)``, adjacent pairs
#: multiplied by complex ``freqs_cis [batch, seq, head_dim/2]`` (Llama 4), q and k
#: ``[batch, seq, heads, head_dim]``; ``complex_heads`` - the same with q and k
#: ``[batch, heads, seq, head_dim]`` (DeepSeek-V2); ``pairs`` - one tensor ``(x, sin,
#: cos)``, adjacent pairs turned by ``sin``/``cos [batch, seq, head_dim/2]`` (GPT-J); all
#: through ``ops.apply_rotary``.
ROTARY_LAYOUTS = ("half", "partial", "interleaved", "deinterleaved", "pairwise", "reversed",
                  "complex", "complex_heads", "pairs")


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
    if layout == "reversed":
        return half(q, k, cos, -sin, dim)  # type: ignore[no-any-return]
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
    alone: bool = False  # called without k, it returns q alone rotated (k defaults to None)
    single: bool = False  # it takes one tensor: (x, cos, sin[, unsqueeze_dim])
    ignored: frozenset[str] = frozenset()  # parameters seen to change nothing (position_ids)

    @property
    def label(self) -> str:
        """``module.function`` as the report names it."""
        return label(self.function, self.name)




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
            refused.append((label(value, name), site))
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
    if len(required) == 3 and (len(positional) == 3 or positional[3].name == "unsqueeze_dim"):
        site = _three_argument_site(name, owner, fn, signature) if len(positional) == 3 \
            else None
        if isinstance(site, RotarySite):
            return site
        single = _single_tensor_site(name, owner, fn, signature)
        if isinstance(single, RotarySite) or site is None:
            return single
        return f"{site}; {single}"
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
    for layout in ("half", "interleaved", "deinterleaved", "pairwise", "reversed"):
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
                              _upcasts(fn, layout, dim), part,
                              _rotates_alone(fn, signature, layout, dim),
                              ignored=_ignored(fn, rest, dim))
    return (f"it computes none of the rotary layouts astrai serves ({', '.join(ROTARY_LAYOUTS)}"
            f"; differs from the half split by {gaps['half']:.2g} on random inputs)")


def _ignored(fn: Any, rest: list[inspect.Parameter], dim: int) -> frozenset[str]:
    """The parameters after ``(q, k, cos, sin)`` defaulting to ``None`` whose value changes
    nothing ``fn`` returns (transformers 4's deprecated ``position_ids``)."""
    q, k, cos, sin = _rotary_probe(dim, 8)
    out: set[str] = set()
    with torch.no_grad():
        try:
            plain = fn(q, k, cos, sin)
        except Exception:
            return frozenset()
        for p in rest:
            if p.default is not None or p.name == "unsqueeze_dim" or p.kind not in (
                    p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                continue
            try:
                given = fn(q, k, cos, sin, **{p.name: torch.arange(5).expand(2, 5)})
            except Exception:
                continue
            if all(torch.equal(a, b) for a, b in zip(given, plain, strict=True)):
                out.add(p.name)
    return frozenset(out)


def _single_tensor_site(name: str, owner: dict[str, Any], fn: Any,
                        signature: inspect.Signature) -> RotarySite | str:
    """A rotary function of one tensor, ``(x, cos, sin[, unsqueeze_dim])`` (Gemma 4 turns
    its queries and keys in two calls), computing the half layout over the whole head or,
    as ``cos`` says, over part of it."""
    dim_param = signature.parameters.get("unsqueeze_dim")
    dim = 1 if dim_param is None else dim_param.default
    if isinstance(dim, bool) or not isinstance(dim, int):
        return f"its unsqueeze_dim default is {dim!r}"
    gaps = []
    for layout, rot in (("half", 8), ("partial", 4)):
        q, k, cos, sin = _rotary_probe(dim, rot)
        try:
            with torch.no_grad():
                got = fn(q, cos, sin)
        except Exception as exc:
            if layout == "partial":  # it rotates whole heads only
                gaps.append(math.inf)
                break
            return f"called as (x, cos, sin) it raised {type(exc).__name__}: {exc}"
        want = rotary_in_layout(layout, q, k, cos, sin, dim, reference_rotary_half,
                                reference_rotary)[0]
        if not (isinstance(got, torch.Tensor) and got.shape == want.shape):
            if layout == "partial":
                gaps.append(math.inf)
                break
            return "called as (x, cos, sin) it does not return x rotated"
        gaps.append(float((got - want).abs().max()))
    if gaps[0] > 1e-5:
        return (f"called as (x, cos, sin) it computes none of the rotary layouts astrai "
                f"serves (differs from the half split by {gaps[0]:.2g} on random inputs)")
    partial = gaps[1] <= 1e-5
    layout = "partial" if partial else "half"
    q, k, cos, sin = (t.to(torch.bfloat16) for t in _rotary_probe(dim, 8))
    with torch.no_grad():
        got = fn(q, cos, sin).float()
    native, wide = (rotary_in_layout(layout, q.to(dtype), k.to(dtype), cos.to(dtype),
                                     sin.to(dtype), dim, reference_rotary_half,
                                     reference_rotary)[0].to(torch.bfloat16).float()
                    for dtype in (torch.bfloat16, torch.float32))
    upcast = float((got - wide).abs().max()) < float((got - native).abs().max())
    return RotarySite(name, owner, fn, dim, signature, layout, upcast, partial, single=True)


def _rotates_alone(fn: Any, signature: inspect.Signature, layout: str, dim: int) -> bool:
    """Whether ``fn``, whose ``k`` defaults to ``None``, called with ``q``, ``cos`` and
    ``sin`` only returns ``q`` alone rotated in ``layout``."""
    names = list(signature.parameters)[:4]
    if signature.parameters[names[1]].default is not None:
        return False
    q, k, cos, sin = _rotary_probe(dim, 8)
    try:
        with torch.no_grad():
            got = fn(q, **{names[2]: cos, names[3]: sin})
    except Exception:
        return False
    want = rotary_in_layout(layout, q, k, cos, sin, dim, reference_rotary_half,
                            reference_rotary)[0]
    return (isinstance(got, torch.Tensor) and got.shape == want.shape
            and float((got - want).abs().max()) <= 1e-5)


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
    if layout == "complex_heads":
        q, k = rand(2, 3, 5, 8), rand(2, 1, 5, 8)
        freqs = torch.complex(rand(2, 5, 4), rand(2, 5, 4))
        table = torch.view_as_real(freqs)
        return (q, k, freqs), tuple(reference_rotary(t.transpose(1, 2), table).transpose(1, 2)
                                    for t in (q, k))
    x, sin, cos = rand(2, 5, 3, 8), rand(2, 5, 4), rand(2, 5, 4)
    return (x, sin, cos), (reference_rotary(x, torch.stack((cos, sin), -1)),)


def _three_argument_site(name: str, owner: dict[str, Any], fn: Any,
                         signature: inspect.Signature) -> RotarySite | str:
    """A rotary function of three arguments: ``complex`` ``(q, k, freqs_cis)`` (heads third,
    or second: ``complex_heads``) or ``pairs`` ``(x, sin, cos)``, told apart by what it
    returns on random inputs."""
    failures: list[str] = []
    for layout in ("complex", "complex_heads", "pairs"):
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



#: dtypes a float32-computing rotary function does not widen
_WIDE = (torch.float32, torch.float64)


def _rotary_router(site: RotarySite) -> Callable[..., Any]:
    """What a routed layer calls instead of ``site``'s function: ``ops.apply_rotary_half``
    in the site's layout, or the function itself (warning once, counted under the origin
    ``model``) for a call the layout cannot express."""
    default_dim, signature = site.unsqueeze_dim, site.signature
    layout, upcast, partial, alone = site.layout, site.upcast, site.partial, site.alone
    ignored = site.ignored
    single = site.single
    names = list(signature.parameters)[:3 if single else 4]

    def routed_rotary(*args: Any, **kwargs: Any) -> Any:
        dim = default_dim
        if len(args) == 4 and not kwargs and not single:
            q, k, cos, sin = args
        else:
            try:
                given = signature.bind(*args, **kwargs).arguments
            except TypeError as exc:
                return _own_rotary(site, args, kwargs, f"its arguments do not bind: {exc}")
            taken = [given.get(n, signature.parameters[n].default) for n in names]
            q, k, cos, sin = (taken[0], None, *taken[1:]) if single else taken
            extra = {n: v for n, v in given.items() if n not in names and n not in ignored}
            dim = extra.pop("unsqueeze_dim", default_dim)
            if any(v is not None and v is not signature.parameters[n].default
                   for n, v in extra.items()):
                return _own_rotary(site, args, kwargs,
                                   f"it was called with {', '.join(extra)}, which its "
                                   f"layout ({layout}) does not take")
        alone_q = k is None and (alone or single) and isinstance(q, torch.Tensor)
        if alone_q and isinstance(dim, int) and -q.dim() <= dim < q.dim():
            k = q.narrow(dim, 0, 0)  # no heads: the queries alone are turned
        if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
                and isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)):
            return _own_rotary(site, args, kwargs, "q, k, cos or sin is not a tensor")
        if not partial and cos.shape[-1] != q.shape[-1]:
            return _own_rotary(site, args, kwargs,
                               f"cos covers {cos.shape[-1]} of head_dim {q.shape[-1]}, and "
                               f"the function was not seen to rotate part of a head")
        if layout == "half" and not upcast:
            out = apply_rotary_half(q, k, cos, sin, dim)
        elif upcast and q.dtype not in _WIDE:
            dtype = q.dtype
            q_out, k_out = rotary_in_layout(layout, q.float(), k.float(), cos.float(),
                                            sin.float(), dim, apply_rotary_half, apply_rotary)
            out = q_out.to(dtype), k_out.to(dtype)
        else:
            out = rotary_in_layout(layout, q, k, cos, sin, dim, apply_rotary_half,
                                   apply_rotary)
        return out[0] if alone_q else out

    routed_rotary.__qualname__ = f"astrai routed {site.name}"
    if layout in ("complex", "complex_heads"):
        return _complex_router(site)
    if layout == "pairs":
        return _pairs_router(site)
    return routed_rotary


def _own_rotary(site: RotarySite, args: tuple[Any, ...], kwargs: dict[str, Any],
                why: str) -> Any:
    """``site``'s own function on a call astrai cannot serve: warned once, counted."""
    warn_once(f"astrai: a rotary call to {site.label} runs the model's own function: {why}")
    count_model_own("rotary")
    return site.function(*args, **kwargs)


def _complex_router(site: RotarySite) -> Callable[..., Any]:
    """``(q, k, freqs_cis)`` (Llama 4) through ``ops.apply_rotary``: ``freqs_cis`` is
    ``[batch, seq, head_dim/2]`` complex, q and k ``[batch, seq, heads, head_dim]``
    (``[batch, heads, seq, head_dim]`` for ``complex_heads``, DeepSeek-V2's)."""
    heads_second = site.layout == "complex_heads"

    def routed_rotary(*args: Any, **kwargs: Any) -> Any:
        if len(args) != 3 or kwargs:
            return _own_rotary(site, args, kwargs, "it was not called as (q, k, freqs_cis)")
        q, k, freqs = args
        if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
                and isinstance(freqs, torch.Tensor) and freqs.is_complex()
                and q.dim() == k.dim() == 4 and freqs.dim() == 3
                and 2 * freqs.shape[-1] == q.shape[-1] == k.shape[-1]):
            return _own_rotary(site, args, kwargs, "its arguments are not q, k "
                               "[batch, seq, heads, head_dim] and complex freqs_cis "
                               "[batch, seq, head_dim/2]")
        table = torch.view_as_real(freqs)
        if heads_second:
            return tuple(apply_rotary(t.transpose(1, 2), table).transpose(1, 2)
                         for t in (q, k))
        return apply_rotary(q, table), apply_rotary(k, table)

    routed_rotary.__qualname__ = f"astrai routed {site.name}"
    return routed_rotary


def _pairs_router(site: RotarySite) -> Callable[..., Any]:
    """``(x, sin, cos)`` (GPT-J) through ``ops.apply_rotary``: ``sin`` and ``cos`` are
    ``[batch, seq, head_dim/2]``, ``x`` ``[batch, seq, heads, head_dim]``."""

    def routed_rotary(*args: Any, **kwargs: Any) -> Any:
        if len(args) != 3 or kwargs:
            return _own_rotary(site, args, kwargs, "it was not called as (x, sin, cos)")
        x, sin, cos = args
        if not (isinstance(x, torch.Tensor) and isinstance(sin, torch.Tensor)
                and isinstance(cos, torch.Tensor) and x.dim() == 4
                and sin.dim() == cos.dim() == 3 and sin.shape == cos.shape
                and 2 * sin.shape[-1] == x.shape[-1]):
            return _own_rotary(site, args, kwargs, "its arguments are not x "
                               "[batch, seq, heads, head_dim] and sin, cos "
                               "[batch, seq, head_dim/2]")
        return apply_rotary(x, torch.stack((cos, sin), -1))

    routed_rotary.__qualname__ = f"astrai routed {site.name}"
    return routed_rotary


def _sites(module: nn.Module, forward: Any, model: nn.Module
           ) -> tuple[Sites | None, list[str | Note]]:
    """The rotary sites of a layer's ``forward``, and why the others are not routed."""
    found, refused = rotary_sites(forward)
    reasons: list[str | Note] = [f"{name}: {reason}" for name, reason in refused]
    if found and module.__dict__.get("use_rope", True) in (False, 0):
        reasons.append(Note("the layer applies no rotary (its use_rope is off: a NoPE "
                            "layer); its rotary functions, never called, are left as they "
                            "are"))
        found = []
    guard = ruled_out(forward, {s.name for s in found}, module) if found else None
    if guard is not None:
        reasons.append(Note(f"the layer applies no rotary: its forward calls "
                            f"{', '.join(sorted({s.name for s in found}))} only where "
                            f"{guard}, which this layer's attributes rule out; left as "
                            f"they are"))
        found = []
    if not found:
        return None, reasons
    owners = {id(s.owner): s.owner for s in found}
    if len(owners) != 1:
        reasons.append("its rotary functions are read from more than one module")
        return None, reasons
    replacements = {s.name: stand_in(s.function, functools.partial(_rotary_router, s))
                    for s in found}
    return Sites(found[0].owner, replacements, ", ".join(s.label for s in found),
                 tuple(found)), reasons


#: Rotary: call sites in attention layers.
RECOGNITION = ModelRecognition(sites=_sites, noun="call sites")
