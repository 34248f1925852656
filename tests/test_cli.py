"""The ``astrai-ops`` command line, run as a user runs it: in a subprocess, from a clean cwd.

Every command is started with ``python -m astrai`` (and once through the ``astrai-ops``
console script) in a temporary directory, with the astrai variables removed from the
environment, so the tests see exactly what a shell user sees: the exit code (0 ok,
1 problems, 2 usage) and the output. Each invocation costs a fresh interpreter that imports
torch, so all of them are started together, once per module, and each test inspects its own.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
ASTR_VARS = ("ASTR_OPS", "ASTR_TABLES", "ASTR_BACKEND")
EXPLAIN = ("explain", "attention", "--dtype", "float32", "--ndim", "4", "--head-dim", "64")
LINEAR_IMPL = "astrai.backends.linear:torch_linear"
SCRIPT = "astrai-ops"  # marker in CASES: run through the console script instead of ``-m``

Proc = subprocess.CompletedProcess[str]
Runs = dict[str, Proc | None]

#: User files written to the working directory before the commands run.
FILES = {
    # line 5: an unknown key; line 9 col 20: a misspelt dtype
    "bad.yaml": f"""\
        version: 1
        family: mylin
        description: d
        fallback: b
        colour: red
        rows:
          - name: a
            impl: {LINEAR_IMPL}
            when: dtype == bfloat61
          - name: b
            impl: {LINEAR_IMPL}
        """,
    "inv.yaml": "version: 1\nrows: [\n",
    # line 5: a row that family 'linear' does not have
    "prof.yaml": """\
        version: 1
        profile: myprof
        families:
          linear:
            force: nosuchrow
        """,
    # 'b' can never win: 'a' takes every call first
    "shady.yaml": f"""\
        version: 1
        family: shady
        description: d
        fallback: c
        rows:
          - name: a
            impl: {LINEAR_IMPL}
            when: always
          - name: b
            impl: {LINEAR_IMPL}
            when: dtype == float16
          - name: c
            impl: {LINEAR_IMPL}
        """,
    "unsat.yaml": f"""\
        version: 1
        family: unsat
        description: d
        fallback: c
        rows:
          - name: u
            impl: {LINEAR_IMPL}
            when: ndim == 3 and ndim == 4
          - name: c
            impl: {LINEAR_IMPL}
        """,
}

#: Every invocation: key -> (arguments, extra environment).
CASES: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "no-command": ((), {}),
    "list": (("list",), {}),
    "script-list": ((SCRIPT, "list"), {}),
    "explain": (EXPLAIN, {}),
    "explain-json": ((*EXPLAIN, "--json"), {}),
    "explain-math": ((*EXPLAIN, "--backend", "math"), {}),
    "explain-flash": ((*EXPLAIN, "--backend", "flash"), {}),
    "explain-profile": ((*EXPLAIN, "--profile", "reference"), {}),
    "explain-env": (EXPLAIN, {"ASTR_OPS": "attention=math"}),
    "explain-bad-family": (("explain", "attentoin"), {}),
    "explain-bad-dtype": (("explain", "attention", "--dtype", "float61"), {}),
    "explain-bad-profile": ((*EXPLAIN, "--profile", "nope"), {}),
    "explain-bad-axis": (("explain", "linear", "--axis", "foo=1"), {}),
    "validate": (("validate",), {}),
    "validate-bad": (("validate", "bad.yaml"), {}),
    "validate-missing": (("validate", "missing.yaml"), {}),
    "validate-invalid": (("validate", "inv.yaml"), {}),
    "validate-profile": (("validate", "prof.yaml"), {}),
    "lint": (("lint",), {}),
    "lint-no-coverage": (("lint", "--no-coverage"), {}),
    "lint-shadow": (("lint", "shady.yaml"), {}),
    "lint-unsat": (("lint", "--no-coverage", "unsat.yaml"), {}),
    "lint-bad-profile": (("lint", "--profile", "nope"), {}),
    "schema-check": (("schema", "--check"), {}),
    "demo": (("demo",), {}),
}

#: The shipped attention table's rows, in order (``explicit_only`` rows included).
ATTENTION_ROWS = ["flash", "torch_native", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "flex",
                  "sdpa_math", "math"]


def _console_script() -> str | None:
    name = "astrai-ops.exe" if os.name == "nt" else "astrai-ops"
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which("astrai-ops")


def _run(args: tuple[str, ...], extra_env: dict[str, str], cwd: Path) -> Proc | None:
    if args[:1] == (SCRIPT,):
        script = _console_script()
        if script is None:
            return None
        cmd = [script, *args[1:]]
    else:
        cmd = [sys.executable, "-m", "astrai", *args]
    env = {k: v for k, v in os.environ.items() if k not in ASTR_VARS}
    env.update(extra_env)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=180, check=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Every invocation in ``CASES``, run concurrently in one fresh working directory."""
    cwd = tmp_path_factory.mktemp("cli")
    for name, text in FILES.items():
        (cwd / name).write_text(textwrap.dedent(text))
    schemas_before = {p.name: p.read_bytes() for p in (REPO / "schemas").glob("*.json")}
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        futures = {key: pool.submit(_run, args, env, cwd) for key, (args, env) in CASES.items()}
        results = {key: f.result() for key, f in futures.items()}
    schemas_after = {p.name: p.read_bytes() for p in (REPO / "schemas").glob("*.json")}
    assert schemas_after == schemas_before, "a command rewrote schemas/"
    return results


