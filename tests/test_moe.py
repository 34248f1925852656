"""The MoE families: ``moe_experts`` (a stack of gated experts applied to the tokens a
router chose; rows loop, grouped, grouped_mm, reference) and ``moe_router`` (top-k of
softmax or sigmoid, DeepSeek's correction bias and groups); their facades' validation,
their tables' regions, and ``dispatch_model`` recognising the expert stacks and routers
of transformers' MoE models by what they compute."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import astrai.dispatch as d
from astrai import ops
from astrai.backends.activation import torch_activation
from astrai.backends.moe_experts import (
    _every_expert,
    grouped_mm_available,
    grouped_mm_moe_experts,
    grouped_moe_experts,
    reference_moe_experts,
    torch_moe_experts,
)
from astrai.backends.moe_router import reference_moe_router, torch_moe_router
from astrai.integrations.transformers import dispatch_model, restore_model, verify_model
from tests import _zoo

EXPERT_ROWS = [torch_moe_experts, grouped_moe_experts, reference_moe_experts]
if grouped_mm_available() is True:
    EXPERT_ROWS.append(grouped_mm_moe_experts)


def _experts(e: int = 5, h: int = 16, i: int = 12, dtype: torch.dtype = torch.float32,
             seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(e, 2 * i, h, generator=g, dtype=torch.float64).to(dtype) / 4,
            torch.randn(e, h, i, generator=g, dtype=torch.float64).to(dtype) / 3)


def _choice(t: int, e: int, k: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return index, torch.rand(t, k, generator=g, dtype=torch.float64)


def _by_hand(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
             gate_up: torch.Tensor, down: torch.Tensor, act: str, on: str) -> torch.Tensor:
    """The definition, token by token, slot by slot, in float64."""
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        for k in range(index.shape[1]):
            e = int(index[t, k])
            if e == gate_up.shape[0]:
                continue
            w = float(weights[t, k])
            x = hidden[t].double() * (w if on == "input" else 1.0)
            gate, up = (gate_up[e].double() @ x).chunk(2)
            y = down[e].double() @ (torch_activation(gate, act) * up)
            out[t] += y * (w if on == "output" else 1.0)
    return out


@pytest.mark.parametrize("row", EXPERT_ROWS, ids=lambda r: r.__name__)
@pytest.mark.parametrize("on", ["output", "input"])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_every_expert_row_computes_the_definition(row: Any, on: str, act: str) -> None:
    gate_up, down = _experts()
    hidden = torch.randn(9, 16, generator=torch.Generator().manual_seed(2))
    index, weights = _choice(9, 5, 2)
    index[3, 1] = 5  # an expert held elsewhere: the slot adds nothing
    want = _by_hand(hidden, index, weights, gate_up, down, act, on)
    got = row(hidden, index, weights.float(), gate_up, down, act, on)
    assert got.dtype == torch.float32 and got.shape == hidden.shape
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("row", EXPERT_ROWS, ids=lambda r: r.__name__)
def test_expert_rows_in_bfloat16_stay_near_the_reference(row: Any) -> None:
    gate_up, down = _experts(i=16, dtype=torch.bfloat16)  # rows of 32 bytes: grouped_mm's
    hidden = torch.randn(33, 16, generator=torch.Generator().manual_seed(3)).bfloat16()
    index, weights = _choice(33, 5, 3)
    want = reference_moe_experts(hidden, index, weights.float(), gate_up, down, "silu")
    got = row(hidden, index, weights.float(), gate_up, down, "silu")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)


def test_no_token_hits_an_expert_and_an_unknown_expert_is_an_error() -> None:
    gate_up, down = _experts()
    hidden = torch.randn(2, 16)
    nobody = torch.full((2, 2), 5)
    for row in EXPERT_ROWS:
        assert torch.equal(row(hidden, nobody, torch.ones(2, 2), gate_up, down, "silu"),
                           torch.zeros(2, 16))
        with pytest.raises(ValueError, match="names expert 6, but there are 5 experts"):
            row(hidden, torch.full((2, 2), 6), torch.ones(2, 2), gate_up, down, "silu")


def test_gradients_flow_through_the_rows_that_train() -> None:
    gate_up, down = _experts(dtype=torch.float64)
    hidden = torch.randn(7, 16, dtype=torch.float64)
    index, weights = _choice(7, 5, 2)
    grads = []
    for row in (torch_moe_experts, grouped_moe_experts, reference_moe_experts):
        leaves = [t.clone().requires_grad_() for t in (hidden, weights, gate_up, down)]
        row(leaves[0], index, leaves[1], leaves[2], leaves[3], "silu").square().sum().backward()
        grads.append([t.grad for t in leaves])
    for other in grads[1:]:
        for a, b in zip(grads[0], other, strict=True):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("tokens", [2, 9])  # fewer (token, slot) pairs than experts, more
@pytest.mark.parametrize("on", ["output", "input"])
def test_the_traced_form_has_the_loops_values_and_gradients(tokens: int, on: str) -> None:
    """What a row traces to under export or autograd (torch's operators, no size from the
    data) gives the loop's sum and gradients, the slot naming no expert included."""
    gate_up, down = _experts(dtype=torch.float64)
    hidden = torch.randn(tokens, 16, dtype=torch.float64)
    index, weights = _choice(tokens, 5, 2)
    index[0, 1] = 5
    grads = []
    for traced in (True, False):
        leaves = [t.clone().requires_grad_() for t in (hidden, weights, gate_up, down)]
        x, w, up, dn = leaves
        out = (_every_expert(x, index, w, up, dn, "silu", on, False) if traced
               else grouped_moe_experts(x, index, w, up, dn, "silu", on))
        out.square().sum().backward()  # type: ignore[no-untyped-call]
        grads.append([out.detach(), *(t.grad for t in leaves)])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("args, match", [
    ((torch.randn(3, 16), torch.zeros(3, 2), torch.ones(3, 2)), "top_k_index must be an integer"),
    ((torch.randn(3, 16), torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2)),
     "with hidden's 3 tokens"),
    ((torch.randn(3, 16), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 1)),
     "top_k_weights must be floating, of top_k_index's shape"),
    ((torch.randn(3, 15), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2)),
     r"gate_up must be \[experts, 2 \* intermediate, 15\]"),
    ((torch.randn(3, 16).double(), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2)),
     "must have hidden's dtype torch.float64"),
])
def test_a_malformed_expert_call_is_refused(args: tuple[Any, ...], match: str) -> None:
    gate_up, down = _experts()
    with pytest.raises(ValueError, match=match):
        ops.moe_experts(*args, gate_up, down, "silu")


