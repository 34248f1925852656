"""xIELU, the trainable activation of Apertus: rows ``torch`` (the models' expression),
``inductor`` (it compiled into one pass) and ``reference`` (written out wide).

``xielu(x, alpha_p, alpha_n, beta, eps)`` with ``alpha_p`` and ``alpha_n`` the module's raw
one-element parameters: with ``a_p = softplus(alpha_p)`` and ``a_n = beta +
softplus(alpha_n)``, ``a_p * x * x + beta * x`` where ``x > 0``, else ``(expm1(min(x,
eps)) - x) * a_n + beta * x``. Its dtype is torch's promotion of ``x`` with the
parameters (a float32 ``alpha_p`` on bfloat16 ``x`` gives float32, as the module does).
"""

from __future__ import annotations

__all__ = ["inductor_xielu", "reference_xielu", "torch_xielu"]

import torch
import torch.nn.functional as F

from astrai.backends.inductor import Compiled


def torch_xielu(x: torch.Tensor, alpha_p: torch.Tensor, alpha_n: torch.Tensor, beta: float,
                eps: float) -> torch.Tensor:
    """The expression op by op, in the models' order and roundings."""
    a_p = F.softplus(alpha_p)
    a_n = beta + F.softplus(alpha_n)
    return torch.where(x > 0, a_p * x * x + beta * x,
                       (torch.expm1(torch.clamp(x, max=eps)) - x) * a_n + beta * x)


_COMPILED = Compiled(torch_xielu, dynamic=True,
                     options={"emulate_precision_casts": True})


def inductor_xielu(x: torch.Tensor, alpha_p: torch.Tensor, alpha_n: torch.Tensor,
                   beta: float, eps: float) -> torch.Tensor:
    """The expression compiled by inductor into one pass over ``x``."""
    key = (x.dtype, alpha_p.dtype, alpha_n.dtype, x.device.type, x.dim())
    return _COMPILED(key, x, alpha_p, alpha_n, beta, eps)  # type: ignore[no-any-return]


def reference_xielu(x: torch.Tensor, alpha_p: torch.Tensor, alpha_n: torch.Tensor,
                    beta: float, eps: float) -> torch.Tensor:
    """Written out in float32 (float64 where the result is), cast once to the result's
    dtype."""
    out = torch.promote_types(x.dtype, torch.promote_types(alpha_p.dtype, alpha_n.dtype))
    wide = torch.float64 if out == torch.float64 else torch.float32
    h = x.to(wide)
    a_p = torch.log1p(torch.exp(-alpha_p.to(wide).abs())) + alpha_p.to(wide).clamp(min=0)
    a_n = beta + torch.log1p(torch.exp(-alpha_n.to(wide).abs())) + alpha_n.to(wide).clamp(min=0)
    positive = a_p * h * h + beta * h
    negative = (torch.expm1(torch.clamp(h, max=eps)) - h) * a_n + beta * h
    return torch.where(h > 0, positive, negative).to(out)
