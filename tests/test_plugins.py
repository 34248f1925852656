"""Kernel packages that extend astrai by being installed: ``astrai.tables``
entry points, row overlays (``extends:``), ``ASTR_PLUGINS``, a broken plugin reported
with its distribution and left out, and who provided each row in explain, list,
fingerprints and lockfiles.

Most tests install a small distribution by writing its ``.dist-info`` (metadata and
entry points) next to its package in a folder put on ``sys.path``: exactly what
``importlib.metadata`` reads for an installed distribution. ``TestExamplePackage``
builds and pip-installs the real example package under ``tests/plugin_example``.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import astrai.dispatch as d
import astrai.ops as ops
from astrai.cli import main
from astrai.dispatch import registry
from astrai.dispatch.explain import explanation
from astrai.dispatch.expr.spec import Spec
from astrai.dispatch.plugins import BROKEN, DISABLED, LOADED, Plugin
from astrai.dispatch.tables import artifact, load
from astrai.dispatch.tables.model import table_revision
from astrai.distributed import comparison, fingerprint
from astrai.errors import TableError

F32, BF16 = torch.float32, torch.bfloat16
REPO = Path(__file__).resolve().parents[1]
EXAMPLE = Path(__file__).resolve().parent / "plugin_example"

ROW = """\
  - name: {name}
    impl: astrai.backends.rms_norm:reference_rms_norm
    when: {when}
"""

Install = Callable[..., Plugin | None]
#: An rms_norm table of one row (``ref``), to replace the shipped one with.
ONE_ROW_RMS_NORM = """\
version: 1
family: rms_norm
fallback: ref
rows:
  - name: ref
    impl: astrai.backends.rms_norm:reference_rms_norm
"""


@pytest.fixture
def install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Install]:
    """``install(dist, files, version=..., entry=..., modules=...)``: make a distribution
    with an ``astrai.tables`` entry point whose package holds ``files`` (name -> YAML
    text), put it on ``sys.path`` and reload the tables; returns that plugin's state."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    packages: list[str] = []

    def make(dist: str, files: dict[str, str], *, version: str = "1.0",
             entry: str | None = None, modules: dict[str, str] | None = None,
             value: str | None = None, reload: bool = True, init: str = "",
             metadata: str | None = None) -> Plugin | None:
        pkg = dist.replace("-", "_")
        (site / pkg / "tables").mkdir(parents=True)
        (site / pkg / "__init__.py").write_text(init)
        (site / pkg / "tables" / "__init__.py").write_text("")
        for name, text in files.items():
            path = site / pkg / "tables" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(text))
        for name, text in (modules or {}).items():
            (site / pkg / f"{name}.py").write_text(textwrap.dedent(text))
        info = site / f"{pkg}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(metadata if metadata is not None else
                                       f"Metadata-Version: 2.1\nName: {dist}\n"
                                       f"Version: {version}\n")
        (info / "entry_points.txt").write_text(
            f"[astrai.tables]\n{entry or pkg} = {value or pkg + '.tables'}\n")
        packages.append(pkg)
        importlib.invalidate_caches()
        if not reload:
            return None
        d.reload_tables()
        return next(p for p in d.current().plugins if p.distribution == dist)

    yield make
    for pkg in packages:
        for mod in [m for m in sys.modules if m == pkg or m.startswith(pkg + ".")]:
            del sys.modules[mod]


def overlay(*rows: str, extends: str = "rms_norm") -> str:
    return f"version: 1\nextends: {extends}\nrows:\n" + "".join(rows)


def row(name: str, when: str = "dtype == bfloat16", **extra: str) -> str:
    return ROW.format(name=name, when=when) + "".join(f"    {k}: {v}\n"
                                                      for k, v in extra.items())


def rows() -> list[str]:
    return d.current().family("rms_norm").row_names()


def served(dtype: torch.dtype = torch.bfloat16, tokens: int = 4) -> str:
    x = torch.randn(tokens, 8, dtype=dtype)
    return d.resolve("rms_norm", ops.context("rms_norm", x, torch.ones(8, dtype=dtype))).name