def get(runs: Runs, key: str) -> Proc:
    """The finished process for ``key`` (skips when its executable is not installed)."""
    proc = runs[key]
    if proc is None:
        pytest.skip("astrai-ops console script is not installed")
    return proc


#: torch's own warning, printed while ``import torch`` runs where NumPy is not installed (a
#: plain ``pip install torch`` does not install it): the warning line, then the source line
#: Python shows beneath it. It is torch's and comes before astrai runs, so what astrai itself
#: writes to stderr is the rest, and the assertions below check the rest.
TORCH_NUMPY_WARNING = re.compile(
    r"^.*[/\\]torch[/\\].*\.py:\d+: UserWarning: Failed to initialize NumPy: .*\n(?:  \S.*\n)?",
    re.M)


def astrai_stderr(stderr: str) -> str:
    """``stderr`` less torch's import-time NumPy warning (once); astrai's output stays."""
    return TORCH_NUMPY_WARNING.sub("", stderr, count=1)


def test_astrai_stderr_leaves_out_only_torchs_numpy_warning() -> None:
    """The filter drops exactly torch's warning, wherever torch is installed, and nothing
    that astrai writes."""
    warning = ("/v env/lib/python3.11/site-packages/torch/_subclasses/functional_tensor.py:368: "
               "UserWarning: Failed to initialize NumPy: No module named 'numpy' (Triggered "
               "internally at /__w/pytorch/pytorch/torch/csrc/utils/tensor_numpy.cpp:84.)\n"
               '  cpu = _conversion_method_template(device=torch.device("cpu"))\n')
    mine = "astrai-ops: error: unknown family 'attentoin'\n    dtype == bfloat61\n"
    assert astrai_stderr(warning) == ""
    assert astrai_stderr(warning + mine) == mine
    assert astrai_stderr(mine + warning) == mine
    assert astrai_stderr(mine) == mine
    assert astrai_stderr(warning.split("\n")[0] + "\n" + mine) == mine  # no source line shown
    for other in (warning.replace("NumPy", "CUDA"), warning.replace("/torch/", "/astrai/"),
                  warning.replace("UserWarning", "RuntimeWarning")):
        assert astrai_stderr(other) == other


def assert_clean_usage_error(proc: Proc, *needles: str) -> None:
    """Exit 2 with one ``error:`` line on stderr that contains every needle, no traceback."""
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = astrai_stderr(proc.stderr).strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "error:" in lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]


class TestTopLevel:
    def test_no_command_is_a_usage_error(self, runs: Runs) -> None:
        """Running with no command exits 2 with argparse's usage message."""
        proc = get(runs, "no-command")
        assert proc.returncode == 2
        assert "usage: astrai-ops" in proc.stderr
        assert "Traceback" not in proc.stderr

    def test_console_script_matches_module(self, runs: Runs) -> None:
        """The installed ``astrai-ops`` script prints the same ``list`` as ``python -m astrai``."""
        proc = get(runs, "script-list")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == get(runs, "list").stdout


