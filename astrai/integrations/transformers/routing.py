"""Whole models through astrai: ``dispatch_model`` and ``restore_model``.

``dispatch_model(model)`` routes, on the live instances of an already-built model, the
work of every declared family that says how it is found in a model (a
``ModelRecognition``, ``astrai.families.recognition``) to that family's facade, so each
call is decided by its table and counted, explained, scoped, recorded, tuned and locked
like any other call. Nothing is patched on a class or a module: other models of the same
architecture in the process are left as they are.

This module knows no family by name. For each module of the model, in order:

- a family that **claims** the module (a norm, a linear layer, a stack of experts) routes
  it whole - its ``Installed`` forward is set on the instance, reading the module's
  parameters on every call - or refuses it with the reason; of several claiming one
  module, the first (in the order families are declared) that routes it wins, and when
  none does the first one's refusal is reported;
- else a family may route the **layer** whole (an attention layer computing ALiBi
  itself);
- else the **call sites** of the layer's ``forward`` (its class's): the functions it
  calls by global name that some family serves. The instance's ``forward`` becomes a
  copy of its class's (``rebind``), decorators included, in which each such name stands
  for what its family gave (a router to the facade); the sites of several families in
  one forward share one copy.

The rest - every module holding a weight that no family serves (embeddings, quantised
layers) - is listed with the reason (``coverage``), beside the shares of parameters and
weight-matmul FLOPs routed to astrai; the report's ``calls()`` says later which calls
astrai's rows computed and which a row handed back to torch.

Each routed module carries its ``Route`` (``_astrai_route``): what was routed, for which
families, and the ``forward`` installed. ``dispatch_model`` routes a module once (a
second call changes nothing, or adds the families it did not route before);
``restore_model`` puts every original ``forward`` back, after which no astrai call
happens. A module whose ``forward`` someone else replaced on the instance (before astrai,
or after it) is left alone and reported.

A routed model copies with ``copy.deepcopy`` (the copy is routed too); pickling the
model object itself (``torch.save(model)``, not its ``state_dict``) needs
``restore_model`` first, and says so.
"""

from __future__ import annotations

__all__ = ["FAMILIES", "MODES", "ROUTE_ATTR", "Route", "RoutingError", "dispatch_model",
           "model_families", "restore_model", "verify_model"]

import copy
import inspect
import os
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from astrai.backends.frozen import freeze, thaw
from astrai.dispatch.log import warn_once
from astrai.dispatch.stats import MODEL_OWN, mark, stats, unobserved
from astrai.families import every_family
from astrai.families.recognition import Installed, ModelRecognition, Note, Refused, Sites
from astrai.integrations.transformers.coverage import shares, unaccounted
from astrai.integrations.transformers.report import DispatchReport, NotRouted, Routed
from astrai.recognition.callers import not_called
from astrai.recognition.inspection import is_norm_kind, own_forward
from astrai.recognition.rebind import rebind

#: The attribute a routed module carries its ``Route`` in.
ROUTE_ATTR = "_astrai_route"


def model_families() -> dict[str, ModelRecognition]:
    """Every declared family ``dispatch_model`` can route, by name, in the order
    declared, with its recognition."""
    out: dict[str, ModelRecognition] = {}
    for name, family in every_family().items():
        recognition = family.recognition()
        if recognition is not None:
            out[name] = recognition
    return out


#: The built-in families ``dispatch_model`` routes, in the order it reports them (a
#: user's family declared with a recognition joins them: ``model_families``).
FAMILIES = tuple(n for n, f in every_family().items() if f.model is not None)


class RoutingError(RuntimeError):
    """``verify_model`` found a routed family that served no call."""


@dataclass
class Route:
    """What ``dispatch_model`` did to one module (kept on it as ``_astrai_route``)."""

    families: frozenset[str]
    # The forward astrai set on the instance (which had none of its own: a module whose
    # forward someone else set is never routed, so restoring is removing this one).
    installed: Any = None
    # Per family: the report's words, and what was recognised (a form, call sites).
    details: dict[str, str] = field(default_factory=dict)
    parts: dict[str, Any] = field(default_factory=dict)
    forward: Callable[..., Any] | None = None  # a layer's rebuilt forward
    # Per family whose call sites the rebuilt forward serves: what it gave.
    sites: dict[str, Sites] = field(default_factory=dict)
    # The direct children the installed forward no longer calls (not routed on their own).
    covers: tuple[str, ...] = ()
    # Whether a call with these arguments reaches the families (None: every call does).
    serves: Callable[[tuple[Any, ...], dict[str, Any]], bool] | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> Route:
        # The installed forward is bound to the module: copy it (the module's copy binds
        # it to itself); the rest is code, shared.
        return Route(self.families, copy.deepcopy(self.installed, memo), dict(self.details),
                     dict(self.parts), self.forward, dict(self.sites), self.covers,
                     self.serves)

    def __reduce__(self) -> Any:
        raise TypeError("a module routed by astrai's dispatch_model cannot be pickled: call "
                        "restore_model(model) first (its state_dict pickles as always)")


