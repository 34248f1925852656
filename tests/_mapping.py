"""Every model type in the installed transformers' causal-LM mapping, built tiny from its
own default config (nothing is downloaded), for the mapping test and its coverage table.

A default config describes a full-size model. ``tiny_config(name)`` shrinks it the way a
reader of the config would: every width, depth, head count, expert count and vocabulary
named by a key transformers uses is made small (in each sub-config too), head widths are
kept consistent, and the per-layer lists (layer types, which layers are MoE or use rope)
keep one layer of each distinct kind, so a hybrid keeps its attention layers and its
mixers. ``_FIXES`` holds what a type needs beyond that. ``build(name)`` returns the model
or the reason it cannot be built on this machine.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

#: keys transformers configs use, and the tiny value each gets wherever it appears
_SIZES: dict[str, Any] = {
    # vocabulary and positions
    "vocab_size": 128, "max_position_embeddings": 64, "n_positions": 64, "n_ctx": 64,
    "context_length": 64, "vocab_size_per_layer_input": 128,
    # widths
    "hidden_size": 64, "d_model": 64, "emb_dim": 64, "n_embd": 64, "embedding_dim": 64,
    "embed_dim": 64,
    "intermediate_size": 128, "ffn_hidden_size": 128, "n_inner": 128, "d_ff": 128,
    "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "ffn_dim": 128,
    "attention_hidden_size": 64, "hidden_size_per_layer_input": 16, "laurel_rank": 8,
    "word_embed_proj_dim": 64, "intermediate_size_mlp": 128,
    # depth
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "encoder_layers": 2,
    "decoder_layers": 2, "num_decoder_layers": 2, "num_blocks": 2,
    # heads
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "d_kv": 16,
    "rotary_dim": 8, "kv_channels": 16,
    # multi-head latent attention
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 16, "qk_head_dim": 16, "index_head_dim": 16, "index_n_heads": 2,
    "index_topk": 4,
    # mixture of experts
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "num_expert_group": 1,
    "top_k_experts": 2, "moe_topk": 2, "moe_k": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "expert_intermediate_size": 32, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
    # state-space and linear-attention mixers
    "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_chunk_size": 16,
    "state_size": 16, "time_step_rank": 8, "chunk_size": 16, "ssm_state_size": 16,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_head_dim": 16, "linear_num_heads": 4,
}

#: keys whose ``None`` in a default config leaves the model unbuildable (elsewhere ``None``
#: means "none": no low-rank query, no sliding window, no experts)
_NONE_IS_UNSET = ("head_dim", "num_key_value_heads", "num_experts_per_tok",
                  "n_routed_experts", "n_shared_experts", "n_group", "topk_group")

#: what a type needs beyond the generic shrink (applied to the top-level config)
_FIXES: dict[str, dict[str, Any]] = {
    "mamba2": dict(num_heads=8, head_dim=16, n_groups=1),
    "bamba": dict(attn_layer_indices=[1]),
    "jamba": dict(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1,
                  expert_layer_period=2, expert_layer_offset=1),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"],
                             num_hidden_layers=2),
    "falcon_h1": dict(mamba_d_ssm=None, mamba_n_heads=8, mamba_d_head=16),
    "zaya": dict(num_experts_per_tok=1),
    "kolibri1_1": dict(index_num_heads=2),
    "dory": dict(num_hidden_layers=3, n_input_layers=1, n_recurrent_layers=1,
                 n_output_layers=1),
    "xlnet": dict(d_head=16),
    "reformer": dict(is_decoder=True, axial_pos_embds_dim=[32, 32], axial_pos_shape=[8, 8]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_hidden_layers=2),
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
                           indexer_budget=8, indexer_compress_ratio=4),
    "zamba2": dict(n_mamba_heads=8, mamba_headdim=16),
}
#: what a type's default config needs before it constructs at all
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma4_assistant": dict(hidden_size_per_layer_input=0),
}


def types() -> list[str]:
    """The model types of the installed transformers' causal-LM mapping, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _is_config(d: Any) -> bool:
    return isinstance(d, dict) and ("model_type" in d or "hidden_size" in d)


#: the keys that count layers: the first present is the depth the per-layer lists follow
_DEPTHS = ("num_hidden_layers", "n_layer", "num_layers", "decoder_layers", "encoder_layers",
           "num_decoder_layers", "num_blocks")


def _depth_key(d: dict[str, Any]) -> str | None:
    for key in _DEPTHS[:4]:
        if isinstance(d.get(key), int):
            return key
    return None


