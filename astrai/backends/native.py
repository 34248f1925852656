"""``native`` rows: RMS norm and the half-layout rotary in one pass of C++ (CPU), and a
linear layer for a few rows that reads the weight once.

Small calls - a decode step's norm of one token, its rotary of one position - cost
torch more in launching operations than in arithmetic: ``LlamaRMSNorm`` is eight
operations, ``torch.rms_norm`` on CPU six more inside, transformers' rotary ten. The
kernels of astrai's native extension (``astrai/native/kernels.cpp``, built with
``astrai-ops native --build``; see ``astrai.native``) compute the same result in one
call, one pass over memory:

- ``native_rms_norm``: every form of the ``rms_norm`` family (the plain norm, Gemma's
  ``1 + weight``, LlamaRMSNorm's cast before the weight), with the types and roundings of
  ``reference_rms_norm``: it equals the reference up to the order in which the squares
  are summed;
- ``native_rotary_half``: ``x * cos + rotate_half(x) * sin`` on q and k, each product and
  the sum rounded as torch's elementwise operations round them: it equals
  ``reference_rotary_half`` bit for bit;
- ``native_linear``: ``x @ weight.T + bias`` in float32 for a few rows (a decode step's
  token), eight weight rows at a time in 256-bit vectors, the weight read as it is stored
  and once per four rows of x. A decode step's linear layers stream their weights from
  memory, and torch's matrix-vector product reached well below the memory's speed on the
  machine measured (``tables/linear.yaml``). It equals ``F.linear`` up to the order of the
  float32 sums; it runs only where its vector build does (x86-64-v3, compiled by GCC), as
  ``native_linear_available`` says.

A kernel splits the rows of a call among torch's intra-op threads (``torch.get_num_threads()``,
with the GIL released), each row computed whole by one thread in one order: its result is
the same for any number of threads. Inputs may be any view (overlapping, broadcast, empty);
the output is a tensor the kernel allocates.

Each row runs its kernel on plain CPU tensors of one kernel dtype (float16, bfloat16,
float32, float64; for RMS norm any mix of x's and the weight's), outside autograd and
``torch.compile`` tracing. Any other call it is handed - another device, mixed rotary
dtypes, tensors that need gradients, a subclass or functorch wrapper, a forward-mode
tangent, a dispatch mode, a JIT trace - is computed with the torch row's operations, so a
row's answer never depends on where it ran, and whatever watches torch's operations sees
them. The tables give these rows
the calls where they were measured to win (``not grad_enabled``, small token counts);
without the extension they are unavailable, with the reason ``astrai.native`` gives.
"""

from __future__ import annotations

__all__ = ["native_available", "native_linear", "native_linear_available", "native_rms_norm",
           "native_rotary", "native_rotary_half"]

from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from astrai import native as extension
from astrai.backends.linear_operator import linear_operator, traceable
from astrai.backends.rms_norm import torch_rms_norm
from astrai.backends.rotary import torch_rotary, torch_rotary_half
from astrai.dispatch.stats import count_handoff
from astrai.dispatch.tables.model import Unavailable
from astrai.dispatch.torch_compile import compiling

#: What computes a call a native row's kernel declines (``stats().handed``).
TORCH_OPS = "torch's operations"


def _kernels() -> ModuleType | None:
    """The extension (its kernels are linked into every build of it) as the process's one
    load decision gives it."""
    return extension.load()


def native_available() -> bool | Unavailable:
    """``True`` when astrai's native extension is loaded in this process; else why not."""
    if _kernels() is not None:
        return True
    return Unavailable(f"astrai's native extension is not loaded: {extension.status().reason}")


def native_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, *,
                    weight_offset: float = 0.0,
                    cast_before_weight: bool = False) -> torch.Tensor:
    """``reference_rms_norm``'s result in one pass (its forms too; see the module
    docstring)."""
    if compiling():  # traced: torch's operations, which inductor fuses
        return torch_rms_norm(x, weight, eps, weight_offset=weight_offset,
                              cast_before_weight=cast_before_weight)
    kernels = _kernels()
    if kernels is not None and weight is not None:  # the kernel scales by a weight
        out = kernels.rms_norm_kernel(x, weight, float(eps), float(weight_offset),
                                      bool(cast_before_weight))
        if out is not None:
            return out  # type: ignore[no-any-return]
    count_handoff("rms_norm", "native", TORCH_OPS)
    return torch_rms_norm(x, weight, eps, weight_offset=weight_offset,
                          cast_before_weight=cast_before_weight)


def native_rotary_half(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb`` in one pass per tensor, bit for bit."""
    if compiling():
        return torch_rotary_half(q, k, cos, sin, unsqueeze_dim)
    kernels = _kernels()
    if kernels is not None:
        out: Any = kernels.rotary_half_kernel(q, k, cos, sin, int(unsqueeze_dim))
        if out is not None:
            return out[0], out[1]
    count_handoff("rotary", "native", TORCH_OPS)
    return torch_rotary_half(q, k, cos, sin, unsqueeze_dim)


def native_rotary(x: torch.Tensor, freqs_cis: torch.Tensor, *half: Any) -> Any:
    """The ``rotary`` family's row protocol: a half-layout call (``native_rotary(q, k, cos,
    sin, unsqueeze_dim)``) is ``native_rotary_half``'s; the table gives this row no
    adjacent-pairs call (its ``when`` asks for ``layout == half``), which, called directly,
    is computed as the torch row computes it."""
    if half:
        return native_rotary_half(x, freqs_cis, *half)
    if not compiling():
        count_handoff("rotary", "native", TORCH_OPS)
    return torch_rotary(x, freqs_cis)


def native_linear_available() -> bool | Unavailable:
    """``True`` when the extension is loaded and its linear kernel runs its vector build
    on this CPU (x86-64-v3: AVX2); else why not (the baseline build is slower than
    torch's own product)."""
    kernels = _kernels()
    if kernels is None:
        return native_available()
    if not kernels.linear_rows_vectorised():
        return Unavailable("the native linear kernel has no vector build for this CPU (it "
                           "needs x86-64-v3, AVX2, and GCC), and without one it is slower "
                           "than torch's product")
    return True


def native_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for a few rows, float32, reading the weight once as it is
    stored (see the module docstring); ``F.linear`` for a call the kernel declines.
    Traced, the call stands in the graph as the operator ``astrai::native_linear`` where
    it would run eagerly (CPU float32, no autograd), else as ``F.linear``."""
    if compiling():
        if traceable(x, weight, bias):
            return _NATIVE_OPERATOR(x, weight, bias)
        return F.linear(x, weight, bias)
    return _native_linear(x, weight, bias)


def _native_linear(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    kernels = _kernels()
    if kernels is not None:
        out = kernels.linear_rows_kernel(x, weight, bias)
        if out is not None:
            return out  # type: ignore[no-any-return]
    count_handoff("linear", "native", TORCH_OPS)
    return F.linear(x, weight, bias)


#: The ``native`` linear row in a compiled graph (``astrai.backends.linear_operator``).
_NATIVE_OPERATOR = linear_operator("native", _native_linear)
