"""Gated MLPs in a model: a module whose forward computes ``down(act(gate(x)) * up(x))``
(Llama, Mistral, Qwen, Gemma, ...) or, with one fused projection,
``down(act(g) * u)`` where ``g, u = gate_up(x).chunk(2, -1)`` (Phi-3), told by what it
computes, and the forward that sends the gated product to ``ops.gated_activation``. A
module with one more child may apply it to the gated product before ``down`` (BitNet's
``ffn_sub_norm``, or a dropout): ``down(sub(act(gate(x)) * up(x)))``, that child served on
its own (a dropout is checked on a training call, both sides drawing the same mask).

A module is claimed when its direct children are one activation module and linear layers
(modules holding a 2-d weight) whose shapes fit one of the two forms. It is run - its
class's own forward, on a copy whose layers hold random weights on the CPU, hooks left out
- on a random input and compared with each assignment of its layers to the form's roles;
the activation is the one its activation module computes. The routed forward calls the
module's own layers (each served by the linear family) and ``ops.gated_activation``; it no
longer calls the activation module, which the route covers (it is not routed on its own).
"""

from __future__ import annotations

__all__ = ["RECOGNITION", "GatedForm", "gated_form"]

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from astrai.families.activation.model import activation_child, child_activation
from astrai.families.gated_activation import gated_activation
from astrai.families.recognition import Installed, ModelRecognition
from astrai.recognition.probe import gap, probe_copy, random_copy


@dataclass(frozen=True)
class GatedForm:
    """How to serve one gated MLP: its layers by role (``gate_up`` for a fused
    projection, else ``gate`` and ``up``), its ``down`` layer, the activation module it
    covers and the activation it computes."""

    act_name: str
    act: str
    down: str
    gate: str | None = None
    up: str | None = None
    gate_up: str | None = None
    #: The child applied to the gated product before ``down``, if any.
    sub: str | None = None

    def describe(self) -> str:
        """The form in words, for the report."""
        if self.gate_up is not None:
            product = f"{self.act}(gate) * up"
        else:
            product = f"{self.act}({self.gate}(x)) * {self.up}(x)"
        if self.sub is not None:
            product = f"{self.sub}({product})"
        if self.gate_up is not None:
            return f"{self.down}({product}), gate, up = {self.gate_up}(x).chunk(2)"
        return f"{self.down}({product})"


def _layers(module: nn.Module) -> dict[str, tuple[int, int]]:
    """The children holding a 2-d weight, by name: ``(in, out)`` features (``nn.Linear``'s
    weight is ``[out, in]``)."""
    out = {}
    for name, child in module._modules.items():
        w = None if child is None else child._parameters.get("weight")
        if isinstance(child, nn.Linear) and isinstance(w, torch.Tensor) and w.dim() == 2:
            out[name] = (w.shape[1], w.shape[0])
    return out



def _candidates(layers: dict[str, tuple[int, int]]) -> list[dict[str, str]]:
    """Assignments of layers to roles whose shapes fit a form."""
    found: list[dict[str, str]] = []
    if len(layers) == 3:
        for gate, up, down in itertools.permutations(layers, 3):
            (gi, go), (ui, uo), (di, do) = layers[gate], layers[up], layers[down]
            if gi == ui == do and go == uo == di:
                found.append({"gate": gate, "up": up, "down": down})
    if len(layers) == 2:
        for gate_up, down in itertools.permutations(layers, 2):
            (gi, go), (di, do) = layers[gate_up], layers[down]
            if go == 2 * di and gi == do:
                found.append({"gate_up": gate_up, "down": down})
    return found


def _claims(module: nn.Module) -> bool:
    if any(p is not None for p in module._parameters.values()):
        return False
    return activation_child(module) is not None and bool(_candidates(_layers(module)))


def _others(module: nn.Module, act_name: str) -> list[str]:
    """The children that are neither its linear layers nor its activation."""
    layers = _layers(module)
    return [name for name, child in module._modules.items()
            if child is not None and name not in layers and name != act_name]


def _probe(module: nn.Module, others: list[str]) -> nn.Module:
    """A copy of ``module`` whose layers hold random float32 weights on the CPU, and
    its ``others`` (a sub-norm) are random CPU copies of theirs."""
    g = torch.Generator().manual_seed(23)
    layers: dict[str, nn.Module | None] = {}
    for name in _layers(module):
        layer = nn.Linear(1, 1)  # replaced below: the child's shapes, random values
        child = module._modules[name]
        assert child is not None
        w = child._parameters["weight"]
        b = child._parameters.get("bias")
        assert w is not None
        layer.weight = nn.Parameter(torch.randn(tuple(w.shape), generator=g) / w.shape[1] ** 0.5,
                                    requires_grad=False)
        bias = None if b is None else nn.Parameter(torch.randn(tuple(b.shape), generator=g),
                                                   requires_grad=False)
        layer.register_parameter("bias", bias)
        layers[name] = layer
    for name in others:
        child = module._modules[name]
        assert child is not None
        layers[name] = random_copy(child, g)
    return probe_copy(module, modules=layers)


