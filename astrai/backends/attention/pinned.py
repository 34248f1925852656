"""SDPA pinned to one kernel: ``sdpa_flash``, ``sdpa_efficient``, ``sdpa_cudnn``, ``sdpa_math``.

Each row calls ``torch.nn.functional.scaled_dot_product_attention`` inside
``torch.nn.attention.sdpa_kernel(SDPBackend.<kernel>)``, so exactly one of SDPA's kernels
serves the call, or the call fails with SDPA's own error; it never quietly runs
another kernel. The dense and paged paths are ``torch_native``'s
(``astrai.backends.attention.sdpa``). What a kernel does not take on a device is
adapted around it, as that device's ``Takes`` states:

- ``masks=False``: the row's ``when`` admits mask-free calls only; a causal call
  with ``q_len != k_len`` goes through torch's lower-right ``CausalBias``, which
  flash runs natively (astrai's causal rule is bottom-right aligned).
- ``gqa=False``: k/v heads are repeated to q's count.
- ``align``: a head_dim that is not a multiple of it is zero-padded (the scale stays
  ``1/sqrt(head_dim)``; the padding is sliced off the output).
- ``min_keys``: fewer keys are padded with zero keys that the mask hides.
- ``empty=False``: a call without queries or keys gets its defined result (zeros,
  see ``dense``) without the kernel, which would reject it.

What the kernels take (torch's ``sdp_utils``): on CPU, flash (torch's CPU
flash-attention kernel: every float dtype, masks, GQA, any head_dim) and math; on
CUDA, flash (fp16/bf16, head_dim <= 256, no mask, sm80-sm121), efficient
(fp16/fp32, and bf16 from sm80; masks; head_dim a multiple of 8 or 4), cuDNN
(fp16/bf16, head_dim <= 128 and a multiple of 8, masks, at least two keys,
sm80-sm121, cuDNN >= 9) and math. ``tables/attention.yaml`` says which calls each
row serves; the probes say where a row cannot run at all. The rows are explicit-only
there: on CPU ``torch_native`` is SDPA's flash kernel without the pinning's 10-30 us
(measured, ``benchmarks/bench_rows.py``), and on CUDA SDPA's own choice stays the
default until the pinned kernels are measured on GPUs.

Thread safety: ``sdpa_kernel`` sets process-wide flags, not per-thread ones. The
rows hold one lock while the flags are pinned, so two pinned rows in two threads
never undo each other's flags; an SDPA call that *another* thread makes outside
these rows (``torch_native``, user code) while a pinned row runs sees the pinned
flags too. Under ``torch.compile`` the flags are read at trace time only.
"""

from __future__ import annotations

__all__ = [
    "ANY",
    "PinnedSdpa",
    "Takes",
    "sdpa_cudnn",
    "sdpa_cudnn_available",
    "sdpa_efficient",
    "sdpa_efficient_available",
    "sdpa_flash",
    "sdpa_flash_available",
    "sdpa_math",
]

import math
import threading
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from astrai.backends.attention.dense import causal_keep, merge_heads, repeat_kv_heads
from astrai.backends.attention.sdpa import sdpa_attention, sdpa_core, sdpa_dense, sdpa_paged
from astrai.dispatch.tables.model import Unavailable
from astrai.dispatch.torch_compile import compiling

#: Held while ``sdpa_kernel`` has the process-wide flags pinned (eager calls only).
_PIN_LOCK = threading.Lock()

_SM80, _SM121 = (8, 0), (12, 1)


@dataclass(frozen=True)
class Takes:
    """What one SDPA kernel takes on one device; the row adapts other calls to it."""

    masks: bool = True  # an attn_mask (else mask-free calls; lower-right causal via CausalBias)
    gqa: bool = True  # fewer k/v heads than q heads (else they are repeated)
    align: int = 1  # head_dim must be a multiple of this (else zero-padded)
    min_keys: int = 0  # at least this many keys (else padded with hidden keys)
    empty: bool = True  # zero queries or keys (else the zero result is returned directly)


#: A kernel that takes every call the table gives it: the row is ``torch_native`` pinned.
ANY = Takes()