class TestRowOverlays:
    def test_joins_before_the_first_faithful_row_in_file_order(self, install: Install) -> None:
        plugin = install("fastnorm", {"rms.yaml": overlay(row("one"), row("two"))})
        assert plugin is not None and plugin.status == LOADED
        assert rows() == ["one", "two", "native", "inductor_large", "torch", "inductor",
                          "reference"]
        assert served() == "one" and served(torch.float32) == "torch"
        rec = d.current().family("rms_norm").row("one")
        assert rec is not None and rec.provided_by == "plugin fastnorm 1.0"
        assert rec.source.endswith("fastnorm/tables/rms.yaml:4")

    def test_before_and_after_a_named_row(self, install: Install) -> None:
        install("fastnorm", {"rms.yaml": overlay(
            row("a1", after="torch"), row("a2", after="torch"), row("b", before="reference"))})
        assert rows() == ["native", "inductor_large", "torch", "a1", "a2", "inductor", "b",
                          "reference"]

    def test_an_anchor_may_name_an_earlier_row_of_the_file(self, install: Install) -> None:
        install("fastnorm", {"rms.yaml": overlay(row("x", after="torch"),
                                                 row("y", before="x"))})
        assert rows()[2:5] == ["torch", "y", "x"]

    def test_when_decides_where_it_wins(self, install: Install) -> None:
        install("fastnorm", {"rms.yaml": overlay(
            row("big_bf16", when="dtype == bfloat16 and tokens >= 64", before="torch"))})
        assert served(tokens=4) == "torch"
        assert served(tokens=100) == "big_bf16"
        assert served(tokens=5000) == "inductor_large"  # the shipped row above it

    def test_plugin_tables_and_profiles_load_too(self, install: Install) -> None:
        install("newfam", {
            "gelu.yaml": """\
                version: 1
                family: mygelu
                fallback: exact
                rows:
                  - name: exact
                    impl: torch.nn.functional:gelu
                """,
            "profiles/fast.yaml": """\
                version: 1
                profile: newfam-first
                families:
                  rms_norm:
                    order: [reference]
                """,
        })
        table = d.current().family("mygelu")
        assert table.provided_by == "plugin newfam 1.0"
        assert "newfam-first" in d.list_profiles()

    def test_kept_when_load_tables_replaces_the_family(self, install: Install,
                                                       write_yaml: Callable[[str, str], Path],
                                                       caplog: pytest.LogCaptureFixture) -> None:
        install("fastnorm", {"rms.yaml": overlay(row("mine", before="torch"))})
        d.load_tables(write_yaml("rms_norm.yaml", ONE_ROW_RMS_NORM))
        assert rows() == ["mine", "ref"]  # torch is gone: placed before the first faithful row
        assert "rms.yaml:4: rms_norm.mine asked to go before 'torch', which the table no " \
               "longer has" in caplog.text

    def test_register_impl_can_anchor_on_a_plugin_row(self, install: Install) -> None:
        install("fastnorm", {"rms.yaml": overlay(row("mine"))})
        d.register_impl(d.ImplRecord("rms_norm", "py", ops.rms_norm), after="mine")
        assert rows()[:2] == ["mine", "py"]
        d.reload_tables()
        assert rows()[:2] == ["mine", "py"]
        with pytest.raises(ValueError, match="was not joined by register_impl"):
            d.unregister_impl("rms_norm", "mine")

    def test_a_user_file_cannot_be_an_overlay(self, write_yaml: Callable[[str, str], Path]
                                              ) -> None:
        path = write_yaml("o.yaml", overlay(row("x")))
        with pytest.raises(TableError) as err:
            d.load_tables(path)
        assert str(err.value).startswith(f"{path}:2:1: a row overlay (extends:) is read from "
                                         f"a plugin package only")