def _layer_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A layer's forward: its class's, seeing what the families' call sites stand for."""
    route: Route = self.__dict__[ROUTE_ATTR]
    assert route.forward is not None
    return route.forward(self, *args, **kwargs)


# -- dispatch_model ------------------------------------------------------------


def _wanted(families: Iterable[str] | None, known: Mapping[str, ModelRecognition]
            ) -> frozenset[str]:
    if families is None:
        return frozenset(known)
    if isinstance(families, str):
        families = (families,)
    wanted = frozenset(families)
    unknown = sorted(wanted - set(known))
    if unknown:
        raise ValueError(f"dispatch_model: unknown famil{'y' if len(unknown) == 1 else 'ies'} "
                         f"{', '.join(map(repr, unknown))}; families: {', '.join(known)}")
    return wanted


def _live_routes(model: nn.Module) -> Iterator[tuple[str, nn.Module, Route]]:
    """``(path, module, route)`` of every module of ``model`` whose forward is still the
    one astrai installed."""
    for path, module in model.named_modules():
        route = module.__dict__.get(ROUTE_ATTR)
        if route is not None and own_forward(module) is route.installed:
            yield path, module, route


def _signed(function: Callable[..., Any], module: nn.Module) -> Callable[..., Any]:
    """``function`` as ``module``'s forward shows itself to ``inspect``: a copy (the same
    code, no extra call) carrying the signature of the class's ``forward``. Callers read
    it - ``generate`` looks for ``attention_mask`` and ``logits_to_keep``, the ``Trainer``
    keeps the dataset columns the model's forward names - so a routed forward must name
    the parameters its class's does."""
    if not isinstance(function, types.FunctionType):
        return function
    try:
        signature = inspect.signature(type(module).forward)
    except (TypeError, ValueError):  # a forward that shows no signature: none to keep
        return function
    signed = types.FunctionType(function.__code__, function.__globals__, function.__name__,
                                function.__defaults__, function.__closure__)
    signed.__kwdefaults__ = function.__kwdefaults__
    signed.__qualname__ = function.__qualname__
    signed.__dict__.update(function.__dict__)
    signed.__signature__ = signature  # type: ignore[attr-defined]
    return signed


def _install(module: nn.Module, function: Callable[..., Any], route: Route) -> None:
    route.installed = types.MethodType(_signed(function, module), module)
    module.__dict__[ROUTE_ATTR] = route
    module.__dict__["forward"] = route.installed


