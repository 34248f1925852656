"""``astrai.tune_model(model)``: tune this machine for a transformers causal LM in one call.

1. The model is routed (``dispatch_model``, mode ``inference`` unless ``train``; a model
   routed already is measured as routed) with no tuned profile in force, so every row
   is measured against the shipped order.
2. A representative run - a prefill of ``prompt`` random tokens, ``new_tokens`` greedy
   decode steps with the model's cache, and with ``train`` a forward and backward of the
   LM loss (the model's gradients and training flag are put back) - is recorded
   (``astrai.record``), and every call of a routed module or call site is captured with
   what the model's own code would have run for it.
3. ``tune_workload`` measures every runnable row on the recorded calls, merged with the
   calls of every model tuned on this machine before (their workloads are kept beside
   the profile), writes the profile into the user's cache (``astrai.dispatch.tuned``), loads
   and verifies it.
4. **The model's own code is a candidate.** Per routed family, each distinct captured
   call is run both ways - the model's own code (the module's class ``forward``, or the
   function the call site named) and the routed call, under the new profile - checked to
   agree (``measure.outputs_agree``) and timed in interleaved rounds
   (``measure.time_rows``, extra rounds where the figures cannot tell, within the
   budget, the machine watched by ``noise``). The family's figures are the calls' means
   weighted by their counts, combined with the figures of the other models tuned here.
   A call timed again and again stays warm in cache, which a call inside the model is
   not; so the family is also measured **inside the model** (``astrai.tune.in_model``):
   the prefill and decode run without gradients, timed with every family routed and with
   all but that one, in interleaved rounds. Where the model's code is faster beyond the
   noise, per call (``statistics.compare``, the routed call standing where the shipped
   row stands for the rows) or inside the model, the profile sets the family's
   ``model_code: true``, the figures go into ``provenance.model_code``, and
   ``dispatch_model`` leaves the family to the model's own code.
5. The profile is put in force process-wide; a model ``tune_model`` routed itself is
   routed again under it (families left to the model's code unrouted).

A call whose arguments hold something other than tensors, plain values, dtypes and
modules (a KV cache object the call changes) is not replayed; its family keeps the
routed call, and the summary says why.
"""

from __future__ import annotations

__all__ = ["CodeFigures", "TunedModel", "model_key", "tune_model"]

import hashlib
import inspect
import json
import math
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from astrai.dispatch.machine import this_machine
from astrai.dispatch.registry import load_tables
from astrai.dispatch.scopes import set_process_profiles, use_profile
from astrai.dispatch.stats import unobserved
from astrai.dispatch.tuned import profile_path, tuned_setting, use_tuned, workloads_dir
from astrai.integrations.transformers.report import DispatchReport
from astrai.integrations.transformers.routing import (
    ROUTE_ATTR,
    Route,
    dispatch_model,
    restore_model,
)
from astrai.record.recording import record
from astrai.record.workload import RecordedCall, Workload
from astrai.tune.in_model import InModel, measure_in_model, routed_families
from astrai.tune.measure import MORE, Budget, Timing, outputs_agree, time_rows
from astrai.tune.noise import NoiseMonitor
from astrai.tune.profile import TuneError, verify, write_profile
from astrai.tune.run import DEFAULT_BUDGET_S, Tuned, _threads, tune_workload
from astrai.tune.statistics import Verdict, compare

#: The verdicts of ``statistics.compare`` as the model-code figures state them (the
#: routed call stands where the shipped row stands for the rows).
_WORDS: dict[str, str] = {"faster": "faster", "shipped": "routed", "tie": "tie",
                          "unclear": "cannot tell", "busy": "cannot tell (busy)",
                          "no shipped": "routed"}


# -- figures -----------------------------------------------------------------------

#: A call's figure where its calls were not timed one by one.
_UNKNOWN = Timing(math.nan, math.nan)

