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
  strides and addresses aligned to 16 bytes (the table's ``align`` axis). Autocast does
  not reach its kernel on a CPU: under autocast it multiplies in the inputs' dtype, as
  transformers' own grouped experts do there.
- ``reference`` is the loop in float32 (float64 for float64), cast once.

Traced (``torch.compile``, ``torch.export``), every row traces with no graph break and
no data-dependent size, for every dtype. Under ``torch.compile`` a call its row would
compute eagerly - no autograd recording, no autocast, no tensor subclass - stands in the
graph as the operator ``astrai::moe_experts_<row>``, which runs the row's eager code (its
sizes depend on the data, so it cannot be traced into). Under ``torch.export``, and
wherever autograd records, the row traces to torch's operators (``_every_expert``), in
the row's dtype (the reference's: float32, float64 for float64): with fewer (token, slot)
pairs than experts, each pair's expert weights gathered; else every expert applied to
every token and kept where the token chose it, ``E / K`` times the loop's products. An
index outside ``[0, E]`` raises when the graph runs.
"""

from __future__ import annotations

__all__ = ["grouped_mm_available", "grouped_mm_moe_experts", "grouped_moe_experts",
           "reference_moe_experts", "torch_moe_experts"]

from collections.abc import Callable

import torch
import torch.nn.functional as F

from astrai.backends.activation import reference_activation, torch_activation
from astrai.backends.operators import plain_call, registered_operator

Tensor = torch.Tensor
#: A row's eager code: ``(hidden, top_k_index, top_k_weights, gate_up, down, act,
#: weights_on) -> out``.
ExpertsKernel = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, str, str], Tensor]


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
    if _tracing():
        return _traced(_TORCH_OPERATOR, hidden, top_k_index, top_k_weights, gate_up, down,
                       act, weights_on, False)
    return _torch_loop(hidden, top_k_index, top_k_weights, gate_up, down, act, weights_on)


def _torch_loop(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                gate_up: Tensor, down: Tensor, act: str, weights_on: str) -> Tensor:
    return _loop(hidden, top_k_index, top_k_weights, gate_up, down, act, weights_on, False)


def reference_moe_experts(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                          gate_up: Tensor, down: Tensor, act: str, weights_on: str = "output"
                          ) -> Tensor:
    """The loop written out in float32 (float64 for float64), cast once."""
    if _tracing():
        return _traced(_REFERENCE_OPERATOR, hidden, top_k_index, top_k_weights, gate_up,
                       down, act, weights_on, True)
    return _reference_loop(hidden, top_k_index, top_k_weights, gate_up, down, act,
                           weights_on)


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The reference's dtype: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _reference_loop(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                    gate_up: Tensor, down: Tensor, act: str, weights_on: str) -> Tensor:
    wide = _wide(hidden.dtype)
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
    if _tracing():
        return _traced(_GROUPED_OPERATOR, hidden, top_k_index, top_k_weights, gate_up, down,
                       act, weights_on, False)
    return _grouped(hidden, top_k_index, top_k_weights, gate_up, down, act, weights_on)


def _grouped(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up: Tensor,
             down: Tensor, act: str, weights_on: str) -> Tensor:
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
    if _tracing():
        return _traced(_GROUPED_MM_OPERATOR, hidden, top_k_index, top_k_weights, gate_up,
                       down, act, weights_on, False)
    return _grouped_mm(hidden, top_k_index, top_k_weights, gate_up, down, act, weights_on)


def _grouped_mm(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                gate_up: Tensor, down: Tensor, act: str, weights_on: str) -> Tensor:
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


# -- traced ---------------------------------------------------------------------------


def _tracing() -> bool:
    """Whether the call is being traced by ``torch.compile`` or ``torch.export`` (dynamo
    folds the answer; eagerly it reads a flag)."""
    return torch.compiler.is_compiling()


def _opaque(*tensors: Tensor) -> bool:
    """Whether a traced call may stand in the graph as its row's operator: compiled, not
    exported (an exported program names torch's operators only), no autograd recording
    (the operators have no backward), no autocast on the tensors' device or the CPU
    (the operator would not be cast as the traced code around it is), every tensor of
    torch's own types."""
    return (plain_call(*tensors) and not torch.compiler.is_exporting()
            and not torch.is_autocast_enabled(tensors[0].device.type))


def _traced(operator: ExpertsKernel, hidden: Tensor, index: Tensor, weights: Tensor,
            gate_up: Tensor, down: Tensor, act: str, weights_on: str, exact: bool) -> Tensor:
    """A row's call while traced: its operator where ``_opaque`` allows, else
    ``_every_expert`` in the row's dtype (``exact``: the reference's)."""
    if _opaque(hidden, index, weights, gate_up, down):
        return operator(hidden, index, weights, gate_up, down, act, weights_on)
    if not exact:
        return _every_expert(hidden, index, weights, gate_up, down, act, weights_on, False)
    wide = _wide(hidden.dtype)
    out = _every_expert(hidden.to(wide), index, weights.to(wide), gate_up.to(wide),
                        down.to(wide), act, weights_on, True)
    return out.to(hidden.dtype)


def _every_expert(hidden: Tensor, index: Tensor, weights: Tensor, gate_up: Tensor,
                  down: Tensor, act: str, weights_on: str, exact: bool) -> Tensor:
    """The experts' sum with no size that depends on the data, so that it traces into
    torch's operators: with fewer (token, slot) pairs than experts, each pair's expert
    weights gathered and applied to its token; else every expert applied to every token
    (each slot's copy of the tokens, with ``weights_on="input"``) and kept where the
    token chose it. An index outside ``[0, E]`` fails the graph's assertion."""
    experts, (t, k) = gate_up.shape[0], index.shape
    torch._assert_async(((index >= 0) & (index <= experts)).all(),
                        f"moe_experts: top_k_index names an expert outside 0..{experts} "
                        f"(there are {experts} experts; {experts} names none)")
    activate = reference_activation if exact else torch_activation
    scaled = weights_on == "input"
    if t * k < experts:
        named = index < experts  # [T, K]; the index E names no expert
        slot = index.clamp(0, experts - 1)
        x = hidden.unsqueeze(1).expand(t, k, hidden.shape[1])
        if scaled:
            x = (x * weights.unsqueeze(-1)).to(hidden.dtype)
        gate, up = (gate_up[slot] @ x.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
        y = (down[slot] @ (activate(gate, act) * up).unsqueeze(-1)).squeeze(-1)  # [T, K, H]
        if not scaled:
            y = y * weights.unsqueeze(-1)
        return torch.where(named.unsqueeze(-1), y, 0).sum(1).to(hidden.dtype)
    chosen = index.unsqueeze(-1) == torch.arange(experts, device=index.device)  # [T, K, E]

    def every(x: Tensor) -> Tensor:  # [T, H] -> [E, T, H]
        gate, up = torch.matmul(x, gate_up.transpose(1, 2)).chunk(2, dim=-1)
        return torch.matmul(activate(gate, act) * up, down.transpose(1, 2))

    if not scaled:
        share = torch.where(chosen, weights.unsqueeze(-1), 0).sum(1)  # [T, E]
        y = every(hidden) * share.T.unsqueeze(-1)
        return torch.where(chosen.any(1).T.unsqueeze(-1), y, 0).sum(0).to(hidden.dtype)
    total: Tensor | None = None
    for s in range(k):
        y = every((hidden * weights[:, s, None]).to(hidden.dtype))
        y = torch.where(chosen[:, s].T.unsqueeze(-1), y, 0).sum(0)
        total = y if total is None else total + y
    return torch.zeros_like(hidden) if total is None else total.to(hidden.dtype)


def _experts_operator(row: str, kernel: ExpertsKernel) -> ExpertsKernel:
    """The operator ``astrai::moe_experts_<row>`` that runs ``kernel`` (a row's eager
    code); registered with torch the first time."""

    def compute(hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                act: str, weights_on: str) -> torch.Tensor:
        out = kernel(hidden, top_k_index, top_k_weights, gate_up, down, act, weights_on)
        return out.contiguous()  # the layout the shape function says

    def shape(hidden: torch.Tensor, top_k_index: torch.Tensor,
              top_k_weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
              act: str, weights_on: str) -> torch.Tensor:
        return hidden.new_empty(hidden.shape)

    return registered_operator(f"moe_experts_{row}", compute, shape)  # type: ignore[no-any-return]


_TORCH_OPERATOR = _experts_operator("torch", _torch_loop)
_GROUPED_OPERATOR = _experts_operator("grouped", _grouped)
_GROUPED_MM_OPERATOR = _experts_operator("grouped_mm", _grouped_mm)
_REFERENCE_OPERATOR = _experts_operator("reference", _reference_loop)