def _keep_layers(d: dict[str, Any], most: int = 6) -> None:
    """Cut the depth to one layer of each distinct kind (at least two), cutting every
    per-layer list and every list of layer indices the same way."""
    key = _depth_key(d)
    if key is None:
        return
    n = d[key]
    per_layer = [k for k, v in d.items() if isinstance(v, list) and len(v) == n and n > 2]
    by_index = [k for k, v in d.items() if isinstance(v, dict) and v and all(
        isinstance(i, int) or (isinstance(i, str) and i.isdigit()) for i in v)]
    indices = [k for k, v in d.items() if isinstance(v, list) and v and len(v) < n
               and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n
                       for i in v) and len(set(v)) == len(v)]
    kinds: dict[Any, int] = {}
    for i in range(n):
        kind = (tuple(repr(d[k][i]) for k in per_layer)
                + tuple(i in d[k] for k in indices)
                + tuple(repr(d[k].get(i, d[k].get(str(i)))) for k in by_index))
        kinds.setdefault(kind, i)
    keep = sorted(kinds.values())[:most]
    for i in range(n):
        if len(keep) >= 2:
            break
        if i not in keep:
            keep = sorted([*keep, i])
    for k in per_layer:
        d[k] = [d[k][i] for i in keep]
    for k in indices:
        d[k] = [keep.index(i) for i in d[k] if i in keep]
    for k in by_index:
        d[k] = {type(j)(keep.index(int(j))): v for j, v in d[k].items() if int(j) in keep}
    for k in _DEPTHS:
        if isinstance(d.get(k), int):
            d[k] = len(keep)


def _shrink(d: dict[str, Any]) -> None:
    _keep_layers(d)
    before = dict(d)
    for key in _NONE_IS_UNSET:
        if key in d and d[key] is None:
            d[key] = _SIZES[key]
    for key, value in list(d.items()):
        if _is_config(value):
            _shrink(value)
        elif key in _SIZES and isinstance(value, int) and not isinstance(value, bool) and value:
            if key in _DEPTHS:
                continue  # _keep_layers set it
            d[key] = min(value, _SIZES[key]) if key.endswith("_heads") else _SIZES[key]
        elif key == "intermediate_size" and isinstance(value, list):
            d[key] = [_SIZES[key]] * len(value)
        elif key == "sliding_window" and isinstance(value, int):
            d[key] = 4
    # a head width that was another key's keeps following it (MLA: the rope part)
    for key in ("qk_rope_head_dim", "v_head_dim", "kv_lora_rank"):
        if before.get("head_dim") is not None and before.get(key) == before["head_dim"]:
            d["head_dim"] = d[key]
            break
    if before.get("head_dim") is not None and before["head_dim"] == (
            (before.get("qk_nope_head_dim") or -1) + (before.get("qk_rope_head_dim") or 0)):
        d["head_dim"] = d["qk_nope_head_dim"] + d["qk_rope_head_dim"]
    if isinstance(d.get("num_key_value_heads"), int) and isinstance(
            d.get("num_attention_heads"), int):
        d["num_key_value_heads"] = min(d["num_key_value_heads"], d["num_attention_heads"])
        if before.get("num_key_value_heads") == before.get("num_attention_heads"):
            d["num_key_value_heads"] = d["num_attention_heads"]
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        if isinstance(d.get(key), int) and d[key] >= 128:
            d[key] = {"pad_token_id": 0, "bos_token_id": 1}.get(key, 2)


def tiny_config(name: str) -> Any:
    """The default config of ``name`` made tiny."""
    from transformers import AutoConfig
    config = AutoConfig.for_model(name, **_DEFAULTS.get(name, {}))
    d = copy.deepcopy(config.to_dict())
    _shrink(d)
    d.update(_FIXES.get(name, {}))
    text = d.get("text_config")
    if name.endswith("_text") is False and isinstance(text, dict):
        text.update(_FIXES.get(f"{name}_text", {}))
    for key in ("transformers_version", "architectures"):
        d.pop(key, None)
    return type(config).from_dict(d)


def build(name: str, limit: int = 30_000_000) -> tuple[nn.Module | None, str]:
    """The tiny random model of ``name`` (float32, eval) with its causal-LM head, or
    ``None`` and why it cannot be built here."""
    from transformers import AutoModelForCausalLM
    try:
        config = tiny_config(name)
        with torch.device("meta"):
            size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    except Exception as e:
        return None, f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    if size > limit:
        return None, f"{size / 1e6:.0f}M parameters from the shrunk config"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    return model.float().eval(), ""
