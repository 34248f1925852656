"""Decision locks: ``lock``, ``lock --check``, ``ASTR_LOCK`` in each mode."""

from __future__ import annotations

import logging
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import astrai.dispatch as dispatch
from astrai import ops
from astrai.cli import main
from astrai.dispatch import FileFormatError, LockDriftError, record
from astrai.distributed.comparison import differences
from astrai.distributed.fingerprint import fingerprint
from astrai.lock.make import check_lock, lock_workload
from astrai.lock.model import Lock
from astrai.record.workload import Workload

SHIPPED = dispatch.shipped_tables_dir()
Q = torch.randn(1, 4, 2, 8)
X, W = torch.randn(3, 8), torch.ones(8)


def workload_calls() -> None:
    """The recorded workload: dense causal attention (torch_native), rms_norm (torch)."""
    ops.attention(Q, Q, Q, is_causal=True)
    ops.rms_norm(X, W)


@pytest.fixture
def workload() -> Workload:
    with record() as wl:
        workload_calls()
    return wl.workload()


@pytest.fixture
def lock_path(workload: Workload, tmp_path: Path) -> Path:
    """The lock of ``workload`` on the shipped tables, written to a file."""
    return lock_workload(workload).save(tmp_path / "astrai.lock")


def edited_attention(tmp_path: Path, edit: Callable[[str], str]) -> Path:
    """A copy of the shipped attention table with ``edit`` applied."""
    path = tmp_path / "edited" / "attention.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(edit((SHIPPED / "attention.yaml").read_text()))
    return path


def math_first(text: str) -> str:
    """The attention table with ``math`` moved above ``torch_native``."""
    start, end = text.index("  - name: torch_native"), text.index("  - name: math")
    return text[:start] + text[end:].rstrip() + "\n\n" + text[start:end]


def use_lock(monkeypatch: pytest.MonkeyPatch, path: Path, mode: str | None = None) -> None:
    """Put the lock at ``path`` in force (with a fresh decision cache)."""
    monkeypatch.setenv("ASTR_LOCK", str(path))
    if mode is not None:
        monkeypatch.setenv("ASTR_LOCK_MODE", mode)
    dispatch.refresh()


class TestLockFile:
    """``lock_workload`` and the lock file."""

    def test_one_decision_per_signature(self, workload: Workload) -> None:
        """Each recorded call signature gets its family, row, origin and revisions."""
        lock = lock_workload(workload)
        assert [(d.family, d.row, d.origin, d.calls) for d in lock.decisions] == [
            ("attention", "torch_native", "chain", 1), ("rms_norm", "torch", "chain", 1)]
        state = dispatch.current()
        attention = lock.decisions[0]
        assert attention.table == state.family("attention").revision
        assert lock.tables["attention"] == (attention.table,
                                            state.family("attention").source)
        assert attention.signature.startswith("attention[dtype=float32 ndim=4 head_dim=8")
        assert lock.machine.cores >= 1 and lock.machine.torch == str(torch.__version__)

    def test_round_trip(self, workload: Workload, tmp_path: Path) -> None:
        """A saved lock loads back with the same decisions and digest."""
        lock = lock_workload(workload, source="wl.yaml")
        back = Lock.load(lock.save(tmp_path / "astrai.lock"))
        assert back.decisions == lock.decisions
        assert back.digest == lock.digest and back.workload == "wl.yaml"
        assert back.machine == lock.machine

    def test_profiles_and_selections_are_locked(self, tmp_path: Path) -> None:
        """A call made under a profile or with a row selected locks that decision, with
        the profile's revision."""
        with record() as wl:
            ops.rms_norm(X, W, backend="reference")
            with dispatch.use_profile("reference"):
                ops.attention(Q, Q, Q)
        lock = lock_workload(wl.workload())
        first, second = lock.decisions
        assert (first.row, first.origin, first.backend) == ("reference", "explicit",
                                                            "reference")
        assert (second.row, second.origin) == ("math", "profile")
        assert second.profiles == {"reference": dispatch.current().profiles["reference"]
                                   .revision}
        assert check_lock(Lock.load(lock.save(tmp_path / "a.lock"))).ok

    def test_error_file_located(self, tmp_path: Path) -> None:
        """A malformed lock is a located ``FileFormatError``."""
        path = tmp_path / "bad.lock"
        path.write_text("version: 1\nkind: lock\ncreated: now\nmachine: {cpu: x}\n"
                        "tables: {}\ndecisions: []\n")
        with pytest.raises(FileFormatError, match=r"bad.lock:4:10: missing required key "
                                                  r"'cores' in machine"):
            Lock.load(path)


