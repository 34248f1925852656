"""``astrai.ops.attention`` vs a direct ``F.scaled_dot_product_attention`` (SPEC §11).

Decode shape B1 H8 S128 D64, dense layout ``[batch, seq, heads, head_dim]``,
``torch.no_grad()``, 1 thread. The direct call does what the facade replaces:
transpose to SDPA's ``[batch, heads, seq, head_dim]``, SDPA, and merge the heads
back to ``[batch, seq, heads*head_dim]``. Target: facade <= 1.10x direct.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import interleaved_us, paired_ratios

from astrai import ops
from astrai.dispatch import resolve
from astrai.ops import context as ops_context

attention_context = functools.partial(ops_context, "attention")


def main() -> None:
    torch.set_num_threads(1)
    b, h, s, dim = 1, 8, 128, 64
    q = torch.randn(b, 1, h, dim)
    k = torch.randn(b, s, h, dim)
    v = torch.randn(b, s, h, dim)

    def direct() -> torch.Tensor:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2))
        return out.transpose(1, 2).reshape(b, 1, h * dim)

    def direct_again() -> torch.Tensor:  # an A/A control: the same code, a separate function
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2))
        return out.transpose(1, 2).reshape(b, 1, h * dim)

    def bare() -> torch.Tensor:
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2))

    def facade() -> torch.Tensor:
        return ops.attention(q, k, v)

    with torch.no_grad():
        torch.testing.assert_close(facade(), direct())
        row = resolve("attention", attention_context(q, k, v)).record
        row_obj = row.obj

        def row_direct() -> torch.Tensor:
            return row_obj(q, k, v)  # type: ignore[no-any-return]

        t = interleaved_us({"direct": direct, "bare": bare, "row": row_direct,
                            "facade": facade}, number=2000)
        r = paired_ratios(direct, {"facade": facade, "control": direct_again}, number=2000)
    print(f"machine: {torch.get_num_threads()} thread, torch {torch.__version__}; "
          f"decode shape B{b} H{h} S{s} D{dim}, dense layout, no_grad")
    print(f"direct SDPA + layout     {t['direct']:.2f} us/call")
    print(f"bare SDPA (no layout)    {t['bare']:.2f} us/call")
    print(f"row {row.name} called directly {t['row']:.2f} us/call")
    print(f"astrai.ops.attention     {t['facade']:.2f} us/call")
    print(f"dispatch overhead over the row {t['facade'] - t['row']:.2f} us/call; "
          f"ratio of the medians above {t['facade'] / t['direct']:.3f}x")
    print(f"A/A control (direct / a copy of direct), paired: {r['control']:.3f}x")
    print(f"facade / direct, median of paired rounds = {r['facade']:.3f}x (target <= 1.10x)")


if __name__ == "__main__":
    main()
