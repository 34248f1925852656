"""MoE routers in a model, told by what they compute, and the forward that sends their
logits to ``ops.linear`` and their choice to ``ops.moe_router``.

A module is claimed when it holds one 2-d ``weight [E, H]`` (an optional ``bias [E]``),
at most one other floating ``[E]`` tensor (DeepSeek's score correction) and an int
attribute naming its top-k (``top_k``, ``num_experts_per_tok``) in ``1..E``: a router.
Two answers are known:

- **triple** - ``(logits [T, E], weights [T, K], indices [T, K])`` (Mixtral, Qwen2-MoE,
  Qwen3-MoE, DeepSeek-V3);
- **dense** - ``(scores [T, E], logits [T, E])``, the chosen experts' weights scattered
  into zeros (Llama 4).

The module's attributes propose the groups (``n_group`` / ``num_group`` and
``topk_group``) and the scale (``routed_scaling_factor``); what it computes decides the
rest. It is run - its class's own forward, on a copy holding random float32 tensors of
its shapes, hooks left out - on random tokens and compared with each scoring (softmax,
sigmoid) and renormalisation; a second run in bfloat16 tells whether it computes its
logits in float32 and in which dtype it returns the weights.
"""

from __future__ import annotations

__all__ = ["RECOGNITION", "RouterForm", "router_form"]

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from astrai.families.linear import linear
from astrai.families.moe_router import moe_router
from astrai.families.recognition import Installed, ModelRecognition
from astrai.recognition.probe import gap, probe_copy

_TOP_K = ("top_k", "num_experts_per_tok")
_GROUPS = ("n_group", "num_group")


@dataclass(frozen=True)
class RouterForm:
    """How to serve one router: its answer (``triple`` or ``dense``), the choice, the
    tensor holding the choice's bias (``None``: none), whether the logits are computed
    in float32 and whether the weights are returned in the logits' dtype."""

    answer: str
    top_k: int
    scoring: str
    normalize: bool
    bias: str | None
    groups: int
    top_groups: int
    scale: float
    upcast: bool
    cast: bool

    def describe(self) -> str:
        """The form in words, for the report."""
        how = f"top-{self.top_k} of {self.scoring}"
        if self.bias is not None:
            how += f" (chosen by score + {self.bias})"
        if self.groups > 1:
            how += f" within the best {self.top_groups} of {self.groups} groups"
        if self.normalize:
            how += ", renormalised"
        if self.scale != 1.0:
            how += f", times {self.scale:g}"
        return how + (", scattered into [T, E]" if self.answer == "dense" else "")


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {n: p for n, p in module._parameters.items()
                                      if isinstance(p, torch.Tensor)}
    found.update({n: b for n, b in module._buffers.items() if isinstance(b, torch.Tensor)})
    return found


