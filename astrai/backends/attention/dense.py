"""Shared rules of the dense attention layout (``[batch, seq, heads, head_dim]``).

Every attention row follows the same conventions, stated here once:

- GQA: ``q`` has ``heads`` heads, ``k``/``v`` have ``kv_heads`` dividing it; query
  head ``h`` reads key/value head ``h // (heads // kv_heads)``.
- ``is_causal`` is aligned to the bottom-right corner (as in flash-attn and the
  paged path): query ``i`` of ``q_len`` sees keys ``j <= i + k_len - q_len``. With
  ``q_len == k_len`` this is the usual lower triangle.
- ``attn_mask`` is bool (``True`` = may attend) or additive float, broadcastable
  to ``[batch, heads, q_len, k_len]``; it combines with ``is_causal``.
- A query that may attend to no key at all gets a zero output.
- The scale is ``1 / sqrt(head_dim)`` unless a call asks for another (``scale``).
- A row that takes the heads-first layout as it is (``takes_heads_first``) is called
  with ``heads_first=True``: q/k/v ``[batch, heads, seq, head_dim]`` (transformers'
  tensors, untouched), and returns ``[batch, seq, heads, head_dim]``; every other row
  is given the same call as transposed views.
- A sliding ``window`` (only with ``is_causal``, or on the paged path) keeps the
  last ``window`` keys of the causal rule, the query's own position included:
  query ``i`` sees keys ``j`` with ``i + k_len - q_len - window < j <= i + k_len -
  q_len`` (transformers' ``sliding_window`` mask for Mistral / Gemma 2; flash-attn's
  ``window_size=(window - 1, 0)``); ``causal_keep`` and ``keeps`` state it once.
"""

from __future__ import annotations

__all__ = [
    "FLOAT_DTYPES",
    "PAGED_MODES",
    "causal_keep",
    "check_dense",
    "check_mask",
    "keeps",
    "merge_heads",
    "merge_masks",
    "repeat_kv_heads",
    "takes_heads_first",
]

from collections.abc import Callable
from typing import Any, TypeVar

import torch

_F = TypeVar("_F", bound=Callable[..., Any])

#: The dtypes the portable rows (math, torch_native) accept.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: The forward modes of the paged path.
PAGED_MODES = ("prefill", "decode")


def check_dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None
) -> None:
    """Raise ``ValueError`` unless q/k/v (and the mask) form a valid dense call."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(
                f"dense attention expects {name} as [batch, seq, heads, head_dim]; "
                f"got shape {tuple(t.shape)}"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    b, q_len, heads, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"batch sizes differ: q {b}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(
            f"k and v disagree on [seq, kv_heads]: {tuple(k.shape[1:3])} vs {tuple(v.shape[1:3])}"
        )
    if k.shape[3] != d:
        raise ValueError(f"q has head_dim {d} but k has {k.shape[3]}")
    kv_heads = k.shape[2]
    if heads % kv_heads:
        raise ValueError(f"q has {heads} heads, not a multiple of k/v's {kv_heads} (GQA)")
    if attn_mask is not None:
        check_mask(attn_mask, (b, heads, q_len, k.shape[1]))


def check_mask(attn_mask: torch.Tensor, target: tuple[int, int, int, int]) -> None:
    """Raise ``ValueError`` unless ``attn_mask`` is bool/float and broadcasts to ``target``."""
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise ValueError(f"attn_mask must be bool or floating point, got {attn_mask.dtype}")
    shape = tuple(attn_mask.shape)
    fits = len(shape) <= len(target) and all(
        n in (1, t) for n, t in zip(reversed(shape), reversed(target), strict=False)
    )
    if not fits:
        raise ValueError(
            f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
            f"[batch, heads, q_len, k_len] = {list(target)}"
        )


def keeps(q_idx: torch.Tensor, k_idx: torch.Tensor, offset: int,
          window: int | None = None) -> torch.Tensor:
    """The causal rule on index tensors: query ``q_idx`` (at position ``q_idx + offset``,
    ``offset = k_len - q_len``) keeps key ``k_idx``; with a ``window``, only the
    ``window`` most recent positions."""
    pos = q_idx + offset
    keep = k_idx <= pos
    if window is not None:
        keep = keep & (k_idx > pos - window)
    return keep


def causal_keep(q_len: int, k_len: int, device: torch.device,
                window: int | None = None) -> torch.Tensor:
    """Bool ``[q_len, k_len]``: query ``i`` may see key ``j`` (bottom-right aligned;
    ``window`` as in ``keeps``)."""
    rows = torch.arange(q_len, device=device).unsqueeze(1)
    cols = torch.arange(k_len, device=device).unsqueeze(0)
    return keeps(rows, cols, k_len - q_len, window)


def merge_masks(
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    q_len: int,
    k_len: int,
    dtype: torch.dtype,
    device: torch.device,
    window: int | None = None,
) -> torch.Tensor | None:
    """One mask equivalent to ``attn_mask`` combined with ``is_causal`` (and its ``window``).

    Bool masks stay bool; additive masks become ``dtype`` with ``-inf`` where the
    causal rule forbids. ``None`` when there is nothing to mask.
    """
    if not is_causal:
        if attn_mask is None or attn_mask.dtype == torch.bool:
            return attn_mask
        return attn_mask.to(dtype)
    keep = causal_keep(q_len, k_len, device, window)
    if attn_mask is None:
        return keep
    if attn_mask.dtype == torch.bool:
        return attn_mask & keep
    return torch.where(keep, attn_mask.to(dtype), float("-inf"))


def merge_heads(out: torch.Tensor) -> torch.Tensor:
    """``[..., heads, head_dim]`` -> ``[..., heads * head_dim]``."""
    return out.reshape(*out.shape[:-2], out.shape[-2] * out.shape[-1])


def repeat_kv_heads(
    k: torch.Tensor, v: torch.Tensor, heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, kv_heads, S, D]`` k/v with each head repeated to ``heads`` (GQA made plain MHA)."""
    group = heads // k.shape[1]
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def takes_heads_first(impl: _F) -> _F:
    """Declare that the attention implementation ``impl`` takes heads-first calls as they
    are: called with ``heads_first=True``, q/k/v ``[batch, heads, seq, head_dim]``, it
    returns ``[batch, seq, heads, head_dim]`` (a view is fine). ``attention_heads_first``
    hands any other row the call as transposed views, so declaring it only saves them."""
    impl.takes_heads_first = True  # type: ignore[attr-defined]
    return impl
