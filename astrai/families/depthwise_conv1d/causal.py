"""Causal convolutions a layer hands to a function: ``causal_conv1d_forward(self.conv,
hidden_states, cache, layer_idx, ...)`` (transformers 5's short-convolution, Mamba and
gated-delta-net mixers).

Such a parent never calls its ``Conv1d``: the function reads the module's weight and bias,
keeps the convolution state in the cache, and computes with two functions of its own
module, ``causal_conv1d_fn(x, weight, bias, activation)`` over a whole sequence and
``causal_conv1d_update(x, conv_state, weight, bias, activation)`` for one cached step.
In the parent's rebuilt forward ``causal_conv1d_forward`` stands for a copy of that
function (its cache handling unchanged) in which those two are astrai's: the
convolution through ``ops.depthwise_conv1d``, with the same casts and activation. A
call given more than the family computes (``seq_idx``: packed sequences, which a kernel
keeps apart; states to start from or return) runs the model's own function, warned once
and counted under the origin ``model``; the other keywords a layer passes on are ignored,
as the function it replaces ignores them. Each
is checked against the function it replaces on random inputs (and a step's state
update with it) before anything is routed; the handed module is then served through
its parent (it is not routed on its own, and the report counts its weight as reaching
astrai).
"""

from __future__ import annotations

__all__ = ["CAUSAL_FORWARD", "causal_sites"]

import functools
import inspect
import re
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from astrai.dispatch.log import warn_once
from astrai.dispatch.stats import count_model_own
from astrai.families.recognition import Sites
from astrai.recognition.inspection import stand_in
from astrai.recognition.probe import gap
from astrai.recognition.rebind import global_names, rebind

#: The function a parent hands its convolution to, and the two it computes with.
CAUSAL_FORWARD = "causal_conv1d_forward"
_WHOLE, _STEP = "causal_conv1d_fn", "causal_conv1d_update"
#: The activation table those functions read (transformers' ``ACT2FN``).
_ACTIVATIONS = "ACT2FN"

Conv = Callable[..., torch.Tensor]

#: What the causal-conv1d kernels take beyond one sequence per row (packed sequences'
#: index, states to start from or to return); the torch function ignores every keyword,
#: as a layer passes its own on (position_ids, ...).
_BEYOND = ("seq_idx", "cu_seqlens", "initial_states", "return_final_states",
           "final_states_out")


