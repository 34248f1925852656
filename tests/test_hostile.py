"""Hostile and unlucky inputs: nothing in a table or a call ends the process or
corrupts state."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from astrai.dispatch import (
    CallContext,
    TableError,
    explain,
    list_families,
    load_tables,
    refresh,
    register_env_alias,
    reload_tables,
    resolve,
)
from astrai.dispatch.registry import validate
from astrai.kv_cache import KVPool

Write = Callable[[str, str], Path]

PROBES = '''\
import sys
import torch


def exits():
    raise SystemExit(0)


def two_element_tensor():
    return torch.tensor([True, False])


def one():
    return 1
'''

EXITS_AT_IMPORT = "import sys\nsys.exit(3)\n"


@pytest.fixture
def hostile_pkg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A package of probes and modules that misbehave, on ``sys.path``."""
    pkg = tmp_path / "site" / "astrai_hostile"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "probes.py").write_text(PROBES)
    (pkg / "exits.py").write_text(EXITS_AT_IMPORT)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for name in [m for m in sys.modules if m.split(".")[0] == pkg.name]:
        monkeypatch.delitem(sys.modules, name)  # imported from an earlier test's directory
    return pkg.name


class TestProbes:
    """A probe that fails in any way, or answers anything but True/False/Unavailable,
    makes its row unavailable with the reason; the process goes on."""

    @pytest.mark.parametrize(("probe", "reason"), [
        ("{pkg}.probes:exits", "probe raised SystemExit: 0"),
        ("sys:exit", "probe raised SystemExit"),
        ("{pkg}.probes:two_element_tensor",
         "two_element_tensor() returned a Tensor, not True, False or "
         "astrai.dispatch.Unavailable(reason)"),
        ("{pkg}.probes:one", "one() returned a int, not True, False or "
                             "astrai.dispatch.Unavailable(reason)"),
    ])
    def test_bad_probe_is_unavailable(self, hostile_pkg: str, write_yaml: Write, probe: str,
                                      reason: str) -> None:
        """The row is skipped with the reason, and the fallback serves."""
        load_tables(write_yaml("h.yaml", f"""\
            version: 1
            family: hostile
            fallback: ref
            rows:
              - name: risky
                impl: tests._impls:fast
                available: {probe.format(pkg=hostile_pkg)}
              - name: ref
                impl: tests._impls:ref
            """))
        assert resolve("hostile", CallContext("hostile")).name == "ref"
        assert explain("hostile", CallContext("hostile")).splitlines()[1] == (
            f"  risky: SKIP unavailable ({reason})")


class TestImports:
    """An impl module that exits at import is a located load error, not an exit."""

    def test_error_module_exits_at_import(self, hostile_pkg: str, write_yaml: Write) -> None:
        path = write_yaml("h.yaml", f"""\
            version: 1
            family: hostile
            fallback: ref
            rows:
              - name: ref
                impl: {hostile_pkg}.exits:f
            """)
        with pytest.raises(TableError) as err:
            load_tables(path)
        assert [str(p) for p in err.value.problems] == [
            f"{path}:6:11: importing '{hostile_pkg}.exits' failed: SystemExit: 3"]


class TestKVPool:
    """The KV pool stores floating K/V only."""

    @pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.int8])
    def test_error_non_floating_dtype(self, dtype: torch.dtype) -> None:
        with pytest.raises(ValueError, match="dtype must be a floating dtype"):
            KVPool(layers=1, slots=8, kv_heads=1, head_dim=4, max_requests=2, max_context=4,
                   dtype=dtype)


class TestDegenerateCalls:
    """0-dim tensors are clear errors; no keys at all gives the same result on every row."""

    def test_error_zero_dim(self) -> None:
        from astrai import ops

        one = torch.tensor(1.0)
        with pytest.raises(ValueError, match=r"expects q as \[batch, seq, heads, head_dim\]"):
            ops.attention(one, one, one)
        with pytest.raises(ValueError, match="rotary expects x as"):
            ops.apply_rotary(one, one)

    def test_no_keys_same_on_every_row(self) -> None:
        from astrai import ops

        q, k = torch.randn(1, 3, 2, 8), torch.randn(1, 0, 2, 8)
        for backend in ("torch_native", "math"):
            out = ops.attention(q, k, k, backend=backend)
            assert out.shape == (1, 3, 16)
            assert not out.any(), backend