class TestBrokenPlugins:
    def assert_left_out(self, plugin: Plugin | None, *expected: str) -> None:
        assert plugin is not None and plugin.status == BROKEN
        text = "\n".join(str(p) for p in plugin.problems)
        for part in expected:
            assert part in text, text
        assert all("plugin broken 1.0: " in str(p) for p in plugin.problems)
        # the shipped tables keep working, and the plugin joined nothing
        assert rows() == ["native", "inductor_large", "torch", "inductor", "reference"]
        assert served() == "torch"
        assert [str(p) for p in registry.validate()] == [str(p) for p in plugin.problems]

    def test_a_typo_in_a_key(self, install: Install, caplog: pytest.LogCaptureFixture
                             ) -> None:
        caplog.set_level(logging.WARNING)
        text = overlay(row("ok"), "  - name: bad\n    impl: x.y:z\n    wen: ndim == 2\n")
        plugin = install("broken", {"rms.yaml": text})
        self.assert_left_out(plugin, "rms.yaml:9:5: plugin broken 1.0: unknown key 'wen' "
                                     "(did you mean 'when'?)")
        assert "plugin broken 1.0 (entry point broken) is left out" in caplog.text

    def test_a_module_that_does_not_import(self, install: Install) -> None:
        plugin = install("broken", {"rms.yaml": overlay(
            "  - name: bad\n    impl: broken.kernels:fast\n")})
        self.assert_left_out(plugin, "rms.yaml:5:11: plugin broken 1.0: ", "broken.kernels")

    def test_a_bad_expression(self, install: Install) -> None:
        plugin = install("broken", {"rms.yaml": overlay(row("bad", when="dtype == bf16"))})
        self.assert_left_out(plugin, "rms.yaml:6:20: plugin broken 1.0: unknown dtype 'bf16'")

    def test_an_unknown_family_or_anchor_or_a_taken_name(self, install: Install) -> None:
        plugin = install("broken", {
            "a.yaml": overlay(row("x"), extends="rms_nrom"),
            "b.yaml": overlay(row("torch"), row("y", before="toch")),
        })
        self.assert_left_out(
            plugin,
            "a.yaml:2:10: plugin broken 1.0: unknown family 'rms_nrom' (did you mean "
            "'rms_norm'?)",
            "b.yaml:4:11: plugin broken 1.0: rms_norm already has a row 'torch'",
            "b.yaml:10:13: plugin broken 1.0: before: rms_norm has no row 'toch' (did you "
            "mean 'torch'?)")

    def test_a_row_after_the_fallback(self, install: Install) -> None:
        """A row placed after the fallback row (the last resort) would never be reached:
        a located problem, not a silent dead row."""
        plugin = install("broken", {"rms.yaml": overlay(row("late", after="reference"))})
        self.assert_left_out(plugin, "after: 'reference' is rms_norm's fallback row, the "
                                     "last resort: a row placed after it is never reached")

    def test_a_profile_cannot_add_a_row_under_a_plugin_row_name(
            self, install: Install, write_yaml: Callable[[str, str], Path]) -> None:
        install("fastx", {"rms.yaml": overlay(row("fastx"))})
        path = write_yaml("shadow.yaml", "version: 1\nprofile: shadow\nfamilies:\n"
                                         "  rms_norm:\n    add:\n      - name: fastx\n"
                                         "        impl: tests._impls:ref\n")
        problems = registry.validate(path)
        assert any("add: rms_norm already has a row 'fastx'" in p.message
                   and "would shadow it" in p.message for p in problems), problems
        assert [(p.line, p.column) for p in problems][:1] == [(6, 15)]

    def test_both_anchors(self, install: Install) -> None:
        plugin = install("broken", {"rms.yaml": overlay(
            row("x", before="torch", after="torch"))})
        self.assert_left_out(plugin, "give 'before' or 'after', not both")

    def test_a_table_for_an_existing_family(self, install: Install) -> None:
        plugin = install("broken", {"rms_norm.yaml": ONE_ROW_RMS_NORM})
        self.assert_left_out(plugin, "family 'rms_norm' already exists (shipped with astrai",
                             "extends: rms_norm")

    def test_a_package_that_does_not_import(self, install: Install) -> None:
        plugin = install("broken", {}, value="broken.nowhere")
        self.assert_left_out(plugin, "broken 1.0 (entry point broken):1:1: plugin broken "
                                     "1.0: entry point broken = 'broken.nowhere': cannot read")

    def test_other_plugins_still_load(self, install: Install) -> None:
        install("broken", {"rms.yaml": overlay(row("bad", when="nope"))}, reload=False)
        install("fine", {"rms.yaml": overlay(row("good"))})
        status = {p.distribution: p.status for p in d.current().plugins}
        assert status == {"broken": BROKEN, "fine": LOADED}
        assert rows()[0] == "good"

    def test_list_and_validate_report_it(self, install: Install, tmp_path: Path) -> None:
        install("broken", {"rms.yaml": overlay(row("bad", when="nope"))})
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"),
                                                            str(REPO)])}
        listed = subprocess.run([sys.executable, "-m", "astrai", "list"], env=env,
                                capture_output=True, text=True, timeout=120)
        assert listed.returncode == 0, listed.stderr
        assert "plugins: broken 1.0 (broken: broken, 1 problem(s))" in listed.stdout
        assert "rms.yaml:6:11: plugin broken 1.0: " in listed.stdout
        checked = subprocess.run([sys.executable, "-m", "astrai", "validate"], env=env,
                                 capture_output=True, text=True, timeout=120)
        assert checked.returncode == 1
        assert checked.stderr.count("rms.yaml:6:11: plugin broken 1.0: ") == 1  # not warned too
        assert "(validated: shipped tables, plugins (broken))" in checked.stderr
        linted = subprocess.run([sys.executable, "-m", "astrai", "lint", "--no-coverage"],
                                env=env, capture_output=True, text=True, timeout=120)
        assert linted.returncode == 1
        assert "rms.yaml:6:11: plugin broken 1.0: " in linted.stderr