class TestCheck:
    """``check_lock`` / ``astrai-ops lock --check``: what changed since the lock."""

    def test_nothing_changed(self, lock_path: Path) -> None:
        """On the tables it was made with, every decision holds."""
        report = check_lock(Lock.load(lock_path))
        assert report.ok and report.notes == ()
        assert report.render() == f"{lock_path}: all 2 locked decisions hold"

    def test_table_edit_that_changes_a_decision(self, lock_path: Path,
                                                tmp_path: Path) -> None:
        """Moving ``math`` above ``torch_native`` changes the locked attention decision:
        reported with the reason, and the CLI exits 1 with the diff table."""
        dispatch.load_tables(edited_attention(tmp_path, math_first))
        report = check_lock(Lock.load(lock_path))
        (change,) = report.changes
        assert (change.decision.row, change.row) == ("torch_native", "math")
        assert change.reason.startswith("the attention table changed (revision ")

    def test_cli_exits_1_with_a_diff_table(self, lock_path: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
        """``lock --check`` prints the table and exits 1 when a decision changed."""
        assert main(["lock", "--check", str(lock_path)]) == 0
        dispatch.load_tables(edited_attention(tmp_path, math_first))
        capsys.readouterr()
        assert main(["lock", "--check", str(lock_path)]) == 1
        lines = capsys.readouterr().out.splitlines()
        assert lines[0] == f"{lock_path}: 1 of 2 locked decisions changed"
        assert lines[1].split() == ["family", "locked", "live", "signatures", "calls"]
        assert lines[2].split() == ["attention", "torch_native", "math", "1", "1"]
        assert lines[3].strip().startswith("reason: the attention table changed")
        assert lines[4].strip().startswith("attention[dtype=float32 ndim=4 head_dim=8")
        assert len(lines) == 5

    def test_comment_edit_is_not_drift(self, lock_path: Path, tmp_path: Path) -> None:
        """A comment changes the table's revision, not a decision: a note, no change."""
        dispatch.load_tables(edited_attention(tmp_path, lambda t: t + "# a comment\n"))
        report = check_lock(Lock.load(lock_path))
        assert report.ok
        (note,) = report.notes
        assert note.startswith("the attention table changed (revision ")
        assert note.endswith("but no locked decision did")

    def test_row_that_wins_nowhere_is_not_drift(self, lock_path: Path,
                                                tmp_path: Path) -> None:
        """A new first row that serves no call of the workload changes nothing."""
        def add_row(text: str) -> str:
            first = text.index("  - name: flash")
            return (text[:first] + "  - name: doubles\n"
                    "    impl: astrai.backends.attention.math:math_attention\n"
                    "    when: dtype == float64\n\n" + text[first:])

        dispatch.load_tables(edited_attention(tmp_path, add_row))
        assert check_lock(Lock.load(lock_path)).ok

    def test_row_no_longer_available(self, toy: Path, tmp_path: Path) -> None:
        """A locked row that became unavailable is the reason given."""
        toy.write_text(toy.read_text().replace(
            "  - name: fast\n    impl: tests._impls:fast\n",
            "  - name: fast\n    impl: tests._impls:fast\n"
            "    available: tests._impls:counted_probe\n"))
        dispatch.load_tables(toy)
        with record() as wl:
            ops.call("toy", torch.zeros(2, 2, 2))
        lock = lock_workload(wl.workload())
        assert lock.decisions[0].row == "fast"
        from tests import _impls

        _impls.PROBE["available"] = False
        dispatch.refresh()
        (change,) = check_lock(lock).changes
        assert change.row == "ref"
        assert change.reason == "row 'fast' cannot serve the call now: unavailable (toggled off)"

    def test_reason_under_the_recorded_scope(self, tmp_path: Path) -> None:
        """A call made under ``use_profile`` is checked under it: its reason names what
        changed (the forced row's ``when``), not the profile."""
        with record() as wl, dispatch.use_profile("reference"):
            ops.rms_norm(X, W)
        lock = lock_workload(wl.workload())
        assert (lock.decisions[0].row, lock.decisions[0].origin) == ("reference", "profile")
        table = tmp_path / "rms_norm.yaml"
        text = (SHIPPED / "rms_norm.yaml").read_text()
        row = text.index("  - name: reference")
        table.write_text(text[:row] + text[row:].replace(
            "when: ndim >= 1 and dtype in {float16, bfloat16, float32, float64}",
            "when: dtype == float64"))
        dispatch.load_tables(table)
        (change,) = check_lock(lock).changes
        assert (change.row, change.origin) == ("torch", "chain")
        assert change.reason.startswith("row 'reference' cannot serve the call now: requires "
                                        "dtype == float64 (call has float32); the rms_norm "
                                        "table changed (revision ")
        assert "profiles" not in change.reason

    def test_fingerprint_mismatch_is_a_note(self, lock_path: Path) -> None:
        """A lock made on another machine says how it differs."""
        lock_path.write_text(lock_path.read_text().replace("cores: ", "cores: 1000"))
        report = check_lock(Lock.load(lock_path))
        assert report.ok
        assert any(n.startswith("the lock was made on another machine: cores: ")
                   for n in report.notes)


class TestLive:
    """``ASTR_LOCK``: each live decision is checked against the lock."""

    def test_warn_once_per_drift(self, lock_path: Path, tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch,
                                 caplog: pytest.LogCaptureFixture) -> None:
        """The default mode warns once and runs the live decision."""
        dispatch.load_tables(edited_attention(tmp_path, math_first))
        use_lock(monkeypatch, lock_path)
        with caplog.at_level(logging.WARNING, logger="astrai"):
            dispatch.stats(reset=True)
            for _ in range(3):
                workload_calls()
            dispatch.refresh()  # a new decision cache: the same drift is not said again
            workload_calls()
        drifts = [r.getMessage() for r in caplog.records if "drifted" in r.getMessage()]
        assert len(drifts) == 1
        assert drifts[0].startswith(f"attention decision drifted from the lock {lock_path}: "
                                    f"attention[dtype=float32 ndim=4 head_dim=8")
        assert "locked row 'torch_native', live row 'math': the attention table changed" \
            in drifts[0]
        assert dispatch.stats().served("attention", "math") == 4

    def test_strict_raises(self, lock_path: Path, tmp_path: Path,
                           monkeypatch: pytest.MonkeyPatch) -> None:
        """``strict``: a drift is ``LockDriftError`` naming family, call, rows, reason."""
        use_lock(monkeypatch, lock_path, "strict")
        workload_calls()  # nothing changed: nothing raised
        dispatch.load_tables(edited_attention(tmp_path, math_first))
        with pytest.raises(LockDriftError) as info:
            ops.attention(Q, Q, Q, is_causal=True)
        err = info.value
        assert (err.family, err.locked, err.live) == ("attention", "torch_native", "math")
        assert err.signature.startswith("attention[dtype=float32 ndim=4")
        assert err.reason.startswith("the attention table changed (revision ")
        with pytest.raises(LockDriftError):  # not cached: every such call raises
            ops.attention(Q, Q, Q, is_causal=True)
        ops.rms_norm(X, W)  # an unchanged decision still runs

    def test_strict_unrelated_edit_does_not_raise(self, lock_path: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
        """A comment in the table changes no decision, so ``strict`` lets calls run."""
        dispatch.load_tables(edited_attention(tmp_path, lambda t: t + "# a comment\n"))
        use_lock(monkeypatch, lock_path, "strict")
        workload_calls()

    def test_strict_new_signature(self, lock_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
        """A call the lock does not hold is drift in ``strict`` mode."""
        use_lock(monkeypatch, lock_path, "strict")
        with pytest.raises(LockDriftError, match="not in the lock, live row 'torch': a new "
                                                 "signature, not in the lock") as info:
            ops.rms_norm(torch.randn(3, 4, 8), W)
        assert info.value.locked is None

    def test_matching_is_by_decision_key(self, lock_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
        """A call of another length that the tables cannot tell from a locked one
        (no table compares lengths) is the locked call."""
        use_lock(monkeypatch, lock_path, "strict")
        ops.rms_norm(torch.randn(50, 8), W)
        ops.attention(torch.randn(1, 9, 2, 8), torch.randn(1, 9, 2, 8),
                      torch.randn(1, 9, 2, 8), is_causal=True)

    def test_pin_makes_the_locked_row_win(self, lock_path: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
        """``pin``: the locked row serves (origin ``lock``), and explain says so."""
        dispatch.load_tables(edited_attention(tmp_path, math_first))
        use_lock(monkeypatch, lock_path, "pin")
        dispatch.stats(reset=True)
        ops.attention(Q, Q, Q, is_causal=True)
        assert dispatch.stats().served("attention", "torch_native", "lock") == 1
        ctx = ops.context("attention", Q, Q, Q, is_causal=True)
        assert dispatch.resolve("attention", ctx).origin == "lock"
        text = dispatch.explain("attention", ctx)
        assert text.endswith("=> torch_native (origin=lock)")
        assert f"note: the lock {lock_path} pins torch_native" in text

    def test_pin_fails_when_the_locked_row_cannot_serve(self, lock_path: Path,
                                                        tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
        """``pin`` raises when the locked row cannot serve the call any more."""
        def float64_only(text: str) -> str:
            row = text.index("  - name: torch_native")
            start = text.index("    when: ", row)
            end = text.index("\n", start)
            return text[:start] + "    when: dtype == float64" + text[end:]

        dispatch.load_tables(edited_attention(tmp_path, float64_only))
        use_lock(monkeypatch, lock_path, "pin")
        with pytest.raises(LockDriftError, match="row 'torch_native' cannot serve the call "
                                                 "now: requires dtype == float64"):
            ops.attention(Q, Q, Q, is_causal=True)

    def test_fingerprint_mismatch_warns(self, lock_path: Path,
                                        monkeypatch: pytest.MonkeyPatch,
                                        caplog: pytest.LogCaptureFixture) -> None:
        """A lock made on another machine warns once when it comes into force."""
        lock_path.write_text(lock_path.read_text().replace("torch: ", "torch: 1.0-"))
        use_lock(monkeypatch, lock_path)
        with caplog.at_level(logging.WARNING, logger="astrai"):
            workload_calls()
            ops.rms_norm(torch.randn(2, 3, 8), W)
        machine = [r.getMessage() for r in caplog.records if "another machine" in
                   r.getMessage()]
        assert len(machine) == 1
        assert machine[0].startswith(f"ASTR_LOCK={lock_path} was made on another machine "
                                     f"(torch: '{torch.__version__}' here, '1.0-")

    def test_unreadable_lock(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """A lock that cannot be read fails every call in ``strict`` mode."""
        bad = tmp_path / "bad.lock"
        bad.write_text("kind: lock\n")
        use_lock(monkeypatch, bad, "strict")
        with pytest.raises(LockDriftError, match="the lock cannot be read"):
            ops.rms_norm(X, W)

    def test_agreement_compares_locks(self, lock_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
        """``check_agreement``'s fingerprint carries the lock's digest and mode, and
        ranks with different locks differ."""
        ctxs = [dispatch.CallContext("rms_norm", dtype=torch.float32, ndim=2)]
        without = fingerprint(ctxs)
        assert without.lock == ""
        use_lock(monkeypatch, lock_path, "strict")
        with_lock = fingerprint(ctxs)
        assert with_lock.lock == f"{Lock.load(lock_path).digest} (strict)"
        (diff,) = differences([without, with_lock], [0, 1])
        assert diff.kind == "lock"
        assert str(diff) == (f"decision lock (ASTR_LOCK digest and mode): rank 0 -> (none); "
                             f"rank 1 -> {with_lock.lock}")
        dispatch.check_agreement(ctxs)  # a world of one agrees with itself


class TestCommand:
    """``astrai-ops lock``."""

    def test_writes_the_lock(self, workload: Workload, tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
        """``lock WORKLOAD -o FILE`` writes the lock and a summary."""
        wl_path = workload.save(tmp_path / "wl.yaml")
        out = tmp_path / "out.lock"
        assert main(["lock", str(wl_path), "-o", str(out)]) == 0
        printed = capsys.readouterr().out.splitlines()
        lock = Lock.load(out)
        assert printed[-1] == f"wrote {out}: 2 decisions, digest {lock.digest}"
        assert printed[1].split() == ["attention", "torch_native", "chain", "1", "1"]
        assert lock.workload == str(wl_path)

    @pytest.mark.parametrize("argv", [["lock"], ["lock", "wl.yaml", "--check", "a.lock"]])
    def test_usage(self, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
        """A workload or ``--check``, exactly one of them."""
        assert main(argv) == 2
        assert capsys.readouterr().err.startswith("astrai-ops lock: error: give ")

    def test_bad_workload_is_a_problem(self, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
        """An unreadable workload is exit 1 with the located problem."""
        path = tmp_path / "wl.yaml"
        path.write_text(textwrap.dedent("""\
            version: 1
            kind: workload
            """))
        assert main(["lock", str(path)]) == 1
        assert f"{path}:1:1: missing required key 'recorded'" in capsys.readouterr().err


class TestPinSaysWhatItDoes:
    """``pin`` serving a row the tables would not pick says so, once; a mode typo fails
    closed."""

    def test_pinning_a_non_faithful_row_warns(self, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
        """A lock made under ``ASTR_OPS=profile=low-precision`` pins linear's bf16 row;
        replayed without the profile, the bf16 row serves - with a warning naming it, the
        row the tables pick, and that it changes numerics."""
        x, w = torch.randn(4, 64), torch.randn(32, 64)
        monkeypatch.setenv("ASTR_OPS", "profile=low-precision")
        dispatch.refresh()
        with record() as wl:
            ops.linear(x, w)
        lock = lock_workload(wl.workload())
        assert [d.row for d in lock.decisions] == ["bf16"]
        path = lock.save(tmp_path / "lowp.lock")
        monkeypatch.delenv("ASTR_OPS")
        use_lock(monkeypatch, path, "pin")
        dispatch.stats(reset=True)
        with caplog.at_level(logging.WARNING, logger="astrai"):
            ops.linear(x, w)
            ops.linear(x, w)
        assert dispatch.stats().served("linear", "bf16", "lock") == 2
        said = [r.getMessage() for r in caplog.records if "runs the locked row" in r.getMessage()]
        assert len(said) == 1
        assert "'bf16' where the tables now pick 'torch'" in said[0]
        assert "not faithful: it changes numerics" in said[0]

    def test_pinning_a_faithful_row_warns_without_the_numerics_note(
            self, lock_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
            caplog: pytest.LogCaptureFixture) -> None:
        dispatch.load_tables(edited_attention(tmp_path, math_first))
        use_lock(monkeypatch, lock_path, "pin")
        with caplog.at_level(logging.WARNING, logger="astrai"):
            ops.attention(Q, Q, Q, is_causal=True)
        said = [r.getMessage() for r in caplog.records if "runs the locked row" in r.getMessage()]
        assert len(said) == 1 and "'torch_native' where the tables now pick 'math'" in said[0]
        assert "not faithful" not in said[0]

    def test_a_mode_typo_fails_closed(self, lock_path: Path, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch,
                                      caplog: pytest.LogCaptureFixture) -> None:
        dispatch.load_tables(edited_attention(tmp_path, math_first))
        use_lock(monkeypatch, lock_path, "strcit")
        with caplog.at_level(logging.WARNING, logger="astrai"), pytest.raises(LockDriftError):
            ops.attention(Q, Q, Q, is_causal=True)
        assert any("'strcit' is not a lock mode" in r.getMessage() and "failing closed: strict"
                   in r.getMessage() for r in caplog.records)