def test_a_bad_activation_or_weighting_is_refused_with_the_valid_names() -> None:
    gate_up, down = _experts()
    call = (torch.randn(3, 16), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2),
            gate_up, down)
    with pytest.raises(ValueError, match="unknown act 'swish'; activations: silu, gelu"):
        ops.moe_experts(*call, "swish")
    with pytest.raises(ValueError, match="weights_on must be one of output, input"):
        ops.moe_experts(*call, "silu", "inside")
    with pytest.raises(TypeError, match=r"down must be a torch\.Tensor"):
        ops.moe_experts(*call[:4], [1.0], "silu")


def _expert_row(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> str:
    index, weights = _choice(hidden.shape[0], gate_up.shape[0], 2)
    ctx = ops.context("moe_experts", hidden, index, weights.to(hidden.dtype), gate_up, down,
                      "silu")
    return d.resolve("moe_experts", ctx).name


def test_the_table_gives_grouped_mm_its_measured_region() -> None:
    gate_up, down = _experts(h=16, i=16)
    first = "grouped_mm" if grouped_mm_available() is True else "grouped"
    with torch.no_grad():
        assert _expert_row(torch.randn(16, 16), gate_up, down) == first  # fp32, 16 tokens
        assert _expert_row(torch.randn(15, 16), gate_up, down) == "grouped"  # decode side
        bf_up, bf_down = gate_up.bfloat16(), down.bfloat16()
        assert _expert_row(torch.randn(64, 16).bfloat16(), bf_up, bf_down) == "grouped"
        odd_up, odd_down = _experts(h=16, i=11)  # 44-byte rows: not aligned to 16
        assert _expert_row(torch.randn(64, 16), odd_up, odd_down) == "grouped"
    assert _expert_row(torch.randn(64, 16), gate_up, down) == "grouped"  # no CPU backward


def test_explain_says_why_grouped_mm_lost_a_training_call() -> None:
    gate_up, down = _experts(dtype=torch.bfloat16)
    index, weights = _choice(4, 5, 2)
    ctx = ops.context("moe_experts", torch.randn(4, 16).bfloat16(), index, weights.bfloat16(),
                      gate_up, down, "silu")
    text = str(d.explain("moe_experts", ctx))
    assert "grouped_mm" in text and "grad_enabled" in text


# -- moe_router ------------------------------------------------------------------------


def _scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    return torch.softmax(logits.double(), -1) if scoring == "softmax" else logits.double().sigmoid()


@pytest.mark.parametrize("row", [torch_moe_router, reference_moe_router],
                         ids=lambda r: r.__name__)
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("normalize", [False, True])
def test_router_rows_take_the_top_k_scores(row: Any, scoring: str, normalize: bool) -> None:
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(4))
    weights, index = row(logits, 3, scoring, normalize, scale=1.5)
    assert weights.dtype == torch.float32 and index.dtype == torch.int64
    scores = _scores(logits, scoring)
    for t in range(6):
        best = sorted(range(8), key=lambda e: -float(scores[t, e]))[:3]
        assert sorted(index[t].tolist()) == sorted(best)
        chosen = scores[t, index[t]]
        if normalize:
            chosen = chosen / chosen.sum()
        torch.testing.assert_close(weights[t].double(), chosen * 1.5, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("row", [torch_moe_router, reference_moe_router],
                         ids=lambda r: r.__name__)
def test_router_groups_and_bias_choose_as_deepseek_does(row: Any) -> None:
    g = torch.Generator().manual_seed(6)
    logits, bias = torch.randn(10, 8, generator=g), torch.randn(8, generator=g)
    weights, index = row(logits, 2, "sigmoid", True, bias, 4, 2, 2.5)
    scores = logits.double().sigmoid()
    choice = scores + bias.double()
    for t in range(10):
        groups = choice[t].reshape(4, 2).sum(-1)  # two per group: both are the best two
        kept = sorted(range(4), key=lambda q: -float(groups[q]))[:2]
        allowed = [e for e in range(8) if e // 2 in kept]
        best = sorted(allowed, key=lambda e: -float(choice[t, e]))[:2]
        assert sorted(index[t].tolist()) == sorted(best)
        chosen = scores[t, index[t]]
        torch.testing.assert_close(weights[t].double(), chosen / chosen.sum() * 2.5,
                                   atol=1e-6, rtol=1e-6)


def test_sigmoid_without_bias_chooses_by_logit_where_sigmoid_saturates() -> None:
    logits = torch.tensor([[30.0, 40.0, 35.0, -1.0]])  # sigmoid: 1.0, 1.0, 1.0 in float32
    for row in (torch_moe_router, reference_moe_router):
        _, index = row(logits, 1, "sigmoid")
        assert index.tolist() == [[1]]


@pytest.mark.parametrize("kwargs, match", [
    (dict(top_k=9), r"top_k must be an int in 1..8"),
    (dict(top_k=2, scoring="relu"), "scoring must be one of softmax, sigmoid"),
    (dict(top_k=2, bias=torch.zeros(8)), "bias must be None or a floating .8. with sigmoid"),
    (dict(top_k=2, scoring="sigmoid", groups=3), "groups must divide the 8 experts"),
    (dict(top_k=4, scoring="sigmoid", groups=4, top_groups=1), "holding top_k experts"),
    (dict(top_k=2, scale="2"), "scale must be a number"),
])
def test_a_malformed_router_call_is_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ops.moe_router(torch.randn(3, 8), **kwargs)


# -- in a model --------------------------------------------------------------------


def _moe_model(name: str, **overrides: Any) -> nn.Module:
    config = _zoo._config(name)
    for key, value in overrides.items():
        setattr(config, key, value)
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).float().eval()


def _routed_equals_plain(model: nn.Module) -> Any:
    plain = copy.deepcopy(model)
    report = dispatch_model(model)
    feed = _zoo.inputs(plain)
    torch.testing.assert_close(_zoo.logits(model, feed), _zoo.logits(plain, feed),
                               atol=1e-5, rtol=1e-5)
    counts = verify_model(model, **feed)
    assert counts["moe_experts"] > 0 and counts["moe_router"] > 0
    return report


@pytest.mark.skipif(not _zoo.available("deepseek_v3"), reason="transformers without DeepSeek-V3")
def test_deepseek_groups_and_renormalisation_are_recognised() -> None:
    model = _moe_model("deepseek_v3", n_routed_experts=8, n_group=4, topk_group=2,
                       norm_topk_prob=True, num_local_experts=8)
    report = _routed_equals_plain(model)
    details = [r.detail for r in report.routed if r.family == "moe_router"]
    assert details and all("within the best 2 of 4 groups" in x and "renormalised" in x
                           for x in details), details


@pytest.mark.skipif(not _zoo.available("qwen3_moe"), reason="transformers without Qwen3-MoE")
@pytest.mark.parametrize("normalize", [False, True])
def test_qwen_renormalisation_is_told_by_what_the_router_computes(normalize: bool) -> None:
    report = _routed_equals_plain(_moe_model("qwen3_moe", norm_topk_prob=normalize))
    details = {r.detail for r in report.routed if r.family == "moe_router"}
    assert details == {"top-2 of softmax" + (", renormalised" if normalize else "")}


@pytest.mark.skipif(not _zoo.available("mixtral"), reason="transformers without Mixtral")
@pytest.mark.parametrize("implementation", ["batched_mm", "grouped_mm"])
def test_transformers_own_experts_implementations_are_recognised(implementation: str) -> None:
    model = _zoo.build("mixtral")
    try:
        model.set_experts_implementation(implementation)
    except (AttributeError, ValueError, ImportError) as exc:
        pytest.skip(f"this transformers cannot set {implementation}: {exc}")
    report = _routed_equals_plain(model)
    assert [n for n in report.not_routed if n.family != "embedding"] == []


@pytest.mark.skipif(not _zoo.available("mixtral"), reason="transformers without Mixtral")
def test_the_experts_activation_is_covered_and_restore_is_exact() -> None:
    model = _zoo.build("mixtral")
    plain = copy.deepcopy(model)
    dispatch_model(model)
    experts = model.model.layers[0].mlp.experts
    assert "forward" in experts.__dict__ and "forward" not in experts.act_fn.__dict__
    feed = _zoo.inputs(plain)
    with d.op_backend(moe_experts="torch", moe_router="reference"):
        torch.testing.assert_close(_zoo.logits(model, feed), _zoo.logits(plain, feed),
                                   atol=1e-5, rtol=1e-5)
    assert restore_model(model) > 0
    assert torch.equal(_zoo.logits(model, feed), _zoo.logits(plain, feed))


class BiasedExperts(nn.Module):
    """Expert weights of the usual shapes, but a forward that adds a bias to every
    expert's output: not the gated-expert computation."""

    def __init__(self, e: int = 4, h: int = 16, i: int = 8) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(e, 2 * i, h) / 4)
        self.down_proj = nn.Parameter(torch.randn(e, h, i) / 3)
        self.act_fn = nn.SiLU()

    def forward(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
                ) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for t in range(hidden.shape[0]):
            for k in range(index.shape[1]):
                e = int(index[t, k])
                gate, up = F.linear(hidden[t], self.gate_up_proj[e]).chunk(2)
                y = F.linear(self.act_fn(gate) * up, self.down_proj[e]) + 1.0
                out[t] += y * weights[t, k]
        return out


