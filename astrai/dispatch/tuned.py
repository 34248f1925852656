"""This machine's tuned profile in the user's cache: where ``astrai.tune_model`` writes it,
and how ``dispatch_model`` finds it and puts it in force.

The profile lives in ``<cache>/astrai/profiles/tuned-<key>.yaml`` (``<cache>``: the user's
cache, ``XDG_CACHE_HOME`` or ``~/.cache``; ``<key>``: a short hash of the machine's
fingerprint, ``machine.this_machine()``: CPU model, cores, GPU, torch and astrai
versions), the workloads it was tuned on beside it, one file per model, in
``tuned-<key>.workloads/``. ``use_tuned`` looks at every ``tuned-*.yaml`` there and takes
the one whose provenance names this machine: it is loaded (``load_tables``, unless the
same file is loaded already) and put in force process-wide
(``scopes.set_process_profiles``). Profiles tuned under another fingerprint (a copied
file, a home shared between machines) are ignored, with one warning naming what
differs. ``ASTR_TUNED=off`` (or ``dispatch_model(..., tuned=False)``) leaves it out.

The GPU is part of the fingerprint; asking its name initialises CUDA, so it is asked only
when CUDA is initialised already, or when a profile that would otherwise match was tuned
with a GPU.
"""

from __future__ import annotations

__all__ = ["TunedProfile", "machine_key", "profile_path", "profiles_dir", "tuned_setting",
           "use_tuned", "workloads_dir"]

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from astrai.dispatch.log import warn_once
from astrai.dispatch.machine import Machine, cuda_initialized, this_machine
from astrai.dispatch.registry import current, load_tables
from astrai.dispatch.scopes import process_profiles, set_process_profiles
from astrai.env import TUNED_ENV, cache_root
from astrai.errors import AstraiError

_OFF = ("off", "0", "false", "no")
_ON = ("", "on", "1", "true", "yes", "auto")


def profiles_dir(cache: str | os.PathLike[str] | None = None) -> Path:
    """Where tuned profiles live: ``<cache>/astrai/profiles`` (``cache``: the user's
    cache by default)."""
    return cache_root(cache) / "profiles"


def machine_key(machine: Machine) -> str:
    """A short hash of ``machine``'s fingerprint (what names its profile file)."""
    text = json.dumps(machine.as_dict(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def profile_path(machine: Machine | None = None,
                 cache: str | os.PathLike[str] | None = None) -> Path:
    """The tuned profile of ``machine`` (this one by default): ``tuned-<key>.yaml``."""
    return profiles_dir(cache) / f"tuned-{machine_key(machine or this_machine())}.yaml"


def workloads_dir(profile: Path) -> Path:
    """Where the workloads a profile was tuned on are kept: one file per model."""
    return profile.with_name(f"{profile.stem}.workloads")


def tuned_setting() -> bool:
    """Whether ``ASTR_TUNED`` lets the tuned profile be used (``off`` does not); an
    unknown value warns once and counts as ``on``."""
    raw = (os.environ.get(TUNED_ENV) or "").strip().lower()
    if raw in _OFF:
        return False
    if raw not in _ON:
        warn_once(f"{TUNED_ENV}={raw!r} is not a setting astrai knows (on, off); the tuned "
                  f"profile is used")
    return True


@dataclass(frozen=True)
class TunedProfile:
    """What ``use_tuned`` found: the profile in force (``name``, its file and when it was
    tuned), or why none is (``why``)."""

    name: str | None = None
    path: Path | None = None
    tuned: str = ""
    why: str = ""

    def describe(self) -> str:
        """One line for a report."""
        if self.name is None:
            return f"none ({self.why})"
        return (f"{self.name} from {self.path} (tuned {self.tuned}), in force process-wide "
                f"(dispatch_model(..., tuned=False) or {TUNED_ENV}=off leaves it out)")


def _read(path: Path) -> tuple[dict[str, Any], str] | str:
    """A profile file's mapping and its revision (as the tables store it), or why it
    cannot be read as a tuned profile."""
    try:
        text = path.read_text(encoding="utf-8")
        doc = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        Machine.from_dict(doc["provenance"]["machine"])
    except (OSError, yaml.YAMLError, KeyError, TypeError) as exc:
        return f"not a tuned profile astrai can read ({type(exc).__name__}: {exc})"
    return doc, hashlib.sha256(text.encode()).hexdigest()[:16]


def use_tuned(cache: str | os.PathLike[str] | None = None) -> TunedProfile:
    """Put this machine's tuned profile in force process-wide (module docstring);
    what was found. Call it where ``tuned_setting()`` allows."""
    where = profiles_dir(cache)
    files = sorted(where.glob("tuned-*.yaml")) if where.is_dir() else []
    if not files:
        return TunedProfile(why=f"no tuned profile in {where}; astrai.tune_model(model) or "
                                f"astrai-ops tune --model tunes this machine")
    read = {f: _read(f) for f in files}
    docs = {f: got for f, got in read.items() if not isinstance(got, str)}
    gpu = cuda_initialized() or not _cuda_available()
    here = this_machine(gpu=gpu)

    def differences(doc: dict[str, Any], machine: Machine, gpu: bool) -> list[str]:
        return machine.differences(Machine.from_dict(doc["provenance"]["machine"]), gpu=gpu)

    mine = [f for f, (doc, _) in docs.items() if not differences(doc, here, gpu)]
    if not gpu and any(docs[f][0]["provenance"]["machine"].get("gpu") for f in mine):
        gpu, here = True, this_machine()  # a candidate tuned with a GPU: ask which GPU
        mine = [f for f in mine if not differences(docs[f][0], here, True)]
    if not mine:
        said = [f"{f.name}: {'; '.join(differences(doc, here, gpu))}"
                for f, (doc, _) in docs.items()]
        said += [f"{f.name}: {why}" for f, why in read.items() if isinstance(why, str)]
        warn_once(f"astrai: the tuned profiles in {where} were tuned on another machine and "
                  f"are ignored ({' | '.join(said)}); astrai.tune_model(model) or astrai-ops "
                  f"tune --model tunes this one")
        return TunedProfile(why=f"the {len(files)} tuned profile(s) in {where} were tuned "
                                f"on another machine")
    named = where / f"tuned-{machine_key(here)}.yaml"
    path = named if named in mine else max(
        mine, key=lambda f: str(docs[f][0]["provenance"].get("tuned", "")))
    doc, revision = docs[path]
    name = str(doc.get("profile", path.stem))
    loaded = current().profiles.get(name)
    if (loaded is None or loaded.revision != revision
            or not loaded.source.startswith(str(path))):
        try:
            load_tables(path)
        except (AstraiError, ValueError, OSError) as exc:
            warn_once(f"astrai: the tuned profile {path} cannot be loaded and is ignored: "
                      f"{exc}")
            return TunedProfile(why=f"{path} cannot be loaded: {str(exc).splitlines()[0]}")
    if name not in process_profiles():
        set_process_profiles(*process_profiles(), name)
    return TunedProfile(name, path, str(doc["provenance"].get("tuned", "")))


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())
