"""``astrai-ops`` manners (contract §10) and ``astrai-ops init`` (contract §5), run as a
user runs them.

Like ``test_cli.py``: every command is a fresh ``python -m astrai`` in a temporary working
directory with the astrai variables removed from the environment, all started together once
per module; each test inspects its own result. A closed pipe is a real pipe whose reading end
the test closes.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

import astrai
from astrai.dispatch import CallContext
from astrai.dispatch.axes import AXES, FEATURE_AXES, LAZY_AXES
from astrai.dispatch.explain import explanation
from astrai.dispatch.registry import shipped_tables_dir
from tests.test_cli import astrai_stderr

#: The feature axes of a call that asks for none.
FEATURES_OFF = {name: AXES[name].default for name in FEATURE_AXES}
ASTR_VARS = ("ASTR_OPS", "ASTR_TABLES", "ASTR_BACKEND")
LINEAR_IMPL = "astrai.backends.linear:torch_linear"
SHIPPED = shipped_tables_dir()
#: Every family astrai ships a table of (one file per family in tables/).
FAMILIES = tuple(sorted(p.stem for p in SHIPPED.glob("*.yaml")))
NO_TRACE = ("Traceback", "BrokenPipeError", "Exception ignored")
POSIX = pytest.mark.skipif(os.name == "nt", reason="pipes and shells as on POSIX")

Proc = subprocess.CompletedProcess[str]

#: User files written to the working directory before the commands run.
FILES = {
    "bad.yaml": "version: 1\nfamily: broken\n",  # no fallback, no rows
    "mylin.yaml": f"""\
        version: 1
        family: mylin
        description: a user's own family
        fallback: only
        rows:
          - name: only
            impl: {LINEAR_IMPL}
        """,
}

#: The shipped attention table's rows, in order (``explicit_only`` rows included).
ATTENTION_ROWS = ["flash", "torch_native", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "flex",
                  "sdpa_math", "math"]


def _env(extra: dict[str, str], *, unbuffered: bool | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ASTR_VARS}
    if unbuffered is not None:
        env.pop("PYTHONUNBUFFERED", None)
        if unbuffered:
            env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def _cmd(args: tuple[str, ...]) -> list[str]:
    return [sys.executable, "-m", "astrai", *args]


def run(args: tuple[str, ...], cwd: Path, extra: dict[str, str] | None = None) -> Proc:
    """One command to completion, its output captured (stderr less torch's own NumPy
    warning on an install without numpy: see ``tests.test_cli.astrai_stderr``)."""
    proc = subprocess.run(_cmd(args), cwd=cwd, env=_env(extra or {}), capture_output=True,
                          text=True, timeout=180, check=False)
    proc.stderr = astrai_stderr(proc.stderr)
    return proc


@dataclass
class Piped:
    """A command whose stdout reader went away: what it read first, the status, stderr."""

    first: str
    returncode: int
    stderr: str


def piped(args: tuple[str, ...], cwd: Path, *, lines: int, unbuffered: bool) -> Piped:
    """Run with stdout into a real pipe; read ``lines`` lines, then close the reading end
    (``lines=0`` closes it before the command has written anything: it imports torch first)."""
    proc = subprocess.Popen(_cmd(args), cwd=cwd, env=_env({}, unbuffered=unbuffered),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    first = "".join(proc.stdout.readline() for _ in range(lines))
    proc.stdout.close()
    err = astrai_stderr(proc.stderr.read())
    proc.stderr.close()
    return Piped(first, proc.wait(timeout=180), err)


DEV_FULL = Path("/dev/full")


def into_full(args: tuple[str, ...], cwd: Path, *, unbuffered: bool) -> Proc | None:
    """Run with stdout on ``/dev/full``, where every write fails (ENOSPC); None without it.
    Buffered, the failure surfaces only when stdout is flushed at the end."""
    if not DEV_FULL.exists():
        return None
    with open(DEV_FULL, "w") as full:
        proc = subprocess.run(_cmd(args), cwd=cwd, env=_env({}, unbuffered=unbuffered),
                              stdout=full, stderr=subprocess.PIPE, text=True, timeout=180,
                              check=False)
    proc.stderr = astrai_stderr(proc.stderr)
    return proc


def stdout_closed(args: tuple[str, ...], cwd: Path, *, stderr_too: bool = False) -> Proc:
    """Run with file descriptor 1 closed (``astrai-ops ARGS >&-``), and 2 as well if asked;
    the shell closes them, then ``exec``s the command."""
    redirect = "2>&- >&-" if stderr_too else ">&-"
    shell = f'exec "$@" {redirect}'
    proc = subprocess.run(["sh", "-c", shell, "sh", *_cmd(args)], cwd=cwd, env=_env({}),
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          timeout=180, check=False)
    proc.stderr = astrai_stderr(proc.stderr)
    return proc


@dataclass
class InitRuns:
    """``init`` run again and again in one directory, and what it left there."""

    work: Path
    first: Proc
    again: Proc
    kept_edit: bool
    forced: Proc
    restored: bool
    validated: Proc
    nested: Proc


def _init_chain(cwd: Path) -> InitRuns:
    work = cwd / "initwd"
    work.mkdir()
    first = run(("init",), work)
    edited = work / "astrai-tables" / "attention.yaml"
    marker = "# my edit\n"
    if edited.exists():
        edited.write_text(marker + edited.read_text())
    again = run(("init",), work)
    kept = edited.exists() and edited.read_text().startswith(marker)
    forced = run(("init", "--force"), work)
    restored = edited.exists() and not edited.read_text().startswith(marker)
    validated = run(("validate", "astrai-tables"), work)
    nested = run(("init", "nested/tables"), work)
    return InitRuns(work, first, again, kept, forced, restored, validated, nested)


def cli(*args: str, **env: str) -> Callable[[Path], Proc]:
    """A case: ``astrai-ops ARGS`` with these variables; ``{cwd}`` in a value is replaced."""
    return lambda cwd: run(args, cwd, {k: v.format(cwd=cwd) for k, v in env.items()})


EXPLAIN_CALL = ("explain", "attention", "--fwd", "decode", "--dtype", "bfloat16", "--ndim",
                "3", "--head-dim", "64", "--cache", "--no-grad")
LINEAR_CALL = ("explain", "linear", "--dtype", "float32", "--ndim", "2")

#: Commands run with stdout closed: key -> arguments.
CLOSED_STDOUT = {
    "list": ("list",),
    "explain": ("explain", "attention"),
    "explain-call": EXPLAIN_CALL,
    "validate": ("validate",),
    "help": ("--help",),
}

#: Every case: key -> a function of the working directory.
CASES: dict[str, Callable[[Path], Any]] = {
    "init": _init_chain,  # first: five commands one after the other
    # a closed pipe
    **{f"closed-{cmd}-{mode}": (lambda cwd, c=cmd, u=(mode == "unbuffered"):
                                piped((c,), cwd, lines=0, unbuffered=u))
       for cmd in ("list", "lint") for mode in ("buffered", "unbuffered")},
    **{f"head-{cmd}": (lambda cwd, c=cmd: piped((c,), cwd, lines=1, unbuffered=True))
       for cmd in ("list", "lint")},
    # output that cannot be written
    **{f"full-{mode}": partial(into_full, ("list",), unbuffered=mode == "unbuffered")
       for mode in ("buffered", "unbuffered")},
    **{f"stdout-closed-{key}": partial(stdout_closed, args)
       for key, args in CLOSED_STDOUT.items()},
    "stdout-stderr-closed": partial(stdout_closed, ("list",), stderr_too=True),
    # explain without a call: the table
    "table": cli("explain", "attention"),
    "table-json": cli("explain", "attention", "--json"),
    "table-profiles": cli("explain", "linear", "--profile", "reference+low-precision"),
    "table-backend": cli("explain", "attention", "--backend", "math"),
    # --json keeps types
    "json-call": cli(*EXPLAIN_CALL, "--json"),
    "json-sparse": cli("explain", "attention", "--ndim", "4", "--json"),
    # impossible values
    "ndim-negative": cli("explain", "attention", "--ndim", "-3"),
    "head-dim-zero": cli("explain", "attention", "--ndim", "4", "--head-dim", "0"),
    "ndim-word": cli("explain", "attention", "--ndim", "four"),
    "ndim-zero": cli("explain", "linear", "--ndim", "0", "--head-dim", "1"),
    # --profile a+b
    "profile-plus": cli(*LINEAR_CALL, "--profile", "reference+low-precision"),
    "profile-repeated": cli(*LINEAR_CALL, "--profile", "reference", "--profile",
                            "low-precision"),
    "profile-empty": cli(*LINEAR_CALL, "--profile", "reference+"),
    "lint-profile-plus": cli("lint", "--no-coverage", "--profile", "reference+low-precision"),
    # validate
    "validate-empty": cli("validate", "empty"),
    "validate-env-empty": cli("validate", ASTR_TABLES="{cwd}/empty"),
    "validate-env-bad": cli("validate", ASTR_TABLES="{cwd}/bad.yaml"),
    # help, list
    "help": cli("--help"),
    "help-explain": cli("explain", "--help"),
    "help-init": cli("init", "--help"),
    "list-sources": cli("list", ASTR_TABLES="{cwd}/mylin.yaml"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every case in ``CASES``, run concurrently in one fresh working directory."""
    cwd = tmp_path_factory.mktemp("manners")
    for name, text in FILES.items():
        (cwd / name).write_text(textwrap.dedent(text))
    (cwd / "empty").mkdir()
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        futures = {key: pool.submit(case, cwd) for key, case in CASES.items()}
        return {key: f.result() for key, f in futures.items()} | {"cwd": cwd}


