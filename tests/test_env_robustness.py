"""The environment cannot break dispatch, and a vanishing table directory cannot either
(contract §5, §7, §12).

Arbitrary bytes (not UTF-8, but without NUL, which the OS refuses) are put into
``ASTR_OPS``, the legacy alias ``ASTR_BACKEND`` and ``ASTR_TABLES`` through
``os.environb``. Resolution and the facades keep answering with a row of the family, and
every warning goes to the ``astrai`` logger once: no message twice, at most one per problem
the value contains (one per entry of ``ASTR_OPS``, one per profile name, one for the alias),
and none when the same value is read again. ``ASTR_TABLES`` is only read when tables load:
a value that names nothing is a ``TableError`` naming the path, and the tables in force stay.

Then a table directory that is removed, or whose file becomes a directory, a dangling
symlink or unreadable, between loads: ``reload_tables()`` / ``load_tables()`` raise a
``TableError`` naming the path and the previous tables stay in force. Unreadability needs a
user that file modes apply to: as root, those cases run with the process's effective user
switched to ``nobody`` for the load. ``TestRegressions`` pins the paths that made the
loader raise ``OSError`` or drop a family silently until fedf52a (an over-long name, a
parent that cannot be entered, an unreadable directory).
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from astrai import ops
from astrai.dispatch import (
    CallContext,
    TableError,
    current,
    load_tables,
    registry,
    reload_tables,
    resolve,
    shipped_tables_dir,
    state,
)
from astrai.errors import AstraiError

#: Every family astrai ships a table of (one file per family in tables/).
SHIPPED = tuple(sorted(p.stem for p in shipped_tables_dir().glob("*.yaml")))
EXAMPLES = 300
CALLS = {
    "attention": CallContext("attention", dtype=torch.float32, ndim=4, head_dim=8),
    "rotary": CallContext("rotary", dtype=torch.float32, ndim=4, head_dim=8),
    "rms_norm": CallContext("rms_norm", dtype=torch.float32, ndim=2),
    "linear": CallContext("linear", dtype=torch.float32, ndim=2),
}
VANISH = """\
version: 1
family: vanish
fallback: ref
rows:
  - name: first
    impl: tests._impls:fast
  - name: ref
    impl: tests._impls:ref
"""
NOBODY = 65534

needs_environb = pytest.mark.skipif(not os.supports_bytes_environ,
                                    reason="needs os.environb (POSIX)")
HYPOTHESIS = settings(
    max_examples=EXAMPLES, deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

#: Pieces that make a value hit the parser's interesting paths more often than random bytes.
PIECES = [
    b"attention", b"linear", b"rotary", b"rms_norm", b"toy", b"profile", b"reference",
    b"low-precision", b"math", b"flash", b"torch", b"bf16", b"fp8", b"complex",
    b"torch_native", b"=", b",", b"+", b" ", b"\t", b"\n", b"==", b"\xff", b"\xc3\xa9",
    b"\xed\xa0\x80", b"\x80", b"'", b"%s", b"{}", b":", b"/", b"..", b"\x1b[0m",
]  # fmt: skip
ENV_BYTES = st.one_of(
    st.binary(max_size=48),
    st.lists(st.sampled_from(PIECES), max_size=12).map(b"".join),
).map(lambda b: b.replace(b"\0", b""))


def no_escape(value: bytes) -> bytes:
    """``value`` as an ``ASTR_TABLES`` that stays inside the sandbox: no ``/``, so neither
    an absolute path nor more than one ``..``."""
    return value.replace(b"\0", b"").replace(b"/", b"_")


#: ``ASTR_TABLES`` values: anything, plus components longer than a file name may be.
TABLES_BYTES = st.one_of(
    ENV_BYTES,
    st.tuples(ENV_BYTES, st.binary(min_size=250, max_size=400)).map(b":".join),
).map(no_escape)


def astrai_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Messages logged as warnings on the ``astrai`` logger."""
    return [r.getMessage() for r in caplog.records
            if r.name == "astrai" and r.levelno == logging.WARNING]


def ops_bound(value: bytes) -> int:
    """The most warnings an ``ASTR_OPS`` value may cause: one per entry and profile name."""
    entries = [e for e in os.fsdecode(value).split(",") if e.strip()]
    return sum(1 + e.count("+") for e in entries)


