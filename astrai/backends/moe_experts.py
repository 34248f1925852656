"""MoE experts: rows ``grouped_mm``, ``grouped``, ``torch`` (the models' loop) and
``reference``.

``moe_experts(hidden, top_k_index, top_k_weights, gate_up, down, act, weights_on)`` runs
each token of ``hidden [T, H]`` through the ``K`` experts ``top_k_index [T, K]`` names
and sums them, weighted by ``top_k_weights [T, K]``. Expert ``e`` is a gated MLP in the
linear layout (``[out, in]``): ``g, u = (x @ gate_up[e].T).chunk(2, -1)``,
``expert(x) = (act(g) * u) @ down[e].T`` with ``gate_up [E, 2I, H]`` and
``down [E, H, I]``. With ``weights_on="output"`` (Mixtral, Qwen-MoE, DeepSeek) a token's
output is ``sum_k w_k * expert_k(x)``; with ``"input"`` (Llama 4) it is
``sum_k expert_k(w_k * x)``. An index equal to ``E`` names no expert (transformers' mark
for an expert held by another rank): that slot adds nothing. Any other index outside
``[0, E)`` is an error.

- ``torch`` is the models' own loop: for each expert hit, find its tokens, run them,
  scale, add (``index_add_``) into an output of ``hidden``'s dtype; products round as
  the models' do (a float32 weight promotes the product, which is cast once when added).
- ``grouped`` sorts the ``T * K`` (token, slot) pairs by expert once, runs one matmul
  pair per expert on its contiguous block and adds every block back in one
  ``index_add_`` - no scan of the index per expert.
- ``grouped_mm`` is ``grouped`` with torch's grouped matmul (``F.grouped_mm``): one call
  per projection for every expert at once. This torch has no backward for it on the CPU,
  its CPU kernel takes float32, bfloat16 and float16 only, and it needs the weights'
  strides and addresses aligned to 16 bytes (the table's ``align`` axis).
- ``reference`` is the loop in float32 (float64 for float64), cast once.
"""

from __future__ import annotations

__all__ = ["grouped_mm_available", "grouped_mm_moe_experts", "grouped_moe_experts",
           "reference_moe_experts", "torch_moe_experts"]

import torch
import torch.nn.functional as F

from astrai.backends.activation import reference_activation, torch_activation

Tensor = torch.Tensor


def _check_index(counts: Tensor, experts: int) -> None:
    if counts.numel() > experts + 1:
        raise ValueError(f"moe_experts: top_k_index names expert {counts.numel() - 1}, but "
                         f"there are {experts} experts (indices 0..{experts - 1}, or "
                         f"{experts} for none)")


def _expert(x: Tensor, gate_up: Tensor, down: Tensor, act: str, exact: bool) -> Tensor:
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    a = reference_activation(gate, act) if exact else torch_activation(gate, act)
    return F.linear(a * up, down)


def _loop(hidden: Tensor, index: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor,
          act: str, weights_on: str, exact: bool) -> Tensor:
    experts = gate_up.shape[0]
    out = torch.zeros_like(hidden)
    with torch.no_grad():
        counts = torch.bincount(index.reshape(-1), minlength=experts + 1)
        _check_index(counts, experts)
        hit = torch.nonzero(counts[:experts]).reshape(-1).tolist()
    for e in hit:
        token, slot = torch.where(index == e)
        x = hidden[token]
        w = weights[token, slot, None]
        if weights_on == "input":
            y = _expert((x * w).to(x.dtype), gate_up[e], down[e], act, exact)
        else:
            y = _expert(x, gate_up[e], down[e], act, exact) * w
        out.index_add_(0, token, y.to(out.dtype))
    return out


def torch_moe_experts(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                      gate_up: Tensor, down: Tensor, act: str, weights_on: str = "output"
                      ) -> Tensor:
    """The models' loop over the experts hit, in the inputs' dtype."""
    return _loop(hidden, top_k_index, top_k_weights, gate_up, down, act, weights_on, False)


def reference_moe_experts(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                          gate_up: Tensor, down: Tensor, act: str, weights_on: str = "output"
                          ) -> Tensor:
    """The loop written out in float32 (float64 for float64), cast once."""
    wide = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    out = _loop(hidden.to(wide), top_k_index, top_k_weights.to(wide), gate_up.to(wide),
                down.to(wide), act, weights_on, True)
    return out.to(hidden.dtype)


def _sorted(hidden: Tensor, index: Tensor, weights: Tensor, experts: int
            ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(token, x, w, counts)``: the (token, slot) pairs sorted by expert - each pair's
    token, its row of ``hidden``, its weight - and how many each expert has (the last
    count: the pairs naming no expert, sorted to the end)."""
    k = index.shape[-1]
    flat = index.reshape(-1)
    with torch.no_grad():
        counts = torch.bincount(flat, minlength=experts + 1)
        _check_index(counts, experts)
        order = torch.argsort(flat, stable=True)
    token = torch.div(order, k, rounding_mode="floor")
    return token, hidden[token], weights.reshape(-1)[order, None], counts


def _add_back(hidden: Tensor, token: Tensor, y: Tensor) -> Tensor:
    out = torch.zeros_like(hidden)
    out.index_add_(0, token[:y.shape[0]], y.to(out.dtype))
    return out


def grouped_moe_experts(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                        gate_up: Tensor, down: Tensor, act: str, weights_on: str = "output"
                        ) -> Tensor:
    """Pairs sorted by expert once; one matmul pair per expert on its block."""
    experts = gate_up.shape[0]
    token, x, w, counts = _sorted(hidden, top_k_index, top_k_weights, experts)
    sizes = counts.tolist()
    n = sum(sizes[:experts])
    if not n:
        return torch.zeros_like(hidden)
    if weights_on == "input":
        x = (x[:n] * w[:n]).to(x.dtype)
    blocks, start = [], 0
    for e in range(experts):
        size = sizes[e]
        if size:
            blocks.append(_expert(x[start:start + size], gate_up[e], down[e], act, False))
            start += size
    y = torch.cat(blocks) if len(blocks) > 1 else blocks[0]
    if weights_on == "output":
        y = y * w[:n]
    return _add_back(hidden, token, y)


def grouped_mm_available() -> bool | str:
    """Whether this torch has ``F.grouped_mm`` (or why not)."""
    if hasattr(F, "grouped_mm"):
        return True
    return f"torch {torch.__version__} has no torch.nn.functional.grouped_mm"


def grouped_mm_moe_experts(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                           gate_up: Tensor, down: Tensor, act: str,
                           weights_on: str = "output") -> Tensor:
    """Pairs sorted by expert once; each projection one grouped matmul over every expert."""
    experts = gate_up.shape[0]
    token, x, w, counts = _sorted(hidden, top_k_index, top_k_weights, experts)
    offsets = torch.cumsum(counts[:experts], 0, dtype=torch.int32)
    n = int(offsets[-1]) if experts else 0
    if not n:
        return torch.zeros_like(hidden)
    x = x[:n]
    if weights_on == "input":
        x = (x * w[:n]).to(x.dtype)
    gate, up = F.grouped_mm(x.contiguous(), gate_up.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
    y = F.grouped_mm((torch_activation(gate, act) * up).contiguous(), down.transpose(1, 2),
                     offs=offsets)
    if weights_on == "output":
        y = y * w[:n]
    return _add_back(hidden, token, y)
