"""Hugging Face transformers through astrai: the attention adapter and whole models.

Two ways in, both explicit (importing this package changes nothing):

- ``register()`` installs ``attn_implementation="astrai"``: a model built with it sends
  every attention call to ``astrai.ops.attention`` (the adapter lives with its family:
  ``astrai.families.attention.transformers``).
- ``dispatch_model(model)`` routes an already-built model's work of every family that
  says how it is found in a model (the built-in ones: RMS norms, linear layers, rotary
  applications and attention calls), on its live instances, through astrai's facades,
  and returns a report of what it routed and what it could not, with the reason;
  ``restore_model(model)`` undoes it (``routing``, ``report``, ``coverage``)::

      from astrai.integrations.transformers import dispatch_model, restore_model
      report = dispatch_model(model)       # every family; or families=("rms_norm", ...)
      print(report)
      restore_model(model)                 # every original forward back

``run_transformers_demo`` (``astrai-ops demo --hf``) shows both on a tiny random Llama.
"""

from __future__ import annotations

__all__ = [
    "ATTN_IMPLEMENTATION",
    "FAMILIES",
    "DispatchReport",
    "NotRouted",
    "Routed",
    "RoutingError",
    "UnsupportedFeatureError",
    "astrai_attention_forward",
    "call_context",
    "dispatch_model",
    "explain_call",
    "is_registered",
    "model_families",
    "register",
    "restore_model",
    "run_transformers_demo",
    "verify_model",
]

from astrai.families.attention.transformers import (
    ATTN_IMPLEMENTATION,
    UnsupportedFeatureError,
    astrai_attention_forward,
    call_context,
    explain_call,
    is_registered,
    register,
)
from astrai.integrations.transformers.demo import run_transformers_demo
from astrai.integrations.transformers.report import DispatchReport, NotRouted, Routed
from astrai.integrations.transformers.routing import (
    FAMILIES,
    RoutingError,
    dispatch_model,
    model_families,
    restore_model,
    verify_model,
)