class TestChoosing:
    @pytest.mark.parametrize("value, loaded", [
        ("0", set()), ("none", set()), ("", {"one", "two"}), ("1", {"one", "two"}),
        ("-one", {"two"}), ("-One", {"two"}), ("two", {"two"}), ("one,two", {"one", "two"}),
    ])
    def test_astr_plugins(self, install: Install, monkeypatch: pytest.MonkeyPatch,
                          value: str, loaded: set[str]) -> None:
        install("one", {"rms.yaml": overlay(row("x1"))}, reload=False)
        install("two", {"rms.yaml": overlay(row("x2"))}, reload=False)
        monkeypatch.setenv("ASTR_PLUGINS", value)
        d.reload_tables()
        got = {p.distribution: p for p in d.current().plugins}
        assert {n for n, p in got.items() if p.status == LOADED} == loaded
        assert all(p.status == DISABLED and "ASTR_PLUGINS" in p.reason
                   for n, p in got.items() if n not in loaded)
        assert {r for r in rows() if r.startswith("x")} == {
            {"one": "x1", "two": "x2"}[n] for n in loaded}

    def test_an_unknown_name_warns(self, install: Install, monkeypatch: pytest.MonkeyPatch,
                                   caplog: pytest.LogCaptureFixture) -> None:
        install("one", {"rms.yaml": overlay(row("x1"))}, reload=False)
        monkeypatch.setenv("ASTR_PLUGINS", "-onr")
        d.reload_tables()
        assert "ASTR_PLUGINS names plugin 'onr', which is not installed (did you mean " \
               "'one'?)" in caplog.text
        assert "x1" in rows()