class Gate(nn.Module):
    """A router: softmax, then top-k, then one more step no form has (squared)."""

    def __init__(self, e: int = 4, h: int = 16, k: int = 2, squared: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(e, h) / 4)
        self.top_k, self.squared = k, squared

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = F.linear(x, self.weight)
        top, index = torch.topk(torch.softmax(logits, -1), self.top_k, dim=-1)
        return logits, top.square() if self.squared else top, index


class Block(nn.Module):
    def __init__(self, experts: nn.Module, gate: nn.Module) -> None:
        super().__init__()
        self.experts, self.gate = experts, gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, weights, index = self.gate(x)
        return self.experts(x, index, weights)


def test_a_stack_computing_something_else_is_refused_with_the_reason() -> None:
    block = Block(BiasedExperts(), Gate())
    report = dispatch_model(block)
    refused = {n.path: n for n in report.not_routed}
    assert "experts" in refused and refused["experts"].family == "moe_experts"
    assert "computes none of their forms" in refused["experts"].reason
    # the router is served; the refused stack's activation is routed on its own
    assert {r.path: r.family for r in report.routed} == {"gate": "moe_router",
                                                         "experts.act_fn": "activation"}


def test_a_router_computing_something_else_keeps_the_linear_familys_reason() -> None:
    block = Block(BiasedExperts(), Gate(squared=True))
    report = dispatch_model(block)
    refused = {n.path: n for n in report.not_routed}
    # the linear family claims it first (a 2-d weight) and the router family cannot
    # serve it either: the first refusal is the one reported
    assert refused["gate"].family == "linear" and "routing layer" in refused["gate"].reason


@pytest.mark.skipif(not _zoo.available("mixtral"), reason="transformers without Mixtral")
def test_asking_for_linear_alone_leaves_routers_to_their_family() -> None:
    model = _zoo.build("mixtral")
    report = dispatch_model(model, families=("linear",))
    gates = [n for n in report.not_routed if n.path.endswith("mlp.gate")]
    assert gates and all(n.family == "linear" for n in gates)
    report = dispatch_model(model)
    assert {r.path for r in report.routed if r.family == "moe_router"} == {
        "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"}