def clean_usage_error(proc: Proc, *needles: str) -> None:
    """Exit 2 with one ``error:`` line on stderr containing every needle, nothing on stdout."""
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "error:" in lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert proc.stdout == ""


@POSIX
class TestClosedPipe:
    @pytest.mark.parametrize("mode", ["buffered", "unbuffered"])
    @pytest.mark.parametrize("cmd", ["list", "lint"])
    def test_closed_before_output(self, runs: dict[str, Any], cmd: str, mode: str) -> None:
        """Output into a pipe nobody reads ends quietly, with 141 (128 + SIGPIPE)."""
        got: Piped = runs[f"closed-{cmd}-{mode}"]
        for needle in NO_TRACE:
            assert needle not in got.stderr, got.stderr
        assert got.stderr == ""
        assert got.returncode == 141

    @pytest.mark.parametrize("cmd", ["list", "lint"])
    def test_head_one_line(self, runs: dict[str, Any], cmd: str) -> None:
        """``astrai-ops CMD | head -1``: the first line arrives, the rest ends quietly."""
        got: Piped = runs[f"head-{cmd}"]
        first = {"list": "ASTR_OPS=''\n", "lint": "activation: "}[cmd]
        assert got.first.startswith(first)
        assert got.stderr == ""
        assert got.returncode in (0, 141)  # 0 when it had written everything already


