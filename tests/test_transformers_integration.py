"""``attn_implementation="astrai"`` on real transformers models with tiny random weights.

Nothing is downloaded: every model is built from a config (hidden 64, 2 layers, 4
heads, vocab 128). Llama covers GQA (2 key/value heads), Mistral a sliding window
of 4 over 12 tokens (small enough that it changes the logits), Gemma 2 a feature
the facade must refuse (logit soft-capping).
"""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
)

import astrai.dispatch as dispatch
from astrai.integrations import transformers as hf

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


def mistral_config() -> PretrainedConfig:
    """Mistral with full multi-head attention and a sliding window of 4 tokens."""
    return MistralConfig(**TINY, num_key_value_heads=4, sliding_window=WINDOW)


CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama-gqa": llama_config,
    "mistral-window": mistral_config,
}


@pytest.fixture(scope="module", autouse=True)
def _registered() -> None:
    """Install ``attn_implementation="astrai"`` once for the module."""
    hf.register()


def build(
    config: PretrainedConfig,
    impls: tuple[str, ...] = ("astrai", "sdpa", "eager"),
    dtype: torch.dtype = torch.float32,
) -> dict[str, PreTrainedModel]:
    """One model per attention implementation, all with the same random weights."""
    torch.manual_seed(0)
    models: dict[str, PreTrainedModel] = {}
    state = None
    for impl in impls:
        # Each model needs its own config: the implementation is stored on it.
        model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            copy.deepcopy(config), attn_implementation=impl
        )
        if state is None:
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
            ({"scaling": 0.5}, "softmax scale"),
            ({"dropout": 0.1}, "attention dropout"),
            ({"softcap": 30.0}, "soft-capping"),
            ({"s_aux": torch.zeros(4)}, "attention sinks"),
            ({"position_bias": torch.zeros(1, 4, 6, 6)}, "position bias"),
            ({"output_attentions": True}, "attention weights"),
            ({"sliding_window": 2}, "sliding window"),
        ],
    )
    def test_error_unsupported_feature(self, kwargs: dict[str, object], feature: str) -> None:
        """A feature the facade cannot express is refused by name, and nothing is dispatched."""
        q, kv = torch.zeros(1, 4, 6, 16), torch.zeros(1, 4, 6, 16)
        with pytest.raises(hf.UnsupportedFeatureError, match=feature) as info:
            hf.astrai_attention_forward(None, q, kv, kv, None, **kwargs)  # type: ignore[arg-type]
        assert isinstance(info.value, NotImplementedError)
        assert "attn_implementation='astrai' does not support" in str(info.value)
        assert dispatch.stats().served("attention") == 0

    def test_error_block_mask(self) -> None:
        """A mask that is not a tensor (flex_attention's BlockMask) is refused."""
        q = torch.zeros(1, 4, 6, 16)
        with pytest.raises(hf.UnsupportedFeatureError, match="mask that is not a tensor"):
            hf.astrai_attention_forward(None, q, q, q, object())  # type: ignore[arg-type]


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

    def test_error_training_with_attention_dropout(self) -> None:
        """Attention dropout in training is refused rather than silently skipped."""
        config = llama_config()
        config.attention_dropout = 0.1
        model = build(config, ("astrai",))["astrai"].train()
        with pytest.raises(hf.UnsupportedFeatureError, match="attention dropout"):
            model(tokens())
        model.eval()
        assert logits(model, tokens()).shape == (2, SEQ, 128)  # no dropout at inference

    def test_error_gemma2_softcapping(self) -> None:
        """Gemma 2's attention logit soft-capping is refused with the feature named."""
        config = Gemma2Config(**TINY, num_key_value_heads=2, head_dim=16,
                              query_pre_attn_scalar=16, sliding_window=WINDOW,
                              attn_logit_softcapping=50.0)
        model = build(config, ("astrai",))["astrai"]
        with pytest.raises(hf.UnsupportedFeatureError, match=r"soft-capping.*50\.0"):
            logits(model, tokens())

    def test_error_output_attentions(self) -> None:
        """Asking the model for attention weights is refused (the facade returns none)."""
        model = build(llama_config(), ("astrai",))["astrai"]
        with pytest.raises(hf.UnsupportedFeatureError, match="output_attentions"):
            logits(model, tokens(), output_attentions=True)


class TestRunTransformersDemo:
    """``run_transformers_demo``."""

    def test_report(self) -> None:
        """The report shows the implementation, the stats table and the decision."""
        report = hf.run_transformers_demo()
        assert "attn_implementation='astrai'" in report
        assert "attention    torch_native" in report
        assert "=> torch_native (origin=chain)" in report
