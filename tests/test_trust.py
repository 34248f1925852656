"""Nothing silent: no wrong results, no quiet fall-throughs, users own their tables,
and any family is callable through ``astrai.ops.call``."""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import astrai.dispatch as d
from astrai import ops
from astrai.dispatch import (
    CallContext,
    NoImplementationError,
    TableError,
    current,
    explain,
    load_tables,
    op_backend,
    reload_tables,
    reset_stats,
    resolve,
    stats,
)

Write = Callable[[str, str], Path]


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "astrai"]


class TestMalformedCalls:
    """Inputs are validated once, before any row runs: a malformed call raises."""

    def test_error_attention_kv_lengths_differ(self) -> None:
        """k and v of different lengths raise on every row, torch_native included."""
        q, k, v = torch.randn(2, 16, 4, 64), torch.randn(2, 8, 4, 64), torch.randn(2, 9, 4, 64)
        for backend in (None, "torch_native", "math"):
            with pytest.raises(ValueError, match=r"k and v disagree on \[seq, kv_heads\]: "
                                                 r"\(8, 4\) vs \(9, 4\)"):
                ops.attention(q, k, v, backend=backend)

    @pytest.mark.parametrize(("q", "k", "message"), [
        ((2, 4, 4, 8), (3, 4, 4, 8), "batch sizes differ: q 2, k 3, v 3"),
        ((2, 4, 4, 8), (2, 4, 4, 16), "q has head_dim 8 but k has 16"),
        ((2, 4, 6, 8), (2, 4, 4, 8), "q has 6 heads, not a multiple of k/v's 4"),
        ((2, 4, 4, 0), (2, 4, 4, 0), "attention needs head_dim >= 1"),
    ])
    def test_error_attention_shapes(self, q: tuple[int, ...], k: tuple[int, ...],
                                    message: str) -> None:
        """Each disagreement is a ValueError naming the shapes, never a row's own crash."""
        with pytest.raises(ValueError, match=message):
            ops.attention(torch.randn(q), torch.randn(k), torch.randn(k))
        with pytest.raises(ValueError, match=message):
            ops.attention(torch.randn(q), torch.randn(k), torch.randn(k), backend="math")

    def test_error_other_families(self) -> None:
        """rotary, rms_norm and linear validate their inputs before any row runs."""
        x = torch.randn(2, 3, 4, 8)
        with pytest.raises(ValueError, match="freqs_cis of shape"):
            ops.apply_rotary(x, torch.randn(1, 5, 4, 2))
        with pytest.raises(ValueError, match=r"weight \[features\]; got x \(2, 3, 4, 8\), "
                                             r"weight \(4,\)"):
            ops.rms_norm(x, torch.ones(4))
        with pytest.raises(ValueError, match="eps must be a number >= 0"):
            ops.rms_norm(x, torch.ones(8), -1.0)
        with pytest.raises(ValueError, match=r"got x \(2, 3, 4, 8\), weight \(5, 7\)"):
            ops.linear(x, torch.randn(5, 7))
        with pytest.raises(ValueError, match=r"bias must have shape \(5,\)"):
            ops.linear(x, torch.randn(5, 8), torch.randn(4))
        with pytest.raises(TypeError, match=r"x must be a torch\.Tensor, got list"):
            ops.linear([1.0], torch.randn(5, 1))  # type: ignore[arg-type]

    def test_valid_calls_still_served(self) -> None:
        """GQA, a mask, and ordinary calls of every family still run."""
        q, kv = torch.randn(2, 5, 8, 16), torch.randn(2, 7, 2, 16)
        assert ops.attention(q, kv, kv, attn_mask=torch.ones(5, 7, dtype=torch.bool)).shape == (
            2, 5, 128)
        assert ops.linear(torch.randn(3, 4), torch.randn(2, 4), torch.randn(2)).shape == (3, 2)


