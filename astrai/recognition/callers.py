"""Whether a module's parent calls it at all, read from the parent's class source.

A routed module serves the calls made to it. Some parents never make one: Mamba's mixer
multiplies by ``self.dt_proj.weight`` itself, and the Mamba-2 and gated-delta-net mixers
hand ``self.conv1d`` to ``causal_conv1d_forward``, which reads its weight. Routing such a
module would claim what never reaches astrai. ``not_called(parent, name)`` reads the
source of the parent's classes (its own, then its bases', up to ``torch.nn.Module``):
where ``self.<name>`` is never called there but its weight or bias is read, or the module
itself is handed to a function, it says so; where the source cannot be read, the parent
is a container (``ModuleList``, ``Sequential``, ``ModuleDict``) or the name is not an
attribute written in the source, it says nothing.
"""

from __future__ import annotations

__all__ = ["not_called"]

import functools
import inspect
import re

from torch import nn

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential, nn.ParameterList)


@functools.cache
def _source(cls: type) -> str | None:
    """The source of ``cls`` and its bases above torch's (read once per class: every
    layer of a model shares it)."""
    parts = []
    for klass in cls.__mro__:
        if klass in (nn.Module, object) or klass.__module__.startswith("torch.nn"):
            continue
        try:
            parts.append(inspect.getsource(klass))
        except (OSError, TypeError):
            return None
    return "\n".join(parts)


def not_called(parent: nn.Module, name: str) -> str | None:
    """Why ``parent`` never calls its child ``name`` (its code reads the child's weight, or
    hands the child to a function), or ``None`` when it may call it."""
    if isinstance(parent, _CONTAINERS) or not name.isidentifier():
        return None
    source = _source(type(parent))  # type: ignore[arg-type]  # classes hash by identity
    if source is None:
        return None
    me = re.escape(name)
    if not re.search(rf"\bself\.{me}\b", source) or re.search(rf"\bself\.{me}\s*\(", source):
        return None
    if re.search(r"getattr\(\s*self\s*,", source) or re.search(r"\bfor\b[^\n]*\bself\.children\(",
                                                                source):
        return None  # the child may be reached by name or by iteration
    read = re.search(rf"\bself\.{me}\.(weight|bias)\b", source)
    handed = re.search(rf"(\w+)\(\s*(?:[^()]*,\s*)?self\.{me}\s*[,)]", source)
    if read is None and handed is None:
        return None
    kind = type(parent).__name__
    if handed is not None:
        return (f"its parent ({kind}) never calls it: its code hands the module to "
                f"{handed.group(1)}(), which reads what it holds")
    assert read is not None
    return f"its parent ({kind}) never calls it: its code reads its {read.group(1)} directly"