@dataclass(frozen=True)
class CodeFigures:
    """One family's calls timed two ways, microseconds per call: the model's own code and
    the routed call (each a mean over the calls, weighted by their counts)."""

    calls: int
    model: Timing
    astrai: Timing
    busy: bool = False
    in_model: InModel | None = None  # the family measured inside the model (whole runs)

    def decision(self) -> tuple[str, Verdict, str]:
        """``statistics.compare`` with the routed call as the choice that stays unless
        the model's code is faster beyond the noise: ``(winner, verdict, rival)``."""
        return compare({"model": self.model.interval, "astrai": self.astrai.interval},
                       "astrai", busy=self.busy)

    @property
    def left_to_model(self) -> bool:
        """Whether the model's own code wins: per call, or inside the model."""
        return self.decision()[0] == "model" or (self.in_model is not None
                                                 and self.in_model.left_to_model)

    @property
    def verdict(self) -> str:
        """The per-call verdict in the profile's words (the in-model one is its own);
        ``not timed`` where the calls were not timed one by one."""
        if math.isnan(self.model.median_us) or math.isnan(self.astrai.median_us):
            return "not timed"
        return _WORDS[self.decision()[1]]

    def plain(self) -> dict[str, Any]:
        """The profile's form (``CodeFiguresModel``)."""
        return {"calls": self.calls, "model_us": round(self.model.median_us, 3),
                "model_interval_us": [round(self.model.interval.low, 3),
                                      round(self.model.interval.high, 3)],
                "astrai_us": round(self.astrai.median_us, 3),
                "astrai_interval_us": [round(self.astrai.interval.low, 3),
                                       round(self.astrai.interval.high, 3)],
                "samples": min(self.model.samples, self.astrai.samples), "busy": self.busy,
                **({} if self.in_model is None else {"in_model": self.in_model.plain()})}

    @classmethod
    def from_plain(cls, data: Mapping[str, Any]) -> CodeFigures:
        """The figures of a profile's ``CodeFiguresModel`` mapping."""
        n = int(data.get("samples", 0))
        m_low, m_high = data["model_interval_us"]
        a_low, a_high = data["astrai_interval_us"]
        in_model = data.get("in_model")
        return cls(int(data["calls"]), Timing(data["model_us"], 0.0, m_low, m_high, n),
                   Timing(data["astrai_us"], 0.0, a_low, a_high, n),
                   bool(data.get("busy", False)),
                   None if not in_model else InModel.from_plain(in_model))

    @classmethod
    def combine(cls, parts: Sequence[tuple[int, Timing, Timing, bool]],
                in_model: Sequence[InModel] = ()) -> CodeFigures:
        """Figures over ``(count, model, astrai, busy)`` parts: the means weighted by the
        counts (as a profile's bucket table weighs its calls); ``in_model``: the models'
        in-model figures, combined (``InModel.combine``)."""
        calls = sum(n for n, *_ in parts)
        parts = [p for p in parts if p[0] > 0 and not math.isnan(p[1].median_us)
                 and not math.isnan(p[2].median_us)]  # those timed one by one
        runs = InModel.combine(in_model) if in_model else None
        if not parts:
            return cls(calls, _UNKNOWN, _UNKNOWN, False, runs)
        return cls(calls, Timing.mean([(n, m) for n, m, _, _ in parts]),
                   Timing.mean([(n, a) for n, _, a, _ in parts]), any(b for *_, b in parts),
                   runs)


# -- capturing what the routed code and the model's own code run ----------------------

_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)


@dataclass
class _Call:
    """One distinct call of a family's routed code: both callables and the arguments
    (copied when first seen), its grad mode, and how many calls were alike."""

    family: str
    own: Callable[..., Any]
    routed: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    grad: bool
    count: int = 1
    odd: str | None = None  # why its arguments cannot be replayed


