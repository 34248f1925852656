"""How much of a model reaches astrai after ``dispatch_model``: the modules no family
serves, and the share of parameters and weight-matmul FLOPs that the routed ones hold.

``unaccounted(model, seen, routed)`` lists every module holding a parameter of its own
(an embedding, a convolution, a stack of MoE experts or a router no family recognised,
anything else) that is neither routed nor already reported, with why no family serves it,
so the report never leaves a weight out (a parameter tied to a routed module's reaches
astrai with it).
A quantised module (torch's ``torch.ao.nn.quantized`` modules, which keep their weights
packed and no parameter; any module without children holding 2-d integer buffers, as
GPTQ-style layers do) is listed too: no astrai row computes on packed weights.
``shares(model, routed)`` counts each parameter tensor once; a module's FLOPs per token
are two per element of its 2-d weights (a convolution's kernel multiplies no weight
matrix: none), and for a 3-d stack of experts ``[experts, ...]`` the share a token runs
(the config's ``num_experts_per_tok`` of them; all of them when the config does not say).
A torch quantised module's packed weight and bias count as its parameters (a linear
one's weight as its matmul FLOPs), none of them reaching astrai; the packed buffers of
other quantised layers are not counted (their reason says so).
"""

from __future__ import annotations

import re

__all__ = ["shares", "unaccounted"]

from collections.abc import Iterator, Set
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from astrai.integrations.transformers.report import NotRouted

_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)
#: torch's convolutions (their weights are kernels, not stacks of experts).
_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                 nn.ConvTranspose3d)


def _own(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in module._parameters.items() if isinstance(p, torch.Tensor)}


#: The namespaces of torch's quantised modules (``.reference`` ones compute in float).
_QUANTISED = ("torch.ao.nn.quantized.", "torch.nn.quantized.")
_PACKED_INTEGERS = (torch.int8, torch.uint8, torch.int16, torch.int32)


@dataclass(frozen=True)
class _Quantised:
    """A quantised module: what it is, its weights' shapes, and their packed dtype."""

    kind: str  # matmul, embedding or other
    shapes: dict[str, tuple[int, ...]]  # empty where its packed size is unknown
    dtype: str

    @property
    def numel(self) -> int:
        total = 0
        for shape in self.shapes.values():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total

    @property
    def flops(self) -> int:
        weight = self.shapes.get("weight", ())
        return 2 * weight[0] * weight[1] if self.kind == "matmul" and len(weight) == 2 else 0


def _packed_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    return {"qint8": "int8", "quint8": "uint8", "qint32": "int32",
            "quint4x2": "uint4", "quint2x4": "uint2"}.get(name, name)


def _torch_quantised(module: nn.Module) -> _Quantised | None:
    """``module`` as one of torch's quantised modules, else ``None``."""
    classes = [c for c in type(module).__mro__
               if c.__module__.startswith(_QUANTISED) and ".reference" not in c.__module__]
    if not classes or not any(
            isinstance(v, torch.ScriptObject) or (isinstance(v, torch.Tensor) and v.is_quantized)
            for m in module.modules() for v in vars(m).values()):
        return None
    names = {c.__name__ for c in classes}
    kind = ("matmul" if "Linear" in names
            else "embedding" if names & {"Embedding", "EmbeddingBag"} else "other")
    shapes: dict[str, tuple[int, ...]] = {}
    dtype: Any = getattr(getattr(module, "_packed_params", None), "dtype", None)
    for name in ("weight", "bias"):
        if not callable(getattr(type(module), name, None)):
            continue
        try:
            value = getattr(module, name)()
        except Exception:  # a packing it cannot unpack: its size stays unknown
            continue
        if isinstance(value, torch.Tensor):
            shapes[name] = tuple(value.shape)
            if name == "weight" and dtype is None:
                dtype = value.dtype
    return _Quantised(kind, shapes, _packed_name(dtype) if dtype is not None else "quantised")


def _integer_packed(module: nn.Module) -> _Quantised | None:
    """A module without children holding 2-d integer buffers (GPTQ's ``qweight``) and no
    floating 2-d parameter, as a quantised layer of unknown size; else ``None``."""
    if module._modules or any(p.dim() == 2 and p.is_floating_point()
                              for p in _own(module).values()):
        return None
    packed = [b for b in module._buffers.values()
              if isinstance(b, torch.Tensor) and b.dim() == 2 and b.dtype in _PACKED_INTEGERS]
    if not packed:
        return None
    return _Quantised("other", {}, _packed_name(packed[0].dtype))


def _quantised(model: nn.Module) -> dict[str, tuple[nn.Module, _Quantised]]:
    """Every quantised module of ``model`` by path (never one inside another)."""
    out: dict[str, tuple[nn.Module, _Quantised]] = {}
    for path, module in model.named_modules():
        name = path or "(the model)"
        if any(name.startswith(f"{q}.") for q in out):
            continue  # the packed parameters its quantised parent holds
        got = _torch_quantised(module) or _integer_packed(module)
        if got is not None:
            out[name] = (module, got)
    return out


