"""``dispatch_model`` / ``restore_model`` on real transformers models with tiny random weights.

Five architectures, each built from a config (nothing is downloaded): Llama (GQA),
Mistral (sliding window), Qwen2 (biased q/k/v projections), Gemma (``1 + weight``
norms, a custom head_dim) and Gemma 2 (soft-capping, four norms per layer, a custom
scale). Each is built with ``attn_implementation="sdpa"`` (Gemma 2: ``"eager"``, its only one
besides flash and flex), its norm weights made random
(so the norm form matters), and compared with an untouched copy of itself.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    GemmaConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
)

import astrai.dispatch as dispatch
from astrai.backends.native import native_available
from astrai.families.attention.model import attention_site
from astrai.integrations.transformers import (
    RoutingError,
    dispatch_model,
    restore_model,
    verify_model,
)
from astrai.integrations.transformers.routing import model_families
from astrai.lock.make import check_lock, lock_workload
from astrai.record.recording import record
from astrai.tune.run import tune_workload

LAYERS = 2
TINY: dict[str, Any] = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
    bos_token_id=1, eos_token_id=2,
)
CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama": lambda: LlamaConfig(**TINY),
    "mistral": lambda: MistralConfig(**TINY, sliding_window=4),
    "qwen2": lambda: Qwen2Config(**TINY),
    "gemma": lambda: GemmaConfig(**TINY, head_dim=16),
    "gemma2": lambda: Gemma2Config(**TINY, head_dim=16, sliding_window=4,
                                   attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
                                   query_pre_attn_scalar=24),
}
#: Norm modules per model: two per layer (four for Gemma 2) and the final one.
#: The families a Llama-style model computes.
LLAMA_FAMILIES = {"attention", "rotary", "rms_norm", "linear", "gated_activation"}
NORMS = {"llama": 5, "mistral": 5, "qwen2": 5, "gemma": 5, "gemma2": 9}
LINEARS = 7 * LAYERS + 1  # q, k, v, o, gate, up, down per layer; the lm head
#: Which form each architecture's norms are served in.
FORM = {"llama": "weight after the cast back", "mistral": "weight after the cast back",
        "qwen2": "weight after the cast back", "gemma": "1 + weight",
        "gemma2": "1 + weight"}
#: Gemma 2 has no sdpa path in transformers: built with eager attention (additive masks).
IMPL = {"gemma2": "eager"}
SEQ = 12


def randomize_norms(model: nn.Module) -> None:
    """Norm weights random, not ones/zeros: each form then gives another result."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def build(arch: str, impl: str | None = None, dtype: torch.dtype = torch.float32
          ) -> tuple[PreTrainedModel, PreTrainedModel]:
    """``(plain, routed)``: one random model and a copy of it, the copy dispatched."""
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        CONFIGS[arch](), attn_implementation=impl or IMPL.get(arch, "sdpa"))
    randomize_norms(plain)
    plain = plain.to(dtype).eval()
    routed = copy.deepcopy(plain)
    dispatch_model(routed)
    return plain, routed


