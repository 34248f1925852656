"""The precompiled shipped tables: same result as the full path, no pydantic at load.

``tables/precompiled.json`` lets the shipped tables load without YAML or pydantic
(contract §11: importing astrai and loading every shipped table costs little beyond
``import torch``). These tests check that the fast path builds exactly what the full
path builds, that anything edited or broken takes the full path, and that the file
is current.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from astrai import dispatch
from astrai.dispatch import registry, state
from astrai.dispatch.registry import shipped_tables_dir
from astrai.dispatch.tables import artifact, build, load, parsed
from astrai.dispatch.tables import format as file_format

SHIPPED = sorted(p for p in shipped_tables_dir().rglob("*.yaml"))


def _table_view(pf: parsed.ParsedFile) -> object:
    """What matters of a parsed table: every row as the engine sees it."""
    t = pf.table
    assert t is not None
    rows = [(r.name, r.spec.description, r.faithful, r.description, r.source, r.priority,
             r.obj, r.available is None) for r in t.rows]
    definitions = {name: spec.encode() for name, spec in t.definitions.items()}
    return (t.name, t.fallback, t.description, t.env_alias, dict(t.axes), t.revision, rows,
            definitions)


class TestSameAsFullPath:
    @pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
    def test_file_is_precompiled(self, path: Path) -> None:
        """Every shipped file has an entry (so loading it never needs pydantic)."""
        assert artifact.lookup(path.read_bytes()) is not None

    @pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
    def test_fast_equals_full(self, path: Path) -> None:
        """The fast path builds the same table / profile data as the full path."""
        fast = load.parse_file(path)
        full = load.parse_text(path.read_bytes().decode("utf-8"), str(path))
        assert fast.located is None and full.located is not None  # the fast path was taken
        assert not fast.problems and not full.problems
        assert (fast.kind, fast.revision) == (full.kind, full.revision)
        if fast.kind == "table":
            assert _table_view(fast) == _table_view(full)
        else:
            assert fast.profile == full.profile

    def test_loaded_profiles_equal(self) -> None:
        """Built profiles (overlays with their compiled specs) are the same both ways."""
        def overlays(pf: parsed.ParsedFile) -> object:
            families = {t.name: t for t in dispatch.current().families.values()}
            prof = build.build_profile(pf, families)
            assert prof is not None
            return {f: (o.force, o.order, o.disable, o.enable, o.fallback,
                        {n: s.description for n, s in o.when.items()},
                        [a.name for a in o.add]) for f, o in prof.overlays.items()}

        for path in (p for p in SHIPPED if p.parent.name == "profiles"):
            full = load.parse_text(path.read_bytes().decode("utf-8"), str(path))
            assert overlays(load.parse_file(path)) == overlays(full)


class TestFallsBackToFullPath:
    def test_edited_file_takes_full_path(self, tmp_path: Path) -> None:
        """One changed byte: no entry, the full path runs, and the edit takes effect."""
        src = shipped_tables_dir() / "linear.yaml"
        edited = src.read_text().replace("description: torch.nn.functional.linear",
                                         "description: edited torch linear")
        path = tmp_path / "linear.yaml"
        path.write_text(edited)
        assert artifact.lookup(path.read_bytes()) is None
        pf = load.parse_file(path)
        assert pf.located is not None and pf.table is not None
        assert pf.table.row("torch").description.startswith("edited torch linear")

    def test_copy_of_shipped_file_is_fast(self, tmp_path: Path) -> None:
        """The entry is keyed by content: a byte-identical copy elsewhere is precompiled,
        and its rows' sources name the copy."""
        path = tmp_path / "copy.yaml"
        path.write_bytes((shipped_tables_dir() / "rotary.yaml").read_bytes())
        pf = load.parse_file(path)
        assert pf.located is None and pf.table is not None
        assert all(r.source.startswith(f"{path}:") for r in pf.table.rows)

    def test_missing_artifact(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        """Without the artifact everything still loads, the full way."""
        monkeypatch.setattr(state, "artifact_entries", None)
        monkeypatch.setattr(artifact, "_artifact_path", lambda: tmp_path / "none.json")
        dispatch.reload_tables()
        assert set(dispatch.list_families()) >= {"attention", "rotary", "rms_norm", "linear"}
        assert state.artifact_entries == {}

    @pytest.mark.parametrize("content", ["not json", '{"format": 99, "files": {}}',
                                         '{"format": 1, "files": {"x": {"kind": 1}}}', "[]"])
    def test_corrupt_artifact(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                              content: str) -> None:
        """A damaged or foreign artifact is ignored, never an error."""
        bad = tmp_path / "precompiled.json"
        bad.write_text(content)
        monkeypatch.setattr(state, "artifact_entries", None)
        monkeypatch.setattr(artifact, "_artifact_path", lambda: bad)
        dispatch.reload_tables()
        assert "attention" in dispatch.list_families()

    def test_bad_entry_falls_back(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """An entry that does not build (here: a row's impl path broken) is not trusted:
        the full path runs and the file loads as written."""
        path = shipped_tables_dir() / "rms_norm.yaml"
        entry = artifact.lookup(path.read_bytes())
        assert entry is not None
        data = json.loads(json.dumps(entry.data))
        data["rows"][0]["impl"] = "astrai.backends.rms_norm:no_such_thing"
        monkeypatch.setattr(artifact, "lookup",
                            lambda _b, _entries=None: dataclasses.replace(entry, data=data))
        pf = load.parse_file(path)
        assert pf.located is not None and not pf.problems and pf.table is not None

    def test_problem_on_fast_path_has_exact_position(
        self, write_yaml: Callable[[str, str], Path]
    ) -> None:
        """A shipped profile (precompiled) that no longer fits a replaced table reports
        the exact line and column, read from its YAML on demand."""
        linear = write_yaml("linear.yaml", """\
            version: 1
            family: linear
            fallback: torch
            rows:
              - name: torch
                impl: astrai.backends.linear:torch_linear
            """)
        profile = shipped_tables_dir() / "profiles" / "low-precision.yaml"
        with pytest.raises(dispatch.TableError) as info:
            dispatch.load_tables(linear, profile)
        lines = profile.read_text().splitlines()
        enable_line = next(i for i, line in enumerate(lines, 1) if "enable:" in line)
        probs = [p for p in info.value.problems
                 if p.file == str(profile) and p.message.startswith("enable:")]
        assert probs and {p.line for p in probs} == {enable_line}
        assert {lines[p.line - 1][p.column - 1:].split(",")[0].strip("] ") for p in probs} \
            == {"fp8", "bf16"}


class TestArtifact:
    def test_artifact_is_current(self) -> None:
        """``tables/precompiled.json`` matches the shipped tables (else: run ``astrai-ops
        schema``); ``astrai-ops schema --check`` fails CI on the same condition."""
        tables = shipped_tables_dir()
        current = (tables / artifact.ARTIFACT).read_text(encoding="utf-8")
        assert current == artifact.render_artifact(tables, load.validate_directory(tables))

    def test_artifact_rejects_bad_tables(self, tmp_path: Path) -> None:
        """It is only generated from tables that load cleanly."""
        (tmp_path / "t.yaml").write_text("version: 1\nfamily: t\nfallback: x\nrows: []\n")
        with pytest.raises(dispatch.TableError):
            load.validate_directory(tmp_path)

    @pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
    def test_entry_data_is_the_format_dump(self, path: Path) -> None:
        """An entry's data is exactly what the format models dump for the file: the fast
        path reads the one file format, not a copy of it."""
        entry = artifact.lookup(path.read_bytes())
        assert entry is not None
        model = file_format.TableFile if entry.kind == "table" else file_format.ProfileFile
        assert model.model_validate(entry.data).model_dump(mode="json") == entry.data


def test_load_imports_no_pydantic_or_yaml() -> None:
    """Importing astrai and loading the shipped tables imports neither pydantic, PyYAML,
    the expression parser nor the file models (the import-time budget of contract §11)."""
    code = ("import sys, astrai.dispatch as d, astrai.ops; d.current(); "
            "print(sorted(m for m in ('pydantic', 'yaml', 'astrai.dispatch.expr._parser', "
            "'astrai.dispatch.tables.format', 'astrai.dispatch.tables._yaml') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**__import__("os").environ, "ASTR_TABLES": ""})
    assert out.stdout.strip() == "[]"
    assert registry.shipped_tables_dir().is_dir()