def _pin(kernel: str) -> AbstractContextManager[Any]:
    """``sdpa_kernel(SDPBackend.<kernel>)`` (``torch.nn.attention`` is imported on first use,
    not with the tables: it costs milliseconds)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(getattr(SDPBackend, kernel))


class PinnedSdpa:
    """A row: SDPA with one kernel enabled (``kernel`` names an ``SDPBackend`` member),
    ``cpu``/``cuda`` saying what it takes there (``None``: it does not run there)."""

    def __init__(self, name: str, kernel: str, cpu: Takes | None, cuda: Takes | None) -> None:
        self.name, self.kernel, self.cpu, self.cuda = name, kernel, cpu, cuda

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: Any = None,
        layer_id: int = 0,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        fwd: str | None = None,
    ) -> torch.Tensor:
        """Attention output ``[..., heads * head_dim]`` in ``q``'s dtype, by this kernel."""
        takes = self.cuda if q.is_cuda else self.cpu
        if takes is None:
            raise RuntimeError(f"{self.name}: SDPA's {self.kernel} kernel does not run "
                               f"on {q.device.type} tensors")
        if compiling():  # the flags are read while tracing; no lock in traced code
            with _pin(self.kernel):
                return _attend(takes, q, k, v, kv_cache, layer_id, attn_mask, is_causal)
        with _PIN_LOCK, _pin(self.kernel):
            return _attend(takes, q, k, v, kv_cache, layer_id, attn_mask, is_causal)

    def __repr__(self) -> str:
        return f"PinnedSdpa({self.name!r}, SDPBackend.{self.kernel})"


def _attend(takes: Takes, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Any,
            layer_id: int, attn_mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
    if takes is ANY:
        return sdpa_attention(q, k, v, kv_cache, layer_id, attn_mask, is_causal)

    def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
             causal: bool) -> torch.Tensor:
        return adapted_core(takes, q, k, v, mask, causal)

    if kv_cache is not None:
        return sdpa_paged(q, k, v, kv_cache, layer_id, core)
    if not takes.masks and is_causal and attn_mask is None and q.shape[1] != k.shape[1]:
        return _lower_right(takes, q, k, v)
    return sdpa_dense(q, k, v, attn_mask, is_causal, core)