def tokens(batch: int = 2, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(3, 128, (batch, seq), generator=torch.Generator().manual_seed(1))


def logits(model: nn.Module, ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(ids, **kwargs).logits.float()
    return out


def greedy(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model.generate(ids, max_new_tokens=8, min_new_tokens=8,
                                           do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:]


def served() -> dict[str, dict[str, int]]:
    """Calls served so far per family, by row."""
    by_row = dispatch.stats().by_row()
    return {f: {row: sum(origins.values()) for row, origins in rows.items()}
            for f, rows in by_row.items()}


def own_forwards(model: nn.Module) -> dict[str, Any]:
    return {name: m.__dict__["forward"] for name, m in model.named_modules()
            if "forward" in m.__dict__}


ARCHS = list(CONFIGS)


class TestModels:
    @pytest.mark.parametrize("arch", ARCHS)
    def test_coverage_and_logits(self, arch: str) -> None:
        plain, routed = build(arch)
        report = dispatch_model(routed)  # a second call: nothing left to do
        assert report.changed == 0
        assert routed_counts(report) == {"attention": LAYERS, "rotary": LAYERS,
                                         "rms_norm": NORMS[arch], "linear": LINEARS,
                                         "gated_activation": LAYERS, "cross_entropy": 1}
        # everything that holds a weight is routed but the token embedding (a lookup)
        assert [(n.family, n.path) for n in report.not_routed] == [
            ("embedding", "model.embed_tokens")]
        assert report.shares()["matmul_flops"] == 1.0
        assert all(FORM[arch] in r.detail for r in report.routed if r.family == "rms_norm")
        ids = tokens()
        torch.testing.assert_close(logits(routed, ids), logits(plain, ids), atol=1e-5,
                                   rtol=1e-5)
        counts = verify_model(routed, ids, labels=ids)  # with labels: the loss too
        assert set(counts) == LLAMA_FAMILIES | {"cross_entropy"} and min(counts.values()) > 0
        assert counts["rms_norm"] == NORMS[arch] and counts["linear"] == LINEARS
        assert counts["rotary"] == counts["attention"] == LAYERS

    @pytest.mark.parametrize("arch", ARCHS)
    def test_generate_greedy(self, arch: str) -> None:
        plain, routed = build(arch)
        ids = tokens()
        assert torch.equal(greedy(routed, ids), greedy(plain, ids))

    @pytest.mark.parametrize("arch", ARCHS)
    def test_gradients(self, arch: str) -> None:
        plain, routed = build(arch)
        ids = tokens()
        grads = []
        for model in (plain, routed):
            model.train()
            model.zero_grad()
            model(ids, labels=ids).loss.backward()
            grads.append({n: p.grad for n, p in model.named_parameters()})
        assert grads[0].keys() == grads[1].keys()
        for name, g in grads[0].items():
            assert g is not None and grads[1][name] is not None, name
            torch.testing.assert_close(grads[1][name], g, atol=1e-5, rtol=1e-4, msg=name)

    @pytest.mark.parametrize("arch", ARCHS)
    def test_restore(self, arch: str) -> None:
        plain, routed = build(arch)
        assert restore_model(routed) == NORMS[arch] + LINEARS + 2 * LAYERS + 1  # MLPs, loss
        assert own_forwards(routed) == {}
        dispatch.reset_stats()
        ids = tokens()
        torch.testing.assert_close(logits(routed, ids), logits(plain, ids))
        assert served() == {}  # no astrai call at all
        assert restore_model(routed) == 0

    @pytest.mark.parametrize("arch", ARCHS)
    def test_scopes_reach_the_layers(self, arch: str) -> None:
        plain, routed = build(arch)
        ids = tokens()
        dispatch.reset_stats()
        with dispatch.op_backend(rms_norm="reference", rotary="reference", linear="torch",
                                 attention="math"):
            got = logits(routed, ids)
        torch.testing.assert_close(got, logits(plain, ids), atol=1e-5, rtol=1e-5)
        assert served() == {"rms_norm": {"reference": NORMS[arch]},
                            "rotary": {"reference": LAYERS},
                            "linear": {"torch": LINEARS}, "attention": {"math": LAYERS},
                            "gated_activation": {"torch": LAYERS}}


class TestDispatch:
    def test_second_call_changes_nothing(self) -> None:
        _, routed = build("llama")
        before = own_forwards(routed)
        assert len(before) == NORMS["llama"] + LINEARS + 2 * LAYERS + 1  # MLPs, the loss
        report = dispatch_model(routed)
        assert report.changed == 0 and own_forwards(routed) == before

    def test_families_narrow_then_widen(self) -> None:
        plain, _ = build("llama")
        model = copy.deepcopy(plain)
        report = dispatch_model(model, ("rms_norm", "linear"))
        assert report.counts() == {"rms_norm": NORMS["llama"], "linear": LINEARS}
        attn = model.model.layers[0].self_attn
        assert "forward" not in attn.__dict__
        assert set(verify_model(model, tokens())) == {"rms_norm", "linear"}
        report = dispatch_model(model, ["rotary"])
        assert report.changed == LAYERS and report.counts()["rotary"] == LAYERS
        report = dispatch_model(model)  # attention joins the rotary already routed
        assert report.changed == 2 * LAYERS + 1  # the layers again, the MLPs, the loss
        assert routed_counts(report) == {"attention": LAYERS, "rotary": LAYERS,
                                         "rms_norm": NORMS["llama"], "linear": LINEARS,
                                         "gated_activation": LAYERS, "cross_entropy": 1}
        torch.testing.assert_close(logits(model, tokens()), logits(plain, tokens()))

    def test_error_unknown_family(self) -> None:
        _, routed = build("llama")
        with pytest.raises(ValueError,
                           match="unknown family 'rope'; families: activation, attention, "):
            dispatch_model(routed, ["rope"])
        with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
            dispatch_model("model")  # type: ignore[arg-type]

    def test_plain_model_untouched(self) -> None:
        """Routing is per instance: another model of the same class is not routed."""
        plain, routed = build("llama")
        dispatch.reset_stats()
        logits(plain, tokens())
        assert served() == {}
        logits(routed, tokens())
        assert set(served()) == LLAMA_FAMILIES

    def test_eager_masks_and_left_padding(self) -> None:
        plain, routed = build("llama", impl="eager")
        ids = tokens()
        mask = torch.ones_like(ids)
        ids[0, :3], mask[0, :3] = 0, 0
        got, want = logits(routed, ids, attention_mask=mask), logits(plain, ids,
                                                                      attention_mask=mask)
        torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[0, 3:], want[0, 3:], atol=1e-5, rtol=1e-5)
        assert dispatch.stats().served("attention") > 0

    def test_attention_masks_it_cannot_read(self) -> None:
        from transformers.models.llama.modeling_llama import LlamaAttention

        why = attention_site(LlamaAttention.forward, "flash_attention_2")
        assert isinstance(why, str) and "'flash_attention_2'" in why and "sdpa" in why
        assert attention_site(nn.Linear.forward, "sdpa") is None

    def test_bfloat16(self) -> None:
        plain, routed = build("llama", dtype=torch.bfloat16)
        ids = tokens()
        want = logits(plain, ids)
        torch.testing.assert_close(logits(routed, ids), want, atol=3e-2, rtol=3e-2)
        with dispatch.op_backend(rms_norm="reference", rotary="reference"):
            exact = logits(routed, ids)  # the references: the model's own bits
        torch.testing.assert_close(exact, want, atol=0, rtol=0)

    def test_env_and_profiles(self, monkeypatch: pytest.MonkeyPatch) -> None:
        plain, routed = build("gemma")
        ids = tokens()
        monkeypatch.setenv("ASTR_OPS", "rms_norm=reference,rotary=reference")
        dispatch.reset_stats()
        logits(routed, ids)
        assert served()["rms_norm"] == {"reference": NORMS["gemma"]}
        assert served()["rotary"] == {"reference": LAYERS}
        monkeypatch.delenv("ASTR_OPS")
        dispatch.reset_stats()
        with dispatch.use_profile("reference"):
            got = logits(routed, ids)
        torch.testing.assert_close(got, logits(plain, ids), atol=1e-5, rtol=1e-5)
        assert {f: set(rows) for f, rows in served().items()} == {
            "rms_norm": {"reference"}, "rotary": {"reference"}, "linear": {"torch"},
            "attention": {"math"}, "gated_activation": {"reference"}}

    def test_explain_a_routed_call(self) -> None:
        _, routed = build("gemma2")
        with record() as wl:
            logits(routed, tokens())
        norm = next(c for c in wl.calls if c.family == "rms_norm")
        text = dispatch.explain("rms_norm", norm.context())
        # an inference call: the native row's where astrai's native extension is loaded
        row = "native" if native_available() else "torch"
        assert "weight_offset=true" in text and f"=> {row} (origin=chain)" in text
        rotary = next(c for c in wl.calls if c.family == "rotary")
        assert "layout=half" in dispatch.explain("rotary", rotary.context())

    def test_record_tune_lock(self, tmp_path: Path) -> None:
        """A real model's workload: recorded, tuned into a profile, locked and checked."""
        _, routed = build("qwen2")
        with record() as wl:
            logits(routed, tokens())
            greedy(routed, tokens(batch=1, seq=4))
        workload = wl.workload()
        assert set(workload.families()) == LLAMA_FAMILIES
        path = workload.save(tmp_path / "wl.yaml")
        tuned = tune_workload(type(workload).load(path), tmp_path / "tuned.yaml", rounds=1,
                              progress=False)
        assert {b.family for b in tuned.buckets} == LLAMA_FAMILIES
        assert not [t for t in tuned.timings if t.skipped]
        dispatch.load_tables(tmp_path / "tuned.yaml")
        with dispatch.use_profile(tuned.name):
            torch.testing.assert_close(logits(routed, tokens()), logits(routed, tokens()))
        lock = lock_workload(workload)
        assert {d.family for d in lock.decisions} == LLAMA_FAMILIES
        assert check_lock(lock).ok

    def test_compile_fullgraph(self) -> None:
        plain, routed = build("llama")
        ids = tokens()
        torch._dynamo.reset()
        explained = torch._dynamo.explain(routed)(ids)
        assert explained.graph_break_count == 0, explained.break_reasons
        compiled = torch.compile(routed, fullgraph=True)
        torch.testing.assert_close(logits(compiled, ids), logits(plain, ids), atol=1e-5,
                                   rtol=1e-5)
        torch._dynamo.reset()

    def test_deepcopy_routed_and_pickle_refused(self) -> None:
        plain, routed = build("llama")
        twin = copy.deepcopy(routed)
        assert dispatch_model(twin).changed == 0  # the copy is routed
        with torch.no_grad():
            twin.model.norm.weight.add_(1.0)  # the copy's forwards read the copy's weights
        ids = tokens()
        torch.testing.assert_close(logits(routed, ids), logits(plain, ids), atol=1e-5,
                                   rtol=1e-5)
        assert not torch.allclose(logits(twin, ids), logits(plain, ids))
        with pytest.raises(TypeError, match=r"restore_model\(model\) first"):
            pickle.dumps(routed)
        restore_model(twin)
        assert pickle.loads(pickle.dumps(twin)) is not None


# -- what is not routed, and why ----------------------------------------------------


class WeirdRMSNorm(nn.Module):
    """Named like an RMS norm, but divides by the mean absolute value."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x / (x.abs().mean(-1, keepdim=True) + self.eps)


class TestNotRouted:
    def test_unrecognised_norm_is_reported(self) -> None:
        plain, _ = build("llama")
        plain.model.norm = WeirdRMSNorm(64)
        plain.model.layers[0].post_attention_layernorm = nn.LayerNorm(64)
        model = copy.deepcopy(plain)
        report = dispatch_model(model)
        reasons = {(n.family, n.path): n.reason for n in report.not_routed}
        assert "matches no RMS norm form" in reasons[("rms_norm", "model.norm")]
        assert report.paths("layer_norm") == ["model.layers.0.post_attention_layernorm"]
        assert report.counts()["rms_norm"] == NORMS["llama"] - 2
        assert "model.norm (WeirdRMSNorm)" in str(report)
        torch.testing.assert_close(logits(model, tokens()), logits(plain, tokens()),
                                   atol=1e-5, rtol=1e-5)

    def test_foreign_forward_left_alone(self, caplog: pytest.LogCaptureFixture) -> None:
        plain, _ = build("llama")
        model = copy.deepcopy(plain)
        norm = model.model.norm
        norm.forward = functools.partial(type(norm).forward, norm)  # an accelerate-style hook
        report = dispatch_model(model)
        refused = [n for n in report.not_routed if n.path == "model.norm"]
        assert refused and "already replaced on the instance" in refused[0].reason
        # replaced after astrai: restore leaves it and says so
        lin = model.lm_head
        mine = functools.partial(nn.Linear.forward, lin)
        lin.forward = mine
        assert dispatch_model(model).changed == 0
        with caplog.at_level(logging.WARNING, logger="astrai"):
            restore_model(model)
        assert lin.forward is mine
        assert any("left lm_head" in r.getMessage() for r in caplog.records)

    def test_not_linear_kinds(self) -> None:
        class QuantLinear(nn.Linear):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return super().forward(x).round()

        plain, _ = build("llama")
        model = copy.deepcopy(plain)
        model.lm_head = QuantLinear(64, 128, bias=False)
        report = dispatch_model(model)
        refused = {n.path: n.reason for n in report.not_routed}
        assert "overrides nn.Linear.forward" in refused["lm_head"]


def pairs_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A rotary of adjacent pairs, under transformers' name pattern."""
    def turn(x: torch.Tensor) -> torch.Tensor:
        x0, x1 = x[..., 0::2], x[..., 1::2]
        c, s = cos[..., 0::2].unsqueeze(1), sin[..., 0::2].unsqueeze(1)
        return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), -1).flatten(-2)
    return turn(q), turn(k)


