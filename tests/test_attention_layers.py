"""Attention layers that compute attention themselves, masked by a causal buffer of their
own (GPT-Neo's global and local layers): routed only where a copy computes what
``ops.attention`` does, and then equal to the plain model - with a sliding window
shorter than the input, padding, a cache, and the attention weights asked for."""

from __future__ import annotations

import copy
import inspect
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from transformers import GPTNeoConfig, GPTNeoForCausalLM
from transformers.models.gpt_neo import modeling_gpt_neo

from astrai.dispatch.stats import MODEL_OWN, reset_stats, stats
from astrai.integrations.transformers import dispatch_model, restore_model, verify_model
from tests._zoo import (
    quiet,  # noqa: F401 - the fixture
    same_step,
)

#: Releases whose GPT-Neo layer takes a head mask (4.x): astrai leaves that layer to its
#: own code, with the reason (``test_a_layer_taking_a_head_mask_is_left_with_the_reason``).
_HEAD_MASKED = "head_mask" in inspect.signature(
    modeling_gpt_neo.GPTNeoSelfAttention.forward).parameters

pytestmark = [pytest.mark.usefixtures("quiet"),
              pytest.mark.skipif(_HEAD_MASKED, reason="this transformers' GPT-Neo layer "
                                                      "takes a head mask")]


def _neo() -> GPTNeoForCausalLM:
    torch.manual_seed(0)
    config = GPTNeoConfig(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4,
                          attention_types=[[["global", "local"], 1]], window_size=3,
                          max_position_embeddings=64, intermediate_size=64)
    return GPTNeoForCausalLM(config).eval()


def _feed() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    return {"input_ids": ids, "attention_mask": mask}


def test_a_gpt_neo_layer_is_served_by_ops_attention() -> None:
    plain = _neo()
    routed = copy.deepcopy(plain)
    report = dispatch_model(routed)
    layers = [e for e in report.routed if e.family == "attention"]
    assert [e.path for e in layers] == [f"transformer.h.{i}.attn.attention" for i in (0, 1)]
    assert {e.detail for e in layers} == {"its causal buffer as an additive mask"}
    assert not [n for n in report.not_routed if n.family == "attention"]

    feed = _feed()
    with torch.no_grad():
        want = plain(**feed, output_attentions=True)
        got = routed(**feed, output_attentions=True)
    # the local layer's window (3) is shorter than the input (10): its mask is the buffer's
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
    for g, w in zip(got.attentions, want.attentions, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)
    assert float(want.attentions[1][0, :, -1, :-3].abs().max()) == 0.0  # local: 3 back

    # decoding with the cache (one query against many keys), padded
    new = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(routed.generate(**feed, **new), plain.generate(**feed, **new))
    served = verify_model(routed, **feed)
    assert served["attention"] == 2
    assert not [site for site in served.unreached if site.startswith("attention")]

    restore_model(routed)
    with torch.no_grad():
        assert torch.equal(routed(**feed).logits, plain(**feed).logits)


def test_rows_with_no_key_left_train_and_autocast_as_the_plain_layer() -> None:
    # a left-padded row's padded queries have no key that both the causal buffer and the
    # padding allow: the layer replaces masked scores, astrai would add the mask, and the
    # two differ there in gradients and under autocast - such a call is the layer's own
    plain = _neo().train()
    plain.config.attn_dropout = plain.config.embed_dropout = plain.config.resid_dropout = 0
    for module in plain.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    routed = copy.deepcopy(plain)
    dispatch_model(routed)
    feed = _feed()
    reset_stats()
    same_step(plain, routed, feed, atol=1e-6, rtol=1e-5)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        # bfloat16 roundings of the other routed ops, well under the 0.2 the padded rows
        # differed by when astrai served them
        torch.testing.assert_close(routed(**feed).logits, plain(**feed).logits,
                                   atol=0.02, rtol=0)

    assert stats().served("attention", origin=MODEL_OWN) > 0

    # with no padding (and in inference with it) astrai serves the layer
    reset_stats()
    whole = {"input_ids": feed["input_ids"], "attention_mask": torch.ones_like(
        feed["attention_mask"])}
    same_step(plain, routed, whole, atol=1e-5, rtol=1e-4)
    with torch.no_grad():
        routed(**feed)
    assert stats().served("attention", origin=MODEL_OWN) == 0
    assert stats().computed("attention") >= 4


class _Halved(modeling_gpt_neo.GPTNeoSelfAttention):
    """A layer of the same make that computes something else: its scores halved."""

    def _attn(self, query, key, value, attention_mask=None):  # type: ignore[no-untyped-def]
        return super()._attn(query * 0.5, key, value, attention_mask)


def _left_with(cls: type[nn.Module], index: int, kind: str) -> Any:
    """The report of a GPT-Neo whose layer ``index`` (of ``kind``) is a ``cls`` holding
    its weights: the one attention layer left, and the report."""
    model = _neo()
    layer = model.transformer.h[index].attn
    swapped = cls(model.config, kind, index)
    swapped.load_state_dict(layer.attention.state_dict())
    layer.attention = swapped
    report = dispatch_model(model)
    (left,) = [n for n in report.not_routed if n.family == "attention"]
    return left, report


def test_a_layer_of_that_make_computing_otherwise_is_left_with_the_reason() -> None:
    left, report = _left_with(_Halved, 0, "global")
    assert left.path == "transformer.h.0.attn.attention"
    assert "does not compute attention masked by its causal buffer" in left.reason
    assert [e.path for e in report.routed if e.family == "attention"] == [
        "transformer.h.1.attn.attention"]


class _HeadMasked(modeling_gpt_neo.GPTNeoSelfAttention):
    """A layer of that make whose forward takes a head mask (as older releases' did)."""

    def forward(self, hidden_states, attention_mask=None, layer_past=None,  # type: ignore[no-untyped-def,override]
                head_mask=None, use_cache=False, output_attentions=False, **kwargs):
        out, weights = super().forward(hidden_states, attention_mask, layer_past, use_cache,
                                       output_attentions)
        return out, weights


def test_a_layer_taking_a_head_mask_is_left_with_the_reason() -> None:
    left, _ = _left_with(_HeadMasked, 1, "local")
    assert left.path == "transformer.h.1.attn.attention"
    assert left.reason.startswith("its forward takes head_mask")
