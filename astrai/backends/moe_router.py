"""MoE routers: rows ``torch`` and ``reference``.

``moe_router(logits, top_k, scoring, normalize, bias, groups, top_groups, scale)`` picks
each token's ``top_k`` experts from its router logits ``[T, E]`` and gives their weights
(float32) and indices (int64), ``[T, K]`` each:

- ``scoring="softmax"`` (Mixtral, Qwen-MoE): scores ``softmax(logits)`` in float32; the
  experts with the highest scores are chosen;
- ``scoring="sigmoid"`` (DeepSeek-V3, Llama 4): scores ``sigmoid(logits)`` in float32; the
  experts are chosen by ``scores + bias`` where a ``bias [E]`` is given (DeepSeek's
  correction), else by the logits themselves (the same order, without sigmoid's ties
  where it saturates);
- ``groups > 1`` (DeepSeek-V3): the experts are split into ``groups`` groups, each rated
  by the sum of its two best choice values; only the ``top_groups`` best groups' experts
  can be chosen;
- the weights are the chosen scores, divided by their sum when ``normalize`` (sigmoid's
  sum ``+ 1e-20``, as DeepSeek writes it), times ``scale``.

The order of the ``K`` chosen experts is the rows' own (the experts family sums them in
any order). ``torch`` uses ``torch.topk``; ``reference`` sorts each row (a stable
descending sort, ties to the lower index) and takes the first ``K``.
"""

from __future__ import annotations

__all__ = ["reference_moe_router", "torch_moe_router"]

from collections.abc import Callable

import torch

Tensor = torch.Tensor
#: ``pick(values, k)``: the ``k`` largest of each row, ``(values, indices)``.
_Pick = Callable[[Tensor, int], tuple[Tensor, Tensor]]


def _topk(values: Tensor, k: int) -> tuple[Tensor, Tensor]:
    top = torch.topk(values, k, dim=-1)
    return top.values, top.indices


def _sorted(values: Tensor, k: int) -> tuple[Tensor, Tensor]:
    ordered = torch.sort(values, dim=-1, descending=True, stable=True)
    return ordered.values[..., :k], ordered.indices[..., :k]


def _route(logits: Tensor, top_k: int, scoring: str, normalize: bool, bias: Tensor | None,
           groups: int, top_groups: int, scale: float, pick: _Pick) -> tuple[Tensor, Tensor]:
    if scoring == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        choice = scores
    else:
        scores = torch.sigmoid(logits.float())
        choice = scores + bias.float() if bias is not None else logits
    if groups > 1:
        t, e = choice.shape
        best = pick(choice.reshape(t, groups, e // groups), 2)[0].sum(-1)
        kept = torch.zeros(t, groups, dtype=torch.bool, device=choice.device)
        kept.scatter_(1, pick(best, top_groups)[1], True)
        mask = kept.unsqueeze(-1).expand(t, groups, e // groups).reshape(t, e)
        choice = choice.masked_fill(~mask, float("-inf"))
    top, index = pick(choice, top_k)
    weights = top if choice is scores else scores.gather(1, index)
    if normalize:
        total = weights.sum(dim=-1, keepdim=True)
        # softmax's chosen scores sum to at least top_k / E; sigmoid's may underflow
        weights = weights / (total if scoring == "softmax" else total + 1e-20)
    if scale != 1.0:
        weights = weights * scale
    return weights, index


def torch_moe_router(logits: Tensor, top_k: int, scoring: str = "softmax",
                     normalize: bool = False, bias: Tensor | None = None, groups: int = 1,
                     top_groups: int = 1, scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """The router with ``torch.topk``."""
    return _route(logits, top_k, scoring, normalize, bias, groups, top_groups, scale,
                  _topk)


def reference_moe_router(logits: Tensor, top_k: int, scoring: str = "softmax",
                         normalize: bool = False, bias: Tensor | None = None, groups: int = 1,
                         top_groups: int = 1, scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """The router with a stable descending sort of each row."""
    return _route(logits, top_k, scoring, normalize, bias, groups, top_groups, scale,
                  _sorted)
