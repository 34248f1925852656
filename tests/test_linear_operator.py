"""Linear rows in a compiled graph: ``onednn`` and ``native`` stand in it as the operators
``astrai::onednn_linear`` and ``astrai::native_linear`` where they would run eagerly, and
as ``F.linear`` elsewhere."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import astrai.dispatch as dispatch
from astrai import ops
from astrai.backends import linear as rows
from astrai.backends import native as native_rows
from astrai.backends.linear_operator import linear_operator
from tests.conftest import cpu_of


@pytest.fixture(autouse=True)
def _amd() -> Iterator[None]:
    """The rows' tables as on the AMD CPU the ``onednn`` row was measured on."""
    torch._dynamo.reset()
    try:
        with cpu_of("amd", transposed=False):
            yield
    finally:
        torch._dynamo.reset()


def _needs_onednn() -> None:
    if rows.onednn_available() is not True:
        pytest.skip(f"the onednn row is unavailable here: {rows.onednn_available()}")


def _graph_of(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> str:
    """The code of the graph dynamo traces from ``fn(*args)`` (one graph, no breaks)."""
    graphs: list[Any] = []

    def capture(gm: torch.fx.GraphModule, _: Any) -> Any:
        graphs.append(gm)
        return gm

    torch.compile(fn, backend=capture, fullgraph=True, dynamic=False)(*args)
    assert len(graphs) == 1
    return str(graphs[0].code)


def _mlp(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    h = ops.linear(x, up)
    return ops.linear(F.silu(h) * h, down) + x


def _weights() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(48, 32, generator=g), torch.randn(32, 48, generator=g)


def test_an_operator_is_registered_once_per_row() -> None:
    first = linear_operator("onednn", F.linear)
    assert first is torch.ops.astrai.onednn_linear
    assert linear_operator("onednn", F.linear) is first


def test_its_shape_function_gives_the_products_shape() -> None:
    op = torch.ops.astrai.onednn_linear
    with FakeTensorMode():
        out = op(torch.empty(2, 5, 32), torch.empty(48, 32), torch.empty(48))
    assert out.shape == (2, 5, 48) and out.dtype == torch.float32


def test_traced_without_autograd_the_onednn_row_stands_in_the_graph() -> None:
    _needs_onednn()
    up, down = _weights()
    with torch.no_grad():
        code = _graph_of(_mlp, torch.randn(1, 32, 32), up, down)
    assert code.count("torch.ops.astrai.onednn_linear") == 2
    assert "linear(" not in code.replace("onednn_linear", "")


def test_traced_with_autograd_or_another_dtype_it_is_f_linear() -> None:
    _needs_onednn()
    up, down = _weights()
    code = _graph_of(_mlp, torch.randn(1, 32, 32), up.requires_grad_(), down)
    assert "astrai" not in code and "linear(" in code
    with torch.no_grad():
        code = _graph_of(rows.onednn_linear, torch.randn(32, 32, dtype=torch.float64),
                         up.double())
    assert "astrai" not in code and "linear(" in code


def test_exported_it_is_f_linear() -> None:
    _needs_onednn()
    up, down = _weights()

    class MLP(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _mlp(x, up, down)

    with torch.no_grad():
        program = torch.export.export(MLP(), (torch.randn(1, 32, 32),))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert not any("astrai" in t for t in targets)
    assert any("linear" in t or "mm" in t for t in targets)


def test_compiled_by_inductor_it_is_kept_and_the_elementwise_work_around_it_fused() -> None:
    _needs_onednn()
    from torch._inductor.utils import run_and_get_code

    up, down = _weights()
    x = torch.randn(1, 32, 32)
    with torch.no_grad():
        got, (code, *_) = run_and_get_code(torch.compile(_mlp, dynamic=False), x, up, down)
        want = F.linear(F.silu(F.linear(x, up)) * F.linear(x, up), down) + x
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert len(re.findall(r"= torch\.ops\.astrai\.onednn_linear\.default\(", code)) == 2
    assert re.search(r"def cpp_fused_\w*mul\w*silu|cpp_fused_\w*mul\w*silu\w* = ", code)


#: A profile letting the native row's operator stand in compiled graphs (the shipped table
#: keeps traced calls off it: not measured against inductor).
NATIVE_TRACED = """version: 1
profile: native-traced
description: the native linear row's operator in compiled graphs
families:
  linear:
    when:
      native: device == cpu and dtype == float32 and not grad_enabled and tokens <= 4
"""


def test_traced_one_token_calls_take_the_native_operator_where_the_table_says(
        kernels: ModuleType, tmp_path: Path) -> None:
    if native_rows.native_linear_available() is not True:
        pytest.skip(f"the native linear row is unavailable: "
                    f"{native_rows.native_linear_available()}")
    up, down = _weights()
    x = torch.randn(1, 1, 32)
    with torch.no_grad():
        eager = _mlp(x, up, down)
        assert dispatch.stats().by_row()["linear"] == {"native": {"chain": 2}}
        shipped = _graph_of(_mlp, x, up, down)  # not traced: the next row, F.linear
        path = tmp_path / "native-traced.yaml"
        path.write_text(NATIVE_TRACED)
        dispatch.load_tables(path)
        torch._dynamo.reset()
        with dispatch.use_profile("native-traced"):
            code = _graph_of(_mlp, x, up, down)
            compiled = torch.compile(_mlp, dynamic=False)(x, up, down)
    assert "astrai" not in shipped and shipped.count("linear(") == 2
    assert code.count("torch.ops.astrai.native_linear") == 2
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape", [(32,), (0, 32), (5, 32), (2, 3, 32)])
def test_compiled_it_serves_any_layout_and_rank(shape: tuple[int, ...]) -> None:
    _needs_onednn()
    up, _ = _weights()
    x = torch.randn(*reversed(shape)).permute(*reversed(range(len(shape))))  # not contiguous
    b = torch.randn(48)
    with torch.no_grad():
        got = torch.compile(rows.onednn_linear, dynamic=False)(x, up, b)
    torch.testing.assert_close(got, F.linear(x, up, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_strided_bias_and_no_input_features_are_served(compiled: bool) -> None:
    _needs_onednn()
    up, _ = _weights()
    x, b = torch.randn(16, 32), torch.randn(96)
    fn = torch.compile(rows.onednn_linear, dynamic=False) if compiled else rows.onednn_linear
    with torch.no_grad():
        torch.testing.assert_close(fn(x, up, b[::2]), F.linear(x, up, b[::2]),
                                   rtol=1e-5, atol=1e-5)
        empty_w = torch.randn(48, 0)
        torch.testing.assert_close(fn(torch.randn(16, 0), empty_w, b[:48]),
                                   b[:48].expand(16, 48))


@pytest.mark.parametrize("tokens", [2, 16])
@pytest.mark.parametrize("compiled", [False, True])
def test_under_cpu_autocast_a_call_gets_f_linears_precision(
        kernels: ModuleType, tokens: int, compiled: bool) -> None:
    up, _ = _weights()
    x = torch.randn(tokens, 32)
    fn = torch.compile(ops.linear, dynamic=False) if compiled else ops.linear
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = fn(x, up), F.linear(x, up)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)
