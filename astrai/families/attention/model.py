"""Attention in a model: the layers whose ``forward`` finds its attention function
through transformers' attention interface, and the layers that compute attention
themselves in a form astrai knows.

- **Attention call sites** (``attention_site``): a ``forward`` that looks its attention
  function up in transformers' ``ALL_ATTENTION_FUNCTIONS`` (or calls
  ``eager_attention_forward`` by name), in a model whose masks the adapter reads
  (``attn_implementation`` ``sdpa``, ``eager`` or ``astrai``). In the layer's rebuilt
  forward the interface stands for one whose every implementation is astrai's adapter
  (``astrai.families.attention.transformers``); the model's masks stay as its
  ``attn_implementation`` builds them.
- **ALiBi layers** (Bloom): a layer computing ALiBi attention itself, checked by running
  a copy of it, gets ``alibi_attention_forward`` (the bias as an additive float mask).
- **Layers masking with a causal buffer of their own** (GPT-Neo, global and local), checked
  the same way, get ``buffered_attention_forward`` (the buffer's slice as an additive
  float mask).
- **Multi-head attention layers of their own** (XGLM, TrOCR, MVP, Megatron-BERT,
  RemBERT): three input projections (and an output one), keys from an encoder's output
  when given, kept in the call's cache, MVP's prompt keys; checked the same way, they get
  ``multihead_attention_forward``.

A module named after attention whose forward reaches neither is reported as computing
attention itself.
"""

from __future__ import annotations

__all__ = ["ATTENTION_INTERFACE", "EAGER_ATTENTION", "READABLE_MASKS", "RECOGNITION",
           "AttentionSite", "attention_site"]

import functools
import inspect
from dataclasses import dataclass
from typing import Any

from torch import nn

from astrai.families.attention.alibi import alibi_attention_forward, alibi_form
from astrai.families.attention.buffered import buffered_form
from astrai.families.attention.multihead import (
    MultiheadForm,
    multihead_attention_forward,
    multihead_form,
)
from astrai.families.attention.transformers import (
    ATTENTION_INTERFACE,
    EAGER_ATTENTION,
    astrai_attention_forward,
    interface_reads,
    watch_collector,
)
from astrai.families.recognition import Installed, ModelRecognition, Sites
from astrai.recognition.inspection import stand_in

#: The ``attn_implementation`` values whose masks the adapter reads (sdpa's boolean or
#: none, eager's additive, astrai's own: sdpa's).
READABLE_MASKS = ("sdpa", "eager", "astrai")


@dataclass(frozen=True)
class AttentionSite:
    """An attention layer's ``forward`` that finds its attention function by global name."""

    owner: dict[str, Any]  # the forward's globals
    names: tuple[str, ...]  # which of ATTENTION_INTERFACE / EAGER_ATTENTION it reads


def attention_site(forward: Any, implementation: Any,
                   config: Any = None) -> AttentionSite | str | None:
    """The site, the reason it cannot be routed, or ``None`` when ``forward`` does not use
    transformers' attention interface at all. ``config`` is the layer's (or the model's)
    configuration, read for what the layer asks of its attention function."""
    found = interface_reads(forward)
    if not found:
        return None
    if implementation not in READABLE_MASKS:
        return (f"the model's attn_implementation is {implementation!r}, whose masks "
                f"astrai's adapter does not read; build the model with "
                f"attn_implementation='sdpa' (or 'astrai')")
    owners = {id(g): g for _, g in found}
    if len(owners) > 1:
        return "its forward reads the attention interface from more than one module"
    owner = found[0][1]
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None and implementation == "sdpa" and _drops(owner, "softcap"):
        return (f"the model's sdpa attention ignores the soft-capping ({softcap}) the layer "
                f"asks for (this transformers' sdpa_attention_forward never reads softcap), "
                f"and astrai would apply it, changing the model's output; build it with "
                f"attn_implementation='eager' to have it applied")
    return AttentionSite(owner, tuple(dict.fromkeys(n for n, _ in found)))


def _drops(owner: dict[str, Any], keyword: str) -> bool:
    """Whether the ``sdpa`` function of the interface ``owner`` reads never reads
    ``keyword`` (neither a parameter nor a name or constant of its code)."""
    interface = owner.get(ATTENTION_INTERFACE)
    try:
        fn = interface["sdpa"]  # type: ignore[index]
    except Exception:
        return False
    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    return keyword not in code.co_varnames and keyword not in code.co_consts and (
        keyword not in code.co_names)


