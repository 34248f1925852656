"""``attn_implementation="astrai"`` on real transformers models with tiny random weights.

Nothing is downloaded: every model is built from a config (hidden 64, 2 layers, 4
heads, vocab 128). Llama covers GQA (2 key/value heads) and, for the attention
weights, full multi-head attention too; Mistral a sliding window of 4 over 12
tokens (small enough that it changes the logits); Gemma 2 soft-capping, a sliding
window and a custom scale (``query_pre_attn_scalar``); gpt-oss attention sinks.
What a model asks for beyond plain attention becomes the facade's features, served
by the first row that declares them (``math`` for soft-capping, sinks and
``output_attentions=True``), and compared with transformers' eager attention.
"""

from __future__ import annotations

import copy
import logging
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import transformers
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
)

import astrai.dispatch as dispatch
from astrai.backends.native import native_available
from astrai.integrations import transformers as hf

if not hasattr(transformers, "AttentionInterface"):
    pytest.skip(f"attn_implementation='astrai' needs transformers >= 4.51 (this is "
                f"{transformers.__version__}); dispatch_model's tests cover older ones",
                allow_module_level=True)

SEQ = 12
WINDOW = 4
FP32_TOL = 1e-4
BF16_TOL = 2e-2
TINY: dict[str, Any] = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
    eos_token_id=2,
)


def llama_config() -> PretrainedConfig:
    """Llama with grouped-query attention: 4 query heads share 2 key/value heads."""
    return LlamaConfig(**TINY, num_key_value_heads=2)


def llama_mha_config() -> PretrainedConfig:
    """Llama with full multi-head attention: 4 query heads, 4 key/value heads."""
    return LlamaConfig(**TINY, num_key_value_heads=4)


def mistral_config() -> PretrainedConfig:
    """Mistral with full multi-head attention and a sliding window of 4 tokens."""
    return MistralConfig(**TINY, num_key_value_heads=4, sliding_window=WINDOW)


CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama-gqa": llama_config,
    "mistral-window": mistral_config,
}
#: The architectures whose attention weights are compared with eager's.
WEIGHT_CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    **CONFIGS, "llama-mha": llama_mha_config,
}

#: An attention table whose rows cannot return weights (``torch_native`` only).
NO_WEIGHTS_TABLE = """\
version: 1
family: attention
description: sdpa only
fallback: torch_native
rows:
  - name: torch_native
    impl: astrai.backends.attention.sdpa:sdpa_attention
    when: dtype in {float16, bfloat16, float32, float64} and not has_cache and ndim == 4
"""


@pytest.fixture(scope="module", autouse=True)
def _registered() -> None:
    """Install ``attn_implementation="astrai"`` once for the module."""
    hf.register()


def build(
    config: PretrainedConfig,
    impls: tuple[str, ...] = ("astrai", "sdpa", "eager"),
    dtype: torch.dtype = torch.float32,
    init: Callable[[PreTrainedModel], None] | None = None,
) -> dict[str, PreTrainedModel]:
    """One model per attention implementation, all with the same random weights (changed
    by ``init`` first, when given)."""
    torch.manual_seed(0)
    models: dict[str, PreTrainedModel] = {}
    state = None
    for impl in impls:
        # Each model needs its own config: the implementation is stored on it.
        model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            copy.deepcopy(config), attn_implementation=impl
        )
        if state is None:
            if init is not None:
                init(model)
            state = model.state_dict()
        else:
            model.load_state_dict(state)
        models[impl] = model.to(dtype).eval()
    return models


def tokens(batch: int = 2, seq: int = SEQ) -> torch.Tensor:
    """Random token ids, avoiding the special ones."""
    return torch.randint(3, 128, (batch, seq), generator=torch.Generator().manual_seed(1))


def left_padded() -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of two whose first row has 3 left-padding tokens: ``(input_ids, attention_mask)``."""
    ids, mask = tokens(), torch.ones(2, SEQ, dtype=torch.long)
    ids[0, :3], mask[0, :3] = 0, 0
    return ids, mask


def logits(model: PreTrainedModel, ids: torch.Tensor, **kwargs: object) -> torch.Tensor:
    """The model's float32 logits without autograd."""
    with torch.no_grad():
        out: torch.Tensor = model(ids, **kwargs).logits.float()
    return out


def greedy(model: PreTrainedModel, ids: torch.Tensor, **kwargs: object) -> torch.Tensor:
    """Eight greedy new tokens."""
    generate: Any = model.generate
    with torch.no_grad():
        out: torch.Tensor = generate(
            ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0, **kwargs
        )
    return out[:, ids.shape[1]:]


class _Attention(torch.nn.Module):
    """Stands in for a transformers attention layer: causal, 2 query heads per kv head."""

    is_causal = True
    num_key_value_groups = 2


