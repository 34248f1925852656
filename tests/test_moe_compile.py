"""The MoE families traced: ``moe_experts`` and ``moe_router`` under ``torch.compile``
(default and ``fullgraph=True``) and ``torch.export``, alone and inside the routed MoE
models of the zoo, give what the plain model (or the eager facade) gives.

Compile is slow on a small CPU: the zoo's compile cases run three architectures (the
softmax router with a shared expert, Mixtral's, and Llama 4's dense experts with its
sigmoid router); export runs all five. Where the plain model itself fails a mode, its
case is skipped with the plain model's error."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import nn

from astrai import ops
from astrai.backends.moe_experts import grouped_mm_available, reference_moe_experts
from astrai.integrations.transformers import dispatch_model
from tests import _zoo

ARCHITECTURES = ("qwen2_moe", "mixtral", "qwen3_moe", "deepseek_v3", "llama4_text")
COMPILED = ("qwen2_moe", "mixtral", "llama4_text")
#: A prompt long enough for ``grouped_mm``'s eager region (16 tokens), and a decode step.
LENGTHS = (18, 1)


@pytest.fixture(autouse=True)
def _reset_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _models(name: str) -> tuple[nn.Module, nn.Module]:
    """The plain and the routed tiny model of ``name`` (no cache returned: one tensor out)."""
    if not _zoo.available(name):
        pytest.skip(f"this transformers has no {name}")
    plain, routed = _zoo.build(name), _zoo.build(name)
    for model in (plain, routed):
        config: Any = model.config
        config.use_cache = False
    dispatch_model(routed)
    return plain, routed


def _feed(model: nn.Module, seq: int) -> dict[str, torch.Tensor]:
    return _zoo.inputs(model, batch=1, seq=seq)


def _compiled(model: nn.Module, fullgraph: bool, backend: str = "inductor"
              ) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    compiled = torch.compile(model, fullgraph=fullgraph, backend=backend)
    return lambda feed: compiled(**feed).logits


def _exported(model: nn.Module, feed: dict[str, torch.Tensor]) -> torch.Tensor:
    ep = torch.export.export(model, (), {"input_ids": feed["input_ids"]})
    return ep.module()(**feed).logits  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", COMPILED)
@pytest.mark.parametrize("fullgraph", [False, True], ids=["default", "fullgraph"])
def test_a_routed_moe_model_compiles_to_the_plain_models_logits(name: str,
                                                                 fullgraph: bool) -> None:
    plain, routed = _models(name)
    feeds = [_feed(plain, seq) for seq in LENGTHS]
    with torch.no_grad():
        try:  # the plain model's own trace (without inductor's code generation)
            traced_plain = _compiled(plain, fullgraph, "aot_eager")
            for feed in feeds:
                traced_plain(feed)
        except Exception as exc:
            pytest.skip(f"the plain {name} does not compile: {type(exc).__name__}: {exc}")
        torch._dynamo.reset()
        run = _compiled(routed, fullgraph)
        for feed in feeds:
            torch.testing.assert_close(run(feed), plain(**feed).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ARCHITECTURES)
@pytest.mark.parametrize("seq", LENGTHS)
def test_a_routed_moe_model_exports_to_the_plain_models_logits(name: str, seq: int) -> None:
    plain, routed = _models(name)
    feed = _feed(plain, seq)
    with torch.no_grad():
        try:
            _exported(plain, feed)
        except Exception as exc:
            pytest.skip(f"the plain {name} does not export: {type(exc).__name__}: {exc}")
        got = _exported(routed, feed)
        torch.testing.assert_close(got, plain(**feed).logits, atol=1e-4, rtol=1e-4)


# -- the facades -----------------------------------------------------------------------


def _stack(dtype: torch.dtype, experts: int = 6, h: int = 16, i: int = 16
           ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return ((torch.randn(experts, 2 * i, h, generator=g) / 4).to(dtype),
            (torch.randn(experts, h, i, generator=g) / 4).to(dtype))


def _routed_mlp(gate_up: torch.Tensor, down: torch.Tensor, weights_on: str = "output"
                ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def mlp(hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        weights, index = ops.moe_router(logits, 2, normalize=True)
        return ops.moe_experts(hidden, index, weights.to(hidden.dtype), gate_up, down,
                               "silu", weights_on)
    return mlp


def _call(tokens: int, dtype: torch.dtype, experts: int = 6
          ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(tokens)
    return (torch.randn(tokens, 16, generator=g).to(dtype),
            torch.randn(tokens, experts, generator=g))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_facades_compile_fullgraph_to_eagers_result(dtype: torch.dtype) -> None:
    """18 float32 tokens are ``grouped_mm``'s eagerly (whose address check and
    bfloat16-only trace cannot be compiled); traced, ``grouped`` serves them through its
    operator, with autograd through torch's operators."""
    gate_up, down = _stack(dtype)
    mlp = _routed_mlp(gate_up, down)
    compiled = torch.compile(mlp, fullgraph=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for tokens in LENGTHS:
        hidden, logits = _call(tokens, dtype)
        with torch.no_grad():
            torch.testing.assert_close(compiled(hidden, logits), mlp(hidden, logits),
                                       atol=tol, rtol=tol)
    leaf = hidden.clone().requires_grad_()  # the decode step, recording autograd
    got = compiled(leaf, logits)
    (got.float() * torch.linspace(-1, 1, 16)).sum().backward()  # type: ignore[no-untyped-call]
    eager = hidden.clone().requires_grad_()
    want = mlp(eager, logits)
    (want.float() * torch.linspace(-1, 1, 16)).sum().backward()  # type: ignore[no-untyped-call]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    torch.testing.assert_close(leaf.grad, eager.grad, atol=tol, rtol=tol)


def _graph_targets(fn: Callable[..., Any], *args: Any) -> set[str]:
    """The call targets of the one graph dynamo makes of ``fn`` (fullgraph)."""
    targets: set[str] = set()

    def capture(gm: torch.fx.GraphModule, inputs: Any) -> Callable[..., Any]:
        targets.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    with torch.no_grad():
        torch.compile(fn, fullgraph=True, backend=capture)(*args)
    return targets


def test_a_traced_call_stands_in_the_graph_as_its_rows_operator() -> None:
    """Traced, the weights' addresses cannot be read: ``align`` counts them at their
    element size, so ``grouped_mm`` (16 bytes) is not chosen; ``grouped`` is, as its
    operator."""
    gate_up, down = _stack(torch.float32)
    hidden, logits = _call(18, torch.float32)
    targets = _graph_targets(_routed_mlp(gate_up, down), hidden, logits)
    assert "astrai.moe_experts_grouped.default" in targets
    assert not any("grouped_mm" in t for t in targets)


@pytest.mark.skipif(grouped_mm_available() is not True, reason="no F.grouped_mm")
def test_naming_grouped_mm_is_refused_when_traced() -> None:
    gate_up, down = _stack(torch.float32)
    hidden = _call(18, torch.float32)[0]
    index, weights = _choice(18)

    def named(hidden: torch.Tensor) -> torch.Tensor:
        return ops.moe_experts(hidden, index, weights, gate_up, down, "silu",
                               backend="grouped_mm")

    with torch.no_grad():
        named(hidden)  # eagerly, the weights' addresses are aligned to 16 bytes
        with pytest.raises(Exception, match="'grouped_mm' selected by the explicit "
                                            "argument cannot serve this call: requires "
                                            "align >= 16"):
            torch.compile(named, fullgraph=True, backend="eager")(hidden)


class _Mlp(nn.Module):
    def __init__(self, dtype: torch.dtype, weights_on: str) -> None:
        super().__init__()
        gate_up, down = _stack(dtype)
        self.gate_up, self.down = nn.Parameter(gate_up), nn.Parameter(down)
        self.weights_on = weights_on

    def forward(self, hidden: torch.Tensor, index: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        return ops.moe_experts(hidden, index, weights, self.gate_up, self.down, "gelu_tanh",
                               self.weights_on)


def _choice(tokens: int, experts: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    index = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(tokens)])
    index[0, 1] = experts  # an expert held elsewhere: the slot adds nothing
    return index, torch.rand(tokens, 2, generator=g)


@pytest.mark.parametrize("weights_on", ["output", "input"])
@pytest.mark.parametrize("tokens", [18, 2])  # more (token, slot) pairs than experts, fewer
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_an_exported_expert_call_names_torchs_operators_and_computes_the_sum(
        weights_on: str, tokens: int, dtype: torch.dtype) -> None:
    mlp = _Mlp(dtype, weights_on)
    hidden = torch.randn(tokens, 16, generator=torch.Generator().manual_seed(3)).to(dtype)
    index, weights = _choice(tokens)
    weights = weights.to(dtype)
    with torch.no_grad():
        ep = torch.export.export(mlp, (hidden, index, weights))
        got = ep.module()(hidden, index, weights)
        want = reference_moe_experts(hidden, index, weights, mlp.gate_up, mlp.down,
                                     "gelu_tanh", weights_on)
    assert not [n for n in ep.graph.nodes if "astrai" in str(n.target)]
    assert got.dtype == dtype and got.shape == hidden.shape
    tol = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_an_exported_expert_call_refuses_an_unknown_expert_when_it_runs() -> None:
    mlp = _Mlp(torch.float32, "output")
    hidden = torch.randn(18, 16)
    index, weights = _choice(18)
    with torch.no_grad():
        run = torch.export.export(mlp, (hidden, index, weights)).module()
        index[3, 0] = 7
        with pytest.raises(RuntimeError, match=r"names an expert outside 0\.\.6"):
            run(hidden, index, weights)
