"""Where a tuned profile's order comes from: its ``provenance:`` mapping.

``astrai-ops tune`` (``astrai.tune.measure``) writes, in the profile it makes, the
fingerprint of the machine it measured on (``machine.this_machine()``), the torch and
astrai versions (part of the fingerprint), the date, the workload file, and the measured
table: each row's median microseconds (and spread) on each shape bucket. Which row is
fastest depends on all of that, so a tuned profile loaded on a machine whose fingerprint
differs warns once, naming what differs, and ``explain`` shows the provenance line of
each active profile that has one.
"""

from __future__ import annotations

__all__ = ["describe", "left_to_model", "machine_of", "warn_if_elsewhere"]

import math
from collections.abc import Mapping
from typing import Any

from astrai.dispatch.log import warn_once
from astrai.dispatch.machine import Machine, cuda_initialized, this_machine


def machine_of(provenance: Mapping[str, Any]) -> Machine:
    """The fingerprint of the machine a profile was tuned on."""
    return Machine.from_dict(provenance["machine"])


def describe(name: str, provenance: Mapping[str, Any]) -> str:
    """One line: ``profile tuned: tuned 2026-...Z on <machine> from wl.yaml (N rounds)``."""
    where = f" from {provenance['workload']}" if provenance.get("workload") else ""
    ranks = provenance.get("ranks", 1)
    combined = f", median of {ranks} ranks" if ranks > 1 else ""
    return (f"profile {name}: tuned {provenance['tuned']} on "
            f"{machine_of(provenance).describe()}{where} ({provenance.get('rounds', 0)} "
            f"rounds{combined})")


def left_to_model(name: str, provenance: Mapping[str, Any] | None, family: str) -> str:
    """Why profile ``name`` leaves ``family`` to a model's own code (its overlay's
    ``model_code``), in words: the figures ``astrai.tune_model`` measured, when the
    provenance holds them."""
    got = (provenance or {}).get("model_code", {}).get(family)
    if not got:
        return f"profile {name} leaves {family} to the model's own code (its model_code)"
    low, high = got["model_interval_us"]
    a_low, a_high = got["astrai_interval_us"]
    models = ", ".join(got.get("models", {})) or "the tuned models"
    said = (f"profile {name} leaves {family} to the model's own code: measured "
            f"{got['model_us']:.2f} us a call [{low:.2f}, {high:.2f}] against "
            f"{got['astrai_us']:.2f} us [{a_low:.2f}, {a_high:.2f}] routed, over "
            f"{got['calls']} calls of {models} ({got['verdict']}; 95% intervals)"
            if not math.isnan(got["model_us"]) else
            f"profile {name} leaves {family} to the model's own code: its calls in "
            f"{models} were not timed one by one")
    run = got.get("in_model")
    if not run:
        return said
    r_low, r_high = run["ratio_interval"]
    return (f"{said}; inside the model ({run['run']}), a run routed took "
            f"{run['ratio']:.3f}x [{r_low:.3f}, {r_high:.3f}] the time of one with {family} "
            f"left to the model's code ({run['verdict']}, {run['rounds']} rounds)")


def warn_if_elsewhere(name: str, source: str, provenance: Mapping[str, Any]) -> list[str]:
    """Warn once when the profile was tuned on a machine whose fingerprint differs from
    this one's; returns the differences. The GPU is compared only when this process has
    initialised CUDA (asking a device's name would initialise it)."""
    gpu = cuda_initialized()
    differs = this_machine(gpu=gpu).differences(machine_of(provenance), gpu=gpu)
    if differs:
        warn_once(f"profile {name!r} ({source}) was tuned on another machine "
                  f"({'; '.join(differs)}): its order may not be the fastest here; "
                  f"run astrai-ops tune again on this machine")
    return differs
