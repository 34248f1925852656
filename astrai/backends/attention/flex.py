"""``flex``: attention through ``torch.nn.attention.flex_attention`` (CPU and CUDA, compiled).

Dense, mask-free calls: ``flex_attention`` on ``[batch, heads, seq, head_dim]``
views of the tensors, a causal call with the bottom-right aligned block mask of
``block_mask.causal_block_mask`` (cached by shape and device), GQA through flex's
``enable_gqa``. A call without queries or keys gets its defined result (zeros, as
in ``dense``) directly.

``flex_attention`` is fast only compiled. The row compiles it with
``torch.compile`` (inductor) on the first call of each signature: the block mask's
shape and causality, device, dtype, batch, heads and head dims. That first call takes
seconds; later calls of that signature reuse the compiled function (``Compiled``
keeps 32 signatures). Every new shape compiles again, so the row suits calls whose
shapes repeat (training steps, fixed prefill buckets), not decode steps whose key
length grows by one each call. Inside a user's ``torch.compile``, the row calls
``flex_attention`` as it is and the user's compile compiles it with the rest.

The row is a plain function: which calls it serves is ``tables/attention.yaml``'s
``when`` alone; ``flex_available`` says where it cannot run.
"""

from __future__ import annotations

__all__ = ["flex_attention", "flex_available"]

import importlib
from typing import Any

import torch

from astrai.backends.attention.block_mask import causal_block_mask
from astrai.backends.attention.dense import merge_heads
from astrai.backends.inductor import Compiled, inductor_available
from astrai.dispatch.tables.model import Unavailable
from astrai.dispatch.torch_compile import compiling

_FLEX = "torch.nn.attention.flex_attention"


def flex_available() -> bool | Unavailable:
    """``True`` when this torch has flex attention and inductor can compile it here."""
    try:
        module = importlib.import_module(_FLEX)
    except ImportError as exc:
        return Unavailable(f"{_FLEX} is missing from torch {torch.__version__} "
                           f"(flex attention needs torch >= 2.5): {exc}")
    if not hasattr(module, "flex_attention"):
        return Unavailable(f"{_FLEX} has no flex_attention in torch {torch.__version__}")
    return inductor_available()


def _call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any,
          gqa: bool) -> torch.Tensor:
    """flex_attention itself (imported here, not at astrai's import)."""
    from torch.nn.attention.flex_attention import flex_attention as flex

    return flex(q, k, v, block_mask=block_mask, enable_gqa=gqa)  # type: ignore[no-any-return]


_compiled = Compiled(_call, dynamic=False)


def flex_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: Any = None,
    layer_id: int = 0,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    fwd: str | None = None,
) -> torch.Tensor:
    """Attention output ``[batch, q_len, heads * head_dim]`` in ``q``'s dtype (dense,
    mask-free calls; anything else is a ``ValueError``, never a result that ignores it)."""
    if kv_cache is not None or attn_mask is not None:
        raise ValueError("flex: serves dense calls without attn_mask (is_causal only); the "
                         "paged path and explicit masks go to another row")
    b, q_len, heads, _ = q.shape
    k_len = k.shape[1]
    if q_len == 0 or k_len == 0:
        return q.new_zeros(b, q_len, heads * v.shape[-1])
    mask = causal_block_mask(q_len, k_len, q.device) if is_causal else None
    gqa = k.shape[2] != heads
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if compiling():
        out = _call(qt, kt, vt, mask, gqa)
    else:
        key = (q.shape, k.shape, v.shape, is_causal, q.dtype, q.device)
        out = _compiled(key, qt, kt, vt, mask, gqa)
    return merge_heads(out.transpose(1, 2))