class _Dispatch:
    """One ``dispatch_model`` call: what it routed and what it could not."""

    def __init__(self, model: nn.Module, known: Mapping[str, ModelRecognition],
                 wanted: frozenset[str], left: Iterable[str] = ()) -> None:
        self.model, self.known, self.wanted = model, known, wanted
        # Families left to the model's own code, and the modules of each kept so.
        self.left = frozenset(left)
        self.kept: dict[str, list[str]] = {}
        self.changed = 0
        self.refused: list[NotRouted] = []
        # Modules a routed parent's forward covers (it no longer calls them), by id.
        self.covered: set[int] = set()
        # ``(family, path, reason)`` of modules a family expected to serve.
        self.expected: list[tuple[str, str, str]] = []
        # What the families noted about layers with none of their work to route.
        self.notes: list[str] = []

    def refuse(self, family: str, path: str, module: nn.Module, reason: str) -> None:
        self.refused.append(NotRouted(family, path or "(the model)", type(module).__name__,
                                      reason))

    def module(self, path: str, module: nn.Module) -> None:
        if id(module) in self.covered:
            return
        route: Route | None = module.__dict__.get(ROUTE_ATTR)
        if route is not None and own_forward(module) is not route.installed:
            for family in sorted(route.families & self.wanted):
                self.refuse(family, path, module, "its forward was replaced on the instance "
                            "after astrai routed it; astrai leaves it alone")
            return
        if route is not None:
            self.cover(module, route.covers)
        claimants = [(f, r) for f, r in self.known.items()
                     if r.claims is not None and r.claims(module)]
        if claimants:
            if route is None:
                self.claimed(path, module, claimants)
            return
        if is_norm_kind(module):  # a norm of a kind no family claims: said, not skipped
            self.refuse("norm", path, module, "a norm of a kind no astrai family claims (no "
                        "declared family recognises its class as one it serves)")
            return
        self.layer(path, module, route)

    def claimed(self, path: str, module: nn.Module,
                claimants: list[tuple[str, ModelRecognition]]) -> None:
        """Serve a module the families ``claimants`` claim (in the order declared): the
        first that routes it wins; when none does, the first one's refusal is reported
        (a router holds a weight the linear family claims and refuses, and the router
        family serves)."""
        refusal: tuple[str, Any] | None = None
        serving = [f for f, _ in claimants if f in self.wanted and f not in self.left]
        if path and serving:
            parent_path, _, child = path.rpartition(".")
            why = not_called(self.model.get_submodule(parent_path), child)
            if why is not None:  # nothing of it would reach astrai: said, not routed
                self.refuse(serving[0], path, module, why)
                return
        for family, recognition in claimants:
            if family in self.left:
                self.kept.setdefault(family, []).append(path or "(the model)")
                return
            if family not in self.wanted or recognition.module is None:
                continue
            answer = recognition.module(module)
            if isinstance(answer, Installed):
                self.answer(family, path, module, answer)
                return
            if answer is not None and refusal is None:
                refusal = (family, answer)
        if refusal is not None:
            self.answer(refusal[0], path, module, refusal[1])

    def answer(self, family: str, path: str, module: nn.Module, answer: Any) -> bool:
        """Act on what a family answered for a whole module; whether it answered."""
        if answer is None:
            return False
        if isinstance(answer, str):
            answer = Refused(answer)
        if isinstance(answer, Refused):
            self.refuse(answer.kind or family, path, module, answer.reason)
            return True
        assert isinstance(answer, Installed), answer
        if not self._foreign(family, path, module, None):
            _install(module, answer.forward, Route(frozenset({family}),
                                                   details={family: answer.detail},
                                                   parts={family: answer.form},
                                                   covers=answer.covers,
                                                   serves=answer.serves))
            self.cover(module, answer.covers)
            self.changed += 1
        return True

    def cover(self, module: nn.Module, names: tuple[str, ...]) -> None:
        """Leave the children ``names`` of ``module`` unrouted: its forward covers them (a
        child routed by an earlier call gets its own forward back)."""
        for name in names:
            child = module._modules.get(name)
            if child is None:
                continue
            self.covered.add(id(child))
            route = child.__dict__.get(ROUTE_ATTR)
            if route is not None and own_forward(child) is route.installed:
                del child.__dict__[ROUTE_ATTR], child.__dict__["forward"]
                self.changed += 1

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

    def layer(self, path: str, module: nn.Module, route: Route | None) -> None:
        wanted = [(f, r) for f, r in self.known.items() if f in self.wanted]
        if route is None:
            for family, recognition in wanted:
                if recognition.layer is not None and self.answer(
                        family, path, module, recognition.layer(module)):
                    return
        forward = type(module).forward
        found: dict[str, Sites] = {}
        for family, recognition in wanted:
            if recognition.sites is None:
                continue
            sites, reasons = recognition.sites(module, forward, self.model)
            for reason in reasons:
                if isinstance(reason, Note):
                    self.notes.append(f"{path or '(the model)'}: {reason.text}")
                else:
                    self.refuse(family, path, module, reason)
            if sites is not None:
                found[family] = sites
            elif not reasons and recognition.expected is not None:
                why = recognition.expected(module)
                if why is not None:
                    self.expected.append((family, path, why))
        if route is not None:  # routed before: add what it did not route then
            if not route.sites or set(found) <= route.families:
                return
            found = {**route.sites, **{f: s for f, s in found.items()
                                       if f not in route.families}}
        if not found:
            return
        families = frozenset(found)
        if self._foreign(min(families), path, module, route):
            return
        rebuilt = self.rebuild(forward, found)
        if rebuilt is None:
            for family in sorted(families):
                self.refuse(family, path, module, "its forward could not be copied to see "
                            "astrai's functions (it reads them from more than one module, "
                            "or it is not a plain Python function)")
            return
        covers = tuple(dict.fromkeys(c for s in found.values() for c in s.covers))
        new = Route(families, details={f: s.detail for f, s in found.items()},
                    parts={f: s.parts for f, s in found.items()}, forward=rebuilt,
                    sites=found, covers=covers)
        _install(module, _layer_forward, new)
        self.cover(module, covers)
        self.changed += 1

    @staticmethod
    def rebuild(forward: Any, found: Mapping[str, Sites]) -> Callable[..., Any] | None:
        owners = {id(s.owner): s.owner for s in found.values()}
        if len(owners) != 1:
            return None
        replacements: dict[str, Any] = {}
        for sites in found.values():
            replacements.update(sites.replacements)
        return rebind(forward, next(iter(owners.values())), replacements)

    def report(self) -> DispatchReport:
        routed: list[Routed] = []
        weights = {f for f, r in self.known.items() if r.holds_weights}
        # children a weight family's route serves through their parent (never called)
        through: set[str] = set()
        # layers routed through call sites that compute more with their own parameters
        partial: set[str] = set()
        for path, module, route in _live_routes(self.model):
            if any(not s.accounts for s in route.sites.values()):
                partial.add(path or "(the model)")
            name = path or "(the model)"
            kind = type(module).__name__
            for family in self.known:
                if family in route.families:
                    routed.append(Routed(family, name, kind, route.details.get(family, "")))
            if route.families & weights:
                through.update(f"{path}.{c}" if path else c for c in route.covers)
        refused = list(self.refused)
        # a container of routed layers is fine; one whose layer is already named, with
        # its own reason, is that layer's container
        named = [(r.family, r.path) for r in routed] + [(n.family, n.path) for n in refused]
        for family, path, why in self.expected:
            if not any(f == family and (not path or p == path or p.startswith(f"{path}."))
                       for f, p in named):
                module = self.model.get_submodule(path)
                refused.append(NotRouted(family, path or "(the model)",
                                         type(module).__name__, why))
        seen = ({r.path for r in routed} - partial) | {n.path for n in refused} | through
        kept = {p for paths in self.kept.values() for p in paths}
        seen.update(kept)
        reaching = ({r.path for r in routed if r.family in weights} - partial) | through
        refused += unaccounted(self.model, seen, reaching | kept)
        params, flops = shares(self.model, reaching)
        notes = list(self.notes)
        if getattr(self.model, "use_kernels", False) is True:
            hub = sum("_kernel_repo" in m.__dict__ for m in self.model.modules())
            notes.append(
                f"the model was built with use_kernels=True: {hub} module(s) run a hub "
                f"kernel in their forward and are left to it (listed below); the call "
                f"sites astrai routes are served by astrai's tables, not by the hub "
                f"functions transformers attached to the layers")
        nouns = {f: r.noun for f, r in self.known.items()}
        return DispatchReport(type(self.model).__name__, tuple(routed), tuple(refused),
                              self.changed, self.wanted, params, flops, tuple(notes),
                              tuple(self.known), nouns, counted_from=mark())