def write_failure(proc: Proc) -> None:
    """Exit 1 with one ``error:`` line on stderr saying that output could not be written,
    and neither a traceback nor Python's "Exception ignored" at exit."""
    assert proc.returncode == 1, proc.stderr
    for needle in NO_TRACE:
        assert needle not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("astrai-ops: error: cannot write output: "), lines[0]


@POSIX
class TestUnwritableOutput:
    @pytest.mark.parametrize("mode", ["buffered", "unbuffered"])
    def test_full_device(self, runs: dict[str, Any], mode: str) -> None:
        """``astrai-ops list > /dev/full`` says the write failed and exits 1, whether the
        failure surfaces at a write (unbuffered) or only at the final flush (buffered)."""
        proc: Proc | None = runs[f"full-{mode}"]
        if proc is None:
            pytest.skip(f"{DEV_FULL} does not exist here")
        write_failure(proc)
        assert "No space left on device" in proc.stderr

    @pytest.mark.parametrize("key", list(CLOSED_STDOUT))
    def test_stdout_closed(self, runs: dict[str, Any], key: str) -> None:
        """``astrai-ops CMD >&-`` does not claim success having written nothing."""
        proc: Proc = runs[f"stdout-closed-{key}"]
        write_failure(proc)
        assert "closed" in proc.stderr

    def test_stderr_closed_too(self, runs: dict[str, Any]) -> None:
        """With nowhere to report it, the failure still shows in the exit status."""
        proc: Proc = runs["stdout-stderr-closed"]
        assert proc.returncode == 1
        assert proc.stderr == ""