class _AdapterInterface:
    """Stands for transformers' ``ALL_ATTENTION_FUNCTIONS`` in a routed layer: every
    implementation it is asked for is astrai's adapter; anything else is the real one's."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def get_interface(self, name: Any, default: Any = None) -> Any:
        return astrai_attention_forward

    def get(self, name: Any, default: Any = None) -> Any:
        return astrai_attention_forward

    def __getitem__(self, name: Any) -> Any:
        return astrai_attention_forward

    def __contains__(self, name: Any) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _implementation(module: nn.Module, model: nn.Module) -> Any:
    for owner in (module, model):
        config = getattr(owner, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            return config._attn_implementation
    return None


def _layer(module: nn.Module) -> Installed | str | None:
    """A layer computing attention itself in a form astrai knows: ALiBi
    (``alibi_attention_forward``), masked by its own causal buffer
    (``buffered_attention_forward``), or multi-head attention taking keys from an
    encoder's output when given (``multihead_attention_forward``)."""
    alibi = alibi_form(module)
    if alibi is True:
        return Installed(alibi_attention_forward, "ALiBi as an additive mask")
    if alibi is not None:
        return alibi or None
    buffered = buffered_form(module)
    if callable(buffered):
        return Installed(buffered, "its causal buffer as an additive mask")
    if buffered is not None:
        return buffered
    multihead = multihead_form(module)
    if isinstance(multihead, MultiheadForm):
        return Installed(multihead_attention_forward(multihead),
                         "multi-head attention of its own (batched products)")
    return multihead


#: The flags by which a transformers model says which attention kernels compute its
#: attention (all ``False``: none but its own eager function).
_KERNEL_FLAGS = ("_supports_sdpa", "_supports_flash_attn", "_supports_flex_attn")


def _keywords(forward: Any) -> set[str]:
    """The keyword names ``forward``'s code passes in its calls (the names of its calls'
    keyword tuples: ``f(..., sinks=s)`` gives ``sinks``)."""
    code = getattr(inspect.unwrap(forward), "__code__", None)
    if code is None:
        return set()
    return {name for const in code.co_consts if isinstance(const, tuple)
            for name in const if isinstance(name, str)}


def eager_only(forward: Any, model: nn.Module) -> str | None:
    """Why a layer's attention is its model's own computation, which astrai's adapter
    does not make: the model says no attention kernel computes it (``_KERNEL_FLAGS`` all
    false) and the layer passes its attention function ``sinks=``, which no transformers
    attention function reads (theirs is ``s_aux``, one logit per head) - the model's own
    eager function computes them (per token, in Inkling 2). ``None`` otherwise."""
    cls = type(model)
    if any(getattr(cls, flag, True) for flag in _KERNEL_FLAGS):
        return None
    if "sinks" not in _keywords(forward):
        return None
    return (f"{cls.__name__} computes attention with its own eager function alone (its "
            f"{', '.join(_KERNEL_FLAGS)} are False) and the layer passes it sinks=, which "
            f"only that function computes; astrai's adapter serves sinks as one logit per "
            f"head (s_aux)")


def _sites(module: nn.Module, forward: Any, model: nn.Module) -> tuple[Sites | None, list[str]]:
    found = attention_site(forward, _implementation(module, model),
                           getattr(module, "config", None) or getattr(model, "config", None))
    if isinstance(found, AttentionSite):
        found = eager_only(forward, model) or found
    if isinstance(found, str):
        return None, [found]
    watch_collector()
    if found is None:
        return None, []
    replacements: dict[str, Any] = {}
    if ATTENTION_INTERFACE in found.names:
        real = found.owner[ATTENTION_INTERFACE]
        replacements[ATTENTION_INTERFACE] = stand_in(
            real, functools.partial(_AdapterInterface, real))
    if EAGER_ATTENTION in found.names:
        replacements[EAGER_ATTENTION] = astrai_attention_forward
    return Sites(found.owner, replacements, "astrai's attention adapter", (found,)), []


def _expected(module: nn.Module) -> str | None:
    if "attention" in type(module).__name__.lower():
        return ("its forward does not go through transformers' attention interface (it "
                "computes attention itself)")
    return None


#: Attention: call sites in layers, and ALiBi layers whole.
RECOGNITION = ModelRecognition(layer=_layer, sites=_sites, expected=_expected,
                               noun="call sites")