def adapted_core(takes: Takes, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """``sdpa_core`` on ``[B, H, S, D]`` tensors, the call first adapted to ``takes``."""
    b, heads, q_len, d = q.shape
    k_len, dv = k.shape[2], v.shape[3]
    if not takes.empty and (q_len == 0 or k_len == 0):
        return q.new_zeros(b, heads, q_len, dv)
    if not takes.gqa and k.shape[1] != heads:
        k, v = repeat_kv_heads(k, v, heads)
    scale = None
    if d % takes.align or dv % takes.align:
        scale = 1.0 / math.sqrt(d)
        q, k, v = (_pad_last(t, takes.align) for t in (q, k, v))
    if k_len < takes.min_keys:
        if causal:  # SDPA's flag (square calls): the same keys as a bottom-right mask
            mask, causal = causal_keep(q_len, k_len, q.device), False
        k, v, mask = _hidden_keys(k, v, mask, takes.min_keys - k_len)
    return sdpa_core(q, k, v, mask, causal, scale)[..., :dv]


def _pad_last(t: torch.Tensor, align: int) -> torch.Tensor:
    return F.pad(t, (0, -t.shape[-1] % align))


def _hidden_keys(k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, extra: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k/v with ``extra`` zero keys appended, and a mask that hides them."""
    k_len = k.shape[2]
    k, v = F.pad(k, (0, 0, 0, extra)), F.pad(v, (0, 0, 0, extra))
    if mask is None:
        mask = torch.ones(1, k_len, dtype=torch.bool, device=k.device)
    mask = mask.expand(*mask.shape[:-1], k_len)
    hide = False if mask.dtype == torch.bool else float("-inf")
    return k, v, torch.cat([mask, mask.new_full((*mask.shape[:-1], extra), hide)], dim=-1)


def _lower_right(takes: Takes, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                 ) -> torch.Tensor:
    """A causal, mask-free, non-square dense call through torch's lower-right ``CausalBias``.

    ``CausalBias`` hands flash (and efficient) the bias as a kernel option rather than a
    mask; it calls them without GQA, so k/v heads are repeated first.
    """
    from torch.nn.attention.bias import causal_lower_right  # imports torch._dynamo: lazily

    b, q_len, heads, _ = q.shape
    k_len = k.shape[1]
    if not takes.empty and (q_len == 0 or k_len == 0):
        return q.new_zeros(b, q_len, heads * v.shape[-1])
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if kt.shape[1] != heads:
        kt, vt = repeat_kv_heads(kt, vt, heads)
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=causal_lower_right(q_len, k_len))
    return merge_heads(out.transpose(1, 2))


# -- availability --------------------------------------------------------------


def _no_cuda(kernel: str) -> Unavailable:
    return Unavailable(f"no CUDA device: SDPA's {kernel} kernel runs on CUDA GPUs only")


def _gpu_supported(kernel: str, low: tuple[int, int],
                   high: tuple[int, int]) -> bool | Unavailable:
    """``True`` when the current GPU's compute capability is in ``[low, high]``."""
    cap = torch.cuda.get_device_capability()
    if low <= cap <= high:
        return True
    return Unavailable(
        f"SDPA's {kernel} kernel needs compute capability {low[0]}.{low[1]} to "
        f"{high[0]}.{high[1]}; {torch.cuda.get_device_name()} has {cap[0]}.{cap[1]}")


def sdpa_flash_available() -> bool | Unavailable:
    """``True`` when SDPA's flash kernel runs here: the CPU kernel answers a tiny call,
    and a CUDA device, if present, is one the CUDA kernel supports (the row's CUDA calls
    cannot yet be told apart by compute capability, so an unsupported GPU turns it off)."""
    q = torch.zeros(1, 1, 2, 8)
    try:
        with _PIN_LOCK, _pin("FLASH_ATTENTION"):
            F.scaled_dot_product_attention(q, q, q)
    except RuntimeError as exc:
        return Unavailable(f"SDPA's CPU flash kernel refused a plain call: {exc}")
    if not torch.cuda.is_available():
        return True
    built = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    if not built():
        return Unavailable("this torch build has no CUDA flash attention kernel")
    return _gpu_supported("flash", _SM80, _SM121)


def sdpa_efficient_available() -> bool | Unavailable:
    """``True`` with a CUDA GPU of compute capability >= 8.0 (bfloat16 needs it; the
    row's calls cannot yet be told apart by compute capability)."""
    if not torch.cuda.is_available():
        return _no_cuda("memory-efficient")
    return _gpu_supported("memory-efficient (bfloat16)", _SM80, _SM121)


def sdpa_cudnn_available() -> bool | Unavailable:
    """``True`` with cuDNN >= 9 and a CUDA GPU of compute capability 8.0 to 12.1."""
    if not torch.cuda.is_available():
        return _no_cuda("cuDNN")
    if not torch.backends.cudnn.is_available():  # type: ignore[no-untyped-call]
        return Unavailable("this torch build has no cuDNN")
    version = torch.backends.cudnn.version() or 0  # type: ignore[no-untyped-call]
    if version < 90000:
        return Unavailable(f"SDPA's cuDNN kernel needs cuDNN >= 9.0; this is {version}")
    return _gpu_supported("cuDNN", _SM80, _SM121)


#: SDPA's flash kernel: torch's CPU flash attention, or flash-attention 2 on CUDA.
sdpa_flash = PinnedSdpa("sdpa_flash", "FLASH_ATTENTION", cpu=ANY,
                        cuda=Takes(masks=False, empty=False))
#: SDPA's memory-efficient (CUTLASS) kernel, CUDA only.
sdpa_efficient = PinnedSdpa("sdpa_efficient", "EFFICIENT_ATTENTION", cpu=None,
                            cuda=Takes(gqa=False, align=8, empty=False))
#: SDPA's cuDNN kernel, CUDA only.
sdpa_cudnn = PinnedSdpa("sdpa_cudnn", "CUDNN_ATTENTION", cpu=None,
                        cuda=Takes(gqa=False, align=8, min_keys=2, empty=False))
#: SDPA's math kernel (composite ops), everywhere.
sdpa_math = PinnedSdpa("sdpa_math", "MATH", cpu=ANY, cuda=ANY)