class TestExplainTable:
    def test_text(self, runs: dict[str, Any]) -> None:
        """``explain FAMILY`` alone shows the rows in order, their conditions, availability,
        flags and the family's file, and no verdict."""
        proc: Proc = runs["table"]
        assert proc.returncode == 0, proc.stderr
        out = proc.stdout
        assert out.startswith("[attention] ")
        assert re.search(rf"^  from: {re.escape(str(SHIPPED / 'attention.yaml'))} "
                         rf"\(shipped with astrai {re.escape(astrai.__version__)}\)$", out, re.M)
        names = re.findall(r"^  (\w+)\s+(?:available|unavailable)", out, re.M)
        assert names == ATTENTION_ROWS
        assert out.count("when: ") == len(ATTENTION_ROWS)
        assert re.search(r"^  math\s+available \[fallback\]$", out, re.M)
        assert re.search(r"^  sdpa_math\s+available \[explicit-only\]$", out, re.M)
        assert not re.search(r"^=>", out, re.M)
        for made_up in ("origin=", "dtype=none", "reject", "MATCH"):
            assert made_up not in out

    def test_json(self, runs: dict[str, Any]) -> None:
        """``explain FAMILY --json`` alone is the table as JSON: no call, no decision."""
        proc: Proc = runs["table-json"]
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        assert doc["family"] == "attention"
        assert doc["source"] == str(SHIPPED / "attention.yaml")
        assert doc["call"] is None
        assert "decision" not in doc and "context" not in doc
        assert [r["name"] for r in doc["rows"]] == ATTENTION_ROWS
        assert doc["fallback"] == "math"
        for row in doc["rows"]:
            assert isinstance(row["available"], bool)
            assert (row["reason"] is None) == row["available"]
            assert isinstance(row["when"], str) and row["when"]
            assert row["fallback"] is (row["name"] == "math")
            assert row["faithful"] is True

    def test_profiles_applied(self, runs: dict[str, Any]) -> None:
        """With ``--profile a+b`` the table is shown as those profiles make it."""
        proc: Proc = runs["table-profiles"]
        assert proc.returncode == 0, proc.stderr
        out = proc.stdout
        assert "  active profiles: reference + low-precision" in out
        assert re.search(r"^  bf16\s+available \[not faithful, enabled by profile "
                         r"low-precision\]$", out, re.M)
        assert "note: profile reference forces torch" in out
        assert not re.search(r"^=>", out, re.M)

    def test_backend_needs_a_call(self, runs: dict[str, Any]) -> None:
        """``--backend`` without a described call is a usage error, not a made-up verdict."""
        clean_usage_error(runs["table-backend"], "--backend", "--dtype")


class TestJsonTypes:
    def test_context_keeps_types(self, runs: dict[str, Any]) -> None:
        """Context values in ``--json`` are ints, booleans, null and the dtype's name."""
        proc: Proc = runs["json-call"]
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["context"] == {
            "fwd": "decode", "dtype": "bfloat16", "device_cuda": False, "ndim": 3,
            "head_dim": 64, "has_cache": True, "has_mask": False, "grad_enabled": False,
            # the lazy (shape and hardware) axes the command line did not set
            **dict.fromkeys(LAZY_AXES), **FEATURES_OFF,
        }

    def test_unset_axes_are_null(self, runs: dict[str, Any]) -> None:
        """An axis the call does not set is ``null``, not the string ``"none"``."""
        proc: Proc = runs["json-sparse"]
        context = json.loads(proc.stdout)["context"]
        assert context["fwd"] is None and context["dtype"] is None
        assert context["head_dim"] is None
        assert context["ndim"] == 4 and type(context["ndim"]) is int
        assert context["has_cache"] is False

    def test_explanation_object(self) -> None:
        """``Explanation.as_dict`` keeps types; ``render`` still writes the grammar's text."""
        call = CallContext("attention", dtype=torch.float32, ndim=4, head_dim=64, q_len=7,
                           device="cpu")
        got = explanation("attention", call)
        context = got.as_dict()["context"]
        assert context == {"fwd": None, "dtype": "float32", "device_cuda": False, "ndim": 4,
                           "head_dim": 64, "has_cache": False, "has_mask": False,
                           "grad_enabled": True, **dict.fromkeys(LAZY_AXES), **FEATURES_OFF,
                           "device": "cpu", "q_len": 7}
        assert json.loads(json.dumps(got.as_dict()))["context"] == context
        # the text leaves out the lazy axes the call does not fill
        assert got.render().splitlines()[0] == (
            "[attention] fwd=none dtype=float32 device_cuda=false ndim=4 head_dim=64 "
            "has_cache=false has_mask=false grad_enabled=true device=cpu q_len=7")


