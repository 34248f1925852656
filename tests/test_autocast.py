"""Families under torch's autocast: each call computes in the dtypes torch's own op would
(``astrai.dispatch.autocasting``), on the compiled hot path, the Python one and under
``torch.compile``; mixed dtypes that autocast produces are cast, never refused; a
decision kept for a float32 call never answers the same call under autocast."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from astrai import ops
from astrai.dispatch.autocasting import Autocast, autocasting, cast_operand
from astrai.dispatch.facade import FamilyCall
from tests.conftest import adopted

BF16 = torch.bfloat16


@pytest.fixture(params=["compiled", "python"])
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each test on the compiled hot path (where it can be built) and on the Python one."""
    if request.param == "compiled":
        built: ModuleType = request.getfixturevalue("built")
        with adopted(built):
            yield request.param
    else:
        with adopted(None):
            yield request.param


def cpu_autocast() -> torch.autocast:
    return torch.autocast("cpu", dtype=BF16)


def test_linear_computes_as_f_linear_does(path: str) -> None:
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(s, generator=g) for s in ((5, 16), (8, 16), (8,)))
    for _ in range(3):  # warm: the hot path keeps the float32 decision
        assert ops.linear(x, w, b).dtype == torch.float32
    with cpu_autocast():
        got, want = ops.linear(x, w, b), F.linear(x, w, b)
        mixed = ops.linear(x.to(BF16), w, b)  # a bf16 activation, float32 weights
    assert got.dtype == want.dtype == mixed.dtype == BF16
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(mixed, want)


def test_gradients_reach_the_float32_weights(path: str) -> None:
    g = torch.Generator().manual_seed(1)
    w0 = torch.randn(8, 16, generator=g)
    x = torch.randn(4, 16, generator=g)
    grads = []
    for fn in (ops.linear, F.linear):
        w = w0.clone().requires_grad_()
        with cpu_autocast():
            y = fn(x, w)
        assert y.dtype == BF16
        y.float().square().sum().backward()
        assert w.grad is not None and w.grad.dtype == torch.float32
        grads.append(w.grad)
    torch.testing.assert_close(grads[0], grads[1])


def test_attention_takes_the_dtypes_rotary_leaves(path: str) -> None:
    """Rotary promotes bf16 q and k with float32 cos/sin to float32 while v stays bf16:
    attention casts all three, as SDPA does under autocast."""
    g = torch.Generator().manual_seed(2)
    q, k = (torch.randn(2, 6, 4, 8, generator=g) for _ in range(2))
    v = torch.randn(2, 6, 4, 8, generator=g).to(BF16)
    with cpu_autocast():
        got = ops.attention(q, k, v, is_causal=True)
        want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2), is_causal=True)
    assert got.dtype == want.dtype == BF16
    torch.testing.assert_close(got.float(), want.transpose(1, 2).reshape(2, 6, 32).float(),
                               atol=2e-2, rtol=2e-2)


def test_heads_first_attention_under_autocast(path: str) -> None:
    from astrai.families.attention import attention_heads_first
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, 5, 8, generator=g) for _ in range(3))
    mask = torch.zeros(1, 1, 5, 5)
    with cpu_autocast():
        got = attention_heads_first(q, k, v.to(BF16), attn_mask=mask)
        want = F.scaled_dot_product_attention(q, k, v.to(BF16), attn_mask=mask)
    assert got.dtype == want.dtype == BF16
    torch.testing.assert_close(got.float(), want.transpose(1, 2).float(), atol=2e-2, rtol=2e-2)


