"""Tiny random models of the transformers architectures users run, built from configs
(nothing is downloaded), for the model-zoo test and ``benchmarks``' coverage table.

``ZOO`` maps a model type to the overrides its config needs to be tiny; ``build(name)``
returns the model (causal-LM head where the architecture has one) in float32, eval
mode, with random norm weights, or ``None`` where the installed transformers lacks the
architecture. ``inputs(model)`` gives the keyword arguments of one forward.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

_TINY: dict[str, Any] = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
_MOE: dict[str, Any] = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=32, shared_expert_intermediate_size=32,
                            decoder_sparse_step=1, mlp_only_layers=[])

#: model type -> config overrides (on top of the tiny defaults); ``None`` drops a key.
ZOO: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": dict(sliding_window=4),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2": {},
    "qwen2_moe": _MOE,
    "qwen3": dict(head_dim=16),
    "qwen3_moe": dict(_MOE, head_dim=16),
    "gemma": dict(head_dim=16),
    "gemma2": dict(head_dim=16, sliding_window=4, attn_logit_softcapping=2.0,
                   final_logit_softcapping=5.0, query_pre_attn_scalar=24),
    "gemma3_text": dict(head_dim=16, sliding_window=4, query_pre_attn_scalar=24),
    "phi": dict(partial_rotary_factor=0.5),
    "phi3": {},
    "gpt2": dict(n_inner=128),
    "gpt_neox": dict(rotary_pct=0.25, use_parallel_residual=True),
    "gptj": dict(rotary_dim=8, n_inner=128),
    "falcon": dict(new_decoder_architecture=False, multi_query=True),
    "olmo": {},
    "olmo2": {},
    "stablelm": dict(partial_rotary_factor=0.25),
    "starcoder2": dict(sliding_window=4),
    "granite": {},
    "cohere": {},
    "deepseek_v3": dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                        moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
                        topk_group=1, q_lora_rank=32, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                        rope_interleave=True),
    "glm": dict(head_dim=16, partial_rotary_factor=0.5),
    "glm4": dict(head_dim=16, partial_rotary_factor=0.5),
    "smollm3": dict(no_rope_layer_interval=2),
    "llama4_text": dict(num_local_experts=4, num_experts_per_tok=1, head_dim=16,
                        intermediate_size_mlp=128, interleave_moe_layer_step=1,
                        no_rope_layers=[1, 0], attention_chunk_size=8),
    "bert": dict(is_decoder=True),
    "t5": dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
               num_heads=4, decoder_start_token_id=0),
    "opt": dict(ffn_dim=128, word_embed_proj_dim=64),
    "bloom": dict(n_head=4),
}


def _config(name: str) -> Any:
    from transformers import AutoConfig
    overrides = dict(_TINY)
    overrides.update(ZOO[name])
    return AutoConfig.for_model(name, **overrides)


@pytest.fixture
def quiet(caplog: pytest.LogCaptureFixture) -> Any:
    """transformers' warnings and logs kept out of a model test's output."""
    import logging
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        caplog.set_level(logging.ERROR, logger="transformers")
        yield


def available(name: str) -> bool:
    """Whether the installed transformers has the architecture ``name``."""
    try:
        _config(name)
    except (KeyError, ValueError, ImportError):
        return False
    return True


def build(name: str, attn_implementation: str = "sdpa") -> nn.Module:
    """The tiny random model of ``name`` (float32, eval), its norm weights random; the
    calling test skips where transformers is not installed."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM
    config = _config(name)
    torch.manual_seed(0)
    auto = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    try:
        model = auto.from_config(config, attn_implementation=attn_implementation)
    except ValueError:  # an architecture without that implementation (Gemma 2, Bloom)
        model = auto.from_config(config, attn_implementation="eager")
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if "norm" in param_name or "ln" in param_name.split(".")[-2:-1][0:1] or (
                    p.dim() == 1 and param_name.endswith("weight") and torch.all(p == 1)):
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.2)
    return model.float().eval()


def inputs(model: nn.Module, batch: int = 2, seq: int = 10) -> dict[str, torch.Tensor]:
    """One forward's keyword arguments: random token ids (and decoder ids for an
    encoder-decoder)."""
    ids = torch.randint(3, 128, (batch, seq), generator=torch.Generator().manual_seed(1))
    out = {"input_ids": ids}
    if getattr(model.config, "is_encoder_decoder", False):
        out["decoder_input_ids"] = ids[:, : seq // 2]
    return out


def greedy(model: nn.Module, feed: dict[str, torch.Tensor], new: int = 4) -> torch.Tensor:
    """``new`` greedy tokens after the prompt."""
    with torch.no_grad():
        return model.generate(**feed, max_new_tokens=new, min_new_tokens=new,  # type: ignore[operator]
                              do_sample=False, pad_token_id=0)


def logits(model: nn.Module, feed: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(**feed).logits  # type: ignore[no-any-return]


def coverage_row(name: str, report: Any) -> str:
    """One line of the coverage table: routed counts per family, the shares, and what
    is not routed by kind."""
    counts = report.counts()
    shares = report.shares()
    left: dict[str, int] = {}
    for n in report.not_routed:
        left[n.family] = left.get(n.family, 0) + 1
    cells = " | ".join(str(counts.get(f, 0)) for f in COLUMNS)
    rest = ", ".join(f"{family} {n}" for family, n in sorted(left.items())) or "-"
    flops, params = (("-" if shares[k] is None else f"{shares[k]:.0%}")
                     for k in ("matmul_flops", "parameters"))
    return f"| {name} | {cells} | {flops} | {params} | {rest} |"


_FIRST = ("attention", "rotary", "rms_norm", "gated_rms_norm", "layer_norm", "linear",
          "activation", "gated_activation", "depthwise_conv1d", "moe_experts", "moe_router",
          "cross_entropy")


def _columns() -> tuple[str, ...]:
    from astrai.integrations.transformers.routing import model_families
    every = tuple(model_families())
    return tuple(f for f in _FIRST if f in every) + tuple(f for f in every if f not in _FIRST)


#: The families the table has a column for: every family dispatch_model routes, in order.
COLUMNS = _columns()
TABLE_HEAD = ("| model type | " + " | ".join(COLUMNS) + " | matmul FLOPs | parameters | "
              "not routed |\n|" + "---|" * (len(COLUMNS) + 4))


def padded_step(model: nn.Module, feed: dict[str, torch.Tensor]
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one training step on ``feed`` (the usual shifted labels, padding
    ignored: the last padded position predicts the first real token) and the gradients it
    gives, by parameter name (a compiled model's names as its original's)."""
    model.zero_grad()
    labels = feed["input_ids"].masked_fill(feed["attention_mask"] == 0, -100)
    loss = model(**feed, labels=labels).loss
    loss.backward()
    return loss.detach(), {n.removeprefix("_orig_mod."): p.grad.clone()
                           for n, p in model.named_parameters() if p.grad is not None}


def same_step(plain: nn.Module, routed: nn.Module, feed: dict[str, torch.Tensor], *,
              atol: float, rtol: float) -> dict[str, torch.Tensor]:
    """Assert that one ``padded_step`` of ``routed`` gives ``plain``'s loss (within
    ``atol``, absolute and relative) and gradients (within ``atol`` and ``rtol``), to the
    same parameters; the plain model's gradients."""
    want_loss, want = padded_step(plain, feed)
    got_loss, got = padded_step(routed, feed)
    torch.testing.assert_close(got_loss, want_loss, atol=atol, rtol=atol)
    assert got.keys() == want.keys()
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, atol=atol, rtol=rtol, msg=name)
    return want
