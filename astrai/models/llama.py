"""A tiny Llama-style decoder built only from the astrai facades.

RMSNorm, rotary embeddings, GQA attention and a SwiGLU MLP, every op through
``astrai.ops``, so each call is dispatched, counted and explainable. The same
weights run in two ways: dense (``[batch, seq]`` tokens, causal attention, for
training and for checking) and packed over a paged KV cache (prefill and decode
of ragged batches).
"""

from __future__ import annotations

__all__ = ["LlamaConfig", "TinyLlama", "generate_dense", "generate_paged"]

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from astrai.backends.rotary import rotary_freqs
from astrai.kv_cache import KVPool, PagedBatch, decode_batch, prefill_batch
from astrai.ops import apply_rotary, attention, linear, rms_norm


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes of the tiny decoder."""

    vocab_size: int = 256
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 256
    eps: float = 1e-6
    theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.hidden // self.heads


def _param(*shape: int, scale: float) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape) * scale)


class _Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        h, d = cfg.hidden, cfg.head_dim
        s = h ** -0.5
        self.attn_norm = nn.Parameter(torch.ones(h))
        self.wq = _param(cfg.heads * d, h, scale=s)
        self.wk = _param(cfg.kv_heads * d, h, scale=s)
        self.wv = _param(cfg.kv_heads * d, h, scale=s)
        self.wo = _param(h, cfg.heads * d, scale=s)
        self.mlp_norm = nn.Parameter(torch.ones(h))
        self.w_gate = _param(cfg.intermediate, h, scale=s)
        self.w_up = _param(cfg.intermediate, h, scale=s)
        self.w_down = _param(h, cfg.intermediate, scale=cfg.intermediate ** -0.5)

    def mlp(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        h = rms_norm(x, self.mlp_norm, eps)
        gated = torch.nn.functional.silu(linear(h, self.w_gate)) * linear(h, self.w_up)
        return linear(gated, self.w_down)


class TinyLlama(nn.Module):
    """The decoder; random weights from ``seed``."""

    def __init__(self, cfg: LlamaConfig | None = None, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg = cfg or LlamaConfig()
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            self.embed = _param(cfg.vocab_size, cfg.hidden, scale=1.0)
            self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.layers))
            self.final_norm = nn.Parameter(torch.ones(cfg.hidden))
            self.lm_head = _param(cfg.vocab_size, cfg.hidden, scale=cfg.hidden ** -0.5)
        finally:
            torch.random.set_rng_state(gen_state)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Dense causal forward: ``tokens [batch, seq]`` -> logits ``[batch, seq, vocab]``."""
        cfg = self.cfg
        b, s = tokens.shape
        freqs = rotary_freqs(torch.arange(s, device=tokens.device)[None], cfg.head_dim, cfg.theta)
        x = self.embed[tokens]
        for blk in self.blocks:
            assert isinstance(blk, _Block)
            h = rms_norm(x, blk.attn_norm, cfg.eps)
            q = apply_rotary(linear(h, blk.wq).view(b, s, cfg.heads, -1), freqs)
            k = apply_rotary(linear(h, blk.wk).view(b, s, cfg.kv_heads, -1), freqs)
            v = linear(h, blk.wv).view(b, s, cfg.kv_heads, -1)
            x = x + linear(attention(q, k, v, is_causal=True), blk.wo)
            x = x + blk.mlp(x, cfg.eps)
        return linear(rms_norm(x, self.final_norm, cfg.eps), self.lm_head)

    def forward_paged(self, tokens: torch.Tensor, positions: torch.Tensor,
                      batch: PagedBatch) -> torch.Tensor:
        """Packed forward over a paged cache: ``tokens [T]`` -> logits ``[T, vocab]``."""
        cfg = self.cfg
        t = tokens.shape[0]
        freqs = rotary_freqs(positions, cfg.head_dim, cfg.theta)
        x = self.embed[tokens]
        for layer, blk in enumerate(self.blocks):
            assert isinstance(blk, _Block)
            h = rms_norm(x, blk.attn_norm, cfg.eps)
            q = apply_rotary(linear(h, blk.wq).view(t, cfg.heads, -1), freqs)
            k = apply_rotary(linear(h, blk.wk).view(t, cfg.kv_heads, -1), freqs)
            v = linear(h, blk.wv).view(t, cfg.kv_heads, -1)
            out = attention(q, k, v, kv_cache=batch, layer_id=layer, fwd=batch.fwd)
            x = x + linear(out, blk.wo)
            x = x + blk.mlp(x, cfg.eps)
        return linear(rms_norm(x, self.final_norm, cfg.eps), self.lm_head)

    def new_pool(self, max_requests: int, max_context: int) -> KVPool:
        """A paged cache sized for this model."""
        cfg = self.cfg
        return KVPool(cfg.layers, max_requests * max_context + 1, cfg.kv_heads, cfg.head_dim,
                      max_requests, max_context, dtype=self.embed.dtype,
                      device=self.embed.device)


@torch.no_grad()
def generate_paged(model: TinyLlama, prompts: Sequence[Sequence[int]], steps: int,
                   pool: KVPool | None = None) -> list[list[int]]:
    """Greedy decoding: one ragged prefill of all prompts, then ``steps`` decode steps."""
    lens = [len(p) for p in prompts]
    pool = pool or model.new_pool(len(prompts), max(lens) + steps + 1)
    batch = prefill_batch(pool, lens)
    tokens = torch.tensor([t for p in prompts for t in p], device=model.embed.device)
    positions = torch.cat([torch.arange(n) for n in lens]).to(tokens.device)
    logits = model.forward_paged(tokens, positions, batch)
    last = batch.qo_indptr[1:] - 1
    nxt = logits[last].argmax(-1)
    out = [[int(t)] for t in nxt]
    rows = batch.req_pool_indices
    for _ in range(steps - 1):
        step = decode_batch(pool, rows)
        logits = model.forward_paged(nxt, step.seq_lens - 1, step)
        nxt = logits.argmax(-1)
        for seq, t in zip(out, nxt.tolist(), strict=True):
            seq.append(int(t))
    pool.free(rows)
    return out


@torch.no_grad()
def generate_dense(model: TinyLlama, prompts: Sequence[Sequence[int]],
                   steps: int) -> list[list[int]]:
    """Greedy decoding by re-running the dense model over the whole sequence each step."""
    out: list[list[int]] = []
    for prompt in prompts:
        seq = list(prompt)
        for _ in range(steps):
            logits = model(torch.tensor([seq], device=model.embed.device))
            seq.append(int(logits[0, -1].argmax()))
        out.append(seq[len(prompt):])
    return out
