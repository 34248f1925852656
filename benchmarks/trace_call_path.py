"""The path of one call through astrai's modules: ``ops.rms_norm`` at decode size.

Python's profiler hook (``sys.setprofile``) sees every Python function a call enters
and leaves. Of those events, the ones in astrai's own modules give the call's path as a
sequence of modules; a *move* is a step from one module to another in that sequence
(into a callee elsewhere, or back to the caller). The served row itself (the kernel the
facade calls once dispatch handed it over) is not part of the path. Printed for a
decision-cache miss (a signature the snapshot has not decided yet, after its first call
made what a snapshot makes once: the rows' probes and the key plan) and for a hit (the
same call again).

Targets: a miss enters at most 8 astrai modules with at most 20 moves; a hit makes at most
4 moves. The path traced is the pure-Python one (the compiled hot path, ``astrai.native``,
enters no Python function; an ``rms_norm`` call is keyed by its route there, the Python
hot path having no plan for it). ``--path`` prints the sequences.
Exit status 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

import astrai.dispatch as dispatch
from astrai import ops
from astrai.dispatch.facade import python_path

MISS_MODULES, MISS_MOVES, HIT_MOVES = 8, 20, 4


def path_of(call: Callable[[], object]) -> list[str]:
    """The astrai modules ``call`` passes through, in order, repeats of one module
    (calls within it) collapsed."""
    seen: list[str] = []
    row: list[FrameType] = []  # the served row's frame while it runs (not dispatch)
    facade: list[str] = []  # the module of the facade the call starts in

    def module(frame: FrameType | None) -> str:
        return "" if frame is None else str(frame.f_globals.get("__name__", ""))

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        if event not in ("call", "return"):
            return
        if row:
            if event == "return" and frame is row[0]:
                row.clear()
            return
        name = module(frame)
        if not facade and event == "call" and name.startswith("astrai"):
            facade.append(name)
        if event == "call" and name.startswith("astrai.backends") and (
                module(frame.f_back) in facade):
            row.append(frame)  # the facade calls the row it was handed: the kernel's time
            return
        if event == "return":  # back in the caller's module
            name = module(frame.f_back)
        if name.startswith("astrai") and (not seen or seen[-1] != name):
            seen.append(name)

    sys.setprofile(hook)
    try:
        call()
    finally:
        sys.setprofile(None)
    return seen


def measure() -> dict[str, list[str]]:
    """The paths of a decision-cache miss and of a hit for one decode-size call."""
    torch.set_num_threads(1)
    w = torch.ones(512)
    dispatch.refresh()
    with python_path():  # the Python path (the compiled one has no frames)
        ops.rms_norm(torch.randn(1, 1, 512), w)  # the snapshot's first call: probes, key plan
        x = torch.randn(1, 512)  # one decode token again, a signature not decided yet
        miss = path_of(lambda: ops.rms_norm(x, w))
        hit = path_of(lambda: ops.rms_norm(x, w))
    return {"miss": miss, "hit": hit}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", action="store_true", help="print each path")
    args = parser.parse_args(argv)
    paths = measure()
    miss, hit = paths["miss"], paths["hit"]
    checks = [
        ("miss: astrai modules entered", len(set(miss)), MISS_MODULES),
        ("miss: moves between them", len(miss) - 1, MISS_MOVES),
        ("hit: moves between modules", len(hit) - 1, HIT_MOVES),
    ]
    ok = True
    for label, got, target in checks:
        passed = got <= target
        ok &= passed
        print(f"{label}: {got}  target <= {target}  {'PASS' if passed else 'FAIL'}")
    if args.path:
        for kind, seq in paths.items():
            print(f"{kind}: {' -> '.join(m.removeprefix('astrai.') for m in seq)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