class TestNoRowCanServe:
    """When no row, the fallback included, can serve a call: NoImplementationError."""

    @pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
    def test_error_integer_tensors(self, dtype: torch.dtype) -> None:
        """Integer and bool tensors are refused by every family, listing every row's reason."""
        x = torch.ones(2, 3, 4, 8, dtype=dtype)
        calls = {
            "attention": lambda: ops.attention(x, x, x),
            "rms_norm": lambda: ops.rms_norm(x, torch.ones(8, dtype=dtype)),
            "linear": lambda: ops.linear(x, torch.ones(2, 8, dtype=dtype)),
            "rotary": lambda: ops.apply_rotary(x, torch.ones(1, 3, 4, 2)),
        }
        for family, run in calls.items():
            with pytest.raises(NoImplementationError) as err:
                run()
            rows = current().families[family].row_names()
            assert err.value.family == family
            assert [name.split(" ")[0] for name, _ in err.value.reasons] == rows
            fallback = current().families[family].fallback
            assert f"  {fallback} (fallback): requires " in str(err.value)
            assert f"(call has {str(dtype).removeprefix('torch.')})" in str(err.value)

    def test_error_pickles_with_reasons(self) -> None:
        """The error survives pickling with its structured fields."""
        x = torch.ones(2, 3, dtype=torch.int64)
        with pytest.raises(NoImplementationError) as err:
            ops.rms_norm(x, torch.ones(3, dtype=torch.int64))
        back = pickle.loads(pickle.dumps(err.value))
        assert (str(back), back.family, back.reasons) == (
            str(err.value), "rms_norm", err.value.reasons)

    def test_explain_shows_the_error(self) -> None:
        """explain ends with the same error instead of a verdict."""
        ctx = CallContext("linear", dtype=torch.int64, ndim=2)
        rows = current().families["linear"].row_names()  # a reason line each after it
        assert explain("linear", ctx).splitlines()[-1 - len(rows)].startswith(
            "=> ERROR: no linear row can serve this call, not even the fallback 'torch'")


class TestSoftRequestsSpeak:
    """An ASTR_OPS choice that cannot be honoured warns once, with the reason."""

    @pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
    @pytest.mark.parametrize(("value", "family", "row", "run"), [
        ("attention=flash", "attention", "flash",
         lambda: ops.attention(*(3 * [torch.randn(1, 4, 2, 8, dtype=torch.float16)]))),
        ("linear=fp8", "linear", "fp8", lambda: ops.linear(torch.randn(2, 4), torch.randn(3, 4))),
    ])
    def test_unavailable_row_warns_once(self, value: str, family: str, row: str,
                                        run: Callable[[], object],
                                        monkeypatch: pytest.MonkeyPatch,
                                        caplog: pytest.LogCaptureFixture) -> None:
        """The call runs the table's choice, and the reason is logged once."""
        monkeypatch.setenv("ASTR_OPS", value)
        reset_stats()
        with caplog.at_level(logging.WARNING, logger="astrai"):
            for _ in range(3):
                run()
        got = warnings(caplog)
        assert len(got) == 1, got
        assert got[0].startswith(f"{family}={row} from ASTR_OPS ({value}) cannot serve this "
                                 f"call: unavailable (")
        assert got[0].endswith("; using the table's choice instead")
        assert stats().served(family, origin="chain") == 3


class TestBadHandles:
    """A backend that is neither a row name nor a callable is named by resolution (as the
    seed names it) but serves no call: the call is a plain TypeError."""

    def test_error_backend_not_callable(self) -> None:
        """``backend=42`` is a TypeError saying the object cannot be called."""
        reset_stats()
        x = torch.randn(2, 4)
        with pytest.raises(TypeError, match=r"the linear backend int 42 \(selected: "
                                            r"explicit\) cannot serve a call: it is not "
                                            r"callable"):
            ops.linear(x, torch.randn(3, 4), backend=42)

    def test_error_scope_not_callable(self) -> None:
        """``op_backend(linear=42)`` is entered (resolution names the object); a call under
        it is refused."""
        with op_backend(linear=42):
            assert resolve("linear", CallContext("linear", dtype=torch.float32)).record.obj == 42
            with pytest.raises(TypeError, match=r"int 42 \(selected: context\) cannot serve"):
                ops.linear(torch.randn(2, 4), torch.randn(3, 4))


GELU_MODULE = '''\
import math
import torch


def gelu_exact(x, approximate=False):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def gelu_tanh(x, approximate=True):
    return torch.nn.functional.gelu(x, approximate="tanh")


def context(x, approximate=False):
    return {"dtype": x.dtype, "ndim": x.dim(), "approximate": approximate}
'''
GELU_TABLE = """\
version: 1
family: gelu
fallback: exact
rows:
  - name: tanh
    impl: {pkg}.impls:gelu_tanh
    when: dtype in {{float16, bfloat16}}
  - name: exact
    impl: {pkg}.impls:gelu_exact
    when: dtype in {{float16, bfloat16, float32, float64}}
"""


