"""The ``gated_activation`` family: ``act(gate) * up`` (SwiGLU, GeGLU) as one call.

Its declaration is its schema: the facade ``gated_activation(gate, up, act,
backend=None)``, its checks, its axes (``dtype``, ``device_cuda``, ``ndim``,
``grad_enabled`` and the table's ``act`` axis; lazily ``device``, ``sm`` and ``tokens`` -
the rows of ``gate``) and the compiled path's reading all follow from it
(``astrai.dispatch.schema``); its model recognition is
``astrai.families.gated_activation.model`` (the gated MLPs of Llama-style models and
Phi-3's fused projection).
"""

from __future__ import annotations

__all__ = ["FAMILY", "GATED", "SCHEMA", "gated_activation"]

from collections.abc import Callable

import torch

from astrai.backends.activation import ACTIVATIONS
from astrai.dispatch.schema import Choice, Schema, Tensor
from astrai.families import Family, declare

#: ``gated_activation(gate, up, act)``: gate and up floating, of one shape and dtype, rank
#: >= 1; act one of the activations, the table's ``act`` axis.
SCHEMA = Schema("gated_activation", {
    "gate": Tensor("..., f", floating=True),
    "up": Tensor("..., f", dtype="gate", like="gate"),
    "act": Choice(ACTIVATIONS, axis="act", noun="activations"),
}, doc="``act(gate) * up`` through the ``gated_activation`` table.", module=__name__)
GATED = SCHEMA.facade()
gated_activation: Callable[..., torch.Tensor] = GATED.function
FAMILY = declare(Family("gated_activation", (GATED,),
                        model="astrai.families.gated_activation.model:RECOGNITION"))