#: ``dispatch_model``'s modes: ``train`` (parameters may change in any way; rows keep
#: nothing derived from them) and ``inference`` (every parameter declared frozen).
MODES = ("train", "inference")


def dispatch_model(model: nn.Module, families: Iterable[str] | None = None, *,
                   mode: str = "train", tuned: bool | str | os.PathLike[str] = True,
                   leave: Iterable[str] = ()) -> DispatchReport:
    """Route ``model``'s work of every family that recognises itself in a model (the
    built-in ones: attention and rotary call sites, RMS norms, linear layers), or only
    of ``families``, through astrai's facades; returns the report of what is routed and
    what could not be, with the reason. Routes each module once.

    ``mode="inference"`` declares every parameter of the model frozen
    (``astrai.backends.frozen.freeze``): changed only through the parameter itself or a
    new ``.data``, never by a write through ``.data`` or a NumPy view; rows may then keep
    copies derived from them (the linear row ``transposed``). ``mode="train"`` (the
    default) withdraws that declaration for every parameter of the model.

    ``tuned`` (default ``True``; ``ASTR_TUNED=off`` says ``False`` for every call): put
    this machine's tuned profile (``astrai.tune_model``, kept in the user's cache, or in
    the cache folder ``tuned`` names) in force
    process-wide (``astrai.dispatch.tuned``), and leave to the model's own code every family a
    profile in force says runs faster there (its ``model_code``; a family named in
    ``families`` is routed all the same). The report says which profile, from which file,
    and what it left to the model.

    ``leave``: families left to the model's own code all the same (said in the report),
    the rest decided as without it."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"dispatch_model takes a torch.nn.Module, got {type(model).__name__}")
    if mode not in MODES:
        raise ValueError(f"dispatch_model: unknown mode {mode!r}; modes: "
                         f"{', '.join(map(repr, MODES))}")
    known = model_families()
    wanted = _wanted(families, known)
    left_here = _wanted(leave, known) & wanted
    found, left, notes = _tuned(tuned, wanted - left_here, families is not None)
    left.update(dict.fromkeys(left_here, "dispatch_model(..., leave=...) names it"))
    (freeze if mode == "inference" else thaw)(model.parameters())
    if families is None:  # (after the freeze: rows copying frozen weights may serve)
        left.update(_nothing_to_gain(known, wanted - set(left)))
    run = _Dispatch(model, known, wanted - set(left), left)
    run.notes += notes
    # Recognition runs each module's own code on small random CPU tensors: whatever
    # device the model lives on (meta included) or the caller made the default; the
    # facade calls it makes to compare leave no trace in stats() or a recording.
    with torch.device("cpu"), unobserved():
        for path, module in model.named_modules():
            run.module(path, module)
    kept = {f: f"{len(p)} {known[f].noun} ({', '.join(p[:3])}{', ...' if len(p) > 3 else ''}); "
            for f, p in run.kept.items()}
    return replace(run.report(), mode=mode, tuned=found,
                   model_code=tuple((f, kept.get(f, "") + why) for f, why in sorted(left.items())))


def _tuned(tuned: bool | str | os.PathLike[str], wanted: frozenset[str], named: bool
           ) -> tuple[str, dict[str, str], list[str]]:
    """The tuned profile (put in force where allowed), in words; the families of
    ``wanted`` a profile in force leaves to the model's own code, with the reason; and
    notes for the families ``named`` explicitly that a profile would have left."""
    from astrai.dispatch.environment import env_now
    from astrai.dispatch.provenance import left_to_model
    from astrai.dispatch.registry import current
    from astrai.dispatch.scopes import active_profiles, process_profiles
    from astrai.dispatch.tuned import tuned_setting, use_tuned

    used = tuned is not False and tuned_setting()
    if tuned is False:
        found = "not used (dispatch_model(..., tuned=False))"
    elif not used:
        found = "not used (ASTR_TUNED=off)"
    else:
        found = use_tuned(None if tuned is True else tuned).describe()
    state = current()
    wide = () if used else process_profiles()
    profiles = [p for p in active_profiles(state, env_now(state)) if p not in wide]
    left: dict[str, str] = {}
    notes: list[str] = []
    for family in sorted(wanted):
        for name in profiles:
            prof = state.profiles[name]
            if family in state.families and any(ov.model_code
                                                for ov in prof.for_family(family)):
                if named:
                    notes.append(f"{family} is routed because families= names it; "
                                 f"{left_to_model(name, prof.provenance, family)}")
                else:
                    left[family] = left_to_model(name, prof.provenance, family)
                break
    return found, left, notes


def _nothing_to_gain(known: Mapping[str, ModelRecognition], wanted: Iterable[str]
                     ) -> dict[str, str]:
    """The families of ``wanted`` whose every row but the one computing what the modules
    do (``ModelRecognition.plain_row``) is out of reach on this machine - unavailable, out
    of the implicit chain, or with a ``when`` that no call here satisfies (its machine
    axes) - with nothing selecting a row for them (``ASTR_OPS``, a profile forcing one):
    routing them could only add its cost. Family -> why."""
    from astrai.dispatch.environment import env_now
    from astrai.dispatch.expr.analysis import on_this_machine
    from astrai.dispatch.hardware import machine_facts
    from astrai.dispatch.registry import current
    from astrai.dispatch.scopes import active_view

    state = current()
    env = env_now(state)
    out: dict[str, str] = {}
    for family in wanted:
        plain = known[family].plain_row if family in known else None
        if plain is None or family not in state.families or family in env.backends:
            continue
        view = active_view(state, family)
        if view.forced is not None or view.row(plain) is None:
            continue
        why: list[str] = []
        for rec in view.rows:
            if rec.name == plain:
                continue
            chained = view.in_chain(rec)
            if rec.name in view.disabled:
                why.append(f"{rec.name}: disabled")
            elif not rec.implicit and rec.name not in view.enabled:
                why.append(f"{rec.name}: explicit-only")
            elif on_this_machine(chained.spec) is False:
                why.append(f"{rec.name}: its when is false on this machine")
            else:  # its probe asked only where nothing else rules the row out
                ok, reason = state.availability(chained)
                if ok:
                    break
                why.append(f"{rec.name}: unavailable ({reason})")
        else:
            facts = machine_facts()
            out[family] = (f"on this machine ({facts.cpu_vendor}, {facts.cpu_isa}) every call "
                           f"goes to row {plain!r}, which computes what the modules do "
                           f"({'; '.join(why)}): routing would only add its cost; name the "
                           f"family in dispatch_model(model, families=...) to route it")
    return out


def restore_model(model: nn.Module) -> int:
    """Put back every ``forward`` ``dispatch_model`` replaced in ``model``; returns how
    many modules were restored. A module whose ``forward`` was replaced again after
    astrai's is left as it is, with a warning (its route is forgotten all the same).
    Every parameter of the model is no longer declared frozen (what rows derived from
    them is dropped)."""
    thaw(model.parameters())
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


def _served_now(families: Iterable[str]) -> tuple[dict[str, int], dict[str, int]]:
    """Calls of each of ``families`` so far: served by a row, and run by the model's own
    code (handed back)."""
    calls = stats().calls
    rows, own = dict.fromkeys(families, 0), dict.fromkeys(families, 0)
    for (family, _row, origin), n in calls.items():
        if family in rows:
            (own if origin == MODEL_OWN else rows)[family] += n
    return rows, own


class Served(dict[str, int]):
    """``verify_model``'s answer: calls served by a row per routed family, and in
    ``unreached`` the routed modules and call sites these inputs did not reach, with why
    (``"rotary (model.layers.1.self_attn Attention)"`` -> ``"its forward did not call
    the rotary function with these inputs"``)."""

    unreached: dict[str, str]


def verify_model(model: nn.Module, *args: Any, **kwargs: Any) -> Served:
    """Run ``model(*args, **kwargs)`` without autograd and count the calls each routed
    family served (a ``Served``: family -> calls). A routed module or call site these
    inputs did not reach - a module the model did not call, one called with arguments
    that do not reach its families (a causal LM's loss called without labels), a call
    site its layer's forward did not call (a layer applying no rotary) - is named in
    ``.unreached`` with why. ``RoutingError`` names every one that was reached and served
    no call through a row: a routing that did not take effect, or whose every call ran
    the model's own code."""
    routes = list(_live_routes(model))
    tally: dict[tuple[int, str], tuple[int, int]] = {}
    taken: dict[int, list[tuple[dict[str, int], dict[str, int]]]] = {}
    called: set[int] = set()  # modules the model called
    reached: set[int] = set()  # ... with arguments that reach their families
    handles = []
    for _path, module, route in routes:
        families = tuple(route.families)

        def before(m: nn.Module, args: Any, kwargs: Any, families: tuple[str, ...] = families,
                   serves: Any = route.serves) -> None:
            called.add(id(m))
            if serves is None or serves(args, kwargs):
                reached.add(id(m))
            taken.setdefault(id(m), []).append(_served_now(families))

        def after(m: nn.Module, _args: Any, _out: Any,
                  families: tuple[str, ...] = families) -> None:
            rows, own = taken[id(m)].pop()
            rows_now, own_now = _served_now(families)
            for family in families:
                key = (id(m), family)
                was = tally.get(key, (0, 0))
                tally[key] = (was[0] + rows_now[family] - rows[family],
                              was[1] + own_now[family] - own[family])

        handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(module.register_forward_hook(after))
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    served = Served()
    served.unreached = {}
    idle: list[str] = []
    for path, module, route in routes:
        for family in sorted(route.families):
            n, own = tally.get((id(module), family), (0, 0))
            served[family] = served.get(family, 0) + n
            if n > 0:
                continue
            where = f"{family} ({path or '(the model)'} {type(module).__name__})"
            site = route.sites.get(family)
            if id(module) not in called:
                served.unreached[where] = "the model did not call it with these inputs"
            elif id(module) not in reached:
                when = (getattr(route.serves, "__doc__", None) or "").strip().rstrip(".")
                served.unreached[where] = (f"called with arguments that do not reach "
                                           f"{family}" + (f" ({when[0].lower()}{when[1:]})"
                                                          if when else ""))
            elif site is not None and own == 0:
                names = ", ".join(site.replacements)
                served.unreached[where] = (f"its forward did not call {names} with these "
                                           f"inputs")
            else:
                idle.append(where)
    if idle:
        raise RoutingError(f"routed but served no call: {'; '.join(idle)} (their code "
                           f"changed under them, or every call ran the model's own code)")
    return served