def cohere_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor, unsqueeze_dim: int = 1
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Cohere's form: ``x * cos + rotate_interleaved(x) * sin``, in float32."""
    c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

    def turn(x: torch.Tensor) -> torch.Tensor:
        w = x.float()
        rot = torch.stack((-w[..., 1::2], w[..., 0::2]), -1).flatten(-2)
        return (w * c + rot * s).to(q.dtype)
    return turn(q), turn(k)


def upcast_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor, unsqueeze_dim: int = 1
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's half layout computed in float32 and cast back."""
    a, b = half_rotary_pos_emb(q.float(), k.float(), cos.float(), sin.float(), unsqueeze_dim)
    return a.to(q.dtype), b.to(k.dtype)


def apply_partial_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                                 sin: torch.Tensor, unsqueeze_dim: int = 1
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-NeoX's partial rotary: the first cos.shape[-1] dims turn, the rest pass."""
    n = cos.shape[-1]
    c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

    def turn(x: torch.Tensor) -> torch.Tensor:
        r, rest = x[..., :n], x[..., n:]
        half = r.shape[-1] // 2
        rot = torch.cat((-r[..., half:], r[..., :half]), -1)
        return torch.cat((r * c + rot * s, rest), -1)
    return turn(q), turn(k)


def half_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, unsqueeze_dim: int = 1
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's rotary: the whole head_dim turns (a shorter cos does not broadcast)."""
    c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

    def turn(x: torch.Tensor) -> torch.Tensor:
        h = x.shape[-1] // 2
        return x * c + torch.cat((-x[..., h:], x[..., :h]), -1) * s
    return turn(q), turn(k)