class TestList:
    def test_exit_code_and_families(self, runs: Runs) -> None:
        """``list`` exits 0 and shows a section for each of the four shipped families."""
        proc = get(runs, "list")
        assert proc.returncode == 0, proc.stderr
        assert astrai_stderr(proc.stderr) == ""
        for family in ("attention", "linear", "rms_norm", "rotary"):
            assert re.search(rf"^\[{family}\] ", proc.stdout, re.M), family

    def test_rows_in_order_with_conditions(self, runs: Runs) -> None:
        """``list`` shows each family's rows in table order, each followed by its condition."""
        section = get(runs, "list").stdout.split("[attention]")[1].split("\n[")[0]
        names = re.findall(r"^  (\w+)\s+(?:available|unavailable)", section, re.M)
        assert names == ATTENTION_ROWS
        assert section.count("when: ") == len(ATTENTION_ROWS)

    def test_unavailable_reason(self, runs: Runs) -> None:
        """``list`` reports a missing accelerated backend as unavailable, with the reason."""
        if torch.cuda.is_available():
            pytest.skip("needs a machine without CUDA")
        assert re.search(r"^  flash\s+unavailable: no CUDA device", get(runs, "list").stdout,
                         re.M)

    def test_flags_and_profiles(self, runs: Runs) -> None:
        """``list`` marks non-faithful and fallback rows and names the shipped profiles."""
        out = get(runs, "list").stdout
        assert re.search(r"^  bf16\s+available \[not faithful\]$", out, re.M)
        assert re.search(r"^  math\s+available \[fallback\]$", out, re.M)
        assert re.search(r"^profiles: .*\blow-precision\b.*\breference\b", out, re.M)
        assert out.startswith("ASTR_OPS=''")


def last_line(proc: Proc) -> str:
    """The last line of the process's stdout."""
    return proc.stdout.strip().splitlines()[-1]


class TestExplain:
    def test_chain_decision(self, runs: Runs) -> None:
        """A float32 dense call is served by ``torch_native`` through the chain."""
        proc = get(runs, "explain")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("[attention] ")
        assert "flash: SKIP unavailable" in proc.stdout
        assert last_line(proc) == "=> torch_native (origin=chain)"

    def test_json(self, runs: Runs) -> None:
        """``--json`` prints one JSON document with the rows and the decision's row and origin."""
        proc = get(runs, "explain-json")
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        assert doc["family"] == "attention"
        assert doc["decision"] == {"row": "torch_native", "origin": "chain"}
        assert doc["error"] is None
        assert [r["name"] for r in doc["rows"]] == ATTENTION_ROWS

    def test_explicit_backend(self, runs: Runs) -> None:
        """``--backend math`` selects the named row with origin ``explicit``."""
        proc = get(runs, "explain-math")
        assert proc.returncode == 0, proc.stderr
        assert last_line(proc) == "=> math (origin=explicit)"

    def test_explicit_unavailable_backend_is_a_problem(self, runs: Runs) -> None:
        """``--backend flash`` without flash-attn installed exits 1 with an ``=> ERROR:`` line."""
        proc = get(runs, "explain-flash")
        assert proc.returncode == 1, (proc.stdout, proc.stderr)
        last = last_line(proc)
        assert last.startswith("=> ERROR:")
        assert "'flash'" in last and "unavailable" in last
        assert "Traceback" not in proc.stderr

    def test_profile(self, runs: Runs) -> None:
        """``--profile reference`` forces the fallback with origin ``profile``."""
        proc = get(runs, "explain-profile")
        assert proc.returncode == 0, proc.stderr
        assert last_line(proc) == "=> math (origin=profile)"

    def test_env_override(self, runs: Runs) -> None:
        """``ASTR_OPS=attention=math`` in the environment is reported with origin ``env``."""
        proc = get(runs, "explain-env")
        assert proc.returncode == 0, proc.stderr
        assert last_line(proc) == "=> math (origin=env)"

    def test_unknown_family(self, runs: Runs) -> None:
        """A misspelt family exits 2 with one line suggesting the right one."""
        proc = get(runs, "explain-bad-family")
        assert_clean_usage_error(proc, "did you mean", "'attention'")
        assert proc.stdout == ""

    def test_unknown_dtype(self, runs: Runs) -> None:
        """An unknown ``--dtype`` exits 2 with one line naming it."""
        assert_clean_usage_error(get(runs, "explain-bad-dtype"), "'float61'", "did you mean")

    def test_unknown_profile(self, runs: Runs) -> None:
        """An unknown ``--profile`` exits 2 with one line listing the known profiles."""
        assert_clean_usage_error(get(runs, "explain-bad-profile"), "'nope'", "reference")

    def test_axis_on_family_without_extra_axes(self, runs: Runs) -> None:
        """``--axis`` on a family with no extra axes exits 2 with one explanatory line."""
        assert_clean_usage_error(get(runs, "explain-bad-axis"), "--axis", "no extra axes")


