"""Flex attention block masks for astrai's causal rule, with an optional sliding window.

``causal_block_mask(q_len, k_len, device, window)`` is the ``BlockMask`` that
``torch.nn.attention.flex_attention`` takes for a causal call: the rule of
``astrai.backends.attention.dense.keeps``, bottom-right aligned (query ``i`` sits at
position ``i + k_len - q_len`` and keeps the keys at or before it). With a
``window`` ``w`` it keeps only the ``w`` most recent of those
(``pos - w < j <= pos``); flex then skips the key blocks that lie wholly outside it.

Building a block mask evaluates the rule over the whole ``[q_len, k_len]`` grid (tens
of milliseconds at 2048 x 2048 on CPU), so the masks are cached by
``(q_len, k_len, window, device)``; the flex row asks for one per call.
"""

from __future__ import annotations

__all__ = ["causal_block_mask"]

import functools
from typing import TYPE_CHECKING

import torch

from astrai.backends.attention.dense import keeps
from astrai.dispatch.torch_compile import compiling

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

#: How many block masks are kept (most recently built last).
CACHE_SIZE = 64


def causal_block_mask(q_len: int, k_len: int, device: torch.device | str,
                      window: int | None = None) -> BlockMask:
    """The causal (optionally sliding-window) ``BlockMask`` for a ``q_len x k_len`` call."""
    if q_len < 1 or k_len < 1:
        raise ValueError(f"a block mask needs q_len and k_len >= 1, got {q_len} and {k_len}")
    if window is not None and (isinstance(window, bool) or window < 1):
        raise ValueError(f"window must be an int >= 1 (the positions each query keeps), "
                         f"got {window!r}")
    # Traced by a user's torch.compile, the mask is built in the graph: no cache there.
    build = _build.__wrapped__ if compiling() else _build
    return build(q_len, k_len, torch.device(device), window)


@functools.lru_cache(maxsize=CACHE_SIZE)
def _build(q_len: int, k_len: int, device: torch.device, window: int | None) -> BlockMask:
    from torch.nn.attention.flex_attention import create_block_mask

    offset = k_len - q_len

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                 kv_idx: torch.Tensor) -> torch.Tensor:
        return keeps(q_idx, kv_idx, offset, window)

    return create_block_mask(mask_mod, None, None, q_len, k_len, device=device)