class TestProvenance:
    def test_explain_tags_a_joined_row(self, install: Install) -> None:
        install("fastnorm", {"rms.yaml": overlay(row("mine"))})
        x = torch.randn(4, 8, dtype=torch.bfloat16)
        ctx = ops.context("rms_norm", x, torch.ones(8, dtype=torch.bfloat16))
        text = d.explain("rms_norm", ctx).splitlines()
        assert text[1] == "  mine: MATCH (dtype == bfloat16)  [plugin fastnorm 1.0]"
        assert text[2].startswith("  native: ") and text[2].endswith(")")  # shipped: no tag
        doc = explanation("rms_norm", ctx).as_dict()
        assert doc["rows"][0]["provided_by"] == "plugin fastnorm 1.0"
        assert doc["rows"][1]["provided_by"].startswith("shipped with astrai ")
        assert doc["provided_by"].startswith("shipped with astrai ")

    def test_list_json(self, install: Install, tmp_path: Path) -> None:
        install("fastnorm", {"rms.yaml": overlay(row("mine"))})
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"),
                                                            str(REPO)])}
        proc = subprocess.run([sys.executable, "-m", "astrai", "list", "--json"], env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        assert [(p["distribution"], p["version"], p["status"]) for p in doc["plugins"]] == [
            ("fastnorm", "1.0", "loaded")]
        rms = next(f for f in doc["families"] if f["family"] == "rms_norm")
        assert rms["rows"][0]["name"] == "mine"
        assert rms["rows"][0]["provided_by"] == "plugin fastnorm 1.0"
        assert rms["rows"][0]["source"].endswith("rms.yaml:4")

    def test_register_impl_and_profile_rows_say_so(self, write_yaml: Callable[[str, str], Path]
                                                   ) -> None:
        d.register_impl(d.ImplRecord("rms_norm", "py", ops.rms_norm))
        assert d.current().family("rms_norm").row("py").provided_by == (  # type: ignore[union-attr]
            f"register_impl in {__name__}")
        d.load_tables(write_yaml("p.yaml", """\
            version: 1
            profile: adds
            families:
              rms_norm:
                add:
                  - name: added
                    impl: astrai.backends.rms_norm:reference_rms_norm
            """))
        added = d.current().profiles["adds"].overlays["rms_norm"].add[0]
        assert added.provided_by == "profile adds (add), load_tables"

    def test_fingerprints_tell_plugin_versions_apart(self, install: Install) -> None:
        ctx = ops.context("rms_norm", torch.randn(2, 8), torch.ones(8))
        plain = fingerprint.fingerprint([ctx])
        assert plain.plugins == ()
        install("fastnorm", {"rms.yaml": overlay(row("mine"))}, version="1.0")
        one = fingerprint.fingerprint([ctx])
        assert one.plugins == (("fastnorm", "1.0"),)
        assert fingerprint.Fingerprint.from_wire(json.loads(json.dumps(one.to_wire()))) == one
        # the same rows from version 2.0: the family's revision differs, and the cause is named
        two = fingerprint.Fingerprint(**{**one.__dict__, "plugins": (("fastnorm", "2.0"),),
                                         "tables": (("rms_norm", "other"),)})
        diffs = comparison.differences([one, two], [0, 1])
        assert [x.kind for x in diffs] == ["plugins", "table"]
        assert str(diffs[0]) == ("plugins (astrai.tables entry points) in the checked "
                                 "families: rank 0 -> fastnorm 1.0; rank 1 -> fastnorm 2.0")
        # a plugin whose rows the checked families do not hold does not count
        assert fingerprint.fingerprint([d.CallContext("linear", ndim=2)]).plugins == ()

    def test_revision_follows_the_plugin_version(self, install: Install, tmp_path: Path
                                                 ) -> None:
        base = table_revision(d.current().family("rms_norm"))
        install("fastnorm", {"rms.yaml": overlay(row("mine"))}, version="1.0")
        one = table_revision(d.current().family("rms_norm"))
        info = next((tmp_path / "site").glob("fastnorm-*.dist-info"))
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fastnorm\nVersion: 1.1\n")
        d.reload_tables()
        assert len({base, one, table_revision(d.current().family("rms_norm"))}) == 3

    def test_lockfiles_record_plugin_versions(self, install: Install, tmp_path: Path) -> None:
        from astrai.lock.make import check_lock, lock_workload
        from astrai.record.recording import record

        install("fastnorm", {"rms.yaml": overlay(row("mine"))})
        with record() as wl:
            ops.rms_norm(torch.randn(2, 8, dtype=torch.bfloat16),
                         torch.ones(8, dtype=torch.bfloat16))
        lock = lock_workload(wl)
        assert dict(lock.plugins) == {"fastnorm": "1.0"}
        assert lock.plain()["plugins"] == {"fastnorm": "1.0"}
        info = next((tmp_path / "site").glob("fastnorm-*.dist-info"))
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fastnorm\nVersion: 1.1\n")
        d.reload_tables()
        checked = check_lock(lock)
        assert not checked.changes
        assert "plugin fastnorm: 1.0 when the lock was made, 1.1 now" in checked.notes


class TestExamplePackage:
    """The example under tests/plugin_example, built and pip-installed for real."""

    @pytest.fixture(scope="class")
    @classmethod
    def target(cls, tmp_path_factory: pytest.TempPathFactory) -> Path:
        work = tmp_path_factory.mktemp("example")
        source = work / "src"
        shutil.copytree(EXAMPLE, source)  # the build writes into its source tree
        target = work / "site"
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation",
             "--no-deps", "--no-index", "--target", str(target), str(source)],
            capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return target

    def run(self, target: Path | None, *code: str, **env: str) -> str:
        path = [str(target)] if target is not None else []
        environ = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, str(REPO)]), **env}
        environ.pop("ASTR_PLUGINS", None) if "ASTR_PLUGINS" not in env else None
        program = "".join(textwrap.dedent(part) for part in code)
        proc = subprocess.run([sys.executable, "-c", program], env=environ,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    CHECK = """\
        import torch, astrai.dispatch as d, astrai.ops as ops
        from astrai.backends.rms_norm import reference_rms_norm
        def served(tokens, dtype=torch.bfloat16):
            x, w = torch.randn(tokens, 64, dtype=dtype), torch.ones(64, dtype=dtype)
            return d.resolve("rms_norm", ops.context("rms_norm", x, w)).name
        print("rows", " ".join(d.current().family("rms_norm").row_names()))
        print("served", served(8), served(600), served(5000), served(600, torch.float32))
        print("plugins", [(p.distribution, p.version, p.status) for p in d.current().plugins])
        import sys
        print("full path", "pydantic" in sys.modules or "yaml" in sys.modules)
        """

    def test_installing_it_changes_the_served_row(self, target: Path) -> None:
        out = self.run(target, self.CHECK, """\
            x = torch.randn(600, 64, dtype=torch.bfloat16)
            w = torch.randn(64, dtype=torch.bfloat16)
            with d.op_backend(rms_norm="example_fused"):
                got = ops.rms_norm(x, w)
            torch.testing.assert_close(got, reference_rms_norm(x, w), atol=2e-2, rtol=2e-2)
            print("numerics ok")
            """)
        assert "rows native example_fused inductor_large torch inductor reference" in out
        assert "served torch example_fused example_fused inductor_large" in out
        assert "('astrai-example-kernels', '0.1.0', 'loaded')" in out
        assert "numerics ok" in out
        assert "full path False" in out  # its precompiled.json spared pydantic and PyYAML

    def test_list_and_explain_name_the_distribution(self, target: Path) -> None:
        listed = self.run(target, "from astrai.cli import main; main(['list'])")
        assert "plugins: astrai-example-kernels 0.1.0 (example: loaded)" in listed
        assert "from: plugin astrai-example-kernels 0.1.0 (" in listed
        explained = self.run(target, "from astrai.cli import main; main(['explain', "
                                     "'rms_norm', '--dtype', 'bfloat16', '--ndim', '2', "
                                     "'--tokens', '600'])")
        assert ("example_fused: MATCH (dtype == bfloat16 and tokens >= 512)  "
                "[plugin astrai-example-kernels 0.1.0]") in explained
        assert explained.rstrip().endswith("=> example_fused (origin=chain)")

    def test_disabled_and_uninstalled_give_the_shipped_behaviour(self, target: Path) -> None:
        shipped = "rows native inductor_large torch inductor reference"
        for out in (self.run(target, self.CHECK, ASTR_PLUGINS="0"),
                    self.run(target, self.CHECK, ASTR_PLUGINS="-astrai-example-kernels"),
                    self.run(None, self.CHECK)):
            assert shipped in out
            assert "served torch inductor_large inductor_large inductor_large" in out
        assert "plugins []" in self.run(None, self.CHECK)


class TestPrecompiled:
    """A plugin's precompiled.json (``astrai-ops precompile``)."""

    def test_the_example_is_current(self) -> None:
        proc = subprocess.run(
            [sys.executable, "-m", "astrai", "precompile", "--check",
             str(EXAMPLE / "astrai_example_kernels" / "tables")],
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(EXAMPLE), str(REPO)])},
            capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr

    def precompiled(self, tmp_path: Path, text: str, *, other_format: bool = False) -> str:
        folder = tmp_path / "pre"
        folder.mkdir()
        (folder / "rms.yaml").write_text(text)
        assert main(["precompile", str(folder)]) == 0
        raw = (folder / "precompiled.json").read_text()
        return raw.replace(artifact.format_digest(), "0" * 16) if other_format else raw

    def test_files_load_from_it(self, install: Install, tmp_path: Path,
                                monkeypatch: pytest.MonkeyPatch) -> None:
        text = overlay(row("mine", before="torch"))
        raw = self.precompiled(tmp_path, text)
        used: list[str] = []
        real = load.parse_text
        monkeypatch.setattr(load, "parse_text", lambda *a, **k: used.append(a[1]) or real(*a, **k))
        plugin = install("fastnorm", {"rms.yaml": text, "precompiled.json": raw})
        assert plugin is not None and plugin.status == LOADED and used == []
        assert rows()[:4] == ["native", "inductor_large", "mine", "torch"]
        rec = d.current().family("rms_norm").row("mine")
        assert rec is not None and rec.source.endswith("rms.yaml:4")

    def test_a_stale_or_foreign_one_is_not_used(self, install: Install, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
        caplog.set_level(logging.INFO, logger="astrai")
        raw = self.precompiled(tmp_path, overlay(row("mine")), other_format=True)
        used: list[str] = []
        real = load.parse_text
        monkeypatch.setattr(load, "parse_text", lambda *a, **k: used.append(a[1]) or real(*a, **k))
        # the YAML differs from what the artifact holds, and the artifact is for other formats
        plugin = install("fastnorm", {"rms.yaml": overlay(row("yours")), "precompiled.json": raw})
        assert plugin is not None and plugin.status == LOADED
        assert len(used) == 1 and rows()[0] == "yours"
        assert "precompiled.json was made for other table formats" in caplog.text

    @pytest.mark.parametrize("damage", ["no requires", "no add", "bad when"])
    def test_a_damaged_entry_takes_the_full_path(self, install: Install, tmp_path: Path,
                                                 damage: str) -> None:
        """An entry that does not build (edited by hand) is not trusted: the file is read
        the full way, and the plugin loads as its YAML says."""
        prof = ("version: 1\nprofile: damaged\nfamilies:\n  rms_norm:\n"
                "    when: {torch: ndim >= 2}\n")
        folder = tmp_path / "pre"
        folder.mkdir()
        (folder / "rms.yaml").write_text(overlay(row("mine")))
        (folder / "p.yaml").write_text(prof)
        assert main(["precompile", str(folder)]) == 0
        doc = json.loads((folder / "precompiled.json").read_text())
        for entry in doc["files"].values():
            if damage == "no requires" and entry["kind"] == "overlay":
                del entry["data"]["rows"][0]["requires"]
            if damage == "no add" and entry["kind"] == "profile":
                del entry["data"]["families"]["rms_norm"]["add"]
            if damage == "bad when" and entry["kind"] == "profile":
                entry["whens"] = [[p, ["axis", "nonexistent"]] for p, _ in entry["whens"]]
        plugin = install("fastnorm", {"rms.yaml": overlay(row("mine")), "p.yaml": prof,
                                      "precompiled.json": json.dumps(doc)})
        assert plugin is not None and plugin.status == LOADED, plugin
        assert rows()[0] == "mine" and "damaged" in d.list_profiles()

    def test_the_digest_covers_what_expressions_mean(self,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
        from astrai.dispatch import axes

        before = artifact.format_digest()
        artifact.format_digest.cache_clear()
        monkeypatch.setitem(axes.PREDICATES, "mask_free",  # type: ignore[index]
                            ("not has_mask and not has_cache", "has_mask"))
        try:
            assert artifact.format_digest() != before
        finally:
            monkeypatch.undo()
            artifact.format_digest.cache_clear()
        assert artifact.format_digest() == before

    def test_precompile_reads_what_the_loader_reads(self, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
        folder = tmp_path / "pkg"
        (folder / "_private").mkdir(parents=True)
        (folder / ".github").mkdir()
        (folder / "rms.yaml").write_text(overlay(row("mine")))
        (folder / "_private" / "x.yaml").write_text("not: a table\n")
        (folder / ".github" / "ci.yml").write_text("on: push\n")
        assert main(["precompile", str(folder)]) == 0
        (folder / "latin.yaml").write_bytes(b"version: 1\n# caf\xe9\n")
        assert main(["precompile", str(folder)]) == 1
        assert "latin.yaml:1:1: file is not UTF-8 text" in capsys.readouterr().err

    def test_precompile_reports_problems(self, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
        folder = tmp_path / "bad"
        folder.mkdir()
        (folder / "rms.yaml").write_text(overlay(row("mine", before="toch")))
        assert main(["precompile", str(folder)]) == 1
        err = capsys.readouterr().err
        assert "rms.yaml:7:13: before: rms_norm has no row 'toch' (did you mean 'torch'?)" in err
        assert not (folder / "precompiled.json").exists()


class TestEdges:
    """What a review found: each a plugin mistake kept to that plugin, never silent."""

    def test_revision_is_the_rows_not_their_path(self, install: Install, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
        install("fastnorm", {"rms.yaml": overlay(row("mine"))})
        here = table_revision(d.current().family("rms_norm"))
        elsewhere = tmp_path / "elsewhere"
        shutil.copytree(tmp_path / "site", elsewhere)
        shutil.rmtree(tmp_path / "site")
        for module in [m for m in sys.modules if m.split(".")[0] == "fastnorm"]:
            monkeypatch.delitem(sys.modules, module)
        monkeypatch.syspath_prepend(str(elsewhere))
        importlib.invalidate_caches()
        d.reload_tables()
        assert d.current().family("rms_norm").row("mine").source.startswith(  # type: ignore[union-attr]
            str(elsewhere))
        assert table_revision(d.current().family("rms_norm")) == here
        d.register_impl(d.ImplRecord("rms_norm", "py", ops.rms_norm, Spec.dtype_in(F32)))
        one = table_revision(d.current().family("rms_norm"))
        d.register_impl(d.ImplRecord("rms_norm", "py", ops.rms_norm, Spec.dtype_in(BF16)))
        assert table_revision(d.current().family("rms_norm")) != one

    def test_a_broken_plugin_takes_no_other_down(self, install: Install) -> None:
        install("alpha", {"a.yaml": overlay(row("fast")),
                          "b.yaml": overlay(row("bad", when="nope"))}, reload=False)
        install("beta", {"b.yaml": overlay(row("fast"))}, reload=False)
        install("gamma", {"g.yaml": overlay(row("g1", after="torch"))})
        status = {p.distribution: p.status for p in d.current().plugins}
        assert status == {"alpha": BROKEN, "beta": LOADED, "gamma": LOADED}
        rec = d.current().family("rms_norm").row("fast")
        assert rec is not None and rec.provided_by == "plugin beta 1.0"

    def test_a_plugin_never_replaces_a_profile(self, install: Install) -> None:
        plugin = install("sneaky", {"p.yaml": """\
            version: 1
            profile: reference
            families:
              rms_norm:
                force: torch
            """})
        assert plugin is not None and plugin.status == BROKEN
        assert "profile 'reference' already exists" in str(plugin.problems[0])
        with d.use_profile("reference"):
            assert served().startswith("reference")

    def test_system_exit_in_its_package_is_a_problem(self, install: Install) -> None:
        plugin = install("quitter", {"r.yaml": overlay(row("x"))},
                         init="import sys\nsys.exit(3)\n")
        assert plugin is not None and plugin.status == BROKEN
        assert "SystemExit: 3" in str(plugin.problems[0])
        assert served() == "torch"

    def test_metadata_without_a_name(self, install: Install) -> None:
        install("noname", {"r.yaml": overlay(row("x"))}, metadata="Metadata-Version: 2.1\n",
                reload=False)
        d.reload_tables()
        (plugin,) = d.current().plugins
        assert (plugin.distribution, plugin.version) == ("(unnamed distribution)", "?")
        assert plugin.status == LOADED

    def test_a_value_that_is_not_a_package(self, install: Install) -> None:
        plugin = install("colon", {"r.yaml": overlay(row("x"))}, value="colon.tables:thing")
        assert plugin is not None and plugin.status == BROKEN
        assert "names a package holding the *.yaml files" in str(plugin.problems[0])

    def test_a_name_register_impl_took(self, install: Install,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("ASTR_PLUGINS", "0")
        install("late", {"r.yaml": overlay(row("mine"))})
        d.register_impl(d.ImplRecord("rms_norm", "mine", ops.rms_norm))
        monkeypatch.setenv("ASTR_PLUGINS", "1")
        d.reload_tables()
        (plugin,) = d.current().plugins
        assert plugin.status == BROKEN
        assert f"already has a row 'mine' (from register_impl in {__name__}" in str(
            plugin.problems[0])
        assert rows().count("mine") == 1

    def test_left_out_by_load_tables_takes_its_profiles(self, install: Install,
                                                        write_yaml: Callable[[str, str], Path]
                                                        ) -> None:
        install("withprof", {"r.yaml": overlay(row("mine", when="always")), "p.yaml": """\
            version: 1
            profile: plugprof
            families:
              rms_norm:
                force: mine
            """})
        assert "plugprof" in d.list_profiles()
        d.load_tables(write_yaml("rms_norm.yaml", ONE_ROW_RMS_NORM.replace("ref\n", "mine\n")))
        (plugin,) = d.current().plugins
        assert plugin.status == BROKEN and "plugprof" not in d.list_profiles()

    @pytest.mark.parametrize("value, loaded, warning", [
        ("- one", {"two"}, None),
        ("one,-one", {"two"}, "both asks for and leaves out one"),
        (",", {"one", "two"}, "empty or malformed entries are ignored"),
        ("-", {"one", "two"}, "empty or malformed entries are ignored"),
    ])
    def test_astr_plugins_edges(self, install: Install, monkeypatch: pytest.MonkeyPatch,
                                caplog: pytest.LogCaptureFixture, value: str,
                                loaded: set[str], warning: str | None) -> None:
        install("one", {"rms.yaml": overlay(row("x1"))}, reload=False)
        install("two", {"rms.yaml": overlay(row("x2"))}, reload=False)
        monkeypatch.setenv("ASTR_PLUGINS", value)
        d.reload_tables()
        assert {p.distribution for p in d.current().plugins if p.status == LOADED} == loaded
        if warning is not None:
            assert warning in caplog.text
