"""Whole models through astrai: ``dispatch_model`` and ``restore_model``.

``dispatch_model(model)`` routes, on the live instances of an already-built model, every
RMS norm, linear layer, rotary application and attention call to astrai's facades
(``ops.rms_norm``, ``ops.linear``, ``ops.apply_rotary_half``, and ``ops.attention``
through the attention adapter), so each of them is decided by its table and counted,
explained, scoped, recorded, tuned and locked like any other call. Nothing is patched
on a class or a module: other models of the same architecture in the process are left
as they are.

How each kind is routed (``recognise`` says how each is found):

- **RMS norms and linear layers**: the instance's ``forward`` becomes astrai's
  (``_rms_norm_forward(form)`` / ``_linear_forward`` / ``_transposed_linear_forward``),
  reading the module's weight, bias and epsilon attribute on every call; for a norm, the
  form its own forward computes (weight in float32 or after the cast back,
  ``1 + weight``) is the call's features.
- **Attention layers**: the instance's ``forward`` becomes a copy of its class's
  (``rebind``), decorators included, that sees the rotary function it calls by name as
  a router to astrai's rotary facades in the function's layout, and transformers'
  ``ALL_ATTENTION_FUNCTIONS`` as an interface whose every implementation is astrai's
  adapter. The model's masks stay as its ``attn_implementation`` builds them (sdpa's or
  eager's, which the adapter reads). A rotary call its layout cannot express (a ``cos``
  shorter than ``head_dim`` for a function not seen to rotate part of a head; an argument
  it does not know) runs the model's own function, warns once naming the function, and is
  counted as row and origin ``model``. A layer computing ALiBi attention itself (Bloom)
  gets ``alibi_attention_forward`` instead.
- **The rest**: every module holding a weight that no family serves (embeddings, MoE
  experts, routers) is listed with the reason (``coverage``), beside the shares of
  parameters and weight-matmul FLOPs reaching astrai.

Each routed module carries its ``Route`` (``_astrai_route``): what was routed, the
``forward`` it had of its own before (usually none) and the one installed.
``dispatch_model`` routes a module once (a second call changes nothing, or adds the
families it did not route before); ``restore_model`` puts every original ``forward``
back, after which no astrai call happens. A module whose ``forward`` someone else
replaced on the instance (before astrai, or after it) is left alone and reported.

A routed model copies with ``copy.deepcopy`` (the copy is routed too); pickling the
model object itself (``torch.save(model)``, not its ``state_dict``) needs
``restore_model`` first, and says so.
"""

from __future__ import annotations

__all__ = ["FAMILIES", "ROUTE_ATTR", "Route", "RoutingError", "dispatch_model",
           "restore_model", "verify_model"]

import copy
import functools
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from astrai.dispatch.log import warn_once
from astrai.dispatch.stats import MODEL_OWN, count_model_own, stats
from astrai.integrations.transformers.alibi import alibi_attention_forward, alibi_form
from astrai.integrations.transformers.attention import astrai_attention_forward, watch_collector
from astrai.integrations.transformers.coverage import shares, unaccounted
from astrai.integrations.transformers.rebind import rebind
from astrai.integrations.transformers.recognise import (
    ATTENTION_INTERFACE,
    EAGER_ATTENTION,
    AttentionSite,
    LinearForm,
    NormForm,
    RotarySite,
    attention_site,
    is_linear_kind,
    is_norm_kind,
    is_rms_kind,
    linear_form,
    own_forward,
    rms_norm_form,
    rotary_in_layout,
    rotary_sites,
)
from astrai.integrations.transformers.report import DispatchReport, NotRouted, Routed
from astrai.ops import apply_rotary, apply_rotary_half, linear
from astrai.ops import rms_norm_form as rms_norm_call

#: The families ``dispatch_model`` routes, in the order it reports them.
FAMILIES = ("attention", "rotary", "rms_norm", "linear")
#: The attribute a routed module carries its ``Route`` in.
ROUTE_ATTR = "_astrai_route"


class RoutingError(RuntimeError):
    """``verify_model`` found a routed family that served no call."""


