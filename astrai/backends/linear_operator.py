"""Linear rows that a compiled graph keeps.

A row that computes a linear layer with a kernel of its own (oneDNN's, astrai's native
one) cannot be traced into: dynamo would see a foreign call and break the graph there,
or trace torch's own product instead and lose the row. So each such row is registered
once as a torch operator, ``astrai::<row>_linear(x, weight, bias) -> Tensor``, with a
shape function for tracing. Under ``torch.compile`` the row calls its operator; inductor
keeps it in the graph as an external kernel, as it keeps ``aten.mm`` on a CPU, and fuses
the elementwise work around it as it would around the product it replaces.

An operator stands in a graph only where its row would run eagerly: CPU float32 tensors
(no subclass), no autograd recording, since the operators have no backward, and no CPU
autocast, which would not cast them. Under
``torch.export`` rows trace to ``F.linear``, so an exported program names only torch's
operators.
"""

from __future__ import annotations

__all__ = ["LinearKernel", "float32_cpu", "linear_operator", "traceable"]

from collections.abc import Callable

import torch

from astrai.backends.operators import plain_call, registered_operator

#: A row's kernel: ``(x, weight, bias) -> x @ weight.T + bias``.
LinearKernel = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def traceable(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a traced call may stand in the graph as a row's operator: a ``plain_call``
    of float32 CPU tensors (an operator has no backward and is not cast by autocast), not
    exported."""
    return (plain_call(x, weight, bias) and float32_cpu(x, weight, bias)
            and not torch.compiler.is_exporting())


def float32_cpu(*tensors: torch.Tensor | None) -> bool:
    """Whether every tensor given (``None`` aside) is float32 on the CPU."""
    return all(t is None or (t.dtype == torch.float32 and t.device.type == "cpu")
               for t in tensors)


def linear_operator(row: str, kernel: LinearKernel) -> LinearKernel:
    """The operator ``astrai::<row>_linear`` that runs ``kernel``; registered with torch
    the first time (a second call with the same ``row`` returns the registered one)."""

    def compute(x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        return kernel(x, weight, bias).contiguous()  # the layout the shape function says

    def shape(x: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    return registered_operator(f"{row}_linear", compute, shape)  # type: ignore[no-any-return]