def _key(value: Any, odd: list[str]) -> Any:
    """What makes two argument values the same call (shapes, not contents); a value no
    call can be replayed with is named in ``odd``."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device.type,
                value.requires_grad, value.is_contiguous())
    if isinstance(value, nn.Module):
        return ("module", type(value).__name__)
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(_key(v, odd) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _key(v, odd)) for k, v in value.items()))
    if isinstance(value, _PLAIN):
        return value
    odd.append(type(value).__name__)
    return ("object", type(value).__name__)


def _copy(value: Any) -> Any:
    """``value`` with every tensor copied (its own storage; grad requirement kept)."""
    if isinstance(value, torch.Tensor):
        got = value.detach().clone()
        return got.requires_grad_(True) if value.requires_grad else got
    if isinstance(value, list | tuple):
        return type(value)(_copy(v) for v in value)
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return value


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, list | tuple):
        return any(_has_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(_has_tensor(v) for v in value.values())
    return False


class _Capture:
    """The distinct calls of the routed modules and call sites seen while in force."""

    def __init__(self) -> None:
        self.calls: dict[tuple[Any, ...], _Call] = {}

    def note(self, family: str, ident: Any, own: Callable[..., Any],
             routed: Callable[..., Any], args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> None:
        odd: list[str] = []
        grad = torch.is_grad_enabled()
        key = (family, ident, grad, _key(args, odd), _key(kwargs, odd))
        got = self.calls.get(key)
        if got is not None:
            got.count += 1
            return
        why = (f"its arguments hold {', '.join(sorted(set(odd)))} (state the call may "
               f"change), so it is not replayed") if odd else None
        self.calls[key] = _Call(family, own, routed, () if odd else _copy(args),
                                {} if odd else _copy(kwargs), grad, odd=why)


def _plain_args(value: Any, pick: str) -> Any:
    """``value`` with each ``_Spy`` in it replaced by its routed or own side."""
    if isinstance(value, _Spy):
        return value.routed if pick == "routed" else value.own
    if isinstance(value, list | tuple):
        return type(value)(_plain_args(v, pick) for v in value)
    if isinstance(value, dict):
        return {k: _plain_args(v, pick) for k, v in value.items()}
    return value


def _names(value: Any) -> Any:
    """Look-up arguments as an identity: plain values as they are, others by type."""
    if isinstance(value, dict):
        return tuple((k, _names(v)) for k, v in value.items())
    if isinstance(value, list | tuple):
        return tuple(_names(v) for v in value)
    return value if isinstance(value, _PLAIN) else type(value).__name__


class _Spy:
    """What a call site's global name stands for while capturing: the family's
    replacement, noting each computation (a call with tensors) with the function the
    model's own code would have called; a look-up (a call without tensors, an attribute,
    an item) is answered by the replacement and, where both sides give a function, spied
    on in turn (``ALL_ATTENTION_FUNCTIONS.get_interface(...)``)."""

    def __init__(self, family: str, routed: Any, own: Any, capture: _Capture,
                 ident: Any) -> None:
        self.family, self.routed, self.own = family, routed, own
        self.capture, self.ident = capture, ident

    def _pair(self, routed: Any, own: Any, ident: Any) -> Any:
        if callable(routed) and callable(own) and not isinstance(routed, type):
            return _Spy(self.family, routed, own, self.capture, ident)
        return routed

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _has_tensor(args) or _has_tensor(kwargs):
            args, kwargs = _plain_args(args, "routed"), _plain_args(kwargs, "routed")
            self.capture.note(self.family, self.ident, self.own, self.routed, args, kwargs)
            return self.routed(*args, **kwargs)
        got = self.routed(*_plain_args(args, "routed"), **_plain_args(kwargs, "routed"))
        try:
            own = self.own(*_plain_args(args, "own"), **_plain_args(kwargs, "own"))
        except Exception:  # the model's side has no such look-up: nothing to pair
            return got
        return self._pair(got, own, (self.ident, "call", _names(args), _names(kwargs)))

    def __getattr__(self, name: str) -> Any:
        got = getattr(self.routed, name)
        return self._pair(got, getattr(self.own, name, None), (self.ident, name))

    def __getitem__(self, key: Any) -> Any:
        got = self.routed[key]
        try:
            own = self.own[key]
        except Exception:
            return got
        return self._pair(got, own, (self.ident, "item", key))


@contextmanager
def _capturing(model: nn.Module, capture: _Capture) -> Iterator[None]:
    """Within the block, every routed module's and call site's calls are noted."""
    from astrai.recognition.rebind import REBOUND, rebind

    handles: list[Any] = []
    swapped: list[tuple[Route, Any]] = []
    placed: set[int] = set()  # the spies standing in rebound namespaces
    for module in model.modules():
        route: Route | None = module.__dict__.get(ROUTE_ATTR)
        if route is None or module.__dict__.get("forward") is not route.installed:
            continue
        if route.forward is None:  # a module served whole
            (family,) = tuple(route.families)[:1] or ("",)
            own = type(module).forward.__get__(module)
            ident = ("module", type(module).__name__,
                     tuple(tuple(p.shape) for p in module.parameters()))

            def before(m: nn.Module, args: Any, kwargs: Any, family: str = family,
                       own: Any = own, ident: Any = ident, route: Route = route) -> None:
                if route.serves is None or route.serves(args, kwargs):
                    capture.note(family, ident, own, m.forward, args, kwargs)

            handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
            continue
        owner = next(iter(route.sites.values())).owner
        spies = {name: _Spy(family, rep, owner.get(name), capture, (family, name))
                 for family, sites in route.sites.items()
                 for name, rep in sites.replacements.items()}
        spied = rebind(type(module).forward, owner, spies)
        if spied is not None:
            swapped.append((route, route.forward))
            placed.update(map(id, spies.values()))
            route.forward = spied
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for route, forward in swapped:
            route.forward = forward
        # The namespaces rebind registered for the spies hold the capture, and with it the
        # model: gone with the capture.
        for name, home in list(sys.modules.items()):
            if name.startswith(REBOUND) and any(id(v) in placed
                                                for v in vars(home).values()):
                del sys.modules[name]


# -- the representative run ------------------------------------------------------------

def _run(model: nn.Module, train: bool, prompt: int, new_tokens: int) -> None:
    """A prefill of ``prompt`` random tokens, ``new_tokens`` greedy decode steps on the
    model's cache, and with ``train`` the LM loss's forward and backward."""
    params = list(model.parameters())
    device = params[0].device if params else torch.device("cpu")
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if not vocab:
        vocab = model.get_input_embeddings().num_embeddings  # type: ignore[operator]
    ids = torch.randint(0, int(vocab), (1, prompt),
                        generator=torch.Generator().manual_seed(0)).to(device)
    try:
        named = inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        named = {}  # type: ignore[assignment]
    # transformers 5 names the model's KV cache ``cache``; earlier, ``past_key_values``
    kv = "cache" if "cache" in named else "past_key_values"
    try:
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            for _ in range(new_tokens):
                past = getattr(out, kv, None)
                out = model(input_ids=token, use_cache=True, **{kv: past})
                token = out.logits[:, -1:].argmax(-1)
        if train:
            _train_step(model, ids, params)
    except (TypeError, AttributeError) as exc:
        raise TuneError(f"tune_model needs a transformers causal LM (a forward taking "
                        f"input_ids, use_cache, its KV cache and labels, giving logits "
                        f"and a loss): {type(model).__name__} raised {type(exc).__name__}: "
                        f"{exc}") from exc


def _train_step(model: nn.Module, ids: torch.Tensor, params: list[nn.Parameter]) -> None:
    """Forward and backward of the LM loss; the gradients and the training flag put back."""
    grads = [p.grad for p in params]
    training = model.training
    model.train()
    try:
        model(input_ids=ids, labels=ids).loss.backward()
    finally:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        model.train(training)


# -- timing the model's own code against the routed call ----------------------------------

def _outputs(value: Any) -> Any:
    to_tuple = getattr(value, "to_tuple", None)
    return to_tuple() if callable(to_tuple) else value


def _time(call: _Call, rounds: int, budget: Budget, monitor: NoiseMonitor
          ) -> tuple[Timing, Timing, bool] | str:
    """The call both ways, checked to agree and timed; or why it was not."""
    if call.odd is not None:
        return call.odd
    own_args, routed_args = _copy((call.args, call.kwargs)), _copy((call.args, call.kwargs))
    calls: dict[str, Callable[[], object]] = {
        "model": lambda: call.own(*own_args[0], **own_args[1]),
        "astrai": lambda: call.routed(*routed_args[0], **routed_args[1]),
    }
    with torch.set_grad_enabled(call.grad):
        try:
            want = calls["astrai"]()
            got = calls["model"]()
        except Exception as exc:
            return f"replaying it raised {type(exc).__name__}: {exc}"
        why = outputs_agree(_outputs(got), _outputs(want))
        if why is not None:
            return f"the model's own code and the routed call disagree: {why}"
        del want, got
        mark = monitor.mark()
        samples = time_rows(calls, rounds, monitor=monitor)
        for _ in range(MORE):
            figures = {r: Timing.of(v).interval for r, v in samples.items()}
            if budget.left() <= 0 or compare(figures, "astrai")[1] != "unclear":
                break
            for r, v in time_rows(calls, rounds, monitor=monitor).items():
                samples[r].extend(v)
    return Timing.of(samples["model"]), Timing.of(samples["astrai"]), monitor.busy_since(mark)


def _untimed(capture: _Capture, family: str) -> CodeFigures:
    """The figures of a family whose calls were not timed one by one (none captured, or
    none replayable): its call count, the per-call figures unknown."""
    return CodeFigures(sum(c.count for c in capture.calls.values() if c.family == family),
                       _UNKNOWN, _UNKNOWN)


def _measure_code(capture: _Capture, rounds: int, budget: float, monitor: NoiseMonitor
                  ) -> tuple[dict[str, CodeFigures], dict[str, str]]:
    """Per family: its calls' figures, or why its own code was not compared."""
    parts: dict[str, list[tuple[int, Timing, Timing, bool]]] = {}
    skipped: dict[str, str] = {}
    left = Budget(budget)
    for call in capture.calls.values():
        if call.family in skipped:
            continue
        got = _time(call, rounds, left, monitor)
        if isinstance(got, str):
            skipped[call.family] = got
            parts.pop(call.family, None)
        else:
            parts.setdefault(call.family, []).append((call.count, *got))
    return {f: CodeFigures.combine(p) for f, p in parts.items()}, skipped