def _quantised_reason(path: str, module: nn.Module, q: _Quantised) -> NotRouted:
    kind = type(module).__name__
    shapes = ", ".join(f"{n} {list(s)}" for n, s in q.shapes.items())
    held = f" ({shapes}, packed {q.dtype})" if shapes else f" (packed {q.dtype} buffers)"
    if q.kind == "matmul":
        return NotRouted("quantised", path, kind, f"quantised linear{held}: no astrai row "
                         f"computes on packed {q.dtype} weights")
    if q.kind == "embedding":
        return NotRouted("embedding", path, kind, f"quantised embedding{held}: a lookup, "
                         f"and no astrai family serves it")
    counted = "" if q.shapes else "; its packed weights are not counted in the shares"
    return NotRouted("quantised", path, kind, f"quantised layer{held}: no astrai row "
                     f"computes on packed {q.dtype} weights{counted}")


def _experts_per_token(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    for owner in (config, getattr(config, "text_config", None)):
        k = getattr(owner, "num_experts_per_tok", None)
        if isinstance(k, int) and k > 0:
            return k
    return None


def _flops(module: nn.Module, per_token: int | None) -> int:
    if isinstance(module, _EMBEDDINGS + _CONVOLUTIONS):  # no weight matmul
        return 0
    total = 0
    for p in _own(module).values():
        if p.dim() == 2:
            total += 2 * p.numel()
        elif p.dim() == 3 and p.shape[0]:
            share = min(per_token or p.shape[0], p.shape[0])
            total += 2 * p.numel() * share // p.shape[0]
    return total


def unaccounted(model: nn.Module, seen: set[str], routed: Set[str] = frozenset()
                ) -> Iterator[NotRouted]:
    """A ``NotRouted`` for every module of ``model`` holding parameters of its own whose
    path is not in ``seen`` (routed or reported already), unless each of them is a
    parameter of a module in ``routed`` too (tied: BERT's head holds its decoder's bias;
    ``routed`` also holds the modules a family decision left to their own code, whose
    tied parameters that decision covers) and the module is no embedding (whose lookup
    no family serves, tied or not)."""
    reached = {id(p) for path, module in model.named_modules()
               if (path or "(the model)") in routed for p in _own(module).values()}
    quantised = _quantised(model)
    for path, module in model.named_modules():
        name = path or "(the model)"
        if name in quantised and name not in seen and name not in routed:
            yield _quantised_reason(name, module, quantised[name][1])
            continue
        params = _own(module)
        if name in seen or not params:
            continue
        if not isinstance(module, _EMBEDDINGS) and all(id(p) in reached
                                                       for p in params.values()):
            continue  # tied to a routed module's: they reach astrai there
        kind = type(module).__name__
        shapes = ", ".join(f"{n} {list(p.shape)}" for n, p in params.items())
        if isinstance(module, _EMBEDDINGS):
            yield NotRouted("embedding", name, kind, "an embedding lookup: it multiplies "
                            "nothing, and no astrai family serves it")
        elif isinstance(module, _CONVOLUTIONS):
            weight = params.get("weight")
            size = "" if weight is None else f", {weight.shape[0]} output channels"
            groups = getattr(module, "groups", 1)
            yield NotRouted("convolution", name, kind, f"a convolution ({shapes}{size}"
                            f"{f', groups {groups}' if groups != 1 else ''}), which no "
                            f"astrai family serves")
        elif _expert_stack(module, params):
            experts = max(p.shape[0] for p in params.values() if p.dim() == 3)
            yield NotRouted("experts", name, kind, f"a stack of {experts} MoE experts "
                            f"({shapes}), which no astrai family serves")
        else:
            yield NotRouted("other", name, kind, f"holds {shapes} and computes what no "
                            f"astrai family recognises")


#: the names of an expert stack's projections
_EXPERT_WEIGHTS = frozenset({"gate_up_proj", "down_proj", "gate_proj", "up_proj", "w1", "w2",
                             "w3"})


def _expert_stack(module: nn.Module, params: dict[str, Any]) -> bool:
    """Whether ``module``'s 3-d parameters are a stack of MoE experts: its class or the
    parameters say experts, or they are named as an expert's projections (other 3-d
    parameters, a recurrence's block-diagonal gates or a learned mask, are not called
    experts)."""
    stacked = [n for n, p in params.items() if p.dim() == 3 and p.shape[0] > 0]
    named = [type(module).__name__, *stacked]
    return bool(stacked) and (any(re.search(r"expert|moe", n, re.I) for n in named)
                              or any(n in _EXPERT_WEIGHTS for n in stacked))


def shares(model: nn.Module, routed: set[str]) -> tuple[tuple[int, int], tuple[int, int]]:
    """``((parameters reaching astrai, in all), (weight-matmul FLOPs per token reaching
    astrai, in all))``; ``routed`` holds the paths of the modules whose own parameters
    astrai's facades read (linear layers, norms)."""
    per_token = _experts_per_token(model)
    reached: dict[Any, int] = {}
    every: dict[Any, int] = {}
    flops = [0, 0]
    for name, (_module, q) in _quantised(model).items():  # none reaches astrai
        every[("quantised", name)] = q.numel
        flops[1] += q.flops
    for path, module in model.named_modules():
        name = path or "(the model)"
        params: dict[str, Any] = _own(module)
        hit = name in routed
        for p in params.values():
            every[id(p)] = p.numel()
            if hit:
                reached[id(p)] = p.numel()
        f = _flops(module, per_token)
        flops[1] += f
        if hit:
            flops[0] += f
    return (sum(reached.values()), sum(every.values())), (flops[0], flops[1])