@dataclass
class Route:
    """What ``dispatch_model`` did to one module (kept on it as ``_astrai_route``)."""

    families: frozenset[str]
    # The forward astrai set on the instance (which had none of its own: a module whose
    # forward someone else set is never routed, so restoring is removing this one).
    installed: Any = None
    norm: NormForm | None = None
    linear: LinearForm | None = None
    rotary: tuple[RotarySite, ...] = ()
    attention: AttentionSite | None = None
    forward: Callable[..., Any] | None = None  # an attention layer's rebuilt forward

    def __deepcopy__(self, memo: dict[int, Any]) -> Route:
        # The installed forward is bound to the module: copy it (the module's copy binds
        # it to itself); the rest is code, shared.
        return Route(self.families, copy.deepcopy(self.installed, memo), self.norm,
                     self.linear, self.rotary, self.attention, self.forward)

    def __reduce__(self) -> Any:
        raise TypeError("a module routed by astrai's dispatch_model cannot be pickled: call "
                        "restore_model(model) first (its state_dict pickles as always)")


# -- the forwards astrai installs -------------------------------------------------


def _rms_norm_forward(form: NormForm) -> Callable[..., Any]:
    """An RMS norm module's forward in ``form``, through ``ops.rms_norm``: the weight read
    from the module's parameters and epsilon from its attribute, on every call. Holds no
    module (a copy of the model binds it to the copy)."""
    call = rms_norm_call(**form.keywords())
    eps_attr, from_dtype = form.eps_attr, form.eps_from_dtype

    def rms_norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        weight: Any
        try:
            weight = self._parameters["weight"]
        except KeyError:  # parametrized since: its weight is a property
            weight = self.weight
        eps = (torch.finfo(hidden_states.dtype).eps if from_dtype
               else self.__dict__[eps_attr])
        return call(hidden_states, weight, eps)

    return rms_norm_forward


