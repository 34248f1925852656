"""Hostile and unlucky inputs (issue 16): nothing in a table or a call ends the process or
corrupts state. This file grows with that issue; the items covered so far are below."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from astrai.dispatch import CallContext, TableError, explain, load_tables, resolve
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
    monkeypatch.delitem(sys.modules, "astrai_hostile.exits", raising=False)
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