# -- the workloads of every model tuned on the machine -----------------------------------

def model_key(model: nn.Module) -> str:
    """What names a model among those tuned on a machine: its class and a short hash of
    its config (or of its parameters' shapes)."""
    config = getattr(model, "config", None)
    to_json = getattr(config, "to_json_string", None)
    text = to_json(use_diff=False) if callable(to_json) else json.dumps(
        [(n, list(p.shape)) for n, p in model.named_parameters()])
    return f"{type(model).__name__}-{hashlib.sha256(text.encode()).hexdigest()[:8]}"


def _merged(folder: Path) -> Workload:
    """The calls of every workload in ``folder``, alike calls merged (counts added)."""
    calls: dict[str, RecordedCall] = {}
    dropped = 0
    for path in sorted(folder.glob("*.yaml")):
        workload = Workload.load(path)
        dropped += workload.dropped
        for call in workload.calls:
            key = json.dumps({**call.plain(), "count": 0}, sort_keys=True, default=str)
            got = calls.get(key)
            calls[key] = call if got is None else RecordedCall(
                got.family, got.axes, got.args, got.kwargs, got.count + call.count,
                got.backend, got.scope_backend, got.scope_profiles)
    return Workload.of(list(calls.values()), this_machine(), dropped)


def _earlier(path: Path) -> dict[str, dict[str, Any]]:
    """The model-code figures of the profile at ``path`` (empty if none): family ->
    model -> figures."""
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        got = doc["provenance"].get("model_code", {})
        return {f: dict(v.get("models", {})) for f, v in got.items()}
    except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError):
        return {}