def optional_k_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor | None = None,
                              cos: torch.Tensor | None = None,
                              sin: torch.Tensor | None = None, unsqueeze_dim: int = 1
                              ) -> Any:
    """Qwen4-Exp's rotary: the half layout, on the queries alone when no keys are given."""
    assert cos is not None and sin is not None
    c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

    def turn(x: torch.Tensor) -> torch.Tensor:
        h = x.shape[-1] // 2
        return x * c + torch.cat((-x[..., h:], x[..., :h]), -1) * s
    return turn(q) if k is None else (turn(q), turn(k))


def single_rotary_pos_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          unsqueeze_dim: int = 1) -> torch.Tensor:
    """Gemma 4's rotary: one tensor a call, the half layout over the whole head."""
    c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    h = x.shape[-1] // 2
    return x * c + torch.cat((-x[..., h:], x[..., :h]), -1) * s


class ToySingleAttention(nn.Module):
    """Turns its queries and its keys in two calls, heads second or third."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (single_rotary_pos_emb(q, cos, sin),
                single_rotary_pos_emb(k.transpose(1, 2), cos, sin, unsqueeze_dim=2))


def routed_counts(report: Any) -> dict[str, int]:
    """The report's counts of the families it routed (it counts every family, 0 where
    none)."""
    counts = report.counts()
    assert set(counts) == set(model_families())
    return {f: n for f, n in counts.items() if n}


def reversed_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, unsqueeze_dim: int = 1
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """NanoChat's rotary: its rotate_half turns the other way, cat(x2, -x1)."""
    c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

    def turn(x: torch.Tensor) -> torch.Tensor:
        h = x.shape[-1] // 2
        return x * c + torch.cat((x[..., h:], -x[..., :h]), -1) * s
    return turn(q), turn(k)