def _experts_as_a_model_writes_them(hidden: torch.Tensor, index: torch.Tensor,
                                    weights: torch.Tensor, gate_up: torch.Tensor,
                                    down: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(hidden)
    for e in range(gate_up.shape[0]):
        token, slot = torch.where(index == e)
        gate, up = F.linear(hidden[token], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


@pytest.mark.parametrize("tokens", [6, 40])
def test_moe_experts_compute_as_a_models_loop(path: str, tokens: int) -> None:
    """Under autocast a model's loop over experts multiplies in bf16 (transformers'
    grouped experts multiply in float32 on a CPU, which autocast does not reach) and sums
    in its input's dtype: every row the table picks gives its input's dtype and the
    loop's values within bfloat16's rounding (40 tokens: the grouped matmul row's calls)."""
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(tokens, 16, generator=g)
    gate_up, down = torch.randn(4, 2 * 8, 16, generator=g), torch.randn(4, 16, 8, generator=g)
    index = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=g)
    with torch.no_grad(), cpu_autocast():
        got = ops.moe_experts(hidden, index, weights, gate_up, down, "silu")
        want = _experts_as_a_model_writes_them(hidden, index, weights, gate_up, down)
    assert got.dtype == want.dtype == torch.float32
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, atol=2e-2 * scale, rtol=2e-2)


def test_linear_cross_entropy_under_autocast(path: str) -> None:
    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(12, 16, generator=g), torch.randn(40, 16, generator=g)
    labels = torch.randint(0, 40, (12,), generator=g)
    with cpu_autocast():
        got = ops.linear_cross_entropy(hidden, weight, labels)
        want = F.cross_entropy(F.linear(hidden, weight), labels)
    assert want.dtype == torch.float32 and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_another_devices_autocast_changes_nothing(path: str) -> None:
    """CUDA autocast in force (its state is set without a GPU) leaves CPU calls as
    they are: no cast, and no endless hand-over."""
    x, w = torch.randn(3, 8), torch.randn(4, 8)
    torch.set_autocast_enabled("cuda", True)  # torch.autocast turns itself off without CUDA
    try:
        assert autocasting()
        out = ops.linear(x, w)
        assert torch.is_autocast_enabled("cuda")  # given back as it was
    finally:
        torch.set_autocast_enabled("cuda", False)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, w))


def test_rows_run_with_autocast_off(path: str) -> None:
    """The row sees the cast call with autocast off, as torch's kernel does."""
    from astrai import dispatch as d
    seen = []

    def row(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
            ) -> torch.Tensor:
        seen.append((x.dtype, weight.dtype, torch.is_autocast_enabled("cpu")))
        return F.linear(x, weight, bias)

    d.register_impl(d.ImplRecord("linear", "spy_row", row, spec=d.Spec.parse("dtype == bfloat16")),
                    before="torch")
    try:
        for _ in range(3):  # float32 calls: not the spy's
            ops.linear(torch.randn(2, 4), torch.randn(3, 4))
        with cpu_autocast():
            out = ops.linear(torch.randn(2, 4), torch.randn(3, 4))
        assert d.stats().served("linear", "spy_row") == 1
    finally:
        d.unregister_impl("linear", "spy_row")
    assert seen == [(BF16, BF16, False)] and out.dtype == BF16


def test_compiled_under_autocast() -> None:
    """A compiled function calling the facades under autocast: the same as eager, in one
    graph."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(4, 16, generator=g), torch.randn(16, 16, generator=g)

    def step(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=BF16):
            h = ops.linear(x, w)
            return ops.attention(h.view(1, 4, 2, 8), h.view(1, 4, 2, 8), h.view(1, 4, 2, 8))

    eager = step(x)
    compiled = torch.compile(step, fullgraph=True)(x)
    assert compiled.dtype == eager.dtype == BF16
    torch.testing.assert_close(compiled, eager)


def test_cast_operand_casts_as_autocast_does() -> None:
    assert cast_operand(torch.ones(2), BF16).dtype == BF16
    assert cast_operand(torch.ones(2, dtype=torch.float16), BF16).dtype == BF16
    assert cast_operand(torch.ones(2, dtype=torch.float64), BF16).dtype == torch.float64
    assert cast_operand(torch.ones(2, dtype=torch.int64), BF16).dtype == torch.int64
    assert cast_operand(None, BF16) is None


def test_an_autocast_naming_no_parameter_is_refused() -> None:
    def scale(x: torch.Tensor, factor: float, backend: object = None) -> torch.Tensor:
        return x * factor

    with pytest.raises(ValueError, match=r"'y', not a parameter of the facade \(x, factor\)"):
        FamilyCall.of(scale, lambda x, f: (x.dtype,), ("dtype",), {}, positional=2,
                      autocast=Autocast(("y",)))