def decisions() -> dict[str, tuple[str, str]]:
    """``(row, origin)`` per shipped family; each row belongs to its family's table."""
    state = current()
    out = {}
    for family, call in CALLS.items():
        res = resolve(family, call)
        assert res.record.family == family
        assert res.name in state.families[family].row_names()
        out[family] = (res.name, res.origin)
    return out


class Tensors:
    """Small CPU inputs for every facade."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(3, 8, generator=gen)
        self.w = torch.randn(5, 8, generator=gen)
        self.g = torch.ones(8)
        self.q = torch.randn(1, 4, 2, 8, generator=gen)
        self.freqs = torch.stack([torch.ones(1, 4, 4), torch.zeros(1, 4, 4)], dim=-1)

    def run(self) -> None:
        """Call every facade once; each returns a tensor of the right shape."""
        assert ops.linear(self.x, self.w).shape == (3, 5)
        assert ops.rms_norm(self.x, self.g).shape == (3, 8)
        assert ops.apply_rotary(self.q, self.freqs).shape == self.q.shape
        assert ops.attention(self.q, self.q, self.q, is_causal=True).shape == (1, 4, 16)


TENSORS = Tensors()


def fresh_process_memory(caplog: pytest.LogCaptureFixture) -> None:
    """Forget warnings already given and parsed values, as a new process would."""
    state.reset()
    caplog.clear()


@needs_environb
class TestArbitraryBytes:
    """Any byte string in the variables dispatch reads on every call."""

    @HYPOTHESIS
    @given(value=ENV_BYTES)
    def test_astr_ops(self, value: bytes, monkeypatch: pytest.MonkeyPatch,
                      caplog: pytest.LogCaptureFixture) -> None:
        """Any ``ASTR_OPS``: every family resolves to one of its rows and the facades run;
        each problem warns once, and reading the value again warns no more."""
        fresh_process_memory(caplog)
        monkeypatch.setitem(os.environb, b"ASTR_OPS", value)
        with caplog.at_level(logging.WARNING, logger="astrai"):
            first = decisions()
            TENSORS.run()
            assert decisions() == first
            given_once = astrai_warnings(caplog)
            caplog.clear()
            decisions()
            TENSORS.run()
            assert astrai_warnings(caplog) == []
        assert len(given_once) == len(set(given_once)), given_once
        assert len(given_once) <= ops_bound(value), given_once

    @HYPOTHESIS
    @given(value=ENV_BYTES)
    def test_legacy_alias(self, value: bytes, monkeypatch: pytest.MonkeyPatch,
                          caplog: pytest.LogCaptureFixture) -> None:
        """Any ``ASTR_BACKEND``: attention resolves to one of its rows, with at most one
        warning (naming the variable), given once."""
        assert current().families["attention"].env_alias == "ASTR_BACKEND"
        fresh_process_memory(caplog)
        monkeypatch.setitem(os.environb, b"ASTR_BACKEND", value)
        with caplog.at_level(logging.WARNING, logger="astrai"):
            first = decisions()
            TENSORS.run()
            assert decisions() == first
        given_once = astrai_warnings(caplog)
        assert len(given_once) <= 1, given_once
        assert all("ASTR_BACKEND" in w for w in given_once), given_once
        if first["attention"][1] == "env":
            assert first["attention"][0] == os.fsdecode(value).strip()

    @HYPOTHESIS
    @given(ops_value=ENV_BYTES, alias=ENV_BYTES, tables=ENV_BYTES)
    def test_all_three_at_once(self, ops_value: bytes, alias: bytes, tables: bytes,
                               monkeypatch: pytest.MonkeyPatch,
                               caplog: pytest.LogCaptureFixture) -> None:
        """All three variables set to anything at once: dispatch still answers; the
        warnings stay within the two per-variable bounds, each given once."""
        fresh_process_memory(caplog)
        monkeypatch.setitem(os.environb, b"ASTR_OPS", ops_value)
        monkeypatch.setitem(os.environb, b"ASTR_BACKEND", alias)
        monkeypatch.setitem(os.environb, b"ASTR_TABLES", no_escape(tables))
        with caplog.at_level(logging.WARNING, logger="astrai"):
            first = decisions()
            TENSORS.run()
            assert decisions() == first
        given_once = astrai_warnings(caplog)
        assert len(given_once) == len(set(given_once))
        assert len(given_once) <= ops_bound(ops_value) + 1

    @settings(HYPOTHESIS, max_examples=EXAMPLES // 3)
    @given(values=st.lists(ENV_BYTES, min_size=2, max_size=5))
    def test_changing_values(self, values: list[bytes], monkeypatch: pytest.MonkeyPatch,
                             caplog: pytest.LogCaptureFixture) -> None:
        """Switching between values, and back, never repeats a warning and each value's
        decisions are the same every time it returns."""
        fresh_process_memory(caplog)
        seen: dict[bytes, dict[str, tuple[str, str]]] = {}
        with caplog.at_level(logging.WARNING, logger="astrai"):
            for value in [*values, *reversed(values)]:
                monkeypatch.setitem(os.environb, b"ASTR_OPS", value)
                got = decisions()
                assert seen.setdefault(value, got) == got
        given_once = astrai_warnings(caplog)
        assert len(given_once) == len(set(given_once))
        assert len(given_once) <= sum(ops_bound(v) for v in set(values))


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working directory two levels inside ``tmp_path`` (``..`` is empty too)."""
    cwd = tmp_path / "a" / "b"
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    return cwd


