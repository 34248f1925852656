"""``astrai-ops demo --hf``: a tiny random transformers Llama, the whole model dispatched."""

from __future__ import annotations

__all__ = ["run_transformers_demo"]

import copy

import torch

from astrai.dispatch import explain, reset_stats, stats
from astrai.integrations.transformers.routing import FAMILIES, dispatch_model
from astrai.record.recording import record


def run_transformers_demo(seed: int = 0, max_new_tokens: int = 8) -> str:
    """Build a tiny random Llama, route the whole model through astrai, report.

    The model (GQA: 4 query heads, 2 key/value heads) gets random weights from its
    config - nothing is downloaded - and is built with ``attn_implementation="sdpa"``.
    ``dispatch_model`` routes its norms, linears, rotary and attention; a forward pass
    is compared with an untouched copy, a short greedy ``generate`` runs recorded, and
    the report shows the routing, the dispatch ``stats()`` and, for each family,
    ``explain`` of the call it served most.
    """
    try:
        import transformers
        from transformers import AutoModelForCausalLM, LlamaConfig
    except ImportError as exc:
        raise ImportError("astrai-ops demo --hf needs transformers >= 4.48 "
                          "(pip install 'astrai[transformers]')") from exc

    layers, heads, kv_heads, head_dim, prompt = 2, 4, 2, 16, 10
    config = LlamaConfig(
        vocab_size=128, hidden_size=heads * head_dim, intermediate_size=128,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        config, attn_implementation="sdpa").eval()
    plain = copy.deepcopy(model)
    routing = dispatch_model(model)

    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 128, (2, prompt), generator=generator)
    reset_stats()
    with torch.no_grad():
        expected = plain(input_ids).logits
        logits = model(input_ids).logits
        want = plain.generate(input_ids, max_new_tokens=max_new_tokens,
                              min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
        with record() as workload:
            tokens = model.generate(input_ids, max_new_tokens=max_new_tokens,
                                    min_new_tokens=max_new_tokens, do_sample=False,
                                    pad_token_id=0)
    usage = stats()
    calls = workload.calls
    lines = [
        f"astrai x transformers {transformers.__version__} (torch {torch.__version__})",
        f"model: LlamaForCausalLM, random weights, {layers} layers, {heads} heads / "
        f"{kv_heads} kv heads (GQA), head_dim {head_dim}, built with "
        f"attn_implementation='sdpa', then dispatch_model(model)",
        "",
        str(routing),
        "",
        f"forward: logits {tuple(logits.shape)}; max |dispatched - plain| = "
        f"{(logits - expected).abs().max().item():.2e}",
        f"generate (greedy, {max_new_tokens} new tokens): {tokens[0, prompt:].tolist()}; "
        f"the plain model's: "
        f"{'the same' if torch.equal(tokens, want) else want[0, prompt:].tolist()}",
        "",
        "dispatch stats:",
        usage.table(),
    ]
    for family in FAMILIES:
        mine = [c for c in calls if c.family == family]
        if not mine:
            continue
        common = max(mine, key=lambda c: c.count)
        lines += ["", f"explain: the {family} call generate made most ({common.count} of "
                  f"{sum(c.count for c in mine)}):", explain(family, common.context())]
    return "\n".join(lines)