def _python_function(fn: Any, name: str) -> types.FunctionType | None:
    """The Python function behind ``fn``: itself, or the one a module standing for it
    calls (HF ``kernels``' function modules hold it in their ``forward``'s closure)."""
    if isinstance(fn, types.FunctionType):
        return fn
    forward = getattr(type(fn), "forward", None) if isinstance(fn, nn.Module) else None
    for cell in getattr(forward, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if isinstance(value, types.FunctionType) and value.__name__ == name:
            return value
    return None


def _activate(table: Any, out: torch.Tensor, activation: str | None) -> torch.Tensor:
    return out if activation is None else table[activation](out)


def _whole(conv: Conv, table: Any, theirs: Any) -> Callable[..., torch.Tensor]:
    def causal_conv1d_fn(hidden_states: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, activation: str | None = None,
                         **kwargs: Any) -> torch.Tensor:
        given = [k for k in _BEYOND if kwargs.get(k) is not None and kwargs[k] is not False]
        if given:  # packed sequences, which a kernel keeps apart, or states it returns
            warn_once(f"astrai: a causal convolution given {', '.join(given)} runs the "
                      f"model's own {_WHOLE}: the family convolves one sequence per row")
            count_model_own("depthwise_conv1d")
            return theirs(hidden_states, weight, bias, activation=activation,  # type: ignore[no-any-return]
                          **kwargs)
        time = hidden_states.shape[-1]
        x = hidden_states.to(weight.dtype)
        out = conv(x, weight.unsqueeze(1), bias, weight.shape[-1] - 1)[..., :time]
        return _activate(table, out, activation).to(hidden_states.dtype)

    return causal_conv1d_fn


def _step(conv: Conv, table: Any) -> Callable[..., torch.Tensor]:
    def causal_conv1d_update(hidden_states: torch.Tensor, conv_state: torch.Tensor,
                             weight: torch.Tensor, bias: torch.Tensor | None = None,
                             activation: str | None = None, **kwargs: Any) -> torch.Tensor:
        time, kept = hidden_states.shape[-1], conv_state.shape[-1]
        full = torch.cat([conv_state, hidden_states], dim=-1).to(weight.dtype)
        conv_state.copy_(full[..., -kept:])
        out = conv(full, weight.unsqueeze(1), bias, 0)[..., -time:]
        return _activate(table, out, activation).to(hidden_states.dtype)

    return causal_conv1d_update


def _differs(mine: Callable[..., torch.Tensor], theirs: Any, step: bool,
             activation: str | None) -> str | None:
    """Where ``mine`` and the function it replaces disagree on a random call, in words."""
    g = torch.Generator().manual_seed(7)
    channels, taps = 6, 4
    weight, bias = torch.randn(channels, taps, generator=g), torch.randn(channels, generator=g)
    x = torch.randn(2, channels, 1 if step else 9, generator=g)
    state = torch.randn(2, channels, taps, generator=g)
    try:
        with torch.no_grad():
            if step:
                ours, their_state = state.clone(), state.clone()
                got = mine(x, ours, weight, bias, activation=activation)
                want = theirs(x, their_state, weight, bias, activation=activation)
                if not torch.equal(ours, their_state):
                    return "its step keeps another convolution state"
            else:
                got = mine(x, weight, bias, activation=activation)
                want = theirs(x, weight, bias, activation=activation)
    except Exception as exc:
        return f"on a random call it raised {type(exc).__name__}: {exc}"
    if not isinstance(want, torch.Tensor) or not gap(got, want) <= 1e-5:
        return "it computes something else than a causal depthwise convolution"
    return None


def _routed(forward: types.FunctionType, conv: Conv) -> types.FunctionType | str:
    """A copy of ``forward`` computing through ``conv``, or why there is none."""
    names = set(forward.__code__.co_names)
    if not {_WHOLE, _STEP} <= names:
        return f"{CAUSAL_FORWARD} does not compute with {_WHOLE} and {_STEP}"
    home = forward.__globals__
    table = home.get(_ACTIVATIONS)
    whole, step = _whole(conv, table, home.get(_WHOLE)), _step(conv, table)
    for mine, name, is_step in ((whole, _WHOLE, False), (step, _STEP, True)):
        for activation in (None, "silu") if table is not None else (None,):
            why = _differs(mine, home.get(name), is_step, activation)
            if why is not None:
                return f"{name} (activation {activation}): {why}"
    copy = rebind(forward, home, {_WHOLE: whole, _STEP: step})
    return copy if copy is not None else f"{CAUSAL_FORWARD} could not be copied"


#: The handed module's name in a parent's call: ``causal_conv1d_forward(self.conv, ...``.
_HANDED = re.compile(rf"\b{CAUSAL_FORWARD}\(\s*self\.(\w+)\s*,")


@functools.cache
def _handed(forward: Any) -> tuple[str, ...] | None:
    """The children ``forward`` hands to ``causal_conv1d_forward``, read from its source
    once (every layer of a model shares it); ``None`` where the source is unreadable."""
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return None
    return tuple(sorted({m.group(1) for m in _HANDED.finditer(source)}))


def causal_sites(conv: Conv, claims: Callable[[nn.Module], bool]
                 ) -> Callable[[nn.Module, Any, nn.Module], tuple[Sites | None, list[str]]]:
    """The family's ``sites``: a layer whose ``forward`` hands a depthwise convolution
    (one ``claims``) to ``causal_conv1d_forward``, served through ``conv`` (the facade
    ``(x, weight, bias, padding)``)."""

    def sites(module: nn.Module, forward: Any, model: nn.Module
              ) -> tuple[Sites | None, list[str]]:
        found = [g for n, g in global_names(forward) if n == CAUSAL_FORWARD]
        if not found:
            return None, []
        owner = found[0]
        handed = _handed(forward)
        if handed is None:
            return None, [f"its forward calls {CAUSAL_FORWARD}, whose arguments its source "
                          f"(unreadable) would say"]
        children = [getattr(module, n, None) for n in handed]
        if not handed or not all(isinstance(c, nn.Module) and claims(c) for c in children):
            return None, [f"its forward calls {CAUSAL_FORWARD} with something other than a "
                          f"depthwise convolution of its own"]
        real = owner[CAUSAL_FORWARD]
        function = _python_function(real, CAUSAL_FORWARD)
        if function is None:
            return None, [f"{CAUSAL_FORWARD} is not a Python function astrai can read"]
        routed = stand_in(real, lambda: _routed(function, conv))
        if isinstance(routed, str):
            return None, [routed]
        return Sites(owner, {CAUSAL_FORWARD: routed}, f"{CAUSAL_FORWARD} ({', '.join(handed)})",
                     covers=tuple(handed), accounts=False), []

    return sites