# -- the one call ----------------------------------------------------------------

@dataclass(frozen=True)
class TunedModel:
    """What ``tune_model`` did: the rows' tuning (``tuned``), the model's own code against
    the routed call per family, the profile and workloads written, and the model's
    routing afterwards."""

    model: str
    tuned: Tuned
    workload: Workload
    workloads: Path
    measured: Mapping[str, CodeFigures]  # this model's figures
    model_code: Mapping[str, CodeFigures]  # every tuned model's figures combined
    skipped: Mapping[str, str] = field(default_factory=dict)
    report: DispatchReport | None = None
    in_force: bool = True

    @property
    def name(self) -> str:
        """The profile's name."""
        return self.tuned.name

    @property
    def path(self) -> Path:
        """The profile's file."""
        return self.tuned.path

    def left_to_model(self) -> list[str]:
        """The families the profile leaves to the model's own code."""
        return [f for f, c in self.model_code.items() if c.left_to_model]

    def summary(self) -> str:
        """The rows' summary, then per family the model's own code against the routed
        call, then where the profile is and what uses it."""
        lines = [self.tuned.summary(), "",
                 "the model's own code against the routed call (us a call, weighted by the "
                 "recorded calls; every model tuned here):",
                 f"{'family':<14} {'calls':>6}  {'model':>9} {'95% interval':>19}  "
                 f"{'astrai':>9} {'95% interval':>19}  {'verdict':<18} served by"]
        for family, c in self.model_code.items():
            lines.append(f"{family:<14} {c.calls:>6}  {c.model.median_us:>9.2f} "
                         f"{_interval(c.model):>19}  {c.astrai.median_us:>9.2f} "
                         f"{_interval(c.astrai):>19}  {c.verdict:<18} "
                         f"{'the model' if c.left_to_model else 'astrai'}")
        lines += [f"{family:<14} not compared for {self.model}: {why}"
                  for family, why in self.skipped.items()]
        runs = {f: c.in_model for f, c in self.model_code.items() if c.in_model is not None}
        if runs:
            lines += ["", "inside the model: a run routed over the run with the family left "
                          "to the model's code (median of the rounds' ratios, 95% interval; "
                          f"{next(iter(runs.values())).run}):"]
            lines += [f"{family:<14} {r.ratio.median_us:>7.3f}x "
                      f"[{r.ratio.interval.low:.3f}, {r.ratio.interval.high:.3f}]  "
                      f"{r.verdict:<18} {r.ratio.samples} rounds"
                      for family, r in runs.items()]
        lines.append(f"profile {self.name}: {self.path} (workloads of "
                     f"{len(list(self.workloads.glob('*.yaml')))} model(s): "
                     f"{self.workloads})")
        lines.append("in force process-wide; dispatch_model uses it on this machine "
                     "(tuned=False or ASTR_TUNED=off leaves it out)" if self.in_force else
                     "not put in force (ASTR_TUNED=off)")
        return "\n".join(lines)