@needs_environb
class TestArbitraryTablesPath:
    """``ASTR_TABLES`` is read only when tables load; any value fails cleanly there."""

    @HYPOTHESIS
    @given(value=TABLES_BYTES)
    def test_astr_tables(self, value: bytes, sandbox: Path, monkeypatch: pytest.MonkeyPatch,
                         caplog: pytest.LogCaptureFixture) -> None:
        """Any ``ASTR_TABLES`` (kept inside an empty sandbox): resolution ignores it, and
        ``reload_tables()`` loads or raises a TableError naming the path, changing nothing."""
        fresh_process_memory(caplog)
        before = current()
        want = decisions()
        monkeypatch.setitem(os.environb, b"ASTR_TABLES", value)
        with caplog.at_level(logging.WARNING, logger="astrai"):
            assert decisions() == want  # not read on the hot path
            try:
                names = reload_tables()
            except AstraiError as exc:
                assert isinstance(exc, TableError), repr(exc)
                components = [p for p in os.fsdecode(value).split(os.pathsep) if p.strip()]
                for problem in exc.problems:
                    assert problem.file in components, (problem, components)
                    assert (problem.line, problem.column) == (1, 1)
                    assert str(problem).startswith(f"{problem.file}:1:1: ")
                assert current() is before
            else:
                assert set(SHIPPED) <= set(names)
            assert decisions() == want
        assert astrai_warnings(caplog) == []


# -- a table directory that changes between loads ------------------------------------------