def gqa_call(q_len: int = 6, kv_len: int = 6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random ``(query, key, value)`` in transformers' layout: 4 query heads, 2 kv heads."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, q_len, 16, generator=gen)
    k, v = (torch.randn(2, 2, kv_len, 16, generator=gen) for _ in range(2))
    return q, k, v


def padding_mask(kv_len: int = 6, pad: int = 2) -> torch.Tensor:
    """Boolean ``[2, 1, kv_len, kv_len]`` causal mask; the first row has ``pad`` left pads."""
    keep = torch.ones(kv_len, kv_len).tril().bool().expand(2, 1, kv_len, kv_len).clone()
    keep[0, :, :, :pad] = False
    return keep


def eager(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own eager attention (Llama's), the reference for the weights."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    additive = None
    if mask is not None:
        additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(query.dtype).min)
    out, weights = eager_attention_forward(
        _Attention(), query, key, value, additive, scaling=query.shape[-1] ** -0.5
    )
    return out, weights


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The messages logged as warnings on the ``astrai`` logger."""
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("astrai") and r.levelno == logging.WARNING]


class TestRegister:
    """``register`` / ``is_registered``."""

    def test_import_does_not_register(self) -> None:
        """Importing the integration neither imports transformers nor installs anything in it."""
        code = (
            "import sys\n"
            "import astrai.integrations.transformers as hf\n"
            "assert 'transformers' not in sys.modules\n"
            "from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS\n"
            "from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS\n"
            "assert 'astrai' not in ALL_ATTENTION_FUNCTIONS\n"
            "assert 'astrai' not in ALL_MASK_ATTENTION_FUNCTIONS\n"
            "assert not hf.is_registered()\n"
            "hf.register()\n"
            "assert hf.is_registered()\n"
        )
        subprocess.run([sys.executable, "-c", code], check=True, timeout=120)

    def test_register_is_idempotent(self) -> None:
        """Registering twice leaves one adapter and sdpa's mask builder under ``astrai``."""
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        hf.register()
        hf.register()
        assert hf.is_registered()
        assert ALL_ATTENTION_FUNCTIONS["astrai"] is hf.astrai_attention_forward
        assert ALL_MASK_ATTENTION_FUNCTIONS["astrai"] is ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]


class TestAstraiAttentionForward:
    """The adapter called directly, in transformers' layout."""

    def test_layout_and_gqa(self) -> None:
        """``[B, H, S, D]`` in (2 kv heads), ``[B, S, H, D]`` out, equal to transformers' sdpa."""
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        module = _Attention()
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(2, 4, 6, 16, generator=gen)
        k, v = (torch.randn(2, 2, 6, 16, generator=gen) for _ in range(2))
        out, weights = hf.astrai_attention_forward(module, q, k, v, None, scaling=16**-0.5)
        expected, _ = sdpa_attention_forward(module, q, k, v, None, scaling=16**-0.5)
        assert weights is None
        assert out.shape == (2, 6, 4, 16)
        torch.testing.assert_close(out, expected, atol=FP32_TOL, rtol=FP32_TOL)
        assert dispatch.stats().served("attention") == 1

    def test_explain_through_call_context(self) -> None:
        """``call_context`` feeds ``explain``, which names the row that serves the call."""
        q, kv = torch.zeros(1, 4, 5, 16), torch.zeros(1, 2, 5, 16)
        assert dispatch.explain("attention", hf.call_context(q, kv, kv)).endswith(
            "=> torch_native (origin=chain)"
        )

    @pytest.mark.parametrize(
        ("kwargs", "feature"),
        [
            ({"s_aux": torch.zeros(3)}, r"attention sinks other than one logit per head \(\[4\]\)"),
            ({"sinks": torch.zeros(1, 4, 6, 1)}, "attention sinks other than one logit per head"),
            ({"sliding_window": 2, "is_causal": False}, "sliding window on a non-causal layer"),
            ({"position_bias": torch.zeros(1), "output_attentions": True},
             "position bias that is not a 4-d float tensor"),
        ],
    )
    def test_error_unsupported_feature(self, kwargs: dict[str, object], feature: str) -> None:
        """What the facade cannot express is refused by name, and nothing is dispatched."""
        q, kv = torch.zeros(1, 4, 6, 16), torch.zeros(1, 4, 6, 16)
        with pytest.raises(hf.UnsupportedFeatureError, match=feature) as info:
            hf.astrai_attention_forward(None, q, kv, kv, None, **kwargs)  # type: ignore[arg-type]
        assert isinstance(info.value, NotImplementedError)
        assert "attn_implementation='astrai' does not support" in str(info.value)
        assert dispatch.stats().served("attention") == 0

    @pytest.mark.parametrize("mask", ["none", "bool", "float"])
    @pytest.mark.parametrize("causal", [True, False])
    def test_position_bias_is_an_additive_mask(self, mask: str, causal: bool) -> None:
        """T5's relative position bias: added to the scores where the call may attend, as
        transformers' eager attention adds it (with its mask, or causal without one)."""
        g = torch.Generator().manual_seed(3)
        q, k, v = (torch.randn(2, 4, 6, 16, generator=g) for _ in range(3))
        bias = torch.randn(1, 4, 6, 6, generator=g)
        allowed = torch.ones(6, 6, dtype=torch.bool).tril() if causal else torch.ones(
            6, 6, dtype=torch.bool)
        allowed = allowed.expand(2, 1, 6, 6).clone()
        allowed[0, :, :, 1] = False  # a padded key in the first sequence
        given: torch.Tensor | None = {
            "none": None, "bool": allowed,
            "float": torch.zeros(2, 1, 6, 6).masked_fill(~allowed, -1e9)}[mask]
        if mask == "none":
            allowed = torch.ones(6, 6, dtype=torch.bool).tril() if causal else torch.ones(
                6, 6, dtype=torch.bool)
        scores = q @ k.transpose(-1, -2) + bias
        scores = scores.masked_fill(~allowed, float("-inf"))
        want = (scores.softmax(-1) @ v).transpose(1, 2)
        dispatch.reset_stats()
        out, weights = hf.astrai_attention_forward(None, q, k, v, given, scaling=1.0,
                                                   is_causal=causal, position_bias=bias)
        assert weights is None
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        assert dispatch.stats().served("attention") == 1

    def test_error_block_mask(self) -> None:
        """A mask that is not a tensor (flex_attention's BlockMask) is refused."""
        q = torch.zeros(1, 4, 6, 16)
        with pytest.raises(hf.UnsupportedFeatureError, match="mask that is not a tensor"):
            hf.astrai_attention_forward(None, q, q, q, object())  # type: ignore[arg-type]


class _SinkAttention(_Attention):
    """gpt-oss's attention layer as its eager function reads it: sinks on the module."""

    def __init__(self, sinks: torch.Tensor) -> None:
        super().__init__()
        self.sinks = sinks


def window_mask(q_len: int, kv_len: int, window: int) -> torch.Tensor:
    """Bool ``[1, 1, q_len, kv_len]`` from transformers' own sliding-window definition
    (``masking_utils``), queries aligned to the end of the keys."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    allowed = sliding_window_causal_mask_function(window)
    rows = torch.arange(q_len).view(-1, 1) + (kv_len - q_len)
    keep: torch.Tensor = allowed(torch.tensor(0), torch.tensor(0), rows, torch.arange(kv_len))
    return keep.expand(1, 1, q_len, kv_len)


def additive(mask: torch.Tensor) -> torch.Tensor:
    """A boolean mask as eager's additive one."""
    return torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)


