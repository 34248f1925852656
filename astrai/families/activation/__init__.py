"""The ``activation`` family: an elementwise activation (silu, gelu, gelu_tanh,
quick_gelu, relu, relu2).

Its declaration is its schema: the facade ``activation(x, act, backend=None)``, its
checks, its axes (``dtype``, ``device_cuda``, ``ndim``, ``grad_enabled`` and the table's
``act`` axis; lazily ``device``, ``sm`` and ``tokens`` - the rows of ``x``) and the
compiled path's reading all follow from it (``astrai.dispatch.schema``); its model
recognition is ``astrai.families.activation.model``.
"""

from __future__ import annotations

__all__ = ["ACTIVATION", "ACTIVATIONS", "FAMILY", "SCHEMA", "activation"]

from collections.abc import Callable

import torch

from astrai.backends.activation import ACTIVATIONS
from astrai.dispatch.schema import Choice, Schema, Tensor
from astrai.families import Family, declare

#: ``activation(x, act)``: x a floating tensor of rank >= 1; act one of the activations,
#: the table's ``act`` axis.
SCHEMA = Schema("activation", {
    "x": Tensor("..., f", floating=True),
    "act": Choice(ACTIVATIONS, axis="act", noun="activations"),
}, doc="``act`` applied to ``x`` elementwise, through the ``activation`` table.",
    module=__name__)
ACTIVATION = SCHEMA.facade()
activation: Callable[..., torch.Tensor] = ACTIVATION.function
FAMILY = declare(Family("activation", (ACTIVATION,),
                        model="astrai.families.activation.model:RECOGNITION"))
