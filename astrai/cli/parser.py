"""The command line's grammar: every command, its arguments and their help."""

from __future__ import annotations

__all__ = ["CALL_OPTIONS", "DESCRIPTION", "INIT_DIR", "MACHINE_OPTIONS", "add_axis_flag",
           "make_parser"]

import argparse

from astrai.cli.output import help_text
from astrai.dispatch.axes import AXES, MACHINE_AXES, TRACED_AXIS, Axis, format_value
from astrai.env import OPS_ENV, TABLES_ENV
from astrai.version import __version__

#: Where ``init`` copies the shipped tables by default.
INIT_DIR = "astrai-tables"

#: The options that describe a call to ``explain`` (without any, it shows the table).
CALL_OPTIONS = (*(axis.flag for axis in AXES.values()), TRACED_AXIS.flag, "--axis")
#: The options that ask ``explain`` about another machine (a machine axis's value).
MACHINE_OPTIONS = tuple(axis.flag for axis in MACHINE_AXES.values())


#: What ``astrai-ops --help`` says the command line is for.
DESCRIPTION = ("``astrai-ops`` / ``python -m astrai``: inspect, explain, validate and lint the "
               "tables.")


def add_axis_flag(parser: argparse.ArgumentParser, axis: Axis) -> None:
    """The ``explain`` option that sets one core axis (declared in ``axes.AXES``), or
    states a machine axis's value for another machine (``axes.MACHINE_AXES``)."""
    if axis.machine:
        what = ", ".join(axis.value_names()) if axis.kind != "int" else \
            f"an integer >= {axis.minimum}"
        parser.add_argument(axis.flag, dest=f"machine_{axis.name}", default=None,
                            metavar="N" if axis.kind == "int" else "VALUE",
                            help=f"as on a machine where {axis.name} is this ({axis.description}"
                                 f"; {what}); default: this machine's")
        return
    if axis.kind == "bool":
        parser.add_argument(axis.flag, dest=axis.name, action="store_const",
                            const=not axis.default, default=axis.default,
                            help=f"set {axis.name} to {format_value(not axis.default)} "
                                 f"({axis.description})")
    elif axis.kind == "enum":
        parser.add_argument(axis.flag, dest=axis.name, default=axis.default,
                            choices=[*(["none"] if axis.nullable else []), *axis.values],
                            help=axis.description)
    else:
        what = (f"an integer >= {axis.minimum}" if axis.kind == "int"
                else "a torch dtype name, e.g. bfloat16")
        parser.add_argument(axis.flag, dest=axis.name, default=None,
                            metavar="N" if axis.kind == "int" else "DTYPE",
                            help=f"{axis.description} ({what})")


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="astrai-ops", description=help_text(DESCRIPTION),
        epilog="Exit codes: 0 ok, 1 problems found, 2 usage error.")
    p.add_argument("--version", action="version", version=f"astrai-ops {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=text, description=text[:1].upper() + text[1:] + ".")

    ls = command("list", "families, rows, availability on this machine, where each family "
                         "and row comes from, and the installed plugins")
    ls.add_argument("--json", action="store_true", help="machine-readable output")

    e = command("explain", "why each row wins or loses for a described call (without call "
                           "options: the family's table, rows in effective order)")
    e.add_argument("family")
    for axis in AXES.values():
        add_axis_flag(e, axis)
    add_axis_flag(e, TRACED_AXIS)
    for axis in MACHINE_AXES.values():
        add_axis_flag(e, axis)
    e.add_argument("--axis", action="append", default=[], metavar="NAME=VALUE",
                   help="a value for one of the family's extra axes")
    e.add_argument("--backend", default=None, metavar="ROW", help="explicit row selection")
    e.add_argument("--profile", action="append", default=[], metavar="P[+P...]",
                   help="activate profiles, applied in order (repeatable)")
    e.add_argument("--json", action="store_true", help="machine-readable output")

    v = command("validate", "check table and profile files")
    v.add_argument("--strict", action="store_true",
                   help=f"also fail (exit 1) on a problem in {OPS_ENV} (an unknown family, "
                        "row or profile, a malformed entry), which otherwise only warns")
    v.add_argument("paths", nargs="*",
                   help=f"files or directories (default: shipped tables and {TABLES_ENV})")

    lint = command("lint", "find rows that can never win")
    lint.add_argument("paths", nargs="*", help="extra files or directories to load first")
    lint.add_argument("--profile", action="append", default=[], metavar="P[+P...]",
                      help="lint under profiles, applied in order (repeatable)")
    lint.add_argument("--no-coverage", action="store_true", help="omit the coverage matrix")

    s = command("schema", "regenerate schemas/ and the precompiled shipped tables")
    s.add_argument("--check", action="store_true",
                   help="exit 1 if schemas/ or tables/precompiled.json is stale")

    pc = command("precompile", "write precompiled.json beside a kernel package's table files, "
                               "so they load without pydantic and PyYAML")
    pc.add_argument("dir", metavar="DIR", help="the package folder holding the *.yaml files")
    pc.add_argument("--check", action="store_true",
                    help="exit 1 if DIR's precompiled.json is missing or stale")

    i = command("init", f"copy the shipped tables and profiles into a directory to edit, and "
                        f"print the {TABLES_ENV} line that uses them")
    i.add_argument("dir", nargs="?", default=INIT_DIR, metavar="DIR",
                   help=f"where to copy them (default: ./{INIT_DIR})")
    i.add_argument("--force", action="store_true", help="overwrite files that already exist")
    i.add_argument("--only", action="append", default=[], metavar="NAME",
                   help="copy only this family's table or this profile (repeatable); "
                        "default: all of them")

    d = command("demo", "run the demo model and show which rows served it")
    d.add_argument("--hf", "--transformers", dest="transformers", action="store_true",
                   help="run a tiny random Hugging Face Llama instead, the whole model "
                        "dispatched through astrai (dispatch_model)")
    d.add_argument("--record", metavar="WORKLOAD",
                   help="record every call the demo makes and write the workload there")

    t = command("tune", "time every row that can serve each call of a recorded workload and "
                        "write the fastest per shape bucket as a profile (with provenance)")
    t.add_argument("workload", nargs="?", metavar="WORKLOAD",
                   help="a recorded workload (demo --record); or --model")
    t.add_argument("--model", metavar="DIR_OR_CONFIG",
                   help="tune this machine for a transformers causal LM in one step "
                        "(astrai.tune_model): a directory save_pretrained wrote, or a "
                        "config.json (random weights where there are none); the profile "
                        "goes to the user's cache, where dispatch_model finds it")
    t.add_argument("--train", action="store_true",
                   help="with --model: a training step (forward and backward of the loss) "
                        "is part of the run")
    t.add_argument("-o", "--output", default="tuned.yaml", metavar="PROFILE",
                   help="where to write the profile; its name is the file's stem "
                        "(default: tuned.yaml)")
    t.add_argument("--rounds", type=int, default=7,
                   help="interleaved timing rounds per call (default: 7)")
    t.add_argument("--budget", type=float, default=20.0, metavar="SECONDS",
                   help="time for extra rounds, over the whole workload, where the figures "
                        "cannot yet tell whether a row beats the shipped one (default: 20)")
    t.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch intra-op threads while timing (default: torch's, as you run)")
    t.add_argument("--allow-nonfaithful", action="store_true",
                   help="time non-faithful rows too (they change numerics)")
    t.add_argument("--report", metavar="REPORT.md",
                   help="write the timing table (markdown) and a plot (PNG, with matplotlib)")

    k = command("lock", "write the decision of every call of a recorded workload to a lock "
                        "file, or check a lock against the tables now (--check)")
    k.add_argument("workload", nargs="?", metavar="WORKLOAD",
                   help="a workload file (astrai-ops demo --record, ASTR_RECORD, record())")
    k.add_argument("-o", "--output", default="astrai.lock", metavar="LOCK",
                   help="where to write the lock (default: astrai.lock)")
    k.add_argument("--check", metavar="LOCK",
                   help="resolve every locked decision again; exit 1 with a table of the "
                        "ones that changed")
    nat = command("native", "say whether astrai's native extension (the facades' compiled "
                            "hot path, the native rows' kernels) is in use, or build it "
                            "(--build) with this machine's C++ compiler")
    nat.add_argument("--build", action="store_true",
                     help="build it for this torch and Python into the cache directory "
                          "(about 15 s; processes started afterwards load it)")
    nat.add_argument("--force", action="store_true", help="with --build: build it again")
    return p
