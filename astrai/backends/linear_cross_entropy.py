"""The loss of a linear head: rows ``chunked`` (fused, the logits never whole),
``torch`` and ``reference``.

``linear_cross_entropy(hidden [N, H], weight [V, H], labels [N], bias, ignore_index,
reduction)`` is ``cross_entropy(hidden @ weight.T + bias, labels)`` (see
``astrai.backends.cross_entropy``), the logits rounded to ``hidden``'s dtype as the head
would give them, then the loss in float32 (float64 for float64).

- ``chunked`` runs the tokens in chunks of about 16 MiB of float32 logits: each chunk's
  logits, their loss and - where autograd records - their gradients (``softmax -
  onehot``, scaled for the reduction) against ``hidden``, ``weight`` and ``bias``, which
  the backward then scales by the loss's gradient. The ``[N, V]`` logits never exist:
  a training step keeps one chunk's. ``reduction`` is ``mean`` or ``sum``. The weight's
  gradient is summed over the chunks in the weight's dtype (a half-type head's rounds
  once per chunk of tokens, where the whole logits' matmul rounds once). With no token
  counted the gradients are zero (the ``mean`` loss NaN), as torch gives them; the count
  stays on the device. The backward is differentiable once: a second derivative
  through it is an error.
- ``torch`` is the head then ``F.cross_entropy``, as a model computes it (the whole
  logits, in memory).
- ``reference`` writes the formula out in float32.
"""

from __future__ import annotations

__all__ = ["chunked_linear_cross_entropy", "reference_linear_cross_entropy",
           "torch_linear_cross_entropy"]

from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from astrai.backends.cross_entropy import as_int64, check_labels, reference_cross_entropy, wide

Tensor = torch.Tensor
_CHUNK_BYTES = 16 << 20  # one chunk's float32 logits


def torch_linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor,
                               bias: Tensor | None = None, ignore_index: int = -100,
                               reduction: str = "mean") -> Tensor:
    """The head, then ``F.cross_entropy`` on its logits in float32."""
    return F.cross_entropy(wide(F.linear(hidden, weight, bias)), as_int64(labels),
                           ignore_index=ignore_index, reduction=reduction)


def reference_linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor,
                                   bias: Tensor | None = None, ignore_index: int = -100,
                                   reduction: str = "mean") -> Tensor:
    """The formula written out, the logits rounded to ``hidden``'s dtype."""
    return reference_cross_entropy(F.linear(hidden, weight, bias), labels, ignore_index,
                                   reduction)


class _Chunked(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None,
                labels: Tensor, ignore_index: int, reduction: str, grads: bool) -> Tensor:
        n, vocab = hidden.shape[0], weight.shape[0]
        labels = as_int64(labels)
        check_labels(labels, vocab, ignore_index)
        counted = labels != ignore_index
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        # mean: the loss divides by the tokens counted (0 / 0 = NaN with none, as torch
        # gives); the gradients by at least 1, so that with none counted they are zero.
        # The count stays on the device (only check_labels reads a flag back).
        count = counted.sum() if reduction == "mean" else None
        scale: Tensor | float = (1.0 if count is None
                                 else count.clamp(min=1).to(acc).reciprocal())
        need = ctx.needs_input_grad if grads else (False,) * 3
        grad_h = torch.empty_like(hidden) if need[0] else None
        # the first chunk writes the weight's gradient, the others add to it in place;
        # without tokens no chunk runs and it stays zero
        grad_w = (torch.zeros_like if n == 0 else torch.empty_like)(weight) \
            if need[1] else None
        grad_b = torch.zeros(vocab, dtype=acc, device=weight.device) \
            if bias is not None and need[2] else None
        total = torch.zeros((), dtype=acc, device=hidden.device)
        step = max(1, _CHUNK_BYTES // (4 * vocab))
        for start in range(0, n, step):
            h = hidden[start:start + step]
            keep = counted[start:start + step]
            target = torch.where(keep, labels[start:start + step], 0).unsqueeze(1)
            logits = wide(F.linear(h, weight, bias))
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)
            loss = (lse - logits.gather(1, target)).squeeze(1)
            total += torch.where(keep, loss, 0.0).sum()
            if grad_h is None and grad_w is None and grad_b is None:
                continue
            g = logits.sub_(lse).exp_()  # softmax, in place of the logits
            g.scatter_add_(1, target, torch.full_like(lse, -1.0))
            g.mul_((keep.to(g.dtype) * scale).unsqueeze(1))
            if grad_b is not None:
                grad_b += g.sum(0)
            if grad_h is None and grad_w is None:
                continue
            g = g.to(hidden.dtype)
            if grad_h is not None:
                torch.mm(g, weight, out=grad_h[start:start + step])
            if grad_w is not None:
                grad_w.addmm_(g.t(), h, beta=0.0 if start == 0 else 1.0)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return total if count is None else total / count

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> Any:
        grad_h, grad_w, grad_b = ctx.saved_tensors
        w_dtype, b_dtype = ctx.dtypes
        one = bool(grad_out == 1.0)

        def scaled(g: Tensor | None, dtype: Any) -> Tensor | None:
            if g is None:
                return None
            g = g if one else g * grad_out
            return g if dtype is None else g.to(dtype)

        return (scaled(grad_h, None), scaled(grad_w, w_dtype), scaled(grad_b, b_dtype),
                None, None, None, None)


def chunked_linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor,
                                 bias: Tensor | None = None, ignore_index: int = -100,
                                 reduction: str = "mean") -> Tensor:
    """Fused and chunked over the tokens: the whole logits never exist (``mean`` or
    ``sum``)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"the chunked row reduces by mean or sum, not {reduction!r}")
    return _Chunked.apply(hidden, weight, bias, labels,  # type: ignore[no-any-return, no-untyped-call]
                          ignore_index, reduction, torch.is_grad_enabled())
