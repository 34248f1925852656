"""MoE expert stacks in a model, told by what they compute, and the forward that sends
them to ``ops.moe_experts``.

A module is claimed when it holds exactly two 3-d parameters with one leading size (the
experts) and one activation child: a stack of gated-MLP experts. Two call forms are
known:

- **routed** - ``forward(hidden [T, H], top_k_index [T, K], top_k_weights [T, K])``:
  each token through the experts its router chose, weighted on their outputs (Mixtral,
  Qwen2-MoE, Qwen3-MoE, DeepSeek-V3; transformers' ``experts_implementation`` switch
  included, whichever it names);
- **dense** - ``forward(hidden [E * T, H])``: block ``e`` of the rows through expert
  ``e`` (Llama 4, whose block scales each copy of the tokens by the router before).

The weights are in the linear layout (``gate_up [E, 2I, H]``, ``down [E, H, I]``) or
transposed (``[E, H, 2I]``, ``[E, I, H]``; Llama 4). A module is run - its class's own
forward, on a copy holding random float32 weights of a shrunk size (its experts kept;
the int attributes naming the hidden or the intermediate size shrunk with them, so that
a real model's experts are never copied), hooks left out - and compared with each form
and layout its shapes fit; the activation is the one its activation child computes. The
routed forward reads the module's parameters on every call and no longer calls the
activation child (the route covers it).
"""

from __future__ import annotations

__all__ = ["RECOGNITION", "ExpertsForm", "experts_form"]

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from astrai.families.activation.model import activation_child, child_activation
from astrai.families.moe_experts import moe_experts
from astrai.families.recognition import Installed, ModelRecognition
from astrai.recognition.inspection import call_signature
from astrai.recognition.probe import gap, probe_copy

_H, _I = 24, 8  # the probe's hidden and intermediate sizes (2 * _I != _H)


@dataclass(frozen=True)
class ExpertsForm:
    """How to serve one expert stack: its two weights by role, whether they are stored
    transposed, the call form (``routed`` or ``dense``) and the activation."""

    gate_up: str
    down: str
    transposed: bool
    call: str
    act_name: str
    act: str

    def describe(self) -> str:
        """The form in words, for the report."""
        layout = "[E, H, 2I]" if self.transposed else "[E, 2I, H]"
        how = ("each token through its top-k experts" if self.call == "routed"
               else "block e of the rows through expert e")
        return f"{how}: {self.down}({self.act}(g) * u), g, u from {self.gate_up} {layout}"


def _stacks(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in module._parameters.items()
            if isinstance(p, torch.Tensor) and p.dim() == 3}



def _claims(module: nn.Module) -> bool:
    params = [p for p in module._parameters.values() if p is not None]
    stacks = _stacks(module)
    return (len(stacks) == 2 and len(params) == 2
            and len({p.shape[0] for p in stacks.values()}) == 1
            and activation_child(module) is not None)


def _sizes(gate_up: torch.Tensor, down: torch.Tensor, transposed: bool
           ) -> tuple[int, int] | None:
    """``(H, I)`` when the two weights fit the layout, else ``None``."""
    if transposed:
        h, i2 = gate_up.shape[1], gate_up.shape[2]
        fits = down.shape[1] * 2 == i2 and down.shape[2] == h
        return (h, down.shape[1]) if fits else None
    i2, h = gate_up.shape[1], gate_up.shape[2]
    fits = down.shape[1] == h and down.shape[2] * 2 == i2
    return (h, down.shape[2]) if fits else None


def _call_form(module: nn.Module) -> str | None:
    signature = call_signature(type(module).forward)
    if signature is None:
        return None
    params = [p for p in signature.parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]  # after self
    required = [p for p in params if p.default is inspect.Parameter.empty]
    if len(params) >= 3 and len(required) <= 3:
        return "routed"
    if len(required) == 1:
        return "dense"
    return None