class TestFeaturesServed:
    """What transformers passes beyond plain attention is served, equal to its eager code."""

    def test_scaling(self) -> None:
        """A custom ``scaling`` is the facade's ``scale``: torch_native serves it."""
        q, k, v = gqa_call()
        out, _ = hf.astrai_attention_forward(_Attention(), q, k, v, None, scaling=0.5)
        from transformers.models.llama.modeling_llama import eager_attention_forward

        causal = additive(padding_mask(pad=0))
        expected, _ = eager_attention_forward(_Attention(), q, k, v, causal, scaling=0.5)
        torch.testing.assert_close(out, expected, atol=FP32_TOL, rtol=FP32_TOL)
        assert dispatch.stats().served("attention", "torch_native") == 1

    @pytest.mark.parametrize("masked", [False, True], ids=["causal", "padding-mask"])
    def test_softcap_and_scaling(self, masked: bool) -> None:
        """Gemma 2's ``softcap`` with its ``scaling``: math serves, equal to Gemma 2's eager."""
        from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

        q, k, v = gqa_call()
        mask = padding_mask(pad=0 if not masked else 2)
        out, _ = hf.astrai_attention_forward(_Attention(), q, k, v, mask if masked else None,
                                             scaling=0.3, softcap=1.5)
        expected, _ = eager_attention_forward(_Attention(), q, k, v, additive(mask),
                                              scaling=0.3, softcap=1.5)
        real = mask[:, 0].any(-1)
        torch.testing.assert_close(out[real], expected[real], atol=FP32_TOL, rtol=FP32_TOL)
        assert dispatch.stats().served("attention", "math") == 1

    @pytest.mark.parametrize("name", ["s_aux", "sinks"])
    def test_sinks(self, name: str) -> None:
        """gpt-oss's ``s_aux`` (one logit per head) is ``sinks``: equal to gpt-oss's eager."""
        from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

        q, k, v = gqa_call()
        sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
        out, weights = hf.astrai_attention_forward(_Attention(), q, k, v, None,
                                                   output_attentions=True, **{name: sinks})
        expected, expected_w = eager_attention_forward(
            _SinkAttention(sinks), q, k, v, additive(padding_mask(pad=0)), scaling=16**-0.5)
        torch.testing.assert_close(out, expected, atol=FP32_TOL, rtol=FP32_TOL)
        assert weights is not None
        torch.testing.assert_close(weights, expected_w, atol=FP32_TOL, rtol=FP32_TOL)
        assert dispatch.stats().served("attention", "math") == 1

    @pytest.mark.parametrize(("q_len", "kv_len"), [(6, 6), (1, 9)], ids=["prefill", "decode"])
    def test_sliding_window_without_a_mask(self, q_len: int, kv_len: int) -> None:
        """No mask came with the call: the window is the facade's, with transformers' meaning
        (query i sees keys i - window < j <= i), even for a single query."""
        from transformers.models.llama.modeling_llama import eager_attention_forward

        q, k, v = gqa_call(q_len, kv_len)
        out, _ = hf.astrai_attention_forward(_Attention(), q, k, v, None, sliding_window=3)
        expected, _ = eager_attention_forward(_Attention(), q, k, v,
                                              additive(window_mask(q_len, kv_len, 3)),
                                              scaling=16**-0.5)
        torch.testing.assert_close(out, expected, atol=FP32_TOL, rtol=FP32_TOL)
        assert dispatch.stats().served("attention", "torch_native") == 1
        ctx = hf.call_context(q, k, v, sliding_window=3)
        assert ctx.window == 3

    def test_sliding_window_that_cuts_nothing_is_left_out(self) -> None:
        """A window no shorter than the keys changes nothing, and is not asked for."""
        q, k, v = gqa_call()
        assert hf.call_context(q, k, v, sliding_window=6).window is None
        assert hf.call_context(q, k, v, sliding_window=5).window == 5

    def test_mask_carries_the_window(self) -> None:
        """With a mask (transformers built it, window included) the window is not asked for."""
        q, k, v = gqa_call()
        mask = window_mask(6, 6, 3)
        assert hf.call_context(q, k, v, mask, sliding_window=3).window is None
        out, _ = hf.astrai_attention_forward(_Attention(), q, k, v, mask, sliding_window=3)
        plain, _ = hf.astrai_attention_forward(_Attention(), q, k, v, None, sliding_window=3)
        torch.testing.assert_close(out, plain, atol=FP32_TOL, rtol=FP32_TOL)

    def test_dropout_like_eager(self) -> None:
        """Training dropout is ``dropout_p``; math drops exactly what eager drops (same seed)."""
        from transformers.models.llama.modeling_llama import eager_attention_forward

        q, k, v = gqa_call()
        module = _Attention().train()
        torch.manual_seed(7)
        with dispatch.op_backend(attention="math"):
            out, weights = hf.astrai_attention_forward(module, q, k, v, None, dropout=0.3,
                                                       output_attentions=True)
        torch.manual_seed(7)
        expected, expected_w = eager_attention_forward(
            module, q, k, v, additive(padding_mask(pad=0)), scaling=16**-0.5, dropout=0.3)
        assert weights is not None and (weights == 0).any()
        torch.testing.assert_close(weights, expected_w, atol=FP32_TOL, rtol=FP32_TOL)
        torch.testing.assert_close(out, expected, atol=FP32_TOL, rtol=FP32_TOL)

    def test_dropout_goes_to_torch_native(self) -> None:
        """Without a scope, the chain's first row declaring dropout serves it."""
        q, k, v = gqa_call()
        ctx = hf.call_context(q, k, v, dropout=0.1)
        assert ctx.dropout
        hf.astrai_attention_forward(_Attention().train(), q, k, v, None, dropout=0.1)
        assert dispatch.stats().served("attention", "torch_native") == 1