def _compute(probe: nn.Module, form: GatedForm, x: torch.Tensor) -> torch.Tensor:
    m = probe._modules
    act = m[form.act_name]
    assert act is not None
    if form.gate_up is not None:
        gate, up = m[form.gate_up](x).chunk(2, dim=-1)  # type: ignore[misc]
    else:
        gate, up = m[form.gate](x), m[form.up](x)  # type: ignore[index, misc]
    product = act(gate) * up
    if form.sub is not None:
        product = m[form.sub](product)  # type: ignore[misc]
    return m[form.down](product)  # type: ignore[misc, no-any-return]


def gated_form(module: nn.Module) -> GatedForm | str | None:
    """``module``'s ``GatedForm``, why it is not served as a gated MLP, or ``None`` when
    its forward cannot even take an input shaped for any assignment of its layers (its
    layers only happen to have such shapes: it is no gated MLP, and they are served on
    their own)."""
    act_name, act = child_activation(module)
    if act.startswith("refused: "):
        return f"its activation {act_name}: {act.removeprefix('refused: ')}"
    others = _others(module, act_name)
    dropping = [name for name in others if any(
        isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0
        for m in module._modules[name].modules())]  # type: ignore[union-attr]
    dropout_reason = (f"it holds a dropout ({', '.join(dropping)}) it does not apply to the "
                      f"gated product alone")
    if dropping and (len(others) > 1 or not isinstance(
            module._modules[dropping[0]], nn.modules.dropout._DropoutNd)):
        return dropout_reason
    # one more child: a sub-norm, or a dropout, on the gated product? A dropout is tried
    # only there (a call out of training cannot tell it from nothing) and probed training,
    # both sides drawing the same mask
    subs: list[str | None] = [*dropping] if dropping else (
        [None, *others] if len(others) == 1 else [None])
    try:
        probe = _probe(module, others if len(others) == 1 else [])
    except Exception as exc:  # a child that cannot be copied to the CPU with values
        return f"its children could not be copied to probe it ({type(exc).__name__}: {exc})"
    for name in dropping:
        probe._modules[name].train()  # type: ignore[union-attr]
    layers = _layers(module)
    failures: list[str] = []
    for roles, sub in itertools.product(_candidates(layers), subs):
        form = GatedForm(act_name, act, **roles, sub=sub)
        first = layers[roles.get("gate_up") or roles["gate"]][0]
        x = torch.randn(2, 3, first, generator=torch.Generator().manual_seed(29))
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                torch.manual_seed(31)
                got = type(module).forward(probe, x)
                torch.manual_seed(31)
                want = _compute(probe, form, x)
        except Exception as exc:
            failures.append(f"its forward raised {type(exc).__name__} on [2, 3, {first}]")
            continue
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            failures.append("its forward returns another shape")
            continue
        far = gap(got, want)
        if far <= 1e-5:
            return form
        failures.append(f"differs by {far:.2g}")
    if dropping:
        return dropout_reason
    if failures and all(" raised " in f for f in failures):
        return None
    return (f"its layers fit a gated MLP but its forward computes none of its forms "
            f"({'; '.join(dict.fromkeys(failures))})")


def _gated_forward(form: GatedForm) -> Callable[..., Any]:
    """The MLP's forward: its own layers, the gated product through the facade."""
    act, down, sub = form.act, form.down, form.sub
    if form.gate_up is not None:
        gate_up = form.gate_up

        def fused_forward(self: nn.Module, x: torch.Tensor) -> Any:
            m = self._modules
            gate, up = m[gate_up](x).chunk(2, dim=-1)  # type: ignore[misc]
            product = gated_activation(gate, up, act)
            return m[down](product if sub is None else m[sub](product))  # type: ignore[misc]

        return fused_forward
    gate_name, up_name = form.gate, form.up

    def gated_forward(self: nn.Module, x: torch.Tensor) -> Any:
        m = self._modules
        product = gated_activation(m[gate_name](x), m[up_name](x), act)  # type: ignore[index,misc]
        return m[down](product if sub is None else m[sub](product))  # type: ignore[misc]

    return gated_forward


def _route(module: nn.Module) -> Installed | str | None:
    form = gated_form(module)
    if form is None or isinstance(form, str):
        return form
    return Installed(_gated_forward(form), form.describe(), form, covers=(form.act_name,))


#: Gated MLPs: whole modules (their layers routed on their own, their activation covered).
RECOGNITION = ModelRecognition(claims=_claims, module=_route)