@pytest.fixture
def user_pkg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """An importable package of the user's own, on ``sys.path``."""
    pkg = tmp_path / "site" / "astrai_user_gelu"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "impls.py").write_text(GELU_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return pkg.name


class TestOpsCall:
    """``astrai.ops.call``: a user's family, dispatched like the built-in ones."""

    def test_user_family(self, user_pkg: str, write_yaml: Write) -> None:
        """Counted, cached, explainable, and strict with ``backend=``."""
        load_tables(write_yaml("gelu.yaml", GELU_TABLE.format(pkg=user_pkg)))
        reset_stats()
        x = torch.randn(4, 8)
        for _ in range(3):
            out = ops.call("gelu", x)
        torch.testing.assert_close(out, torch.nn.functional.gelu(x))
        s = stats()
        assert s.served("gelu", "exact", "chain") == 3
        assert (s.cache_hits, s.cache_misses) == (2, 1)
        half = x.to(torch.float16)
        torch.testing.assert_close(ops.call("gelu", half),
                                   torch.nn.functional.gelu(half, approximate="tanh"))
        assert ops.call("gelu", half, backend="exact").dtype == torch.float16
        assert stats().served("gelu", "exact", "explicit") == 1
        with pytest.raises(d.ExplicitSelectionError, match="'tanh' selected by the explicit"):
            ops.call("gelu", x, backend="tanh")
        with pytest.raises(NoImplementationError):
            ops.call("gelu", torch.ones(3, dtype=torch.int64))

    def test_context_builder(self, user_pkg: str, write_yaml: Write) -> None:
        """A table's ``context:`` builder supplies the axes, extra ones included."""
        table = GELU_TABLE.format(pkg=user_pkg).replace(
            "fallback: exact", f"axes:\n  - {{name: approximate, type: bool}}\n"
                               f"context: {user_pkg}.impls:context\nfallback: exact").replace(
            "when: dtype in {float16, bfloat16}", "when: approximate")
        load_tables(write_yaml("gelu.yaml", table))
        x = torch.randn(4, 8)
        torch.testing.assert_close(ops.call("gelu", x, approximate=False),
                                   torch.nn.functional.gelu(x))
        reset_stats()
        torch.testing.assert_close(ops.call("gelu", x, approximate=True),
                                   torch.nn.functional.gelu(x, approximate="tanh"))
        assert stats().served("gelu", "tanh", "chain") == 1
        res = d.resolve("gelu", CallContext("gelu", dtype=torch.float32, ndim=2,
                                            extra={"approximate": True}))
        assert res.name == "tanh"

    def test_builtin_family_uses_its_facade(self) -> None:
        """``ops.call('attention', ...)`` is ``ops.attention(...)``, checks included."""
        q = torch.randn(1, 4, 2, 8)
        torch.testing.assert_close(ops.call("attention", q, q, q, is_causal=True),
                                   ops.attention(q, q, q, is_causal=True))
        with pytest.raises(ValueError, match="k and v disagree"):
            ops.call("attention", q, q, torch.randn(1, 5, 2, 8))

    def test_error_unknown_family(self) -> None:
        """An unknown family is a KeyError listing the known ones."""
        with pytest.raises(KeyError,
                           match=r"Unknown family: 'gelu'.*known families: activation, attention"):
            ops.call("gelu", torch.randn(2))


class TestUserOwnedTables:
    """A file in ASTR_TABLES replaces the shipped family of the same name."""

    def test_astr_tables_replaces_shipped(self, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
        """The user's attention table wins, and explain names its file."""
        shipped = current().families["attention"].source
        text = Path(shipped).read_text()
        mine = tmp_path / "attention.yaml"
        # move math to the top: the user's order must win
        mine.write_text(text.replace("  - name: math\n", "  - name: xmath\n").replace(
            "rows:\n", "rows:\n  - name: math\n    impl: astrai.backends.attention.math:"
                       "math_attention\n", 1).replace("fallback: math", "fallback: xmath"))
        monkeypatch.setenv("ASTR_TABLES", str(tmp_path))
        reload_tables()
        table = current().families["attention"]
        assert table.source == str(mine)
        assert table.row_names()[0] == "math"
        ctx = CallContext("attention", dtype=torch.float32, ndim=4, head_dim=8)
        assert d.resolve("attention", ctx).name == "math"
        assert f"  table: {mine} (ASTR_TABLES)" in explain("attention", ctx).splitlines()

    def test_error_family_twice_in_one_source(self, write_yaml: Write, tmp_path: Path,
                                              user_pkg: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
        """Two files of one ASTR_TABLES directory defining one family is still an error."""
        one = write_yaml("mine/a.yaml", GELU_TABLE.format(pkg=user_pkg))
        two = write_yaml("mine/b.yaml", GELU_TABLE.format(pkg=user_pkg))
        monkeypatch.setenv("ASTR_TABLES", str(tmp_path / "mine"))
        with pytest.raises(TableError, match=f"{two}:2:9: family 'gelu' is also defined in "
                                             f"{one}"):
            reload_tables()