class TestImpossibleValues:
    def test_negative_ndim(self, runs: dict[str, Any]) -> None:
        """``--ndim -3`` is a usage error."""
        clean_usage_error(runs["ndim-negative"], "--ndim", "-3", ">= 0")

    def test_zero_head_dim(self, runs: dict[str, Any]) -> None:
        """``--head-dim 0`` is a usage error."""
        clean_usage_error(runs["head-dim-zero"], "--head-dim", "0", ">= 1")

    def test_not_a_number(self, runs: dict[str, Any]) -> None:
        """A word for ``--ndim`` is one clear line too."""
        clean_usage_error(runs["ndim-word"], "--ndim", "'four'")

    def test_zero_ndim_is_a_call(self, runs: dict[str, Any]) -> None:
        """``--ndim 0`` (a 0-d tensor) and ``--head-dim 1`` are possible: explained."""
        proc: Proc = runs["ndim-zero"]
        assert proc.returncode != 2, proc.stderr
        assert "ndim=0 head_dim=1" in proc.stdout.splitlines()[0]
        assert re.search(r"^=> ", proc.stdout, re.M)


class TestProfilePlus:
    def test_explain(self, runs: dict[str, Any]) -> None:
        """``--profile reference+low-precision`` applies both, in order, as ``ASTR_OPS`` does."""
        proc: Proc = runs["profile-plus"]
        assert proc.returncode == 0, proc.stderr
        assert "  profiles: reference + low-precision" in proc.stdout
        assert proc.stdout.strip().splitlines()[-1] == "=> torch (origin=profile)"

    def test_repeated_option_is_the_same(self, runs: dict[str, Any]) -> None:
        """``--profile a --profile b`` means ``--profile a+b``."""
        assert runs["profile-repeated"].returncode == 0
        assert runs["profile-repeated"].stdout == runs["profile-plus"].stdout

    def test_empty_name(self, runs: dict[str, Any]) -> None:
        """A dangling ``+`` is a usage error naming the value."""
        clean_usage_error(runs["profile-empty"], "'reference+'", "empty profile name")

    def test_lint(self, runs: dict[str, Any]) -> None:
        """``lint --profile a+b`` lints under both profiles."""
        proc: Proc = runs["lint-profile-plus"]
        assert proc.returncode == 0, (proc.stdout, proc.stderr)
        for family in FAMILIES:
            assert (f"{family}: ok: no shadowed or unsatisfiable rows under profile "
                    f"reference + low-precision") in proc.stdout


