"""What the families' model recognition shares: reading a module or a function as
it is, through whatever wraps it.

Each family says which modules of a model compute it (``astrai.families.recognition``);
they all tell a module by what it does rather than by its class's name, with these
helpers: the ``forward`` set on an instance (a module whose instance ``forward`` someone
else replaced - accelerate's offloading hooks do this - is never routed), a function's
parameters through any wrapper, the name a report gives a function, whether a module is
a norm the report must account for, and the stand-ins a rebuilt forward sees, made once
per object.
"""

from __future__ import annotations

__all__ = ["EMBEDDINGS", "call_signature", "further_inputs", "is_norm_kind", "label",
           "own_forward", "stand_in"]

import inspect
import re
from collections.abc import Callable
from typing import Any

from torch import nn

#: Modules that look a row up rather than multiply by their weight.
EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)
_NORM_NAME = re.compile(r"norm", re.IGNORECASE)


def own_forward(module: nn.Module) -> Any:
    """The ``forward`` set on the instance itself, or ``None``."""
    return module.__dict__.get("forward")


def is_norm_kind(module: nn.Module) -> bool:
    """Whether the report must account for ``module`` as a norm: ``torch.nn.RMSNorm``, or
    a module of no submodules whose class is named ``...Norm...`` (a layer named after
    its model, as RoBERTa-PreLayerNorm's are, holds modules and is no norm)."""
    if isinstance(module, nn.RMSNorm):
        return True
    return (bool(_NORM_NAME.search(type(module).__name__))
            and next(module.children(), None) is None)


def call_signature(fn: Any) -> inspect.Signature | None:
    """The parameters a call of ``fn`` takes, read through the wrappers models put
    around their functions: ``functools.wraps`` decorators (``__wrapped__``), bound
    methods, and a module that is called like a function and states its parameters on
    its ``forward`` (HF ``kernels``' function modules, whose ``__call__`` takes
    ``(*args, **kwargs)``). ``None`` when no layer of it says more than ``(*args,
    **kwargs)``."""
    candidates = [fn]
    if isinstance(fn, nn.Module):
        candidates.append(fn.forward)
    for candidate in candidates:
        try:
            signature = inspect.signature(candidate)
        except (TypeError, ValueError):
            continue
        if any(p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
               for p in signature.parameters.values()):
            return signature
    return None



def further_inputs(module: nn.Module) -> list[str]:
    """The parameters the class's ``forward`` of ``module`` takes besides ``self`` and its
    input (``RMSNormGated.forward(self, hidden_states, gate=None)``: ``["gate"]``);
    ``*args`` and ``**kwargs`` are not counted. A route serving ``module(x)`` alone must
    refuse a module whose callers may pass more."""
    signature = call_signature(type(module).forward)
    if signature is None:
        return []
    named = [p.name for p in signature.parameters.values()
             if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return named[2:]


def label(fn: Any, name: str) -> str:
    """``module.function`` of ``fn``, found under the global ``name``."""
    qualname = getattr(fn, "__qualname__", None)
    if not isinstance(qualname, str) or "<locals>" in qualname:
        qualname = name  # a wrapper class made in a function: the name it is called by
    return f"{getattr(fn, '__module__', '?')}.{qualname}"


#: What stands in for each replaced object (a rotary function, transformers' interface),
#: made once per object, so that every layer of an architecture shares one copy of its
#: module's globals (``rebind.home``): ``id(object) -> (object, stand-in)``.
_STAND_INS: dict[int, tuple[Any, Any]] = {}


def stand_in(real: Any, make: Callable[[], Any]) -> Any:
    """What stands in for ``real`` in rebuilt forwards: ``make()``, made once per object."""
    got = _STAND_INS.get(id(real))
    if got is None or got[0] is not real:
        got = _STAND_INS[id(real)] = (real, make())
    return got[1]