class ToyReversedAttention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return reversed_rotary_pos_emb(q, k, cos, sin)


def old_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, position_ids: torch.Tensor | None = None,
                      unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers 4's: position_ids deprecated and unused."""
    return half_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)


class ToyOldAttention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return old_rotary_pos_emb(q, k, cos, sin, torch.arange(q.shape[2])[None])


class ToyGuardedAttention(nn.Module):
    """Cohere 2's: rotary in sliding-window layers only, by its own attribute."""

    def __init__(self, sliding_window: int | None) -> None:
        super().__init__()
        self.sliding_window = sliding_window

    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.sliding_window is not None:
            q, k = half_rotary_pos_emb(q, k, cos, sin)
        return q, k


class ToyIndexerAttention(nn.Module):
    """Rotates queries and keys, and queries alone by keyword (an indexer's)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q2, k2 = optional_k_rotary_pos_emb(q, k, cos, sin)
        alone = optional_k_rotary_pos_emb(q.transpose(1, 2), cos=cos, sin=sin,
                                          unsqueeze_dim=2)
        return q2, k2, alone


class ToyAttention(nn.Module):
    """Calls a rotary function by its global name, as transformers' layers do: a
    partial one (half of head_dim turns)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return apply_partial_rotary_pos_emb(q, k, cos[..., :8], sin[..., :8])


class ToyPairsAttention(nn.Module):
    """Calls a rotary of adjacent pairs by its global name."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return pairs_rotary_pos_emb(q, k, cos, sin)


class ToyCohereAttention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return cohere_rotary_pos_emb(q, k, cos, sin)


class ToyUpcastAttention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return upcast_rotary_pos_emb(q, k, cos, sin)


class ToyBranchAttention(nn.Module):
    """Reads two rotary functions and calls one of them, as DeepSeek-V3's layers do;
    or none, when ``rotate`` is off."""

    def __init__(self, partial: bool = True, rotate: bool = True) -> None:
        super().__init__()
        self.partial, self.rotate = partial, rotate

    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not self.rotate:
            return q, k
        if self.partial:
            return apply_partial_rotary_pos_emb(q, k, cos, sin)
        return half_rotary_pos_emb(q, k, cos, sin)


class ToyHalfAttention(nn.Module):
    """A half-layout function handed a cos shorter than head_dim, which it cannot
    broadcast: the model's own function raises, and so does the routed call."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return half_rotary_pos_emb(q, k, cos[..., :8], sin[..., :8])