@pytest.fixture
def extra(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """``ASTR_TABLES`` naming a directory with the ``vanish`` family, loaded.

    The directory lies in a fresh, world-readable temporary directory (not under
    ``tmp_path``, whose parents only root may enter), so a child running as ``nobody``
    reaches it.
    """
    base = Path(tempfile.mkdtemp(prefix="astrai-env-"))
    base.chmod(0o755)
    root = base / "extra"
    root.mkdir()
    (root / "vanish.yaml").write_text(VANISH)
    monkeypatch.setenv("ASTR_TABLES", str(root))
    assert "vanish" in reload_tables()
    assert resolve("vanish", CallContext("vanish")).name == "first"
    try:
        yield root
    finally:
        _unlock(base)
        shutil.rmtree(base)


def _unlock(path: Path) -> None:
    """Give back the modes a test took away (directories first, so they can be listed)."""
    if path.is_symlink():
        return
    if path.is_dir():
        path.chmod(0o755)
        for child in path.iterdir():
            _unlock(child)
    else:
        path.chmod(0o644)


def outcome(action: Callable[[], Any]) -> dict[str, Any]:
    """Run ``action`` (a load) and describe what happened, as plain data."""
    before = current()
    try:
        return {"loaded": action()}
    except Exception as exc:
        problems = ([[p.file, p.line, p.column, p.message] for p in exc.problems]
                    if isinstance(exc, TableError) else [])
        return {
            "raised": type(exc).__name__,
            "astrai": isinstance(exc, AstraiError),
            "message": str(exc),
            "problems": problems,
            "kept": current() is before,
            "row": resolve("vanish", CallContext("vanish")).name,
        }


def _reachable_by_others(path: Path) -> bool:
    """Whether a user other than the owner may enter every directory down to ``path``."""
    return all(p.stat().st_mode & stat.S_IXOTH for p in [path, *path.parents])


def as_unprivileged(action: Callable[[], Any]) -> dict[str, Any]:
    """``outcome(action)`` as a user that file modes apply to.

    Not root: here. Root: here too, with the effective user and group switched to
    ``nobody`` (no supplementary groups) for the action and back after it; the
    capabilities that let root ignore file modes leave with the effective user, and
    return with it. No child process: a fork of this process (large, with torch's
    threads) would depend on the memory and locks of the moment. The reload reads the
    shipped tables too, and the checkout may lie where only root may enter (CI clones
    into a fresh ``mktemp -d``, mode 700): so ``nobody`` reads a world-readable copy of
    them, as from an installed wheel (``shipped_tables_dir`` is pointed there for the
    action only). What the process has already imported it keeps.
    """
    if os.geteuid() != 0:
        return outcome(action)
    if not hasattr(os, "seteuid"):
        pytest.skip("running as root without os.seteuid: cannot drop privileges")
    base = Path(tempfile.mkdtemp(prefix="astrai-shipped-"))
    try:
        tables = base / "tables"
        shutil.copytree(shipped_tables_dir(), tables)
        _unlock(base)
        if not _reachable_by_others(tables):
            pytest.skip(f"{base.parent} cannot be entered by others: 'nobody' could not "
                        "read the tables")
        return _as_nobody(action, tables)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _as_nobody(action: Callable[[], Any], tables: Path) -> dict[str, Any]:
    """``outcome(action)`` with this process's effective ids ``nobody``'s and the shipped
    tables read from ``tables``; root's ids and groups restored whatever happens."""
    groups = os.getgroups()
    shipped = registry.shipped_tables_dir
    registry.shipped_tables_dir = lambda: tables
    try:
        os.setgroups([])
        os.setegid(NOBODY)
        try:
            os.seteuid(NOBODY)
        except OSError as exc:
            pytest.skip(f"cannot switch to nobody: {exc}")
        try:
            assert os.geteuid() == NOBODY
            return outcome(action)
        finally:
            os.seteuid(0)
    finally:
        os.setegid(0)
        os.setgroups(groups)
        registry.shipped_tables_dir = shipped


def assert_refused_naming(report: dict[str, Any], path: Path, words: str) -> None:
    """The load raised a TableError naming ``path`` and the old tables stayed in force."""
    assert report.get("raised") == "TableError", report
    assert [p[0] for p in report["problems"]] == [str(path)], report
    assert words in report["problems"][0][3], report
    assert report["kept"] and report["row"] == "first", report


class TestVanishingTables:
    """A table directory or file that disappears or becomes unreadable between loads."""

    def test_directory_removed(self, extra: Path) -> None:
        """``rmtree`` of the directory: reload_tables names it; the old tables stay."""
        shutil.rmtree(extra)
        assert_refused_naming(outcome(reload_tables), extra, "no such file or directory")
        assert_refused_naming(outcome(lambda: load_tables(extra)), extra,
                              "no such file or directory")

    def test_file_removed(self, extra: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """``ASTR_TABLES`` naming a file that is then deleted: the file is named."""
        path = extra / "vanish.yaml"
        monkeypatch.setenv("ASTR_TABLES", str(path))
        assert "vanish" in reload_tables()
        path.unlink()
        assert_refused_naming(outcome(reload_tables), path, "no such file or directory")

    def test_file_deleted_from_directory(self, extra: Path) -> None:
        """A file deleted from a listed directory is an edit, not an error: the directory's
        files are the set, so the reload succeeds without that family."""
        (extra / "vanish.yaml").unlink()
        report = outcome(reload_tables)
        assert report == {"loaded": sorted(SHIPPED)}, report

    @pytest.mark.parametrize("listed", ["directory", "file"])
    def test_file_becomes_directory(self, extra: Path, monkeypatch: pytest.MonkeyPatch,
                                    listed: str) -> None:
        """A table file replaced by a directory of the same name. Found in a listed directory:
        a TableError naming it, the old tables kept (not a silently dropped family). Listed
        itself in ``ASTR_TABLES``: it is now a directory (of no tables), so either that error
        or a reload without the family; nothing else."""
        path = extra / "vanish.yaml"
        if listed == "file":
            monkeypatch.setenv("ASTR_TABLES", str(path))
            assert "vanish" in reload_tables()
        path.unlink()
        path.mkdir()
        report = outcome(reload_tables)
        if listed == "file" and "raised" not in report:
            assert report == {"loaded": sorted(SHIPPED)}, report
        else:
            assert_refused_naming(report, path, "not a regular file (a directory)")

    def test_file_becomes_dangling_symlink(self, extra: Path) -> None:
        """A table file replaced by a symlink to nothing: named, not skipped."""
        path = extra / "vanish.yaml"
        path.unlink()
        path.symlink_to(extra / "gone.yaml")
        assert_refused_naming(outcome(reload_tables), path, "cannot read file")

    def test_directory_becomes_file(self, extra: Path) -> None:
        """The directory replaced by a file of garbage: named."""
        shutil.rmtree(extra)
        extra.write_bytes(b"\xff\xfe not yaml at all")
        assert_refused_naming(outcome(reload_tables), extra, "not UTF-8")

    def test_unreadable_file(self, extra: Path) -> None:
        """A table file with mode 000: the reader that cannot read it gets the file named
        (as root, checked as ``nobody``)."""
        path = extra / "vanish.yaml"
        path.chmod(0)
        assert_refused_naming(as_unprivileged(reload_tables), path, "Permission denied")

    def test_old_tables_answer_after_failures(self, extra: Path) -> None:
        """After several failed reloads the snapshot, its epoch and decisions are unchanged."""
        before = current()
        want = decisions()
        shutil.rmtree(extra)
        for _ in range(3):
            with pytest.raises(TableError):
                reload_tables()
            with pytest.raises(TableError):
                load_tables(extra)
        assert current() is before
        assert current().epoch == before.epoch
        assert resolve("vanish", CallContext("vanish")).name == "first"
        assert decisions() == want


class TestRegressions:
    """Paths that made ``reload_tables`` / ``load_tables`` raise an ``OSError`` or silently
    drop families before fedf52a (found by this module)."""

    def test_overlong_component_in_astr_tables(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A 300-byte path component is a TableError naming it (it escaped as OSError
        ENAMETOOLONG); the tables stay."""
        before = current()
        monkeypatch.setenv("ASTR_TABLES", "x" * 300)
        with pytest.raises(TableError) as err:
            reload_tables()
        assert [(p.file, p.line, p.column) for p in err.value.problems] == [("x" * 300, 1, 1)]
        assert "too long" in err.value.problems[0].message
        assert current() is before

    def test_overlong_path_given_to_load_tables(self, tmp_path: Path) -> None:
        """``load_tables`` of a 300-byte name is a TableError naming it (it escaped as
        OSError), and so is a path whose whole length passes PATH_MAX."""
        before = current()
        for path in ["y" * 300, str(tmp_path / "/".join(["z" * 200] * 25))]:
            with pytest.raises(TableError) as err:
                load_tables(path)
            assert [p.file for p in err.value.problems] == [path]
        assert current() is before

    def test_untraversable_parent(self, extra: Path) -> None:
        """A table directory whose parent cannot be entered is a TableError naming it (it
        escaped as PermissionError; as root, checked as ``nobody``)."""
        extra.parent.chmod(0)
        assert_refused_naming(as_unprivileged(reload_tables), extra, "Permission denied")

    def test_unreadable_directory(self, extra: Path) -> None:
        """A table directory with mode 000 is a TableError naming it, not an empty directory
        whose families silently disappear (as root, checked as ``nobody``)."""
        extra.chmod(0)
        assert_refused_naming(as_unprivileged(reload_tables), extra, "Permission denied")

    def test_unreadable_subdirectory(self, extra: Path) -> None:
        """An unreadable directory below a table directory is named too."""
        sub = extra / "more"
        sub.mkdir()
        (sub / "other.yaml").write_text(VANISH.replace("vanish", "other"))
        sub.chmod(0)
        assert_refused_naming(as_unprivileged(reload_tables), sub, "Permission denied")
