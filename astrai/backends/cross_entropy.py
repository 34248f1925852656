"""Cross-entropy on given logits: rows ``torch`` and ``reference``.

``cross_entropy(logits [N, V], labels [N], ignore_index, reduction)``: each token's loss
``logsumexp(logits) - logits[label]``, computed in float32 (float64 for float64 logits);
tokens whose label is ``ignore_index`` add nothing. ``mean`` divides the sum by the
tokens counted (NaN when none is, as torch gives; the gradients are then zero), ``sum``
does not, ``none`` gives each token's loss (0 for an ignored one). Labels of any integer
dtype are read as int64. A label outside ``[0, V)`` other than ``ignore_index`` is an
error. ``torch`` is ``F.cross_entropy``; ``reference`` writes the formula out.
"""

from __future__ import annotations

__all__ = ["as_int64", "reference_cross_entropy", "torch_cross_entropy", "wide"]

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def wide(t: Tensor) -> Tensor:
    """``t`` in float32 (float64 stays float64)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def as_int64(labels: Tensor) -> Tensor:
    """``labels`` as int64 (themselves when they are): ``F.cross_entropy`` takes int64
    targets, and a narrower dtype would wrap ``ignore_index`` when compared with it."""
    return labels if labels.dtype == torch.int64 else labels.long()


def torch_cross_entropy(logits: Tensor, labels: Tensor, ignore_index: int = -100,
                        reduction: str = "mean") -> Tensor:
    """``F.cross_entropy`` on the logits in float32."""
    return F.cross_entropy(wide(logits), as_int64(labels), ignore_index=ignore_index,
                           reduction=reduction)


def check_labels(labels: Tensor, vocab: int, ignore_index: int) -> None:
    """``ValueError`` for a label outside ``[0, vocab)`` that is not ``ignore_index``."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if bool(bad.any()):
        got = int(labels[bad][0])
        raise ValueError(f"cross_entropy: label {got} is outside the vocabulary 0..{vocab - 1} "
                         f"(and is not ignore_index {ignore_index})")


def reference_cross_entropy(logits: Tensor, labels: Tensor, ignore_index: int = -100,
                            reduction: str = "mean") -> Tensor:
    """``logsumexp(logits) - logits[label]`` over the tokens counted, in float32."""
    x, labels = wide(logits), as_int64(labels)
    check_labels(labels, x.shape[-1], ignore_index)
    counted = labels != ignore_index
    target = x.gather(1, torch.where(counted, labels, 0).unsqueeze(1)).squeeze(1)
    each = torch.where(counted, torch.logsumexp(x, dim=-1) - target, 0.0)
    if reduction == "none":
        return each
    total = each.sum()
    return total / counted.sum() if reduction == "mean" else total