class TestValidate:
    def test_empty_directory(self, runs: dict[str, Any]) -> None:
        """``validate`` on a directory without tables says so and exits 1."""
        proc: Proc = runs["validate-empty"]
        assert proc.returncode == 1, (proc.stdout, proc.stderr)
        assert not proc.stdout.startswith("ok")
        assert re.search(r"^empty: no table or profile file", proc.stderr, re.M)
        assert proc.stderr.strip().splitlines()[-1].startswith("1 problem(s) in empty")

    def test_empty_tables_entry(self, runs: dict[str, Any]) -> None:
        """An ``ASTR_TABLES`` entry without tables is reported too."""
        proc: Proc = runs["validate-env-empty"]
        assert proc.returncode == 1, (proc.stdout, proc.stderr)
        assert "no table or profile file" in proc.stderr
        assert "ASTR_TABLES" in proc.stderr

    def test_tables_file_is_not_called_shipped(self, runs: dict[str, Any]) -> None:
        """A problem in an ``ASTR_TABLES`` file is summed up under that file's name."""
        proc: Proc = runs["validate-env-bad"]
        bad = str(runs["cwd"] / "bad.yaml")
        assert proc.returncode == 1
        assert re.search(rf"^{re.escape(bad)}:\d+:\d+: ", proc.stderr, re.M)
        summary = proc.stderr.strip().splitlines()[-1]
        assert re.match(rf"\d+ problem\(s\) in {re.escape(bad)}\b", summary), summary
        assert f"ASTR_TABLES ({bad})" in summary


class TestHelpAndList:
    @pytest.mark.parametrize("key", ["help", "help-explain", "help-init"])
    def test_no_backticks(self, runs: dict[str, Any], key: str) -> None:
        """``--help`` shows plain text, not reStructuredText markup."""
        proc: Proc = runs[key]
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("usage: astrai-ops")
        assert "`" not in proc.stdout

    def test_list_names_each_family_file(self, runs: dict[str, Any]) -> None:
        """``list`` shows under each family the file it came from, and who provided it."""
        proc: Proc = runs["list-sources"]
        assert proc.returncode == 0, proc.stderr
        sources = dict(re.findall(r"^\[(\w+)\] .*\n  from: (.*)$", proc.stdout, re.M))
        shipped = f"(shipped with astrai {astrai.__version__})"
        assert sources == {**{f: f"{SHIPPED / f'{f}.yaml'} {shipped}" for f in FAMILIES},
                           "mylin": f"{runs['cwd'] / 'mylin.yaml'} (ASTR_TABLES)"}


def _shipped_yaml() -> list[Path]:
    return sorted(p.relative_to(SHIPPED) for p in SHIPPED.rglob("*.y*ml"))


class TestInit:
    def test_copies_tables_and_profiles(self, runs: dict[str, Any]) -> None:
        """``init`` copies every shipped table and profile (not the precompiled JSON) into
        ``./astrai-tables``, unchanged but for a schema modeline that still resolves."""
        got: InitRuns = runs["init"]
        assert got.first.returncode == 0, got.first.stderr
        dest = got.work / "astrai-tables"
        wanted = _shipped_yaml()
        assert Path("profiles") in {p.parent for p in wanted}
        assert sorted(p.relative_to(dest) for p in dest.rglob("*") if p.is_file()) == wanted
        for rel in wanted:
            original = (SHIPPED / rel).read_text().splitlines()
            copy = (dest / rel).read_text().splitlines()
            assert copy[1:] == original[1:]
            modeline = re.fullmatch(r"# yaml-language-server: \$schema=(\S+)", copy[0])
            assert modeline, copy[0]
            schema = Path(modeline.group(1))
            assert schema.is_absolute() and schema.is_file(), schema
            assert schema.name == original[0].rsplit("/", 1)[1]

    @POSIX
    def test_prints_the_tables_line(self, runs: dict[str, Any]) -> None:
        """The last line is the shell line that puts the copies in ``ASTR_TABLES``."""
        got: InitRuns = runs["init"]
        dest = got.work / "astrai-tables"
        assert got.first.stdout.strip().splitlines()[-1] == (
            f"export ASTR_TABLES={shlex.quote(str(dest))}")

    def test_refuses_to_overwrite(self, runs: dict[str, Any]) -> None:
        """A second ``init`` exits 1, lists the files in the way, and changes nothing."""
        got: InitRuns = runs["init"]
        assert got.again.returncode == 1, (got.again.stdout, got.again.stderr)
        assert "--force" in got.again.stderr
        for rel in _shipped_yaml():
            assert str(got.work / "astrai-tables" / rel) in got.again.stderr
        assert "Traceback" not in got.again.stderr
        assert got.kept_edit

    def test_force_overwrites(self, runs: dict[str, Any]) -> None:
        """``init --force`` copies over existing files."""
        got: InitRuns = runs["init"]
        assert got.forced.returncode == 0, got.forced.stderr
        assert got.restored

    def test_copies_validate(self, runs: dict[str, Any]) -> None:
        """The copied directory validates on its own."""
        got: InitRuns = runs["init"]
        assert got.validated.returncode == 0, got.validated.stderr
        assert got.validated.stdout.startswith("ok: astrai-tables")

    def test_explicit_directory(self, runs: dict[str, Any]) -> None:
        """``init DIR`` creates DIR (and its parents)."""
        got: InitRuns = runs["init"]
        assert got.nested.returncode == 0, got.nested.stderr
        assert (got.work / "nested" / "tables" / "attention.yaml").is_file()