class TestOutputAttentions:
    """``output_attentions=True`` through the adapter: the ``return_weights`` feature."""

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
    def test_weights_equal_eager(self, dtype: torch.dtype) -> None:
        """GQA with a padding mask: output and per-query-head weights equal eager's."""
        q, k, v = (t.to(dtype) for t in gqa_call())
        mask = padding_mask()
        out, weights = hf.astrai_attention_forward(
            _Attention(), q, k, v, mask, scaling=16**-0.5, output_attentions=True
        )
        expected_out, expected = eager(q, k, v, mask)
        assert weights is not None
        assert weights.shape == (2, 4, 6, 6) and weights.dtype == dtype
        tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
        real = mask[:, 0].any(-1)  # query rows that may see a key: [batch, q_len]
        torch.testing.assert_close(weights.transpose(1, 2)[real], expected.transpose(1, 2)[real],
                                   atol=tol, rtol=tol)
        torch.testing.assert_close(out[real], expected_out[real], atol=tol, rtol=tol)
        assert torch.equal(weights.transpose(1, 2)[~real], torch.zeros(2, 4, 6, dtype=dtype))

    def test_counted_under_the_serving_row(self) -> None:
        """The chain skips torch_native (it does not declare return_weights): math serves."""
        q, k, v = gqa_call()
        for _ in range(3):
            hf.astrai_attention_forward(_Attention(), q, k, v, None, output_attentions=True)
        usage = dispatch.stats()
        assert usage.served("attention") == 3
        assert usage.served("attention", "math", "chain") == 3

    def test_without_output_attentions_unchanged(self) -> None:
        """Without the flag (or with it false) the chain's row serves and no weights come back."""
        q, k, v = gqa_call()
        for flag in ({}, {"output_attentions": False}):
            _, weights = hf.astrai_attention_forward(_Attention(), q, k, v, None, **flag)
            assert weights is None
        assert dispatch.stats().served("attention", "torch_native", "chain") == 2

    def test_cut_cache_slots_get_zero_weight(self) -> None:
        """Causal prefill into a longer static cache: weights span every slot, unwritten ones 0."""
        q, k, v = gqa_call(q_len=6, kv_len=9)
        _, weights = hf.astrai_attention_forward(_Attention(), q, k, v, None,
                                                 output_attentions=True)
        _, expected = eager(q, k[:, :, :6], v[:, :, :6], padding_mask(6, pad=0))
        assert weights is not None and weights.shape == (2, 4, 6, 9)
        torch.testing.assert_close(weights[..., :6], expected, atol=FP32_TOL, rtol=FP32_TOL)
        assert not weights[..., 6:].any()

    def test_scope_selecting_math(self) -> None:
        """A scope that selects a row returning weights is honoured, with its origin."""
        q, k, v = gqa_call()
        with dispatch.op_backend(attention="math"):
            hf.astrai_attention_forward(_Attention(), q, k, v, None, output_attentions=True)
        assert dispatch.stats().served("attention", "math", "context") == 1

    def test_error_strict_scope_without_weights(self) -> None:
        """A strict scope forcing ``torch_native`` is an error naming the row and the feature."""
        q, k, v = gqa_call()
        with dispatch.op_backend(attention="torch_native"), \
                pytest.raises(dispatch.ExplicitSelectionError) as info:
            hf.astrai_attention_forward(_Attention(), q, k, v, None, output_attentions=True)
        assert str(info.value) == (
            "attention implementation 'torch_native' selected by an op_backend scope cannot "
            "serve this call: requires features: [return_weights] (the call asks for "
            "return_weights; the row declares dropout, scale, window)"
        )
        assert (info.value.family, info.value.row) == ("attention", "torch_native")
        assert dispatch.stats().served("attention") == 0

    def test_soft_env_choice_warns_once(
        self, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        """``ASTR_OPS=attention=torch_native`` is set aside for weight calls, said once."""
        q, k, v = gqa_call()
        monkeypatch.setenv("ASTR_OPS", "attention=torch_native")
        with caplog.at_level(logging.WARNING, logger="astrai"):
            for _ in range(2):
                hf.astrai_attention_forward(_Attention(), q, k, v, None, output_attentions=True)
            hf.astrai_attention_forward(_Attention(), q, k, v, None)
        assert warnings(caplog) == [
            "attention=torch_native from ASTR_OPS (attention=torch_native) cannot serve this "
            "call: requires features: [return_weights] (the call asks for return_weights; the "
            "row declares dropout, scale, window); using the table's choice instead"
        ]
        usage = dispatch.stats()
        assert usage.served("attention", "math", "chain") == 2
        assert usage.served("attention", "torch_native", "env") == 1

    def test_reference_profile(self) -> None:
        """The ``reference`` profile forces ``math``, which returns weights: origin ``profile``."""
        q, k, v = gqa_call()
        with dispatch.use_profile("reference"):
            hf.astrai_attention_forward(_Attention(), q, k, v, None, output_attentions=True)
        assert dispatch.stats().served("attention", "math", "profile") == 1

    def test_error_no_row_returns_weights(
        self, write_yaml: Callable[[str, str], Path]
    ) -> None:
        """With a table whose rows cannot return weights, the call is refused with the reason."""
        dispatch.load_tables(write_yaml("attention.yaml", NO_WEIGHTS_TABLE))
        q, k, v = gqa_call()
        with pytest.raises(dispatch.NoImplementationError) as info:
            hf.astrai_attention_forward(_Attention(), q, k, v, None, output_attentions=True)
        assert ("torch_native (fallback): requires features: [return_weights] (the call asks "
                "for return_weights; the row declares none)") in str(info.value)
        assert dispatch.stats().served("attention") == 0
        out, _ = hf.astrai_attention_forward(_Attention(), q, k, v, None)
        assert out.shape == (2, 6, 4, 16)  # ordinary calls are unaffected


class TestExplainCall:
    """``explain_call``."""

    def test_plain_call(self) -> None:
        """Without features it is ``explain`` of ``call_context``."""
        q, k, v = gqa_call()
        assert hf.explain_call(q, k, v) == dispatch.explain("attention", hf.call_context(q, k, v))

    def test_output_attentions(self) -> None:
        """With it, torch_native is rejected for the feature and math serves from the chain."""
        q, k, v = gqa_call()
        text = hf.explain_call(q, k, v, output_attentions=True)
        assert ("  torch_native: reject (features: [return_weights] (the call asks for "
                "return_weights; the row declares dropout, scale, window))") in text
        assert text.endswith("=> math (origin=chain)")
        assert dispatch.stats().served("attention") == 0

    def test_model_features(self) -> None:
        """Gemma 2's keywords show as the call's features (scale, softcap, window)."""
        q, k, v = gqa_call()
        text = hf.explain_call(q, k, v, scaling=0.3, softcap=50.0, sliding_window=4)
        assert text.splitlines()[0].endswith("scale=true softcap=true window=4")
        assert text.endswith("=> math (origin=chain)")

    def test_error_strict_scope(self) -> None:
        """Under a strict scope without weights it ends in the engine's error."""
        q, k, v = gqa_call()
        with dispatch.op_backend(attention="torch_native"):
            text = hf.explain_call(q, k, v, output_attentions=True)
        assert text.splitlines()[-1].startswith(
            "=> ERROR: attention implementation 'torch_native' selected by an op_backend scope")


@pytest.mark.parametrize("arch", sorted(CONFIGS))
class TestModels:
    """Whole models: ``astrai`` against transformers' ``sdpa`` and ``eager``."""

    def test_logits_fp32(self, arch: str) -> None:
        """fp32 logits match sdpa and eager; every layer's call went through the facade."""
        models = build(CONFIGS[arch]())
        ids = tokens()
        out = {impl: logits(m, ids) for impl, m in models.items()}
        torch.testing.assert_close(out["astrai"], out["sdpa"], atol=FP32_TOL, rtol=FP32_TOL)
        torch.testing.assert_close(out["astrai"], out["eager"], atol=FP32_TOL, rtol=FP32_TOL)
        assert dispatch.stats().served("attention", "torch_native") == 2

    def test_logits_bf16(self, arch: str) -> None:
        """bf16 logits match sdpa and eager within bf16 tolerance."""
        models = build(CONFIGS[arch](), dtype=torch.bfloat16)
        ids = tokens()
        out = {impl: logits(m, ids) for impl, m in models.items()}
        torch.testing.assert_close(out["astrai"], out["sdpa"], atol=BF16_TOL, rtol=BF16_TOL)
        torch.testing.assert_close(out["astrai"], out["eager"], atol=BF16_TOL, rtol=BF16_TOL)

    def test_generate_greedy(self, arch: str) -> None:
        """Greedy generation yields the same tokens as sdpa, one facade call per layer and step."""
        models = build(CONFIGS[arch](), ("astrai", "sdpa"))
        ids = tokens()
        dispatch.reset_stats()
        produced = greedy(models["astrai"], ids)
        assert dispatch.stats().served("attention") == 2 * 8  # prefill + 7 decode steps
        assert torch.equal(produced, greedy(models["sdpa"], ids))

    def test_left_padded_batch(self, arch: str) -> None:
        """With left padding, real positions match sdpa and eager, and generation matches sdpa."""
        models = build(CONFIGS[arch]())
        ids, mask = left_padded()
        out = {impl: logits(m, ids, attention_mask=mask) for impl, m in models.items()}
        real = mask.bool()
        for other in ("sdpa", "eager"):
            torch.testing.assert_close(
                out["astrai"][real], out[other][real], atol=FP32_TOL, rtol=FP32_TOL
            )
        assert torch.equal(
            greedy(models["astrai"], ids, attention_mask=mask),
            greedy(models["sdpa"], ids, attention_mask=mask),
        )

    def test_math_row_from_env(self, arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
        """``ASTR_OPS=attention=math`` routes every call to ``math``, results still match."""
        models = build(CONFIGS[arch](), ("astrai", "sdpa"))
        ids, mask = left_padded()
        monkeypatch.setenv("ASTR_OPS", "attention=math")
        dispatch.reset_stats()
        got = logits(models["astrai"], ids, attention_mask=mask)
        produced = greedy(models["astrai"], ids, attention_mask=mask)
        usage = dispatch.stats()
        assert usage.served("attention", "math") > 0
        assert usage.served("attention") == usage.served("attention", "math")
        monkeypatch.delenv("ASTR_OPS")
        real = mask.bool()
        expected = logits(models["sdpa"], ids, attention_mask=mask)
        torch.testing.assert_close(got[real], expected[real], atol=FP32_TOL, rtol=FP32_TOL)
        assert torch.equal(produced, greedy(models["sdpa"], ids, attention_mask=mask))

    def test_training_step_gradients(self, arch: str) -> None:
        """One training step's gradients match sdpa, by the chain's row and by ``math``."""
        models = build(CONFIGS[arch](), ("astrai", "sdpa"))
        ids = tokens()
        names = (
            "model.embed_tokens.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.k_proj.weight",
            "model.layers.1.self_attn.v_proj.weight",
        )

        def grads(model: PreTrainedModel) -> dict[str, torch.Tensor]:
            model.train()
            model.zero_grad()
            model(ids, labels=ids).loss.backward()
            params = dict(model.named_parameters())
            return {n: params[n].grad.clone() for n in names}  # type: ignore[union-attr]

        expected = grads(models["sdpa"])
        for row in ("torch_native", "math"):
            dispatch.reset_stats()
            with dispatch.op_backend(attention=row):
                got = grads(models["astrai"])
            assert dispatch.stats().served("attention", row) == 2
            for name in names:
                torch.testing.assert_close(got[name], expected[name], atol=FP32_TOL, rtol=1e-3)


class TestModelFeatures:
    """Model-level paths that need a particular setup."""

    def test_static_cache_generate(self) -> None:
        """A static cache (prefill into unwritten slots, mask left out) generates like sdpa."""
        models = build(llama_config(), ("astrai", "sdpa"))
        ids = tokens()
        assert torch.equal(
            greedy(models["astrai"], ids, cache_implementation="static"),
            greedy(models["sdpa"], ids, cache_implementation="static"),
        )

    def test_training_with_attention_dropout(self) -> None:
        """Attention dropout in training is served: math drops exactly what eager drops (same
        seed), and the chain gives it to torch_native, gradients included."""
        config = llama_config()
        config.attention_dropout = 0.3
        models = build(config, ("astrai", "eager"))
        ids = tokens()
        out = {}
        for impl, model in models.items():
            model.train()
            torch.manual_seed(3)
            with dispatch.op_backend(attention="math"), torch.no_grad():
                out[impl] = model(ids).logits
        torch.testing.assert_close(out["astrai"], out["eager"], atol=FP32_TOL, rtol=FP32_TOL)
        dispatch.reset_stats()
        model = models["astrai"]
        loss = model(ids, labels=ids).loss
        loss.backward()
        assert torch.isfinite(loss)
        assert dispatch.stats().served("attention", "torch_native", "chain") == 2
        model.eval()
        assert not torch.allclose(logits(model, ids), out["astrai"], atol=1e-3)

    @pytest.mark.parametrize("arch", sorted(WEIGHT_CONFIGS))
    def test_output_attentions_equal_eager(self, arch: str) -> None:
        """With padding in the batch, ``attentions`` equal eager's; sdpa returns none."""
        models = build(WEIGHT_CONFIGS[arch]())
        ids, mask = left_padded()
        out = {}
        for impl, model in models.items():
            dispatch.reset_stats()
            with torch.no_grad():
                out[impl] = model(ids, attention_mask=mask, output_attentions=True)
            if impl == "astrai":
                usage = dispatch.stats()
        assert not out["sdpa"].attentions  # () in transformers 5, None in 4.x
        got, expected = out["astrai"].attentions, out["eager"].attentions
        assert len(got) == len(expected) == 2
        real = mask.bool()  # query positions that are not padding
        for layer, ref in zip(got, expected, strict=True):
            assert layer.shape == ref.shape == (2, 4, SEQ, SEQ)
            torch.testing.assert_close(layer.transpose(1, 2)[real], ref.transpose(1, 2)[real],
                                       atol=FP32_TOL, rtol=FP32_TOL)
        torch.testing.assert_close(out["astrai"].logits[real], out["eager"].logits[real],
                                   atol=FP32_TOL, rtol=FP32_TOL)
        assert usage.served("attention") == usage.served("attention", "math", "chain") == 2

    def test_output_attentions_generate(self) -> None:
        """Generating with ``output_attentions``: eager's tokens, and its weights at every step."""
        models = build(llama_config(), ("astrai", "eager"))
        ids, mask = left_padded()
        runs = {}
        for impl, model in models.items():
            generate: Any = model.generate
            with torch.no_grad():
                runs[impl] = generate(
                    ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4,
                    do_sample=False, pad_token_id=0, output_attentions=True,
                    return_dict_in_generate=True,
                )
        assert torch.equal(runs["astrai"].sequences, runs["eager"].sequences)
        for step, ref_step in zip(runs["astrai"].attentions, runs["eager"].attentions,
                                  strict=True):
            for layer, ref in zip(step, ref_step, strict=True):
                assert layer.shape == ref.shape
                # the last query row of each step is a real token in both sequences
                torch.testing.assert_close(layer[:, :, -1], ref[:, :, -1],
                                           atol=FP32_TOL, rtol=FP32_TOL)

    def test_output_attentions_bf16(self) -> None:
        """bf16 weights come back in bf16 and match eager's within bf16 tolerance."""
        models = build(llama_config(), ("astrai", "eager"), dtype=torch.bfloat16)
        ids = tokens()
        with torch.no_grad():
            got = models["astrai"](ids, output_attentions=True).attentions
            expected = models["eager"](ids, output_attentions=True).attentions
        for layer, ref in zip(got, expected, strict=True):
            assert layer.dtype == ref.dtype == torch.bfloat16
            torch.testing.assert_close(layer, ref, atol=BF16_TOL, rtol=BF16_TOL)

    def test_error_output_attentions_strict_scope(self) -> None:
        """A strict scope forcing a row without weights refuses ``output_attentions`` clearly."""
        model = build(llama_config(), ("astrai",))["astrai"]
        with dispatch.op_backend(attention="torch_native"):
            with pytest.raises(dispatch.ExplicitSelectionError,
                               match=r"'torch_native' selected by an op_backend scope cannot "
                                     r"serve this call: requires features: \[return_weights\]"):
                logits(model, tokens(), output_attentions=True)
            assert logits(model, tokens()).shape == (2, SEQ, 128)  # without weights, it serves


def gemma2_config(softcap: float | None = 2.0) -> PretrainedConfig:
    """Gemma 2: soft-capping, a sliding window of 4 on every other layer, and a scale of
    ``query_pre_attn_scalar ** -0.5`` with ``query_pre_attn_scalar`` 24, not head_dim 16."""
    return Gemma2Config(**TINY, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                        sliding_window=WINDOW, attn_logit_softcapping=softcap)


def sharpen(model: PreTrainedModel) -> None:
    """Make the random logits large enough for soft-capping and scaling to matter."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(20)


def with_sinks(model: PreTrainedModel) -> None:
    """Give gpt-oss's sinks values far from zero, so they change the result."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("self_attn.sinks"):
                param.copy_(torch.randn(param.shape, generator=gen) * 2)


def gpt_oss_config() -> PretrainedConfig:
    """gpt-oss: a sink logit per head, sliding window of 4 on every other layer, 4 experts."""
    if not hasattr(transformers, "GptOssConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no gpt-oss")
    return transformers.GptOssConfig(
        **TINY, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
        num_local_experts=4, num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


class TestGemma2:
    """Gemma 2 (soft-capping, sliding window, custom scale) served, equal to eager."""

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
    def test_logits_equal_eager(self, dtype: torch.dtype) -> None:
        """Logits match eager's (whose soft-capping changes them); math serves every layer."""
        models = build(gemma2_config(), ("astrai", "eager"), dtype=dtype, init=sharpen)
        ids, mask = left_padded()
        dispatch.reset_stats()
        got = logits(models["astrai"], ids, attention_mask=mask)
        assert dispatch.stats().served("attention", "math", "chain") == 2
        expected = logits(models["eager"], ids, attention_mask=mask)
        tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
        real = mask.bool()
        torch.testing.assert_close(got[real], expected[real], atol=tol, rtol=tol)
        layers: Any = models["eager"].model.layers
        for layer in layers:
            layer.self_attn.attn_logit_softcapping = None
        uncapped = logits(models["eager"], ids, attention_mask=mask)
        assert not torch.allclose(uncapped[real], expected[real], atol=0.1)

    def test_attentions_equal_eager(self) -> None:
        """``output_attentions=True``: every layer's weights (sliding and full) are eager's."""
        models = build(gemma2_config(), ("astrai", "eager"), init=sharpen)
        ids = tokens()
        with torch.no_grad():
            got = models["astrai"](ids, output_attentions=True).attentions
            expected = models["eager"](ids, output_attentions=True).attentions
        assert len(got) == len(expected) == 2
        for layer, ref in zip(got, expected, strict=True):
            torch.testing.assert_close(layer, ref, atol=FP32_TOL, rtol=FP32_TOL)
        sliding = got[0][0, 0]  # layer 0 slides: the 5th key back is out of sight
        assert not sliding.tril(-WINDOW).any() and sliding.tril(-(WINDOW - 1)).any()

    def test_generate_equal_eager(self) -> None:
        """Greedy generation yields eager's tokens."""
        models = build(gemma2_config(), ("astrai", "eager"), init=sharpen)
        ids = tokens()
        assert torch.equal(greedy(models["astrai"], ids), greedy(models["eager"], ids))

    def test_scale_alone_goes_to_torch_native(self) -> None:
        """Without soft-capping, the custom scale is torch_native's: it serves, equal to eager."""
        models = build(gemma2_config(softcap=None), ("astrai", "eager"), init=sharpen)
        ids = tokens()
        dispatch.reset_stats()
        got = logits(models["astrai"], ids)
        assert dispatch.stats().served("attention", "torch_native", "chain") == 2
        torch.testing.assert_close(got, logits(models["eager"], ids), atol=FP32_TOL,
                                   rtol=FP32_TOL)


class TestGptOss:
    """gpt-oss (attention sinks) served, equal to eager."""

    def test_logits_equal_eager(self) -> None:
        """Logits match eager's (whose sinks change them); math serves every layer."""
        models = build(gpt_oss_config(), ("astrai", "eager"), init=with_sinks)
        ids = tokens()
        dispatch.reset_stats()
        got = logits(models["astrai"], ids)
        assert dispatch.stats().served("attention", "math", "chain") == 2
        expected = logits(models["eager"], ids)
        torch.testing.assert_close(got, expected, atol=FP32_TOL, rtol=FP32_TOL)
        with torch.no_grad():
            for name, param in models["eager"].named_parameters():
                if name.endswith("self_attn.sinks"):
                    param.fill_(-1e4)  # sinks that absorb nothing
        assert not torch.allclose(logits(models["eager"], ids), expected, atol=1e-3)

    def test_generate_equal_eager(self) -> None:
        """Greedy generation yields eager's tokens."""
        models = build(gpt_oss_config(), ("astrai", "eager"), init=with_sinks)
        ids = tokens()
        assert torch.equal(greedy(models["astrai"], ids), greedy(models["eager"], ids))


class TestRunTransformersDemo:
    """``run_transformers_demo`` (``astrai-ops demo --hf``)."""

    def test_report(self) -> None:
        """The report shows the routing, equal numerics, the stats table and, for each
        family, the decision of its most frequent call."""
        report = hf.run_transformers_demo()
        assert "then dispatch_model(model)" in report
        assert "not routed:\n    embedding  model.embed_tokens (Embedding)" in report
        gap = re.search(r"max \|dispatched - plain\| = (\S+)", report)
        assert gap is not None and float(gap.group(1)) <= 1e-5  # float32 rounding at most
        assert "the plain model's: the same" in report
        # inference calls: the native rows where astrai's native extension is loaded
        one_pass = "native" if native_available() else "torch"
        # linear: the row this machine's table gives a decode step's call (by CPU vendor)
        import astrai.dispatch as dispatch
        from astrai import ops

        with torch.no_grad():
            decode = dispatch.resolve("linear", ops.context(
                "linear", torch.randn(1, 1, 64), torch.randn(64, 64))).name
        for family, row in (("attention", "torch_native"), ("rotary", one_pass),
                            ("rms_norm", one_pass), ("linear", decode)):
            assert re.search(rf"\n{family} +{row} ", report), (family, row)
            assert f"explain: the {family} call generate made most" in report
        assert "layout=half" in report and "cast_before_weight=true" in report

    def test_command_line(self) -> None:
        proc = subprocess.run([sys.executable, "-m", "astrai", "demo", "--hf"],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        assert "astrai dispatch_model: LlamaForCausalLM" in proc.stdout
