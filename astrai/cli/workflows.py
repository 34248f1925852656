"""The workflows: ``demo`` (optionally recording its workload), ``lock`` and ``tune``."""

from __future__ import annotations

__all__ = ["cmd_demo", "cmd_lock", "cmd_tune"]

import argparse
import sys
from contextlib import ExitStack
from typing import Any

from astrai.cli.output import OK, PROBLEMS, UsageError
from astrai.formats.common import not_an_input


def cmd_demo(args: argparse.Namespace) -> int:
    from astrai.record.recording import Recording

    recording = Recording()
    with recording if args.record else ExitStack():  # recording costs: only when asked
        if args.transformers:
            from astrai.integrations.transformers import run_transformers_demo

            report = run_transformers_demo()
        else:
            from astrai.demo import run_demo

            report = run_demo()
    print(report)
    if args.record:
        workload = recording.workload()
        try:
            path = workload.save(args.record)
        except OSError as exc:
            print(f"astrai-ops demo: error: cannot write {args.record}: "
                  f"{exc.strerror or exc}", file=sys.stderr)
            return PROBLEMS
        print(f"\nrecorded {len(workload.calls)} distinct calls ({workload.total} calls) "
              f"to {path}")
    return OK


def cmd_lock(args: argparse.Namespace) -> int:
    from astrai.lock.make import check_lock, lock_workload
    from astrai.lock.model import Lock
    from astrai.record.workload import Workload

    if args.check is not None:
        if args.workload is not None:
            raise UsageError("give a WORKLOAD to write a lock, or --check LOCK, not both")
        report = check_lock(Lock.load(args.check))
        print(report.render())
        return OK if report.ok else PROBLEMS
    if args.workload is None:
        raise UsageError("give the WORKLOAD to lock (or --check LOCK)")
    not_an_input(args.output, args.workload)
    lock = lock_workload(Workload.load(args.workload), source=args.workload)
    try:
        path = lock.save(args.output)
    except OSError as exc:
        print(f"astrai-ops lock: error: cannot write {args.output}: {exc.strerror or exc}",
              file=sys.stderr)
        return PROBLEMS
    print(_lock_summary(lock))
    print(f"wrote {path}: {len(lock.decisions)} decisions, digest {lock.digest}")
    return OK


def _lock_summary(lock: Any) -> str:
    """Per family, row and origin: the locked signatures and the calls they stand for."""
    groups: dict[tuple[str, str, str], list[int]] = {}
    for d in lock.decisions:
        got = groups.setdefault((d.family, d.row or "(none)", d.origin or "error"), [0, 0])
        got[0] += 1
        got[1] += d.calls
    lines = [f"{'family':<12} {'row':<16} {'origin':<9} {'signatures':>10} {'calls':>8}"]
    lines += [f"{f:<12} {r:<16} {o:<9} {n:>10} {c:>8}"
              for (f, r, o), (n, c) in sorted(groups.items())]
    errors = [d for d in lock.decisions if d.error is not None]
    lines += [f"  {d.signature}: {d.error}" for d in errors]
    return "\n".join(lines)

def cmd_tune(args: argparse.Namespace) -> int:
    from astrai.record.workload import Workload
    from astrai.tune.ranks import init_from_environment
    from astrai.tune.report import write_report
    from astrai.tune.run import tune_workload

    if args.rounds < 1:
        raise UsageError("--rounds must be at least 1")
    if args.budget < 0:
        raise UsageError("--budget must be 0 or more seconds")
    if args.threads is not None and args.threads < 1:
        raise UsageError("--threads must be at least 1")
    if (args.model is None) == (args.workload is None):
        raise UsageError("tune takes a WORKLOAD or --model DIR_OR_CONFIG (one of them)")
    if args.model is not None:
        return _tune_model(args)
    if args.train:
        raise UsageError("--train goes with --model")
    if args.report:
        not_an_input(args.report, args.workload, args.output, what="--report")
    workload = Workload.load(args.workload)
    started = init_from_environment()  # under torchrun: every rank tunes, one profile
    try:
        tuned = tune_workload(workload, args.output, rounds=args.rounds,
                              allow_nonfaithful=args.allow_nonfaithful, source=args.workload,
                              budget=args.budget, threads=args.threads)
    finally:
        if started:
            import torch.distributed as dist

            dist.destroy_process_group()
    calls = sum(len(b.calls) for b in tuned.buckets)
    ranks = f" on {tuned.ranks} ranks (median across ranks)" if tuned.ranks > 1 else ""
    if tuned.plan is None or tuned.plan.rank == 0:
        print(tuned.summary())
        for line in tuned.excluded():
            print(line)
    print(f"wrote {tuned.path}: profile {tuned.name!r}, {len(tuned.buckets)} buckets{ranks}; "
          f"verified: each of the {calls} tuned calls resolves to its measured winner")
    if tuned.plan is not None:
        print(f"check_agreement: plan {tuned.plan.digest} agreed by {tuned.ranks} ranks")
    if args.report and (tuned.plan is None or tuned.plan.rank == 0):
        for line in write_report(tuned, args.report):
            print(line)
    print(f"activate: ASTR_TABLES={tuned.path} ASTR_OPS=profile={tuned.name}")
    return OK


def _tune_model(args: argparse.Namespace) -> int:
    """``tune --model``: build the model, ``astrai.tune_model`` it, print the summary."""
    from astrai.tune.model import tune_model

    model = load_model(args.model)
    tuned = tune_model(model, train=args.train, threads=args.threads, rounds=args.rounds,
                       budget=args.budget)
    print(tuned.summary())
    for line in tuned.tuned.excluded():
        print(line)
    return OK


def load_model(where: str) -> Any:
    """A transformers causal LM from a directory ``save_pretrained`` wrote (its weights,
    or random ones where the directory holds a config alone) or from a config file."""
    import json
    from pathlib import Path

    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as exc:
        raise UsageError(f"--model needs transformers installed: {exc}") from None
    path = Path(where)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UsageError(f"--model {where}: the directory holds no config.json")
        weights = [*path.glob("*.safetensors"), *path.glob("pytorch_model*.bin")]
        if weights:
            return AutoModelForCausalLM.from_pretrained(path)
        config = AutoConfig.from_pretrained(path)
    elif path.is_file():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            kind = data.pop("model_type")
        except (OSError, ValueError, KeyError) as exc:
            raise UsageError(f"--model {where}: not a transformers config (a JSON object "
                             f"with a model_type): {exc}") from None
        config = AutoConfig.for_model(kind, **data)
    else:
        raise UsageError(f"--model {where}: no such directory or file")
    return AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