class TestNewUser:
    """The command line as a new user tries it."""

    def _kernels(self, where: Path) -> None:
        pkg = where / "mykernels"
        pkg.mkdir()
        (pkg / "__init__.py").write_text("")
        (pkg / "gelu.py").write_text("def gelu(x):\n    return x\n")

    def _table(self, where: Path, module: str) -> Path:
        path = where / "act.yaml"
        path.write_text(f"version: 1\nfamily: act\nfallback: ref\nrows:\n  - name: ref\n"
                        f"    impl: {module}:gelu\n")
        return path

    def test_the_script_imports_from_the_current_directory_as_python_m_does(
            self, tmp_path: Path) -> None:
        self._kernels(tmp_path)
        self._table(tmp_path, "mykernels.gelu")
        script = Path(sys.executable).with_name("astrai-ops")
        if not script.exists():
            pytest.skip("the astrai-ops script is not installed beside this interpreter")
        for argv in ([str(script)], _cmd(())):
            proc = subprocess.run([*argv, "validate", "act.yaml"], cwd=tmp_path, env=_env({}),
                                  capture_output=True, text=True, timeout=180, check=False)
            assert proc.returncode == 0, (argv, proc.stderr)
            assert "ok: act.yaml" in proc.stdout

    def test_a_misspelled_module_gets_a_did_you_mean(self, tmp_path: Path) -> None:
        self._kernels(tmp_path)
        self._table(tmp_path, "mykernels.gelus")
        proc = run(("validate", "act.yaml"), tmp_path)
        assert proc.returncode == 1
        assert "No module named 'mykernels.gelus' (did you mean 'mykernels.gelu'?)" in (
            proc.stderr)

    def test_version(self, tmp_path: Path) -> None:
        from astrai import __version__

        proc = run(("--version",), tmp_path)
        assert proc.returncode == 0 and proc.stdout.strip() == f"astrai-ops {__version__}"

    def test_init_only_what_one_means_to_edit(self, tmp_path: Path) -> None:
        proc = run(("init", "mine", "--only", "rms_norm", "--only", "reference"), tmp_path)
        assert proc.returncode == 0, proc.stderr
        copied = sorted(p.relative_to(tmp_path / "mine").as_posix()
                        for p in (tmp_path / "mine").rglob("*.yaml"))
        assert copied == ["profiles/reference.yaml", "rms_norm.yaml"]
        bad = run(("init", "other", "--only", "rmsnorm"), tmp_path)
        assert bad.returncode == 2 and "(did you mean 'rms_norm'?)" in bad.stderr
        assert not (tmp_path / "other").exists()

    def test_validate_strict_fails_on_astr_ops_typos(self, tmp_path: Path) -> None:
        loose = run(("validate",), tmp_path, {"ASTR_OPS": "linear=torhc"})
        assert loose.returncode == 0
        strict = run(("validate", "--strict"), tmp_path, {"ASTR_OPS": "linear=torhc"})
        assert strict.returncode == 1
        assert "unknown linear row 'torhc' (did you mean 'torch'?)" in strict.stderr
        clean = run(("validate", "--strict"), tmp_path, {"ASTR_OPS": "linear=torch"})
        assert clean.returncode == 0

    def test_flash_says_no_cuda_first(self) -> None:
        if __import__("torch").cuda.is_available():
            pytest.skip("needs a machine without CUDA")
        from astrai.backends.attention.flash import flash_available

        assert str(flash_available()).startswith("no CUDA device")