class TestValidate:
    def test_shipped_tables_ok(self, runs: Runs) -> None:
        """With no paths, ``validate`` checks the shipped tables and exits 0 with ``ok``."""
        proc = get(runs, "validate")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("ok")
        assert astrai_stderr(proc.stderr) == ""

    def test_bad_table(self, runs: Runs) -> None:
        """A misspelt dtype and an unknown key exit 1 with located, caret-marked errors."""
        proc = get(runs, "validate-bad")
        assert proc.returncode == 1, (proc.stdout, proc.stderr)
        err = proc.stderr
        assert "Traceback" not in err
        assert re.search(r"^bad\.yaml:5:1: .*unknown key 'colour'", err, re.M)
        assert re.search(r"^bad\.yaml:9:20: .*'bfloat61'.*did you mean 'bfloat16'", err, re.M)
        lines = err.splitlines()
        caret = next(i for i, line in enumerate(lines) if "^" in line)
        assert lines[caret - 1].strip() == "dtype == bfloat61"
        # the caret sits under the 'b' of 'bfloat61' in the echoed source line
        assert lines[caret].index("^") == lines[caret - 1].index("bfloat61")
        assert "2 problem(s)" in err

    def test_missing_file(self, runs: Runs) -> None:
        """A path that does not exist exits 1 with a ``no such file`` problem."""
        proc = get(runs, "validate-missing")
        assert proc.returncode == 1
        assert re.search(r"^missing\.yaml:\d+:\d+: no such file", proc.stderr, re.M)
        assert "Traceback" not in proc.stderr

    def test_invalid_yaml(self, runs: Runs) -> None:
        """Unparseable YAML exits 1 with one located ``invalid YAML`` line and no traceback."""
        proc = get(runs, "validate-invalid")
        assert proc.returncode == 1
        assert "Traceback" not in proc.stderr
        problems = [ln for ln in proc.stderr.splitlines() if ln.startswith("inv.yaml:")]
        assert len(problems) == 1, proc.stderr
        assert re.match(r"inv\.yaml:\d+:\d+: invalid YAML", problems[0])

    def test_profile_naming_unknown_row(self, runs: Runs) -> None:
        """A profile forcing a row that does not exist exits 1 with its file:line:col."""
        proc = get(runs, "validate-profile")
        assert proc.returncode == 1
        assert re.search(r"^prof\.yaml:5:\d+: .*'nosuchrow'", proc.stderr, re.M)
        assert "Traceback" not in proc.stderr


class TestLint:
    def test_shipped_tables_clean(self, runs: Runs) -> None:
        """The shipped tables lint clean (exit 0), with a coverage matrix per family."""
        proc = get(runs, "lint")
        assert proc.returncode == 0, (proc.stdout, proc.stderr)
        for family in ("attention", "linear", "rms_norm", "rotary"):
            assert f"{family}: ok: no shadowed or unsatisfiable rows" in proc.stdout
            assert f"{family}: coverage" in proc.stdout

    def test_no_coverage(self, runs: Runs) -> None:
        """``--no-coverage`` keeps the verdicts but omits the coverage matrix."""
        proc = get(runs, "lint-no-coverage")
        assert proc.returncode == 0
        assert "attention: ok:" in proc.stdout
        assert "coverage" not in proc.stdout
        assert "winner" not in proc.stdout

    def test_shadowed_row(self, runs: Runs) -> None:
        """A row after an ``always`` row is reported as shadowed by it and lint exits 1."""
        proc = get(runs, "lint-shadow")
        assert proc.returncode == 1, (proc.stdout, proc.stderr)
        assert "shady: row 'b' is shadowed by 'a'" in proc.stdout
        assert "Traceback" not in proc.stderr

    def test_unsatisfiable_row(self, runs: Runs) -> None:
        """A row whose condition can never hold is reported as unsatisfiable and lint exits 1."""
        proc = get(runs, "lint-unsat")
        assert proc.returncode == 1, (proc.stdout, proc.stderr)
        assert "unsat: row 'u' is unsatisfiable" in proc.stdout

    def test_unknown_profile(self, runs: Runs) -> None:
        """``lint --profile`` with an unknown name exits 2 with one line."""
        assert_clean_usage_error(get(runs, "lint-bad-profile"), "unknown profile 'nope'")


class TestSchema:
    def test_check_is_current(self, runs: Runs) -> None:
        """``schema --check`` exits 0 on the repository without rewriting schemas/."""
        proc = get(runs, "schema-check")
        assert proc.returncode == 0, proc.stderr
        assert astrai_stderr(proc.stderr) == ""
        assert proc.stdout == ""


class TestDemo:
    def test_demo_reports_rows(self, runs: Runs) -> None:
        """``demo`` runs the tiny model and reports the row, calls and origin per family."""
        proc = get(runs, "demo")
        assert proc.returncode == 0, proc.stderr
        out = proc.stdout
        for family in ("attention", "linear", "rms_norm", "rotary"):
            assert re.search(rf"^{family}\s+\w+\s+\d+\s+\w+$", out, re.M), family
        assert "rows unavailable on this machine:" in out
        assert ("attention.flash: no CUDA device" in out or torch.cuda.is_available()
                or "attention.flash: flash_attn is not installed" in out)