def _probe(module: nn.Module, gate_up: str, down: str, transposed: bool, h: int, i: int,
           g: torch.Generator) -> nn.Module:
    """A copy of ``module`` holding random float32 weights of hidden size ``_H`` and
    intermediate size ``_I`` in its layout, with its int attributes equal to ``h`` (or
    ``i``, ``2 i``) set to those."""
    e = module._parameters[gate_up].shape[0]  # type: ignore[union-attr]
    gu_shape = (e, _H, 2 * _I) if transposed else (e, 2 * _I, _H)
    dn_shape = (e, _I, _H) if transposed else (e, _H, _I)
    sizes = {name: _H if value == h else _I if value == i else 2 * _I
             for name, value in module.__dict__.items()
             if type(value) is int and not name.startswith("_") and value in (h, i, 2 * i)}
    return probe_copy(module, parameters={
        gate_up: torch.randn(gu_shape, generator=g) / _H ** 0.5,
        down: torch.randn(dn_shape, generator=g) / _I ** 0.5}, attributes=sizes)


def _inputs(form: str, experts: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    if form == "dense":
        return (torch.randn(experts * 3, _H, generator=g),)
    k = min(2, experts)
    tokens = 5
    index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    return torch.randn(tokens, _H, generator=g), index, torch.rand(tokens, k, generator=g)


def _served(form: ExpertsForm, args: tuple[torch.Tensor, ...], gate_up: torch.Tensor,
            down: torch.Tensor, backend: Any = None) -> torch.Tensor:
    if form.transposed:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    if form.call == "dense":
        hidden = args[0]
        experts = gate_up.shape[0]
        index = torch.arange(experts, device=hidden.device).repeat_interleave(
            hidden.shape[0] // experts).unsqueeze(1)
        weights = torch.ones(index.shape, dtype=hidden.dtype, device=hidden.device)
        return moe_experts(hidden, index, weights, gate_up, down, form.act, "output",
                           backend=backend)
    return moe_experts(args[0], args[1], args[2], gate_up, down, form.act, "output",
                       backend=backend)


def experts_form(module: nn.Module) -> ExpertsForm | str:
    """``module``'s ``ExpertsForm``, or why it is not served as an expert stack."""
    act_name, act = child_activation(module)
    if act.startswith("refused: "):
        return f"its activation {act_name}: {act.removeprefix('refused: ')}"
    call = _call_form(module)
    if call is None:
        return ("its forward takes neither (hidden, top_k_index, top_k_weights) nor one "
                "tensor of rows grouped by expert")
    stacks = _stacks(module)
    failures: list[str] = []
    for gate_up, down in (tuple(stacks), tuple(stacks)[::-1]):
        for transposed in (False, True):
            sizes = _sizes(stacks[gate_up], stacks[down], transposed)
            if sizes is None:
                continue
            form = ExpertsForm(gate_up, down, transposed, call, act_name, act)
            g = torch.Generator().manual_seed(31)
            probe = _probe(module, gate_up, down, transposed, *sizes, g)
            args = _inputs(call, stacks[gate_up].shape[0], g)
            try:
                with torch.no_grad():
                    got = type(module).forward(probe, *args)
                    want = _served(form, args, probe._parameters[gate_up],  # type: ignore[arg-type]
                                   probe._parameters[down], "reference")  # type: ignore[arg-type]
            except Exception as exc:
                failures.append(f"its forward raised {type(exc).__name__}")
                continue
            if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                failures.append("its forward returns another shape")
                continue
            far = gap(got, want)
            if far <= 1e-5:
                return form
            failures.append(f"differs by {far:.2g}")
    if not failures:
        return "its two 3-d weights fit no gated-expert layout ([E, 2I, H] and [E, H, I])"
    return (f"its weights fit a stack of gated experts but its forward computes none of "
            f"their forms ({'; '.join(dict.fromkeys(failures))})")


def _experts_forward(form: ExpertsForm) -> Callable[..., Any]:
    gate_up, down = form.gate_up, form.down
    if form.call == "dense":
        def dense_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
            p = self._parameters
            return _served(form, (hidden_states,), p[gate_up], p[down])  # type: ignore[arg-type]

        return dense_forward

    def routed_forward(self: nn.Module, hidden_states: torch.Tensor,
                       top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        p = self._parameters
        return _served(form, (hidden_states, top_k_index, top_k_weights),
                       p[gate_up], p[down])  # type: ignore[arg-type]

    return routed_forward


def _route(module: nn.Module) -> Installed | str:
    form = experts_form(module)
    if isinstance(form, str):
        return form
    return Installed(_experts_forward(form), form.describe(), form, covers=(form.act_name,))


#: Expert stacks: whole modules (their activation covered).
RECOGNITION = ModelRecognition(claims=_claims, module=_route, holds_weights=True)
