"""Multi-head attention layers that compute attention themselves with batched products
(XGLM, TrOCR, MVP; BERT-era layers without an output projection: Megatron-BERT): routed
only where a copy computes what ``ops.attention`` does, and then equal to the plain
model - padded, with a cache, attending across to an encoder's output (its keys computed
once and read back), with MVP's prompt keys, and with the attention weights asked for.
A training call with a row that has no key left to attend to stays the layer's own
(Bloom's ALiBi layers' too), compiled as well."""

from __future__ import annotations

import copy
import inspect
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from transformers import (
    BartConfig,
    BartForCausalLM,
    BloomConfig,
    BloomForCausalLM,
    MegatronBertConfig,
    MegatronBertForCausalLM,
    MvpConfig,
    MvpForCausalLM,
    TrOCRConfig,
    TrOCRForCausalLM,
    XGLMConfig,
    XGLMForCausalLM,
)
from transformers.models.xglm import modeling_xglm

from astrai.dispatch.stats import MODEL_OWN, reset_stats, stats
from astrai.integrations.transformers import dispatch_model, restore_model, verify_model
from tests._zoo import (
    quiet,  # noqa: F401 - the fixture
    same_step,
)

#: Releases whose layers take a head mask (4.x): astrai leaves them to their own code,
#: with the reason (``test_a_layer_taking_more_is_left_with_the_reason``).
_HEAD_MASKED = "layer_head_mask" in inspect.signature(
    modeling_xglm.XGLMAttention.forward).parameters

pytestmark = [pytest.mark.usefixtures("quiet"),
              pytest.mark.skipif(_HEAD_MASKED, reason="this transformers' layers take a "
                                                      "head mask")]


def _xglm() -> XGLMForCausalLM:
    torch.manual_seed(0)
    return XGLMForCausalLM(XGLMConfig(
        vocab_size=97, d_model=32, attention_heads=4, ffn_dim=64, num_layers=2,
        max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0)).eval()


def _trocr() -> TrOCRForCausalLM:
    torch.manual_seed(0)
    return TrOCRForCausalLM(TrOCRConfig(
        vocab_size=97, d_model=32, decoder_attention_heads=4, decoder_ffn_dim=64,
        decoder_layers=2, cross_attention_hidden_size=24, max_position_embeddings=64,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)).eval()


def _mvp() -> MvpForCausalLM:
    torch.manual_seed(0)
    return MvpForCausalLM(MvpConfig(
        vocab_size=97, d_model=32, decoder_attention_heads=4, encoder_attention_heads=4,
        decoder_ffn_dim=64, encoder_ffn_dim=64, decoder_layers=2, encoder_layers=2,
        max_position_embeddings=64, use_prompt=True, prompt_length=3, prompt_mid_dim=16,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)).eval()


