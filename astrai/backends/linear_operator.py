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

__all__ = ["LinearKernel", "float32_cpu", "handoff_reason", "linear_operator", "plain_call",
           "traceable"]

from collections.abc import Callable

import torch

#: A row's kernel: ``(x, weight, bias) -> x @ weight.T + bias``.
LinearKernel = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]

#: The tensor types the CPU linear rows serve (a subclass may compute otherwise).
_PLAIN = (torch.Tensor, torch.nn.Parameter)
#: ``torch.compiler.is_exporting`` (torch >= 2.5; before it, nothing says so).
_exporting: Callable[[], bool] = getattr(torch.compiler, "is_exporting", lambda: False)


def traceable(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a traced call may stand in the graph as a row's operator: a ``plain_call``
    of float32 CPU tensors (an operator has no backward and is not cast by autocast), not
    exported."""
    return plain_call(x, weight, bias) and float32_cpu(x, weight, bias) and not _exporting()


def plain_call(*tensors: torch.Tensor | None) -> bool:
    """Whether a call is one the CPU linear rows compute themselves: no autograd
    recording, no CPU autocast (``F.linear`` computes in its lower precision there), and
    every tensor given (``None`` aside) of torch's own types."""
    if torch.is_grad_enabled() or torch.is_autocast_enabled("cpu"):
        return False
    return all(t is None or type(t) in _PLAIN for t in tensors)


def handoff_reason(*tensors: torch.Tensor | None) -> str:
    """Why ``plain_call`` leaves a call to torch (``""`` where it does not)."""
    subclasses = sorted({type(t).__name__ for t in tensors
                         if t is not None and type(t) not in _PLAIN})
    if subclasses:
        return f"a tensor subclass ({', '.join(subclasses)})"
    if torch.is_autocast_enabled("cpu"):
        return "CPU autocast in force"
    if torch.is_grad_enabled():
        return "autograd recording"
    return ""


def float32_cpu(*tensors: torch.Tensor | None) -> bool:
    """Whether every tensor given (``None`` aside) is float32 on the CPU."""
    return all(t is None or (t.dtype == torch.float32 and t.device.type == "cpu")
               for t in tensors)


def linear_operator(row: str, kernel: LinearKernel) -> LinearKernel:
    """The operator ``astrai::<row>_linear`` that runs ``kernel``; registered with torch
    the first time (a second call with the same ``row`` returns the registered one)."""
    name = f"{row}_linear"
    namespace = torch.ops.astrai
    if hasattr(namespace, name):
        return getattr(namespace, name)  # type: ignore[no-any-return]

    def compute(x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        return kernel(x, weight, bias).contiguous()  # the layout the shape function says

    op = torch.library.custom_op(f"astrai::{name}", compute, mutates_args=())

    @op.register_fake  # type: ignore[untyped-decorator, misc]
    def _shape(x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    return op  # type: ignore[return-value]
