"""How much of a model reaches astrai after ``dispatch_model``: the modules no family
serves, and the share of parameters and weight-matmul FLOPs that the routed ones hold.

``unaccounted(model, seen, routed)`` lists every module holding a parameter of its own
(an embedding, a stack of MoE experts or a router no family recognised, anything else)
that is neither routed nor already reported, with why no family serves it, so the report
never leaves a weight out (a parameter tied to a routed module's reaches astrai with it).
``shares(model, routed)`` counts each parameter tensor once; a module's FLOPs per token
are two per element of its 2-d weights, and for a 3-d stack of experts ``[experts,
...]`` the share a token runs (the config's ``num_experts_per_tok`` of
them; all of them when the config does not say).
"""

from __future__ import annotations

__all__ = ["shares", "unaccounted"]

from collections.abc import Iterator, Set
from typing import Any

import torch
from torch import nn

from astrai.integrations.transformers.report import NotRouted

_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)


def _own(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in module._parameters.items() if isinstance(p, torch.Tensor)}


def _experts_per_token(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    for owner in (config, getattr(config, "text_config", None)):
        k = getattr(owner, "num_experts_per_tok", None)
        if isinstance(k, int) and k > 0:
            return k
    return None


def _flops(module: nn.Module, per_token: int | None) -> int:
    if isinstance(module, _EMBEDDINGS):
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
    parameter of a module in ``routed`` too (tied: BERT's head holds its decoder's bias)
    and the module is no embedding (whose lookup no family serves, tied or not)."""
    reached = {id(p) for path, module in model.named_modules()
               if (path or "(the model)") in routed for p in _own(module).values()}
    for path, module in model.named_modules():
        name = path or "(the model)"
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
        elif any(p.dim() == 3 for p in params.values()):
            experts = max(p.shape[0] for p in params.values() if p.dim() == 3)
            yield NotRouted("experts", name, kind, f"a stack of {experts} MoE experts "
                            f"({shapes}), which no astrai family serves")
        else:
            yield NotRouted("other", name, kind, f"holds {shapes} and computes what no "
                            f"astrai family recognises")


def shares(model: nn.Module, routed: set[str]) -> tuple[tuple[int, int], tuple[int, int]]:
    """``((parameters reaching astrai, in all), (weight-matmul FLOPs per token reaching
    astrai, in all))``; ``routed`` holds the paths of the modules whose own parameters
    astrai's facades read (linear layers, norms)."""
    per_token = _experts_per_token(model)
    reached: dict[int, int] = {}
    every: dict[int, int] = {}
    flops = [0, 0]
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