def _megatron() -> MegatronBertForCausalLM:
    torch.manual_seed(0)
    return MegatronBertForCausalLM(MegatronBertConfig(
        vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, is_decoder=True,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).eval()


def _feed() -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 97, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    return {"input_ids": ids, "attention_mask": mask}


def _routed(plain: nn.Module) -> nn.Module:
    routed = copy.deepcopy(plain)
    report = dispatch_model(routed)
    layers = [e for e in report.routed if e.family == "attention"]
    assert layers and {e.detail for e in layers} == {
        "multi-head attention of its own (batched products)"}
    assert not [n for n in report.not_routed if n.family == "attention"]
    return routed


@pytest.mark.parametrize("make", [_xglm, _mvp, _megatron],
                         ids=["xglm", "mvp-prompts", "megatron-bert"])
def test_a_layer_is_served_by_ops_attention(make: Any) -> None:
    plain = make()
    routed = _routed(plain)
    feed = _feed()
    reset_stats()
    with torch.no_grad():
        want = plain(**feed, output_attentions=True)
        got = routed(**feed, output_attentions=True)
    assert stats().computed("attention") == 2
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
    assert len(got.attentions) == len(want.attentions) == 2
    for g, w in zip(got.attentions, want.attentions, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)

    reset_stats()
    with torch.no_grad():  # no weights asked for: none computed, so a fast row serves
        routed(**feed)
    assert stats().computed("attention") == 2 and stats().served("attention", row="math") == 0

    new = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(routed.generate(**feed, **new), plain.generate(**feed, **new))
    served = verify_model(routed, **feed)
    assert served["attention"] == 2
    assert not [site for site in served.unreached if site.startswith("attention")
                and "encoder_attn" not in site]

    restore_model(routed)
    with torch.no_grad():
        assert torch.equal(routed(**feed).logits, plain(**feed).logits)


def test_attention_across_reads_its_keys_back_from_the_cache() -> None:
    plain = _trocr()
    routed = _routed(plain)
    feed = _feed()
    encoded = torch.randn(2, 7, 24, generator=torch.Generator().manual_seed(2))
    across = torch.ones(2, 7, dtype=torch.long)
    across[0, -2:] = 0  # the encoder's padding
    outs = []
    for model in (plain, routed):
        with torch.no_grad():
            first = model(**feed, encoder_hidden_states=encoded,
                          encoder_attention_mask=across, use_cache=True,
                          output_attentions=True)
            step = model(input_ids=first.logits[:, -1:].argmax(-1),
                         attention_mask=torch.cat([feed["attention_mask"],
                                                   torch.ones(2, 1, dtype=torch.long)], 1),
                         encoder_hidden_states=encoded, encoder_attention_mask=across,
                         cache=first.past_key_values, use_cache=True)
        outs.append((first, step))
    (want, want_step), (got, got_step) = outs
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
    for g, w in zip(got.cross_attentions, want.cross_attentions, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got_step.logits, want_step.logits, atol=1e-5, rtol=1e-5)


def _bloom() -> BloomForCausalLM:
    torch.manual_seed(0)
    return BloomForCausalLM(BloomConfig(vocab_size=97, hidden_size=32, n_layer=2, n_head=4,
                                        hidden_dropout=0.0, attention_dropout=0.0)).eval()


@pytest.mark.parametrize("make", [_xglm, _bloom], ids=["xglm", "bloom-alibi"])
def test_a_training_call_with_a_row_with_no_key_left_is_the_layers_own(make: Any) -> None:
    # a left-padded row's padded queries have no key left: the layer's softmax spreads
    # over masked keys and gives them gradients, which astrai's kernels do not (Bloom's
    # ALiBi layers compute attention themselves too)
    plain = make().train()
    routed = copy.deepcopy(plain)
    dispatch_model(routed)
    for feed, own in ((_feed(), True), ({"input_ids": _feed()["input_ids"],
                                         "attention_mask": torch.ones(2, 10)}, False)):
        reset_stats()
        same_step(plain, routed, feed, atol=1e-5, rtol=1e-4)
        assert (stats().served("attention", origin=MODEL_OWN) == 2) is own
        assert (stats().computed("attention") == 2) is not own

    # only a parameter that is not the layer's first needs gradients (as an adapter's):
    # the first layer's input needs none either
    for model in (plain, routed):
        for name, param in model.named_parameters():
            param.requires_grad_(name.endswith(".bias") and ".0." in name and (
                "v_proj" in name or "query_key_value" in name))
    reset_stats()
    assert len(same_step(plain, routed, _feed(), atol=1e-5, rtol=1e-4)) == 1
    assert stats().served("attention", origin=MODEL_OWN) == 2
    for model in (plain, routed):
        model.requires_grad_(True)

    # compiled (one graph): such a call is the layer's own there too
    same_step(plain, torch.compile(routed, fullgraph=True), _feed(), atol=1e-5, rtol=1e-4)


class _Doubled(modeling_xglm.XGLMAttention):
    """A layer of the same make that computes something else: its output doubled."""

    def forward(self, hidden_states, key_value_states=None, cache=None,  # type: ignore[no-untyped-def,override]
                attention_mask=None, **kwargs):
        out, weights = super().forward(hidden_states, key_value_states, cache,
                                       attention_mask, **kwargs)
        return out * 2, weights


class _Masked(modeling_xglm.XGLMAttention):
    """A layer of the same make whose forward takes a head mask."""

    def forward(self, hidden_states, key_value_states=None, cache=None,  # type: ignore[no-untyped-def,override]
                attention_mask=None, layer_head_mask=None, **kwargs):
        return super().forward(hidden_states, key_value_states, cache, attention_mask,
                               **kwargs)


@pytest.mark.parametrize(("cls", "reason"), [
    (_Doubled, "it does not compute multi-head attention as astrai serves it (attending "
               "to itself, it differs by"),
    (_Masked, "its forward takes layer_head_mask, which astrai's forward for it would "
              "not apply"),
])
def test_a_layer_computing_otherwise_is_left_with_the_reason(cls: type, reason: str
                                                             ) -> None:
    model = _xglm()
    layer = model.model.layers[1].self_attn
    swapped = cls(32, 4, layer_idx=1)
    swapped.load_state_dict(layer.state_dict())
    model.model.layers[1].self_attn = swapped
    plain = copy.deepcopy(model)
    report = dispatch_model(model)
    left = [n for n in report.not_routed if n.path == "model.layers.1.self_attn"]
    assert len(left) == 1 and left[0].reason.startswith(reason), left
    assert [e.path for e in report.routed if e.family == "attention"] == [
        "model.layers.0.self_attn"]
    feed = _feed()
    with torch.no_grad():
        torch.testing.assert_close(model(**feed).logits, plain(**feed).logits,
                                   atol=1e-5, rtol=1e-5)


def test_a_layer_going_through_the_attention_interface_keeps_the_adapter() -> None:
    # BART's layers hold the same projections and take key_value_states, but find their
    # attention function through transformers' interface: the adapter serves them there
    torch.manual_seed(0)
    model = BartForCausalLM(BartConfig(
        vocab_size=97, d_model=32, decoder_attention_heads=4, encoder_attention_heads=4,
        decoder_ffn_dim=64, encoder_ffn_dim=64, decoder_layers=2, encoder_layers=2,
        max_position_embeddings=64)).eval()
    report = dispatch_model(model)
    assert not [n for n in report.not_routed if n.family == "attention"]
    assert {e.detail for e in report.routed if e.family == "attention"} == {
        "astrai's attention adapter"}


def test_weights_asked_for_in_training_with_dropout_are_the_layers_own() -> None:
    # XGLM returns its weights before its dropout, BERT's after: such a call is its own
    torch.manual_seed(0)
    plain = XGLMForCausalLM(XGLMConfig(
        vocab_size=97, d_model=32, attention_heads=4, ffn_dim=64, num_layers=2,
        max_position_embeddings=64, dropout=0.0, attention_dropout=0.5,
        activation_dropout=0.0)).train()
    routed = _routed(plain)
    feed = {"input_ids": _feed()["input_ids"]}
    outs = []
    reset_stats()
    for model in (plain, routed):
        torch.manual_seed(4)
        outs.append(model(**feed, output_attentions=True))
    for g, w in zip(outs[1].attentions, outs[0].attentions, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(g.sum(-1), torch.ones_like(g.sum(-1)))
    torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=1e-5, rtol=1e-5)
    assert stats().served("attention", origin=MODEL_OWN) == 2


def test_float16_rows_with_no_key_left_are_the_layers_own() -> None:
    # in float16 the lowest mask value swallows the scores of a row with no key left;
    # astrai's kernels would round that row otherwise
    plain = _xglm().half()
    routed = _routed(plain)
    feed = _feed()
    reset_stats()
    with torch.no_grad():
        want, got = plain(**feed).logits, routed(**feed).logits
    torch.testing.assert_close(got, want, atol=0.02, rtol=0.01)
    assert stats().served("attention", origin=MODEL_OWN) == 2
    with torch.no_grad():  # unpadded: astrai's
        routed(input_ids=feed["input_ids"])
    assert stats().computed("attention") == 2