def _interval(t: Timing) -> str:
    return f"[{t.interval.low:.2f}, {t.interval.high:.2f}]"


def tune_model(model: nn.Module, *, train: bool = False, prompt: int = 16,
               new_tokens: int = 8, threads: int | None = None, rounds: int = 7,
               budget: float = DEFAULT_BUDGET_S,
               cache: str | os.PathLike[str] | None = None) -> TunedModel:
    """Tune this machine for ``model`` (a transformers causal LM) in one call and keep
    the profile in the user's cache, where ``dispatch_model`` finds it (module
    docstring). ``train``: a training step is part of the run (and the model is routed
    in mode ``train``); ``prompt`` / ``new_tokens``: the run's sizes; ``threads``: torch's
    intra-op threads while timing; ``rounds``: timed rounds per call; ``budget``: seconds
    of extra rounds where the figures cannot tell yet (for the rows, and again for the
    model's own code); ``cache``: the user's cache folder (default ``XDG_CACHE_HOME`` or
    ``~/.cache``, where ``dispatch_model`` looks)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"tune_model takes a torch.nn.Module, got {type(model).__name__}")
    if prompt < 1 or new_tokens < 0 or rounds < 1 or budget < 0:
        raise ValueError(f"tune_model: prompt must be at least 1, new_tokens and budget 0 "
                         f"or more, rounds at least 1 (got prompt={prompt}, new_tokens="
                         f"{new_tokens}, rounds={rounds}, budget={budget})")
    path = profile_path(cache=cache)
    path.parent.mkdir(parents=True, exist_ok=True)
    folder = workloads_dir(path)
    key = model_key(model)
    earlier = _earlier(path)
    mode = "train" if train else "inference"
    before = set_process_profiles()  # every row measured against the shipped order
    routed_here = not any(ROUTE_ATTR in m.__dict__ for m in model.modules())
    done = False
    try:
        if routed_here:
            dispatch_model(model, mode=mode, tuned=False)
        capture = _Capture()
        with record() as recording, _capturing(model, capture):
            _run(model, train, prompt, new_tokens)
        folder.mkdir(exist_ok=True)
        recording.workload().save(folder / f"{key}.yaml")
        workload = _merged(folder)
        tuned = tune_workload(workload, path, rounds=rounds, source=str(folder),
                              budget=budget, threads=threads)
        monitor = NoiseMonitor()
        with _threads(threads), use_profile(tuned.name), unobserved():
            monitor.start()
            measured, skipped = _measure_code(capture, rounds, budget, monitor)
            routed = routed_families(model)

            def without(family: str) -> None:
                if routed_here:  # as dispatch_model decides, that family left
                    dispatch_model(model, mode=mode, tuned=False, leave=[family])
                else:  # the caller's families, but that one
                    dispatch_model(model, sorted(routed - {family}), mode=mode, tuned=False)

            runs = measure_in_model(
                model, lambda: _run(model, False, prompt, new_tokens),
                f"a prefill of {prompt} tokens and {new_tokens} decode steps", without,
                rounds, budget, monitor)
        measured = {f: replace(measured.get(f) or _untimed(capture, f), in_model=runs.get(f))
                    for f in sorted({*measured, *runs})}
        combined = _write_model_code(tuned, key, measured, earlier, path)
        done = True
    finally:
        set_process_profiles(*before)
        if routed_here and not done:
            restore_model(model)
    in_force = tuned_setting()
    if in_force:
        use_tuned(cache)
    report = None
    if routed_here:
        restore_model(model)
        report = dispatch_model(model, mode=mode, tuned=(cache or True) if in_force else False)
    return TunedModel(key, tuned, workload, folder, measured, combined, skipped, report,
                      in_force)


def _write_model_code(tuned: Tuned, key: str, measured: Mapping[str, CodeFigures],
                      earlier: Mapping[str, Mapping[str, Any]], path: Path
                      ) -> dict[str, CodeFigures]:
    """Combine this model's figures with the other models' of the profile before, set
    ``model_code`` where the model's code wins, write, load and verify the profile."""
    models: dict[str, dict[str, Any]] = {f: {k: v for k, v in m.items() if k != key}
                                         for f, m in earlier.items()}
    for family, figures in measured.items():
        models.setdefault(family, {})[key] = figures.plain()
    combined: dict[str, CodeFigures] = {}
    provenance: dict[str, Any] = {}
    for family, by_model in sorted(models.items()):
        if not by_model:
            continue
        parts = [CodeFigures.from_plain(v) for v in by_model.values()]
        got = CodeFigures.combine([(c.calls, c.model, c.astrai, c.busy) for c in parts],
                                  [c.in_model for c in parts if c.in_model is not None])
        if got.in_model is None and (got.calls == 0 or any(
                math.isnan(x) for x in (got.model.median_us, got.astrai.median_us))):
            continue
        combined[family] = got
        provenance[family] = {**got.plain(), "left_to_model": got.left_to_model,
                              "verdict": got.verdict, "models": by_model}
    doc = dict(tuned.document)
    families = {f: dict(v) for f, v in doc["families"].items()}
    for family, got in combined.items():
        if got.left_to_model:
            families.setdefault(family, {})["model_code"] = True
    doc["families"] = families
    doc["provenance"] = {**doc["provenance"], "model_code": provenance}
    write_profile(path, doc)
    load_tables(path)
    verify(tuned.name, tuned.buckets)
    return combined