class TestRotarySites:
    def toy_call(self) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(0)
        return (torch.randn(1, 4, 3, 16, generator=g), torch.randn(1, 2, 3, 16, generator=g),
                torch.randn(1, 3, 16, generator=g), torch.randn(1, 3, 16, generator=g))

    def test_other_rotary_reported(self) -> None:
        toy = ToyPairsAttention()  # pairs turned by their even feature's angle alone
        report = dispatch_model(toy, ["rotary"])
        assert report.counts() == {"rotary": 0}
        (refused,) = [n for n in report.not_routed if "pairs_rotary_pos_emb" in n.reason]
        assert "computes none of the rotary layouts astrai serves" in refused.reason

    def test_pairwise_layout_served(self) -> None:
        toy = ToyCohereAttention()
        assert dispatch_model(toy, ["rotary"]).counts() == {"rotary": 1}
        (site,) = toy.__dict__["_astrai_route"].parts["rotary"]
        assert (site.layout, site.upcast, site.partial) == ("pairwise", True, False)
        for dtype in (torch.float32, torch.bfloat16):
            args = tuple(t.to(dtype) for t in self.toy_call())
            want = type(toy).forward(toy, *args)
            dispatch.reset_stats()
            got = toy(*args)
            for a, b in zip(got, want, strict=True):
                assert a.dtype == dtype
                torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
            assert served() == {"rotary": {n: 1 for n in served()["rotary"]}}
            assert dispatch.stats().served("rotary", origin="model") == 0

    def test_a_whole_head_layout_given_part_of_a_head_runs_its_own(self) -> None:
        toy = ToyCohereAttention()
        dispatch_model(toy, ["rotary"])
        q, k, cos, sin = self.toy_call()
        dispatch.reset_stats()
        with pytest.raises(RuntimeError, match="size of tensor"):  # as it does unrouted
            toy(q, k, cos[..., :8], sin[..., :8])
        assert served() == {"rotary": {"model": 1}}

    def test_a_function_computing_in_float32_is_served_in_float32(self) -> None:
        plain, wide = ToyHalfAttention(), ToyUpcastAttention()
        dispatch_model(plain, ["rotary"])
        dispatch_model(wide, ["rotary"])
        (narrow_site,) = plain.__dict__["_astrai_route"].parts["rotary"]
        (wide_site,) = wide.__dict__["_astrai_route"].parts["rotary"]
        assert (narrow_site.layout, narrow_site.upcast) == ("half", False)
        assert (wide_site.layout, wide_site.upcast) == ("half", True)
        q, k, cos, sin = (t.to(torch.bfloat16) for t in self.toy_call())
        want = type(wide).forward(wide, q, k, cos, sin)
        got = wide(q, k, cos, sin)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == torch.bfloat16
            torch.testing.assert_close(a, b, atol=0, rtol=0)

    def test_partial_rotary_is_served(self, caplog: pytest.LogCaptureFixture) -> None:
        toy = ToyAttention()
        report = dispatch_model(toy, ["rotary"])
        assert report.counts() == {"rotary": 1}
        (site,) = toy.__dict__["_astrai_route"].parts["rotary"]
        assert site.layout == "partial"
        args = self.toy_call()
        want = type(toy).forward(toy, *args)
        dispatch.reset_stats()
        with caplog.at_level(logging.WARNING, logger="astrai"):
            got = toy(*args)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert sum(served()["rotary"].values()) == 1
        assert not [r for r in caplog.records if "own function" in r.getMessage()]
        assert verify_model(toy, *args) == {"rotary": 1}

    def test_queries_alone_are_served_where_the_function_rotates_them_alone(
            self, caplog: pytest.LogCaptureFixture) -> None:
        toy = ToyIndexerAttention()
        assert dispatch_model(toy, ["rotary"]).counts() == {"rotary": 1}
        (site,) = toy.__dict__["_astrai_route"].parts["rotary"]
        assert (site.layout, site.alone) == ("half", True)
        args = self.toy_call()
        want = type(toy).forward(toy, *args)
        dispatch.reset_stats()
        with caplog.at_level(logging.WARNING, logger="astrai"):
            got = toy(*args)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
        assert sum(served()["rotary"].values()) == 2
        assert dispatch.stats().served("rotary", origin="model") == 0
        assert not [r for r in caplog.records if "own function" in r.getMessage()]

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
    def test_a_function_of_one_tensor_is_served(self, dtype: torch.dtype) -> None:
        toy = ToySingleAttention()
        assert dispatch_model(toy, ["rotary"]).counts() == {"rotary": 1}
        (site,) = toy.__dict__["_astrai_route"].parts["rotary"]
        assert (site.single, site.layout, site.upcast) == (True, "half", False)
        args = tuple(t.to(dtype) for t in self.toy_call())
        want = type(toy).forward(toy, *args)
        dispatch.reset_stats()
        got = toy(*args)
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        for a, b in zip(got, want, strict=True):
            assert a.dtype == dtype and a.shape == b.shape
            torch.testing.assert_close(a, b, atol=tol, rtol=tol)
        assert sum(served()["rotary"].values()) == 2
        assert dispatch.stats().served("rotary", origin="model") == 0

    def test_a_parameter_the_function_ignores_is_dropped(self) -> None:
        toy = ToyOldAttention()
        assert dispatch_model(toy, ["rotary"]).counts() == {"rotary": 1}
        (site,) = toy.__dict__["_astrai_route"].parts["rotary"]
        assert site.ignored == frozenset({"position_ids"})
        args = self.toy_call()
        want = type(toy).forward(toy, *args)
        dispatch.reset_stats()
        for a, b in zip(toy(*args), want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
        assert dispatch.stats().served("rotary", origin="model") == 0

    def test_the_reversed_half_layout_is_served(self) -> None:
        toy = ToyReversedAttention()
        assert dispatch_model(toy, ["rotary"]).counts() == {"rotary": 1}
        (site,) = toy.__dict__["_astrai_route"].parts["rotary"]
        assert site.layout == "reversed"
        args = self.toy_call()
        want = type(toy).forward(toy, *args)
        dispatch.reset_stats()
        for a, b in zip(toy(*args), want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
        assert dispatch.stats().served("rotary", origin="model") == 0
        assert sum(served()["rotary"].values()) == 1

    def test_a_layer_whose_attributes_rule_its_rotary_out_has_no_rotary_site(self) -> None:
        model = nn.ModuleList([ToyGuardedAttention(4), ToyGuardedAttention(None)])
        report = dispatch_model(model, ["rotary"])
        assert report.paths("rotary") == ["0"]
        (note,) = [n for n in report.notes if "applies no rotary" in str(n)]
        assert "only where self.sliding_window is not None" in str(note)
        args = self.toy_call()
        for layer in model:
            want = type(layer).forward(layer, *args)
            assert all(torch.allclose(a, b, atol=1e-6)
                       for a, b in zip(layer(*args), want, strict=True))
        assert verify_model(model[0], *args) == {"rotary": 1}

    def test_a_call_its_layout_cannot_take_runs_its_own_and_is_counted(
            self, caplog: pytest.LogCaptureFixture) -> None:
        toy = ToyHalfAttention()
        assert dispatch_model(toy, ["rotary"]).counts() == {"rotary": 1}
        args = self.toy_call()
        dispatch.reset_stats()
        with caplog.at_level(logging.WARNING, logger="astrai"), \
                pytest.raises(RuntimeError, match="size of tensor"):
            toy(*args)  # the model's own function, which fails as it does unrouted
        assert served() == {"rotary": {"model": 1}}
        assert dispatch.stats().served("rotary", origin="model") == 1
        warned = [r.getMessage() for r in caplog.records if "own function" in r.getMessage()]
        assert len(warned) == 1 and "cos covers 8 of head_dim 16" in warned[0]

    def test_verify_model_names_a_site_the_layer_did_not_call_unreached(self) -> None:
        toy = ToyBranchAttention(rotate=False)  # a layer applying no rotary (NoPE)
        assert dispatch_model(toy, ["rotary"]).counts() == {"rotary": 1}
        got = verify_model(toy, *self.toy_call())
        assert got == {"rotary": 0}
        assert got.unreached == {
            "rotary ((the model) ToyBranchAttention)":
                "its forward did not call apply_partial_rotary_pos_emb, half_rotary_pos_emb "
                "with these inputs"}

    def test_verify_model_refuses_a_module_whose_every_call_ran_its_own_code(self) -> None:
        from astrai.dispatch.stats import count_model_own
        from astrai.integrations.transformers.routing import ROUTE_ATTR

        model = nn.Sequential(nn.Linear(8, 8), nn.RMSNorm(8, eps=1e-6), nn.RMSNorm(8, eps=1e-6))
        dispatch_model(model, ["rms_norm"])
        norm, idle = model[1], model[2]
        route = norm.__dict__[ROUTE_ATTR]

        def handing_back(x: torch.Tensor) -> torch.Tensor:
            count_model_own("rms_norm")
            return type(norm).forward(norm, x)

        norm.__dict__["forward"] = route.installed = handing_back
        model.forward = lambda x: norm(model[0](x))  # type: ignore[method-assign]
        with pytest.raises(RoutingError) as got:
            verify_model(model, torch.randn(2, 8))
        # the norm the model did not call is unreached, not an error
        assert str(got.value) == ("routed but served no call: rms_norm (1 RMSNorm) (their "
                                  "code changed under them, or every call ran the model's "
                                  "own code)")
        assert idle.__dict__[ROUTE_ATTR] is not None

    def test_verify_model_counts_either_branch_of_a_layer(self) -> None:
        for partial in (True, False):
            toy = ToyBranchAttention(partial=partial)
            report = dispatch_model(toy, ["rotary"])
            assert report.counts() == {"rotary": 1}
            assert verify_model(toy, *self.toy_call()) == {"rotary": 1}


class FunctionModule(nn.Module):
    """What HF ``kernels`` makes of a function it may swap for a hub kernel: a module
    called like the function, ``forward(self, *args, **kwargs)``, whose parameters are
    stated only on ``forward.__signature__``."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return half_rotary_pos_emb(*args, **kwargs)


FunctionModule.forward.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
     *inspect.signature(half_rotary_pos_emb).parameters.values()])


def _decorated(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)
    return wrapper


class _Rotator:
    def apply_rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, unsqueeze_dim: int = 1) -> tuple[torch.Tensor, ...]:
        return half_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)


apply_rotary_module = FunctionModule()
apply_rotary_decorated = _decorated(half_rotary_pos_emb)
apply_rotary_bound = _Rotator().apply_rotary


class ToyWrappedAttention(nn.Module):
    """Calls its rotary through a function module, a ``functools.wraps`` decorator and a
    bound method, by their global names; the second call passes ``unsqueeze_dim`` by
    keyword (read through the wrapper's signature)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k = apply_rotary_module(q, k, cos, sin)
        q, k = apply_rotary_decorated(q, k, cos, sin, unsqueeze_dim=1)
        return apply_rotary_bound(q, k, cos, sin)


class TestWrappedRotary:
    def test_every_wrapper_is_read_and_served(self) -> None:
        toy = ToyWrappedAttention()
        args = TestRotarySites().toy_call()
        want = type(toy).forward(toy, *args)
        report = dispatch_model(toy, ["rotary"])
        assert report.not_routed == ()
        (routed,) = report.routed
        assert "apply_rotary_module" in routed.detail  # the name a wrapper class is called by
        assert "_Rotator.apply_rotary" in routed.detail
        dispatch.reset_stats()
        got = toy(*args)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert sum(served()["rotary"].values()) == 3
        assert verify_model(toy, *args) == {"rotary": 3}

    def test_a_wrapper_that_states_nothing_is_a_reason(self) -> None:
        class Opaque(nn.Module):
            def forward(self, *args: Any, **kwargs: Any) -> Any:
                return half_rotary_pos_emb(*args, **kwargs)

        from astrai.families.rotary.model import rotary_sites
        from astrai.recognition.inspection import call_signature
        assert call_signature(Opaque()) is None
        owner = {"apply_rotary_pos_emb": Opaque()}
        code = compile("def forward(q, k, c, s):\n    return apply_rotary_pos_emb(q, k, c, s)\n",
                       "<toy>", "exec")
        exec(code, owner)
        sites, refused = rotary_sites(owner["forward"])
        assert sites == [] and "signature cannot be read" in refused[0][1]

    def test_transformers_own_wrapper(self) -> None:
        from transformers.models.llama import modeling_llama
        fn = modeling_llama.apply_rotary_pos_emb
        _plain, routed = build("llama")
        assert routed.model.layers[0].self_attn.__dict__["_astrai_route"].parts["rotary"]
        if isinstance(fn, nn.Module):  # HF kernels is installed: transformers wraps it
            detail = [r.detail for r in dispatch_model(routed).routed if r.family == "rotary"]
            assert detail and all("apply_rotary_pos_emb" in d for d in detail)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor,
                     freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama 4's complex rotary, pairs times complex angles."""
    def turn(x: torch.Tensor) -> torch.Tensor:
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs_cis[:, :, None, :]).flatten(3).type_as(x)
    return turn(xq), turn(xk)


def apply_rotary_emb_heads(xq: torch.Tensor, xk: torch.Tensor,
                           freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2's complex rotary: heads second, the angles unsqueezed at 1."""
    def turn(x: torch.Tensor) -> torch.Tensor:
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs_cis.unsqueeze(1)).flatten(3).type_as(x)
    return turn(xq), turn(xk)


class ToyHeadsSecondAttention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, freqs: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        return apply_rotary_emb_heads(q, k, freqs)


def apply_rotary_pos_emb_one(x: torch.Tensor, sin: torch.Tensor,
                             cos: torch.Tensor) -> torch.Tensor:
    """GPT-J's rotary of one tensor, sin and cos per pair."""
    s = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
    c = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
    turned = torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)
    return x * c + turned * s


class ToyThreeArgumentAttention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, freqs: torch.Tensor,
                sin: torch.Tensor, cos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k = apply_rotary_emb(q, k, freqs)
        return apply_rotary_pos_emb_one(q, sin, cos), apply_rotary_pos_emb_one(k, sin, cos)


class TestThreeArgumentRotary:
    def call(self) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(4)
        q, k = torch.randn(1, 3, 4, 8, generator=g), torch.randn(1, 3, 2, 8, generator=g)
        angles = torch.randn(1, 3, 4, generator=g)
        return q, k, torch.polar(torch.ones_like(angles), angles), angles.sin(), angles.cos()

    def test_complex_and_pairs_layouts_served(self) -> None:
        toy = ToyThreeArgumentAttention()
        args = self.call()
        want = type(toy).forward(toy, *args)
        report = dispatch_model(toy, ["rotary"])
        layouts = sorted(s.layout for s in toy.__dict__["_astrai_route"].parts["rotary"])
        assert report.counts() == {"rotary": 1} and layouts == ["complex", "pairs"]
        dispatch.reset_stats()
        got = toy(*args)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
        assert dispatch.stats().served("rotary") == 4  # q and k through each
        assert dispatch.stats().served("rotary", origin="model") == 0

    def test_complex_angles_with_heads_second_are_served(self) -> None:
        toy = ToyHeadsSecondAttention()
        q, k, freqs, _, _ = self.call()
        args = (q.transpose(1, 2), k.transpose(1, 2), freqs)
        want = type(toy).forward(toy, *args)
        assert dispatch_model(toy, ["rotary"]).counts() == {"rotary": 1}
        (site,) = toy.__dict__["_astrai_route"].parts["rotary"]
        assert site.layout == "complex_heads"
        dispatch.reset_stats()
        for a, b in zip(toy(*args), want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
        assert dispatch.stats().served("rotary") == 2
        assert dispatch.stats().served("rotary", origin="model") == 0

    def test_a_call_of_another_shape_runs_its_own(self) -> None:
        toy = ToyThreeArgumentAttention()
        dispatch_model(toy, ["rotary"])
        q, k, freqs, sin, cos = self.call()
        dispatch.reset_stats()
        with pytest.raises(IndexError):  # freqs without its batch axis: raises as unrouted
            toy(q, k, freqs[0], sin, cos)
        with pytest.raises(IndexError):
            type(toy).forward(toy, q, k, freqs[0], sin, cos)
        assert dispatch.stats().served("rotary", origin="model") == 1