def _int_attr(module: nn.Module, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = module.__dict__.get(name)
        if type(value) is int:
            return value
    return None


def _extra(module: nn.Module) -> str | None:
    """The name of the floating ``[E]`` tensor that is not the bias, if any."""
    extra = [n for n, t in _tensors(module).items() if n not in ("weight", "bias")]
    return extra[0] if extra else None


def _claims(module: nn.Module) -> bool:
    weight = module._parameters.get("weight")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return False
    e = weight.shape[0]
    others = {n: t for n, t in _tensors(module).items() if n != "weight"}
    bias = others.pop("bias", None)
    if bias is not None and bias.shape != (e,):
        return False
    if len(others) > 1 or any(t.shape != (e,) or not t.dtype.is_floating_point
                              for t in others.values()):
        return False
    k = _int_attr(module, _TOP_K)
    return k is not None and 1 <= k <= e and not module._modules


def _probe(module: nn.Module, dtype: torch.dtype, g: torch.Generator) -> nn.Module:
    """A copy of ``module`` whose tensors are random, of its shapes, in ``dtype``."""
    def random(owner: dict[str, Any]) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in owner.items():
            if isinstance(t, torch.Tensor):
                value = torch.randn(tuple(t.shape), generator=g).to(dtype)
                out[name] = value / t.shape[1] ** 0.5 * 4.0 if name == "weight" else value
        return out

    return probe_copy(module, parameters=random(module._parameters),
                      buffers=random(module._buffers))


def _served(form: RouterForm, module: nn.Module, x: torch.Tensor,
            backend: Any = None) -> tuple[torch.Tensor, ...]:
    weight: torch.Tensor | None = module._parameters["weight"]
    assert weight is not None
    bias: torch.Tensor | None = module._parameters.get("bias")
    x = x.reshape(-1, weight.shape[1])
    if form.upcast:
        x, weight = x.float(), weight.float()
        bias = None if bias is None else bias.float()
    logits = linear(x, weight, bias)
    choice_bias = None if form.bias is None else _tensors(module)[form.bias]
    weights, index = moe_router(logits, form.top_k, form.scoring, form.normalize,
                                choice_bias, form.groups, form.top_groups, form.scale,
                                backend=backend)
    if form.answer == "dense":
        scores = torch.zeros_like(logits).scatter_(1, index, weights.to(logits.dtype))
        return scores, logits
    if form.cast:
        weights = weights.to(logits.dtype)
    return logits, weights, index


def _answer(got: Any, t: int, e: int, k: int) -> str | None:
    if isinstance(got, tuple) and all(isinstance(g, torch.Tensor) for g in got):
        shapes = [tuple(g.shape) for g in got]
        if shapes == [(t, e), (t, k), (t, k)]:
            return "triple"
        if shapes == [(t, e), (t, e)]:
            return "dense"
    return None


def _gap(answer: str, got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]
         ) -> float:
    if answer == "triple":
        (gl, gw, gi), (wl, ww, wi) = got, want
        go, wo = gi.sort(dim=-1), wi.sort(dim=-1)
        if not torch.equal(go.values, wo.values.to(go.values.dtype)):
            return float("inf")
        got = (gl, gw.float().gather(1, go.indices))
        want = (wl, ww.float().gather(1, wo.indices))
    return max(gap(a, b) for a, b in zip(got, want, strict=True))


def router_form(module: nn.Module) -> RouterForm | str:
    """``module``'s ``RouterForm``, or why it is not served as a router."""
    weight = module._parameters["weight"]
    assert weight is not None
    e, h = weight.shape
    k = _int_attr(module, _TOP_K)
    assert k is not None
    groups = _int_attr(module, _GROUPS) or 1
    top_groups = _int_attr(module, ("topk_group",)) or 1
    scale = module.__dict__.get("routed_scaling_factor", 1.0)
    scale = float(scale) if isinstance(scale, (int, float)) and not isinstance(scale, bool) \
        else 1.0
    extra = _extra(module)
    g = torch.Generator().manual_seed(37)
    x = torch.randn(5, h, generator=g)
    probe = _probe(module, torch.float32, g)
    try:
        with torch.no_grad():
            half = type(module).forward(_probe(module, torch.bfloat16, g), x.bfloat16())
            got = type(module).forward(probe, x)
    except Exception as exc:
        return f"its forward raised {type(exc).__name__} on random tokens"
    answer = _answer(got, 5, e, k)
    if answer is None or _answer(half, 5, e, k) != answer:
        return ("its forward returns neither (logits, weights, indices) nor (scores, "
                "logits) of a top-k router")
    logits_dtype = half[0 if answer == "triple" else 1].dtype
    upcast = logits_dtype == torch.float32
    cast = answer == "triple" and half[1].dtype == logits_dtype
    gaps = []
    for scoring in ("softmax", "sigmoid"):
        for normalize in (False, True):
            form = RouterForm(answer, k, scoring, normalize,
                              extra if scoring == "sigmoid" else None,
                              groups, top_groups, scale, upcast, cast)
            if extra is not None and scoring == "softmax":
                continue
            try:
                with torch.no_grad():
                    want = _served(form, probe, x, "reference")
            except ValueError as exc:
                gaps.append(str(exc))
                continue
            gap = _gap(answer, got, want)
            if gap <= 1e-5:
                return form
            gaps.append(f"{scoring}{' renormalised' if normalize else ''} differs by "
                        f"{gap:.2g}")
    return f"it computes none of the router forms astrai serves ({'; '.join(gaps)})"


def _router_forward(form: RouterForm) -> Callable[..., Any]:
    def router_forward(self: nn.Module, hidden_states: torch.Tensor) -> Any:
        return _served(form, self, hidden_states)

    return router_forward


def _route(module: nn.Module) -> Installed | str:
    form = router_form(module)
    if isinstance(form, str):
        return form
    return Installed(_router_forward(form), form.describe(), form)


#: Routers: whole modules (their logits through the linear family, their choice here).
RECOGNITION = ModelRecognition(claims=_claims, module=_route, holds_weights=True)