GATE = '''\
import threading

STARTED = threading.Event()
RELEASE = threading.Event()
'''

SLOW_IMPORT = '''\
from astrai_hostile import gate

gate.STARTED.set()
gate.RELEASE.wait(30)


def f(x):
    return x
'''

INTERRUPTS_AT_IMPORT = "raise KeyboardInterrupt\n"


def _finishes(fn: Callable[[], object], seconds: float = 20.0) -> object:
    """``fn()``'s result, run in a thread that must finish within ``seconds``."""
    import threading

    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed back to the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn} still blocked after {seconds} s"
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box.get("value")


def _table(name: str, impl: str = "tests._impls:ref") -> str:
    return f"version: 1\nfamily: {name}\nfallback: ref\nrows:\n  - name: ref\n    impl: {impl}\n"


class TestTableFiles:
    """Only regular files of bounded size are tables, and no lock is held while reading."""

    def test_error_fifo_in_tables_directory(self, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
        """A FIFO named like a table is a TableError naming it, at once (it used to block
        the first call forever)."""
        import os

        fifo = tmp_path / "pipe.yaml"
        os.mkfifo(fifo)
        monkeypatch.setenv("ASTR_TABLES", str(tmp_path))
        with pytest.raises(TableError) as err:
            _finishes(reload_tables, 10)
        assert [str(p) for p in err.value.problems] == [
            f"{fifo}:1:1: not a regular file (a FIFO (named pipe)): only regular files are "
            f"tables"]

    def test_error_symlink_to_dev_zero(self, tmp_path: Path) -> None:
        """``/dev/zero`` is refused as a device, not read until memory runs out."""
        link = tmp_path / "zero.yaml"
        link.symlink_to("/dev/zero")
        problems = [str(p) for p in validate(link)]
        assert problems == [f"{link}:1:1: not a regular file (a character device): only "
                            f"regular files are tables"]

    def test_error_oversized_file(self, tmp_path: Path) -> None:
        """A file above the cap is refused with the cap in the message; nothing loads."""
        from astrai.dispatch.tables.load import MAX_TABLE_BYTES

        big = tmp_path / "big.yaml"
        big.write_text(_table("big") + "#" * MAX_TABLE_BYTES)
        with pytest.raises(TableError, match=f"larger than {MAX_TABLE_BYTES} bytes"):
            load_tables(big)
        assert "big" not in list_families()
        just = tmp_path / "just.yaml"
        text = _table("just")
        just.write_text(text + "#" * (MAX_TABLE_BYTES - len(text) - 1) + "\n")
        assert load_tables(just) == ["just"]

    def test_error_empty_path_is_not_cwd(self, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
        """``validate("")`` names the empty path; it does not walk the current directory."""
        (tmp_path / "broken.yaml").write_text("version: 1\nfamily: [\n")
        monkeypatch.chdir(tmp_path)
        assert [str(p) for p in validate("")] == [
            "'':1:1: an empty path names no table file or directory"]
        with pytest.raises(TableError, match="an empty path"):
            load_tables("")

    def test_no_lock_held_while_reading(self, hostile_pkg: str, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
        """While one thread's load is stuck importing a module, other threads refresh, load
        tables and register aliases; when it finishes, its family and theirs are all in."""
        import threading

        site = tmp_path / "site" / hostile_pkg
        (site / "gate.py").write_text(GATE)
        (site / "slow.py").write_text(SLOW_IMPORT)
        for mod in ("gate", "slow"):
            monkeypatch.delitem(sys.modules, f"{hostile_pkg}.{mod}", raising=False)
        import importlib

        importlib.invalidate_caches()
        gate = importlib.import_module(f"{hostile_pkg}.gate")
        slow_table = tmp_path / "slow.yaml"
        slow_table.write_text(_table("slowfam", f"{hostile_pkg}.slow:f"))
        quick_table = tmp_path / "quick.yaml"
        quick_table.write_text(_table("quickfam"))
        loader = threading.Thread(target=load_tables, args=(slow_table,), daemon=True)
        loader.start()
        try:
            assert gate.STARTED.wait(10)
            _finishes(refresh, 10)
            assert _finishes(lambda: load_tables(quick_table), 10) == ["quickfam"]
            _finishes(lambda: register_env_alias("quickfam", "ASTR_QUICK"), 10)
        finally:
            gate.RELEASE.set()
            loader.join(30)
        assert not loader.is_alive()
        assert {"slowfam", "quickfam"} <= set(list_families())
        assert resolve("slowfam", CallContext("slowfam")).name == "ref"
        monkeypatch.setenv("ASTR_QUICK", "ref")
        assert resolve("quickfam", CallContext("quickfam")).name == "ref"


class TestImportInterrupt:
    """A module that raises KeyboardInterrupt at import is a located load error."""

    def test_error_keyboard_interrupt_at_import(self, hostile_pkg: str, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
        (tmp_path / "site" / hostile_pkg / "interrupts.py").write_text(INTERRUPTS_AT_IMPORT)
        monkeypatch.delitem(sys.modules, f"{hostile_pkg}.interrupts", raising=False)
        import importlib

        importlib.invalidate_caches()
        path = tmp_path / "h.yaml"
        path.write_text(_table("hostile", f"{hostile_pkg}.interrupts:f"))
        problems = [str(p) for p in validate(path)]
        assert problems == [f"{path}:6:11: importing '{hostile_pkg}.interrupts' failed: "
                            f"KeyboardInterrupt"]


class TestProbeOnce:
    """A probe runs once, however many threads make the first call at the same time."""

    def test_probe_once_under_concurrent_first_calls(self, write_yaml: Write) -> None:
        import threading

        from tests import _impls

        load_tables(write_yaml("p.yaml", """\
            version: 1
            family: probed
            fallback: ref
            rows:
              - name: fast
                impl: tests._impls:fast
                available: tests._impls:slow_probe
              - name: ref
                impl: tests._impls:ref
            """))
        refresh()
        _impls.PROBE.update(available=True, calls=0)
        start = threading.Barrier(8)
        names: list[str] = []

        def call() -> None:
            start.wait(10)
            names.append(resolve("probed", CallContext("probed")).name)

        threads = [threading.Thread(target=call) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert names == ["fast"] * 8
        assert _impls.PROBE["calls"] == 1


class TestScopesInGenerators:
    """A scope that ends where it is not the innermost one raises ScopeError, and a scope
    that has ended never comes back."""

    @staticmethod
    def _gen(backend: str) -> Iterator[int]:
        from astrai.dispatch import op_backend

        with op_backend(attention=backend):
            yield 1

    def test_error_generators_closed_out_of_order(self) -> None:
        from astrai.dispatch import ScopeError, current_overrides

        first, second = self._gen("math"), self._gen("torch_native")
        next(first)
        next(second)
        assert current_overrides() == {"attention": "torch_native"}
        with pytest.raises(ScopeError, match=r"op_backend\(attention=math\) ended where it is "
                                             r"not the innermost scope \(that is "
                                             r"op_backend\(attention=torch_native\)\)"):
            first.close()
        second.close()
        assert dict(current_overrides()) == {}  # the finished math scope did not come back

    def test_error_generator_closed_in_another_thread(self) -> None:
        import threading

        from astrai.dispatch import ScopeError, current_overrides

        gen = self._gen("math")
        next(gen)
        errors: list[BaseException] = []

        def close() -> None:
            try:
                gen.close()
            except BaseException as exc:  # inspected below
                errors.append(exc)

        thread = threading.Thread(target=close)
        thread.start()
        thread.join(10)
        assert len(errors) == 1 and isinstance(errors[0], ScopeError), errors
        assert "in the thread or task that began them" in str(errors[0])
        # The caveat, documented: this thread still has the generator's scope in force.
        assert current_overrides() == {"attention": "math"}

    def test_error_reset_override_token_twice(self) -> None:
        from astrai.dispatch import ScopeError, current_overrides, reset_override, set_override

        token = set_override("attention", "math")
        reset_override(token)
        with pytest.raises(ScopeError, match="already used"):
            reset_override(token)
        assert dict(current_overrides()) == {}

    def test_nested_scopes_in_order_unchanged(self) -> None:
        from astrai.dispatch import current_overrides, op_backend, use_profile

        with op_backend(attention="math"):
            with use_profile("reference"), op_backend(rotary="torch"):
                assert dict(current_overrides()) == {"attention": "math", "rotary": "torch"}
            assert dict(current_overrides()) == {"attention": "math"}
        assert dict(current_overrides()) == {}


class TestHugeExpressions:
    """An error in a huge expression echoes a window of it, not all of it."""

    @pytest.mark.parametrize("when", [
        "ndim == 3 and " + "x" * 1_000_000,              # a 1 MB unknown name
        "ndim == 3 and " + "(" * 500_000 + "ndim == 3",  # unclosed, the span reaches back
        "ndim == 3 " + " " * 1_000_000 + "and and",       # the error at the far end
    ])
    def test_error_message_is_capped(self, write_yaml: Write, when: str) -> None:
        from astrai.dispatch import parse_spec
        from astrai.errors import SpecSyntaxError

        with pytest.raises(SpecSyntaxError) as err:
            parse_spec(when)
        text = str(err.value)
        assert len(text) < 1200, len(text)
        _, shown, marker = text.split("\n")
        assert "^" in marker
        # The caret sits under the character the span starts at.
        start = err.value.span[0]
        at = marker.index("^")
        if shown.strip().startswith("..."):
            assert shown[at] == when[start] or when[start].isspace()
        path = write_yaml("huge.yaml", f"""\
            version: 1
            family: huge
            fallback: ref
            rows:
              - name: ref
                impl: tests._impls:ref
                when: "{when}"
            """)
        problems = validate(path)
        assert len(problems) == 1
        assert len(str(problems[0])) < 1500, len(str(problems[0]))


class TestFamilyNames:
    """register_family validates names like the YAML loader; 'profile' is reserved in both."""

    @pytest.mark.parametrize("name", ["", "*", "a,b=c", "has space", "1st", "a\n", 3])
    def test_error_register_family_bad_name(self, name: object) -> None:
        from astrai.dispatch import register_family

        with pytest.raises(ValueError, match=r"is not a family name: a letter or '_' first"):
            register_family(name, [], "ref")  # type: ignore[arg-type]
        assert "" not in list_families() and "*" not in list_families()

    def test_error_family_named_profile(self, write_yaml: Write) -> None:
        from astrai.dispatch import register_family

        with pytest.raises(ValueError, match="'profile' cannot name a family: ASTR_OPS reads"):
            register_family("profile", [], "ref")
        path = write_yaml("p.yaml", _table("profile"))
        assert [str(p) for p in validate(path)] == [
            f"{path}:2:9: family: 'profile' cannot name a family: ASTR_OPS reads "
            f"'profile=...' as the profiles to apply, so such a family could never be "
            f"selected there"]


class TestProfilesSayWhatHappened:
    """explain says when a force beats a disable, and when a '*' force does not apply."""

    @pytest.fixture
    def profiles(self, tmp_path: Path) -> None:
        (tmp_path / "off.yaml").write_text(
            "version: 1\nprofile: off-torch\nfamilies:\n  rms_norm:\n    disable: [torch]\n")
        (tmp_path / "on.yaml").write_text(
            "version: 1\nprofile: force-torch\nfamilies:\n  rms_norm:\n    force: torch\n")
        (tmp_path / "all.yaml").write_text(
            "version: 1\nprofile: all-flash\nfamilies:\n  '*':\n    force: flash\n")
        load_tables(tmp_path)

    @staticmethod
    def _ctx() -> CallContext:
        return CallContext("rms_norm", dtype=torch.float32, ndim=3)

    @pytest.mark.parametrize("order", [("off-torch", "force-torch"), ("force-torch", "off-torch")])
    def test_force_beats_disable_is_explained(self, profiles: None,
                                              order: tuple[str, str]) -> None:
        from astrai.dispatch import use_profile

        with use_profile(*order):
            assert resolve("rms_norm", self._ctx()).name == "torch"
            lines = explain("rms_norm", self._ctx()).splitlines()
        assert ("  torch: SKIP disabled by profile off-torch in the chain, but forced by "
                "profile force-torch") in lines
        assert ("  note: profile force-torch forces torch, which profile off-torch disables: "
                "a force beats a disable") in lines
        assert lines[-1] == "=> torch (origin=profile)"

    def test_star_force_that_does_not_apply_is_explained(self, profiles: None) -> None:
        from astrai.dispatch import use_profile

        with use_profile("all-flash"):
            assert resolve("rms_norm", self._ctx()).name == "torch"
            lines = explain("rms_norm", self._ctx()).splitlines()
            attention = explain("attention", CallContext(
                "attention", fwd="none", dtype=torch.float32, ndim=4, head_dim=8)).splitlines()
        assert ("  note: profile all-flash: '*' force: flash does not apply to rms_norm, which "
                "has no row 'flash'") in lines
        assert not any("does not apply" in line for line in attention)


def test_error_cli_validate_empty_path(tmp_path: Path) -> None:
    """``astrai-ops validate ""`` reports the empty path and does not walk the current
    directory (which here holds a broken table that must not be mentioned)."""
    import subprocess

    (tmp_path / "broken.yaml").write_text("version: 1\nfamily: [\n")
    done = subprocess.run([sys.executable, "-m", "astrai", "validate", ""], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done
    assert "an empty path names no table file or directory" in done.stderr
    assert "broken.yaml" not in done.stderr + done.stdout


def _bomb(levels: int = 7) -> str:
    """Aliases that expand tenfold per level: a few hundred bytes, 10**levels values."""
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]")
    return "\n".join(lines) + "\n"


class TestAliasBombs:
    """Alias expansion is bounded before anything is converted, in every file astrai
    reads: the refusal names the alias, and memory and time stay those of the text."""

    def test_a_workload(self, tmp_path: Path) -> None:
        from astrai.errors import FileFormatError
        from astrai.record.workload import Workload

        path = tmp_path / "bomb.yaml"
        path.write_text('version: 1\nkind: workload\nrecorded: "x"\n' + _bomb() + "calls: []\n")
        assert len(path.read_bytes()) < 600
        with pytest.raises(FileFormatError, match="an alias bomb"):
            Workload.load(path)

    def test_a_lock_in_force(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             caplog: pytest.LogCaptureFixture) -> None:
        import logging

        import astrai.dispatch as dispatch
        from astrai import ops

        path = tmp_path / "bomb.lock"
        path.write_text('version: 1\nkind: lock\n' + _bomb())
        monkeypatch.setenv("ASTR_LOCK", str(path))
        dispatch.refresh()
        with caplog.at_level(logging.WARNING, logger="astrai"):
            ops.rms_norm(torch.randn(2, 8), torch.ones(8))
        assert any("an alias bomb" in r.getMessage() for r in caplog.records)

    def test_a_table(self, tmp_path: Path) -> None:
        path = tmp_path / "bomb.yaml"
        path.write_text("version: 1\nfamily: bombed\nfallback: ref\n" + _bomb(6)
                        + "rows:\n  - name: ref\n    impl: tests._impls:ref\n")
        problems = validate(path)  # a table's own bound (100 000 values) is met first
        assert any("after expanding aliases" in p.message for p in problems)
