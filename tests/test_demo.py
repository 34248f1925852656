"""The demo model and the main job."""

from __future__ import annotations

from typing import Any

import torch

from astrai.dispatch import op_backend, stats
from astrai.models.llama import LlamaConfig, TinyLlama, generate_dense, generate_paged

SMALL = LlamaConfig(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64)


class TestGeneratePaged:
    def test_paged_greedy_tokens_equal_dense_recompute(self) -> None:
        """Greedy tokens from one ragged paged prefill + decode equal dense re-runs."""
        model = TinyLlama(SMALL, seed=3)
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (3, 7, 12)]
        paged = generate_paged(model, prompts, steps=10)
        dense = generate_dense(model, prompts, steps=10)
        assert paged == dense
        assert all(len(p) == 10 for p in paged)

    def test_paged_equals_dense_through_the_reference_rows(self) -> None:
        """The same holds when every family is forced to its reference row."""
        model = TinyLlama(SMALL, seed=4)
        prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
        with op_backend(attention="math", rotary="reference", rms_norm="reference"):
            paged = generate_paged(model, prompts, steps=6)
        dense = generate_dense(model, prompts, steps=6)
        assert paged == dense

    def test_paged_decode_is_served_by_the_cache_rows(self) -> None:
        """Paged generation reaches attention with fwd=prefill/decode and a cache."""
        model = TinyLlama(SMALL, seed=5)
        stats(reset=True)
        generate_paged(model, [[1, 2, 3, 4]], steps=3)
        # 2 layers x (1 prefill + 2 decode steps)
        assert stats().served("attention") == 6


class TestRunDemo:
    def test_demo_reports_rows_and_throughput(self) -> None:
        """The main job prints throughput and a family x row x origin table."""
        from astrai.demo import run_demo

        report = run_demo()
        lines = report.splitlines()
        startup = next(line for line in lines if line.startswith("start-up"))
        warm = next(line for line in lines if line.startswith("warm: generated 96 tokens"))
        assert " s " in startup and "tokens/s" in warm and "tokens/s" not in startup
        for family in ("attention", "rotary", "rms_norm", "linear"):
            assert family in report
        assert "torch_native" in report
        usage = stats()
        # Generation twice (cold, then warm): 3 prompts prefilled together + 31 decode
        # steps, 2 layers each; plus 2 training calls.
        assert usage.served("attention") == 2 * 2 * (1 + 31) + 2

    def test_a_build_at_the_first_call_is_reported_apart(self, monkeypatch: Any) -> None:
        """Where the demo's process built the native extension, the start-up line gives
        the build's seconds apart; a process that loaded a built one says nothing of it."""
        from astrai import demo, native

        built_now = native.NativeStatus(True, native.building.built_path(),
                                        "built for this process")
        monkeypatch.setattr(native, "status", lambda: built_now)
        startup = next(line for line in demo.run_demo().splitlines()
                       if line.startswith("start-up"))
        assert "building the native extension took " in startup
        assert startup.endswith(" s before it, once per machine)")
        loaded = native.NativeStatus(True, native.building.built_path(), "built")
        monkeypatch.setattr(native, "status", lambda: loaded)
        startup = next(line for line in demo.run_demo().splitlines()
                       if line.startswith("start-up"))
        assert "building" not in startup

    def test_the_demo_loads_no_compiler_for_rows_its_calls_do_not_reach(self) -> None:
        """The demo's calls are small: the compiled rows' ``when`` rejects them, so their
        availability probes (which import ``torch._inductor``) never run."""
        import subprocess
        import sys

        code = ("import sys, torch\n"
                "from astrai.demo import TinyLlama, LlamaConfig, generate_paged\n"
                "generate_paged(TinyLlama(LlamaConfig(), seed=0), [[1, 2, 3]], 4)\n"
                "print('torch._inductor' in sys.modules)")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True)
        assert out.stdout.strip().splitlines()[-1] == "False"
