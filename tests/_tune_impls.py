"""Rows of the ``twice`` family the tune tests time: each doubles its input, at a cost
(busy CPU work, which ``tune`` measures) that depends on the number of tokens; ``wrong``
is the fastest and returns wrong values."""

from __future__ import annotations

from typing import Any

import torch

#: The ``twice`` family with a reference and one fast-on-few-tokens row.
TWICE_TABLE = """\
version: 1
family: twice
context: tests._tune_impls:context
fallback: reference
rows:
  - name: reference
    impl: tests._tune_impls:reference
  - name: small
    impl: tests._tune_impls:small
"""


def _busy(n: int) -> None:
    total = 0
    for i in range(n):
        total += i
    assert total >= 0


def context(x: torch.Tensor) -> dict[str, Any]:
    """The call's axes: dtype, ndim and tokens (rows of ``x``)."""
    return {"dtype": x.dtype, "ndim": x.dim(), "tokens": x.shape[0]}


def reference(x: torch.Tensor) -> torch.Tensor:
    """The fallback: right, and slow everywhere."""
    _busy(20000)
    return x * 2


def small(x: torch.Tensor) -> torch.Tensor:
    """Right; fast on few tokens, slow on many."""
    _busy(200 if x.shape[0] <= 8 else 40000)
    return x * 2


def large(x: torch.Tensor) -> torch.Tensor:
    """Right; medium on few tokens, fast on many."""
    _busy(5000 if x.shape[0] <= 8 else 200)
    return x + x


def wrong(x: torch.Tensor) -> torch.Tensor:
    """The fastest row, and wrong: the numerics check must exclude it."""
    return x * 3


# -- the ``ranked`` family: rows whose cost depends on the rank (tests/test_tune_ranks.py) --

def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def steady(x: torch.Tensor) -> torch.Tensor:
    """Right; the same medium cost on every rank."""
    _busy(4000)
    return x * 2


def skewed(x: torch.Tensor) -> torch.Tensor:
    """Right; the fastest on rank 0, slowed down on rank 1 (busy work, so the cost is
    the CPU's whatever tune's clock)."""
    _busy(20000 if _rank() == 1 else 300)
    return x * 2


def flaky(x: torch.Tensor) -> torch.Tensor:
    """The fastest; right on rank 0, wrong on rank 1."""
    return x * 3 if _rank() == 1 else x * 2


# -- rows that misbehave on their inputs (tests/test_tune_trust.py) ----------------------

def scribbler(x: torch.Tensor) -> torch.Tensor:
    """The fastest; right, then writes into its input: it must be excluded for that, and
    no other row may be blamed."""
    out = x * 2
    x.add_(1.0)
    return out


def broken(x: torch.Tensor) -> torch.Tensor:
    """A reference row that cannot serve: the call must be skipped, the run go on."""
    raise RuntimeError("this reference row is broken")
