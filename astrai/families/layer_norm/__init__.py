"""The ``layer_norm`` family: layer normalisation over the last dimension.

Its declaration is its schema: the facade ``layer_norm(x, weight=None, bias=None,
eps=1e-5, backend=None)``, its checks, its axes (``dtype``, ``device_cuda``, ``ndim``,
``grad_enabled``; lazily ``device``, ``sm`` and ``tokens`` - the rows normalised) and the
compiled path's reading follow from it (``astrai.dispatch.schema``); its model
recognition is ``astrai.families.layer_norm.model``. ``weight`` and ``bias`` are each
``[features]`` or ``None``, of ``x``'s dtype, or float32 with a float16/bfloat16 ``x``.
"""

from __future__ import annotations

__all__ = ["FAMILY", "LAYER_NORM", "SCHEMA", "layer_norm"]

from collections.abc import Callable

import torch

from astrai.dispatch.schema import Scalar, Schema, Tensor
from astrai.families import Family, declare

SCHEMA = Schema("layer_norm", {
    "x": Tensor("..., f", floating=True),
    "weight": Tensor("f", optional=True, dtype="x", float32_too=True),
    "bias": Tensor("f", optional=True, dtype="x", float32_too=True),
    "eps": Scalar("float", ge=0, default=1e-5),
}, doc="Layer normalisation over the last dimension, then ``* weight + bias`` (each "
       "optional), through the ``layer_norm`` table.", module=__name__)
LAYER_NORM = SCHEMA.facade()
layer_norm: Callable[..., torch.Tensor] = LAYER_NORM.function
FAMILY = declare(Family("layer_norm", (LAYER_NORM,),
                        model="astrai.families.layer_norm.model:RECOGNITION"))