def _linear_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` through ``ops.linear``."""
    params = self._parameters
    try:
        return linear(input, params["weight"], params.get("bias"))  # type: ignore[arg-type]
    except KeyError:  # parametrized since: its weight is a property
        return linear(input, self.weight, getattr(self, "bias", None))  # type: ignore[arg-type]


def _transposed_linear_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    """``x @ W + b`` (the weight stored ``[in, out]``, GPT-2's ``Conv1D``) through
    ``ops.linear``, with a transposed view of the weight."""
    params = self._parameters
    weight: Any
    try:
        weight = params["weight"]
    except KeyError:  # parametrized since: its weight is a property
        weight = self.weight
    return linear(input, weight.t(), params.get("bias"))


def _layer_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """An attention layer's forward: its class's, seeing astrai's rotary and attention."""
    route: Route = self.__dict__[ROUTE_ATTR]
    assert route.forward is not None
    return route.forward(self, *args, **kwargs)


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


#: What stands in for each replaced object (a rotary function, transformers' interface),
#: made once per object, so that every layer of an architecture shares one copy of its
#: module's globals (``rebind.home``): ``id(object) -> (object, stand-in)``.
_STAND_INS: dict[int, tuple[Any, Any]] = {}


def _stand_in(real: Any, make: Callable[[], Any]) -> Any:
    got = _STAND_INS.get(id(real))
    if got is None or got[0] is not real:
        got = _STAND_INS[id(real)] = (real, make())
    return got[1]


#: dtypes a float32-computing rotary function does not widen
_WIDE = (torch.float32, torch.float64)


def _rotary_router(site: RotarySite) -> Callable[..., Any]:
    """What a routed layer calls instead of ``site``'s function: ``ops.apply_rotary_half``
    in the site's layout, or the function itself (warning once, counted under the origin
    ``model``) for a call the layout cannot express."""
    original, default_dim, signature = site.function, site.unsqueeze_dim, site.signature
    layout, upcast, partial = site.layout, site.upcast, site.partial

    def own(q: Any, k: Any, cos: Any, sin: Any, args: tuple[Any, ...],
            kwargs: dict[str, Any], why: str) -> Any:
        warn_once(f"astrai: a rotary call to {site.label} runs the model's own function: "
                  f"{why}")
        count_model_own("rotary")
        return original(q, k, cos, sin, *args, **kwargs)

    def routed_rotary(q: Any, k: Any, cos: Any, sin: Any, *args: Any, **kwargs: Any) -> Any:
        dim = default_dim
        if args or kwargs:
            bound = signature.bind(q, k, cos, sin, *args, **kwargs)
            extra = {n: v for n, v in list(bound.arguments.items())[4:]}
            dim = extra.pop("unsqueeze_dim", default_dim)
            if any(v is not None and v is not signature.parameters[n].default
                   for n, v in extra.items()):
                return own(q, k, cos, sin, args, kwargs,
                           f"it was called with {', '.join(extra)}, which its layout "
                           f"({layout}) does not take")
        if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
                and isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)):
            return own(q, k, cos, sin, args, kwargs, "q, k, cos or sin is not a tensor")
        if not partial and cos.shape[-1] != q.shape[-1]:
            return own(q, k, cos, sin, args, kwargs,
                       f"cos covers {cos.shape[-1]} of head_dim {q.shape[-1]}, and the "
                       f"function was not seen to rotate part of a head")
        if layout == "half" and not upcast:
            return apply_rotary_half(q, k, cos, sin, dim)
        if upcast and q.dtype not in _WIDE:
            dtype = q.dtype
            q_out, k_out = rotary_in_layout(layout, q.float(), k.float(), cos.float(),
                                            sin.float(), dim, apply_rotary_half, apply_rotary)
            return q_out.to(dtype), k_out.to(dtype)
        return rotary_in_layout(layout, q, k, cos, sin, dim, apply_rotary_half, apply_rotary)

    routed_rotary.__qualname__ = f"astrai routed {site.name}"
    if layout == "complex":
        return _complex_router(site)
    if layout == "pairs":
        return _pairs_router(site)
    return routed_rotary


def _own_rotary(site: RotarySite, args: tuple[Any, ...], kwargs: dict[str, Any],
                why: str) -> Any:
    """``site``'s own function on a call astrai cannot serve: warned once, counted."""
    warn_once(f"astrai: a rotary call to {site.label} runs the model's own function: {why}")
    count_model_own("rotary")
    return site.function(*args, **kwargs)


def _complex_router(site: RotarySite) -> Callable[..., Any]:
    """``(q, k, freqs_cis)`` (Llama 4) through ``ops.apply_rotary``: ``freqs_cis`` is
    ``[batch, seq, head_dim/2]`` complex, q and k ``[batch, seq, heads, head_dim]``."""

    def routed_rotary(*args: Any, **kwargs: Any) -> Any:
        if len(args) != 3 or kwargs:
            return _own_rotary(site, args, kwargs, "it was not called as (q, k, freqs_cis)")
        q, k, freqs = args
        if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
                and isinstance(freqs, torch.Tensor) and freqs.is_complex()
                and q.dim() == k.dim() == 4 and freqs.dim() == 3
                and 2 * freqs.shape[-1] == q.shape[-1] == k.shape[-1]):
            return _own_rotary(site, args, kwargs, "its arguments are not q, k "
                               "[batch, seq, heads, head_dim] and complex freqs_cis "
                               "[batch, seq, head_dim/2]")
        table = torch.view_as_real(freqs)
        return apply_rotary(q, table), apply_rotary(k, table)

    routed_rotary.__qualname__ = f"astrai routed {site.name}"
    return routed_rotary


def _pairs_router(site: RotarySite) -> Callable[..., Any]:
    """``(x, sin, cos)`` (GPT-J) through ``ops.apply_rotary``: ``sin`` and ``cos`` are
    ``[batch, seq, head_dim/2]``, ``x`` ``[batch, seq, heads, head_dim]``."""

    def routed_rotary(*args: Any, **kwargs: Any) -> Any:
        if len(args) != 3 or kwargs:
            return _own_rotary(site, args, kwargs, "it was not called as (x, sin, cos)")
        x, sin, cos = args
        if not (isinstance(x, torch.Tensor) and isinstance(sin, torch.Tensor)
                and isinstance(cos, torch.Tensor) and x.dim() == 4
                and sin.dim() == cos.dim() == 3 and sin.shape == cos.shape
                and 2 * sin.shape[-1] == x.shape[-1]):
            return _own_rotary(site, args, kwargs, "its arguments are not x "
                               "[batch, seq, heads, head_dim] and sin, cos "
                               "[batch, seq, head_dim/2]")
        return apply_rotary(x, torch.stack((cos, sin), -1))

    routed_rotary.__qualname__ = f"astrai routed {site.name}"
    return routed_rotary


# -- dispatch_model ------------------------------------------------------------


def _families(families: Iterable[str] | None) -> frozenset[str]:
    if families is None:
        return frozenset(FAMILIES)
    if isinstance(families, str):
        families = (families,)
    wanted = frozenset(families)
    unknown = sorted(wanted - set(FAMILIES))
    if unknown:
        raise ValueError(f"dispatch_model: unknown famil{'y' if len(unknown) == 1 else 'ies'} "
                         f"{', '.join(map(repr, unknown))}; families: {', '.join(FAMILIES)}")
    return wanted


def _live_routes(model: nn.Module) -> Iterator[tuple[str, nn.Module, Route]]:
    """``(path, module, route)`` of every module of ``model`` whose forward is still the
    one astrai installed."""
    for path, module in model.named_modules():
        route = module.__dict__.get(ROUTE_ATTR)
        if route is not None and own_forward(module) is route.installed:
            yield path, module, route


def _install(module: nn.Module, function: Callable[..., Any], route: Route) -> None:
    route.installed = types.MethodType(function, module)
    module.__dict__[ROUTE_ATTR] = route
    module.__dict__["forward"] = route.installed


def _implementation(module: nn.Module, model: nn.Module) -> Any:
    for owner in (module, model):
        config = getattr(owner, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            return config._attn_implementation
    return None


class _Dispatch:
    """One ``dispatch_model`` call: what it routed and what it could not."""

    def __init__(self, model: nn.Module, wanted: frozenset[str]) -> None:
        self.model, self.wanted = model, wanted
        self.changed = 0
        self.refused: list[NotRouted] = []
        self.attention_named: list[str] = []

    def refuse(self, family: str, path: str, module: nn.Module, reason: str) -> None:
        self.refused.append(NotRouted(family, path or "(the model)", type(module).__name__,
                                      reason))

    def module(self, path: str, module: nn.Module) -> None:
        route: Route | None = module.__dict__.get(ROUTE_ATTR)
        if route is not None and own_forward(module) is not route.installed:
            for family in sorted(route.families & self.wanted):
                self.refuse(family, path, module, "its forward was replaced on the instance "
                            "after astrai routed it; astrai leaves it alone")
            return
        if is_linear_kind(module):
            self.linear(path, module, route)
        elif is_norm_kind(module):
            self.norm(path, module, route)
        else:
            self.layer(path, module, route)

    def _foreign(self, family: str, path: str, module: nn.Module, route: Route | None) -> bool:
        """Whether someone else set this module's forward (then it is refused)."""
        if route is None and "_kernel_repo" in module.__dict__:
            self.refuse(family, path, module,
                        f"transformers' use_kernels=True put a hub kernel "
                        f"({module.__dict__['_kernel_repo']!r}) in its forward; astrai leaves "
                        f"that kernel in charge")
            return True
        if route is None and own_forward(module) is not None:
            self.refuse(family, path, module,
                        f"its forward is already replaced on the instance "
                        f"({own_forward(module)!r}, e.g. by accelerate's hooks); astrai "
                        f"leaves it alone")
            return True
        return False

    def linear(self, path: str, module: nn.Module, route: Route | None) -> None:
        if "linear" not in self.wanted or route is not None:
            return
        if self._foreign("linear", path, module, route):
            return
        form = linear_form(module)
        if isinstance(form, str):
            self.refuse("linear", path, module, form)
            return
        forward = _transposed_linear_forward if form.transposed else _linear_forward
        _install(module, forward, Route(frozenset({"linear"}), linear=form))
        self.changed += 1

    def norm(self, path: str, module: nn.Module, route: Route | None) -> None:
        if "rms_norm" not in self.wanted or route is not None:
            return
        if self._foreign("rms_norm", path, module, route):
            return
        form = rms_norm_form(module)
        if isinstance(form, str):
            self.refuse("rms_norm" if is_rms_kind(module) else "norm", path, module, form)
            return
        _install(module, _rms_norm_forward(form), Route(frozenset({"rms_norm"}), norm=form))
        self.changed += 1

    def layer(self, path: str, module: nn.Module, route: Route | None) -> None:
        wanted = self.wanted & {"attention", "rotary"}
        if not wanted:
            return
        if "attention" in wanted and route is None:
            alibi = alibi_form(module)
            if isinstance(alibi, str):
                self.refuse("attention", path, module, alibi)
                return
            if alibi and not self._foreign("attention", path, module, route):
                _install(module, alibi_attention_forward, Route(frozenset({"attention"})))
                self.changed += 1
            if alibi is not None:
                return
        forward = type(module).forward
        attention: AttentionSite | None = None
        sites: list[RotarySite] = []
        if "attention" in wanted:
            found = attention_site(forward, _implementation(module, self.model),
                                   getattr(module, "config", None)
                                   or getattr(self.model, "config", None))
            if isinstance(found, str):
                self.refuse("attention", path, module, found)
            else:
                attention = found
                watch_collector()
            if found is None and "attention" in type(module).__name__.lower():
                self.attention_named.append(path)
        if "rotary" in wanted:
            sites, refused = rotary_sites(forward)
            for label, reason in refused:
                self.refuse("rotary", path, module, f"{label}: {reason}")
            if sites and module.__dict__.get("use_rope", True) in (False, 0):
                self.refuse("rotary", path, module, "the layer applies no rotary (its "
                            "use_rope is off: a NoPE layer), so its rotary functions "
                            "are not routed")
                sites = []
        families = frozenset({"attention"} if attention is not None else set()) | (
            frozenset({"rotary"}) if sites else frozenset())
        if route is not None:  # routed before: add what it did not route then
            families |= route.families
            attention = attention or route.attention
            sites = sites or list(route.rotary)
            if families == route.families:
                return
        if not families:
            return
        if self._foreign(next(iter(sorted(families))), path, module, route):
            return
        rebuilt = self.rebuild(forward, attention, sites)
        if rebuilt is None:
            for family in sorted(families):
                self.refuse(family, path, module, "its forward could not be copied to see "
                            "astrai's functions (it is not a plain Python function)")
            return
        new = Route(families, rotary=tuple(sites), attention=attention, forward=rebuilt)
        _install(module, _layer_forward, new)
        self.changed += 1

    def rebuild(self, forward: Any, attention: AttentionSite | None,
                sites: list[RotarySite]) -> Callable[..., Any] | None:
        owners = {id(s.owner): s.owner for s in sites}
        if attention is not None:
            owners[id(attention.owner)] = attention.owner
        if len(owners) != 1:
            return None
        owner = next(iter(owners.values()))
        replacements: dict[str, Any] = {
            s.name: _stand_in(s.function, functools.partial(_rotary_router, s)) for s in sites}
        if attention is not None:
            if ATTENTION_INTERFACE in attention.names:
                real = owner[ATTENTION_INTERFACE]
                replacements[ATTENTION_INTERFACE] = _stand_in(
                    real, functools.partial(_AdapterInterface, real))
            if EAGER_ATTENTION in attention.names:
                replacements[EAGER_ATTENTION] = astrai_attention_forward
        return rebind(forward, owner, replacements)

    def report(self) -> DispatchReport:
        routed: list[Routed] = []
        attention_paths: list[str] = []
        for path, module, route in _live_routes(self.model):
            name = path or "(the model)"
            kind = type(module).__name__
            for family in FAMILIES:
                if family not in route.families:
                    continue
                if family == "rms_norm" and route.norm is not None:
                    detail = route.norm.describe()
                elif family == "linear" and route.linear is not None:
                    detail = route.linear.describe()
                elif family == "rotary":
                    detail = ", ".join(s.label for s in route.rotary)
                elif family == "attention":
                    detail = ("ALiBi as an additive mask" if route.forward is None
                              else "astrai's attention adapter")
                    attention_paths.append(path)
                else:
                    detail = ""
                routed.append(Routed(family, name, kind, detail))
        refused = list(self.refused)
        for path in self.attention_named:  # an attention-named container of routed layers
            if not any(p.startswith(f"{path}.") or not path for p in attention_paths):
                module = self.model.get_submodule(path)
                refused.append(NotRouted("attention", path or "(the model)",
                                         type(module).__name__,
                                         "its forward does not go through transformers' "
                                         "attention interface (it computes attention itself)"))
        seen = {r.path for r in routed} | {n.path for n in refused}
        refused += unaccounted(self.model, seen)
        params, flops = shares(self.model, {r.path for r in routed
                                            if r.family in ("linear", "rms_norm")})
        notes: list[str] = []
        if getattr(self.model, "use_kernels", False) is True:
            hub = sum("_kernel_repo" in m.__dict__ for m in self.model.modules())
            notes.append(
                f"the model was built with use_kernels=True: {hub} module(s) run a hub "
                f"kernel in their forward and are left to it (listed below); the rotary "
                f"call sites astrai routes are served by astrai's tables, not by the hub "
                f"functions transformers attached to the layers")
        return DispatchReport(type(self.model).__name__, tuple(routed), tuple(refused),
                              self.changed, self.wanted, params, flops, tuple(notes))


def dispatch_model(model: nn.Module, families: Iterable[str] | None = None) -> DispatchReport:
    """Route ``model``'s RMS norms, linear layers, rotary applications and attention
    calls (or only ``families``) through astrai's facades; returns the report of what is
    routed and what could not be, with the reason. Routes each module once."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"dispatch_model takes a torch.nn.Module, got {type(model).__name__}")
    wanted = _families(families)
    run = _Dispatch(model, wanted)
    # Recognition runs each module's own code on small random CPU tensors: whatever
    # device the model lives on (meta included) or the caller made the default.
    with torch.device("cpu"):
        for path, module in model.named_modules():
            run.module(path, module)
    return run.report()


def restore_model(model: nn.Module) -> int:
    """Put back every ``forward`` ``dispatch_model`` replaced in ``model``; returns how
    many modules were restored. A module whose ``forward`` was replaced again after
    astrai's is left as it is, with a warning (its route is forgotten all the same)."""
    restored = 0
    for path, module in model.named_modules():
        route: Route | None = module.__dict__.pop(ROUTE_ATTR, None)
        if route is None:
            continue
        if own_forward(module) is not route.installed:
            warn_once(f"astrai: restore_model left {path or 'the model'} "
                      f"({type(module).__name__}) alone: its forward was replaced again "
                      f"after astrai routed it")
            continue
        del module.__dict__["forward"]
        restored += 1
    return restored


def _served_now(families: Iterable[str]) -> dict[str, int]:
    """Calls of each of ``families`` served by a row so far (the model's own code not
    counted)."""
    calls = stats().calls
    out = dict.fromkeys(families, 0)
    for (family, _row, origin), n in calls.items():
        if family in out and origin != MODEL_OWN:
            out[family] += n
    return out


def verify_model(model: nn.Module, *args: Any, **kwargs: Any) -> dict[str, int]:
    """Run ``model(*args, **kwargs)`` without autograd and count the calls each routed
    family served; ``RoutingError`` naming every routed module (for attention and rotary:
    every call site) that served no call through a row - a routing that did not take
    effect, or whose every call ran the model's own code."""
    routes = list(_live_routes(model))
    tally: dict[tuple[int, str], int] = {}
    taken: dict[int, list[dict[str, int]]] = {}
    handles = []
    for _path, module, route in routes:
        families = tuple(route.families)

        def before(m: nn.Module, _args: Any, families: tuple[str, ...] = families) -> None:
            taken.setdefault(id(m), []).append(_served_now(families))

        def after(m: nn.Module, _args: Any, _out: Any,
                  families: tuple[str, ...] = families) -> None:
            then = taken[id(m)].pop()
            for family, n in _served_now(families).items():
                key = (id(m), family)
                tally[key] = tally.get(key, 0) + n - then[family]

        handles.append(module.register_forward_pre_hook(before))
        handles.append(module.register_forward_hook(after))
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    served: dict[str, int] = {}
    idle: list[str] = []
    for path, module, route in routes:
        for family in FAMILIES:
            if family not in route.families:
                continue
            n = tally.get((id(module), family), 0)
            served[family] = served.get(family, 0) + n
            if n <= 0:
                idle.append(f"{family} ({path or '(the model)'} {type(module).__name__})")
    if idle:
        raise RoutingError(f"routed but served no call: {'; '.join(idle)} (the model does "
                           f"not reach these modules, their code changed under them, or "
                           f"every call ran the model's own code)")
    return served
