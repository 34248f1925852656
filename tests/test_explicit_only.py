"""``explicit_only: true``: a faithful row the implicit chain never picks.

Such a row is selected by name (``backend=``, ``op_backend``, ``ASTR_OPS``, a profile's
``force``) or joins the chain when a profile ``enable``s it, exactly like a non-faithful
row; explain, lint, the CLI and ``NoImplementationError`` say so.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from astrai import cli, dispatch
from astrai.dispatch import (
    CallContext,
    ExplicitSelectionError,
    ImplRecord,
    NoImplementationError,
    Spec,
    explain,
    load_tables,
    op_backend,
    register_family,
    resolve,
    use_profile,
)
from astrai.dispatch.lint import lint_family
from astrai.dispatch.tables.model import table_revision

#: ``by_name`` would win every call it accepts, but is explicit-only; ``ref`` is the fallback.
TABLE = """\
version: 1
family: toy_eo
fallback: ref
rows:
  - name: by_name
    impl: tests._impls:fast
    when: ndim == 3
    explicit_only: true
  - name: ref
    impl: tests._impls:ref
    when: ndim >= 2
"""

PROFILE = """\
version: 1
profile: toy-eo-enable
families:
  toy_eo:
    enable: [by_name]
"""


@pytest.fixture
def toy_eo(write_yaml: Callable[[str, str], Path]) -> Path:
    """Load the ``toy_eo`` family and a profile that enables its explicit-only row."""
    path = write_yaml("toy_eo.yaml", TABLE)
    load_tables(path, write_yaml("profiles/toy-eo-enable.yaml", PROFILE))
    return path


def ctx(ndim: int = 3) -> CallContext:
    return CallContext("toy_eo", ndim=ndim)


class TestChain:
    def test_chain_skips_the_row(self, toy_eo: Path) -> None:
        """A call the explicit-only row accepts goes to the next row of the chain."""
        res = resolve("toy_eo", ctx())
        assert (res.name, res.origin) == ("ref", "chain")

    def test_profile_enable_lets_it_win(self, toy_eo: Path) -> None:
        """Under a profile that enables it, the row wins the calls it accepts."""
        with use_profile("toy-eo-enable"):
            res = resolve("toy_eo", ctx())
        assert (res.name, res.origin) == ("by_name", "chain")

    def test_record_flag_from_the_table(self, toy_eo: Path) -> None:
        """The loaded record carries the flag; ``implicit`` is false for it only."""
        rows = {r.name: r for r in dispatch.current().family("toy_eo").rows}
        assert rows["by_name"].explicit_only and not rows["by_name"].implicit
        assert not rows["ref"].explicit_only and rows["ref"].implicit


class TestByName:
    def test_explicit_argument(self, toy_eo: Path) -> None:
        """``explicit="by_name"`` selects it."""
        res = resolve("toy_eo", ctx(), explicit="by_name")
        assert (res.name, res.origin) == ("by_name", "explicit")

    def test_context_scope(self, toy_eo: Path) -> None:
        """An ``op_backend`` scope selects it."""
        with op_backend(toy_eo="by_name"):
            res = resolve("toy_eo", ctx())
        assert (res.name, res.origin) == ("by_name", "context")

    def test_env_entry(self, toy_eo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """An ``ASTR_OPS`` entry selects it."""
        monkeypatch.setenv("ASTR_OPS", "toy_eo=by_name")
        res = resolve("toy_eo", ctx())
        assert (res.name, res.origin) == ("by_name", "env")

    def test_error_by_name_still_checks_when(self, toy_eo: Path) -> None:
        """Selected by name, its ``when`` still decides: a call it rejects is an error."""
        with pytest.raises(ExplicitSelectionError, match=r"'by_name'.*ndim == 3"):
            resolve("toy_eo", ctx(ndim=2), explicit="by_name")


class TestExplain:
    def test_explain_says_skip(self, toy_eo: Path) -> None:
        """Explain shows the row skipped as explicit-only, then the chain's choice."""
        text = explain("toy_eo", ctx())
        assert "  by_name: SKIP explicit-only (selected by name or a profile)" in text
        assert text.splitlines()[-1] == "=> ref (origin=chain)"

    def test_explain_enabled_by_profile(self, toy_eo: Path) -> None:
        """Enabled by a profile, the row's MATCH line names the profile."""
        with use_profile("toy-eo-enable"):
            text = explain("toy_eo", ctx())
        assert "by_name: MATCH (ndim == 3; enabled by profile toy-eo-enable)" in text

    def test_no_implementation_lists_it(self, toy_eo: Path) -> None:
        """When nothing serves, the error gives the explicit-only row its own reason."""
        with pytest.raises(NoImplementationError) as info:
            resolve("toy_eo", CallContext("toy_eo", ndim=1))
        assert ("by_name", "explicit-only (explicit or profile-enabled only)") in \
            info.value.reasons


class TestLint:
    def test_not_shadowed_but_noted(self, toy_eo: Path) -> None:
        """Lint does not call the row shadowed; it notes that it is explicit-only."""
        report = lint_family("toy_eo")
        assert report.ok, report.problems
        assert "row 'by_name' is explicit-only (explicit_only: true; no profile enables it)" \
            in report.notes

    def test_enabled_row_is_linted(self, toy_eo: Path) -> None:
        """Under the enabling profile the row takes part, and shadows nothing it should not."""
        report = lint_family("toy_eo", ("toy-eo-enable",))
        assert report.ok
        assert any(cov == "by_name" for _, cov in report.coverage)


class TestCli:
    def test_list_flags_the_row(self, toy_eo: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """``explain FAMILY`` (the table view) flags the row; ``--json`` has the key."""
        assert cli.main(["explain", "toy_eo"]) == 0
        out = capsys.readouterr().out
        assert "by_name        available [explicit-only]" in out
        assert cli.main(["explain", "toy_eo", "--json"]) == 0
        rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
        assert rows["by_name"]["explicit_only"] is True
        assert rows["ref"]["explicit_only"] is False


class TestRegistered:
    def test_register_family_record(self) -> None:
        """A programmatic record with ``explicit_only=True`` behaves the same, and the flag
        changes the table's revision (ranks that disagree on it are told apart)."""
        fast = ImplRecord("toy_py", "fast", lambda: "fast", Spec.always(), explicit_only=True)
        ref = ImplRecord("toy_py", "ref", lambda: "ref", Spec.always())
        register_family("toy_py", [fast, ref], "ref")
        assert resolve("toy_py", CallContext("toy_py")).name == "ref"
        assert resolve("toy_py", CallContext("toy_py"), explicit="fast").name == "fast"
        flagged = table_revision(dispatch.current().family("toy_py"))
        register_family("toy_py", [ImplRecord("toy_py", "fast", fast.obj, Spec.always()), ref],
                        "ref")
        assert table_revision(dispatch.current().family("toy_py")) != flagged
