"""Linear layers: rows ``fp8`` and ``bf16`` (non-faithful), ``transposed`` and ``torch``
(the fallback).

``linear(x, weight, bias=None) = x @ weight.T + bias`` with ``weight``
``[out_features, in_features]`` and ``x`` ``[..., in_features]``; the output is
``[..., out_features]`` in ``x``'s dtype.

- ``torch``: ``F.linear`` in ``x``'s dtype.
- ``transposed``: one matrix product ``x @ Wt`` with a contiguous ``[in, out]`` copy
  ``Wt`` of the weight (CPU). MKL multiplies by the weight as it is stored, ``[out, in]``
  read transposed, markedly slower at a few to a few hundred rows (2x at 8 rows of a
  512-wide layer); the copy turns every later call into the fast product. The result
  equals ``F.linear``'s up to the order of the float32 sums. A copy is kept only for a
  weight declared frozen (``dispatch_model(model, mode="inference")``, or
  ``astrai.backends.frozen.freeze``): a write through ``weight.data`` or a NumPy view
  moves nothing a copy could be checked against, so a call with any other weight runs
  ``F.linear``, counted in ``stats().handed`` (a weight stored ``[in, out]`` and passed
  as its transpose, GPT-2's ``Conv1D``, is read as it is, frozen or not). A frozen
  weight's copy is made at its first such call and remade when the weight shows a
  change: its version (inference tensors track none), address, storage (the storage
  object itself, so a new storage at a freed one's address is seen), shape, strides,
  dtype or device. Copies go with their weight (freed, or its declaration withdrawn)
  and all together stay within a budget (``set_weight_copy_budget``, 1 GiB unless
  set): past it, the first refusal warns once and the call runs ``F.linear``, counted
  in ``stats().handed``. ``weight_copies()`` says what is held,
  ``release_weight_copies()`` frees it. ``in_features == 0``: ``F.linear`` (the bias,
  or zeros).
- ``bf16``: casts to bfloat16, multiplies, casts back — faster on hardware with
  bf16 matrix units, at bfloat16 precision (so not faithful).
- ``fp8``: per-tensor-scaled float8 (e4m3) operands multiplied by
  ``torch._scaled_mm``, on CUDA GPUs of compute capability >= 8.9 (Ada, Hopper);
  ``fp8_available`` says why not elsewhere.

Rows are plain functions: ``tables/linear.yaml``'s ``when`` decides which calls
each serves, and the facade (``astrai.ops.linear``) validates shapes and dtypes
before any row runs, so a row does neither.
"""

from __future__ import annotations

__all__ = [
    "bf16_linear",
    "fp8_available",
    "fp8_linear",
    "onednn_available",
    "onednn_linear",
    "release_weight_copies",
    "set_weight_copy_budget",
    "torch_linear",
    "transposed_available",
    "transposed_linear",
    "transposed_one_linear",
    "transposed_one_row_available",
    "weight_copies",
]

import threading
import weakref

import torch
import torch.nn.functional as F

from astrai.backends.frozen import any_frozen, derived, derived_stores
from astrai.backends.linear_operator import float32_cpu, linear_operator, traceable
from astrai.backends.operators import handoff_reason, plain_call
from astrai.dispatch.log import warn_once
from astrai.dispatch.stats import count_handoff
from astrai.dispatch.tables.model import Unavailable
from astrai.dispatch.torch_compile import compiling

_FP8_MIN_CAPABILITY = (8, 9)
_FP8_ALIGN = 16  # _scaled_mm wants every matrix dimension a multiple of 16
_fp8_ready = False  # set once fp8_available() has said yes in this process


def fp8_available() -> bool | Unavailable:
    """``True`` when ``torch._scaled_mm`` and a GPU with fp8 matrix units are present."""
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return Unavailable(f"torch {torch.__version__} has no torch._scaled_mm / float8_e4m3fn")
    if not torch.cuda.is_available():
        return Unavailable("no CUDA device (fp8 matmul needs compute capability >= 8.9)")
    capability = torch.cuda.get_device_capability()
    if capability < _FP8_MIN_CAPABILITY:
        return Unavailable(
            f"fp8 matmul needs compute capability >= 8.9 (Ada/Hopper); "
            f"{torch.cuda.get_device_name()} has {capability[0]}.{capability[1]}"
        )
    return True


#: The ``torch`` row: ``F.linear`` itself, ``x @ weight.T + bias`` in ``x``'s dtype (the
#: facade checked that x, weight and bias share it). The row is the builtin, so a call
#: pays no Python frame of ours on top of it.
torch_linear = F.linear


def bf16_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias`` computed in bfloat16 and returned in ``x``'s dtype."""
    b = None if bias is None else bias.to(torch.bfloat16)
    out = F.linear(x.to(torch.bfloat16), weight.to(torch.bfloat16), b)
    return out.to(x.dtype)


def _quantize(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor scaled e4m3: ``(t / scale)`` in float8 and the float32 ``scale``."""
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    t32 = t.float()
    scale = (t32.abs().amax() / fp8_max).clamp(min=torch.finfo(torch.float32).tiny)
    q = (t32 / scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)
    return q, scale


def _pad_to(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad a 2-d tensor to ``[rows, cols]`` (zeros add nothing to a product)."""
    if t.shape == (rows, cols):
        return t
    return F.pad(t, (0, cols - t.shape[1], 0, rows - t.shape[0]))


def _round_up(n: int) -> int:
    return -(-n // _FP8_ALIGN) * _FP8_ALIGN


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias`` with per-tensor-scaled float8 e4m3 operands via
    ``torch._scaled_mm`` (CUDA, cc >= 8.9), returned in ``x``'s dtype."""
    global _fp8_ready
    if not _fp8_ready:
        ok = fp8_available()
        if not ok:
            raise RuntimeError(f"the fp8 linear row cannot run: {ok}")
        _fp8_ready = True
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    n = weight.shape[0]
    mp, kp, np_ = _round_up(m), _round_up(k), _round_up(n)
    xq, x_scale = _quantize(_pad_to(x2, mp, kp))
    wq, w_scale = _quantize(_pad_to(weight, np_, kp))
    # mat2 must be column-major: the transpose of a row-major [n, k] weight is.
    out = torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=x.dtype)
    if isinstance(out, tuple):  # torch < 2.4 also returned the output's amax
        out = out[0]
    out = out[:m, :n]
    if bias is not None:
        out = out + bias.to(x.dtype)
    return out.reshape(*lead, n)


# -- transposed: the weight kept as a contiguous [in, out] copy ----------------------


class _Copy:
    """A frozen weight's ``[in, out]`` copy, and what the weight was when it was made."""

    __slots__ = ("device", "dtype", "ptr", "shape", "storage", "stride", "t", "version")

    def __init__(self, weight: torch.Tensor) -> None:
        with torch.no_grad():
            self.t = weight.detach().t().contiguous()
        self.version = _version(weight)
        self.ptr, self.shape, self.stride = weight.data_ptr(), weight.shape, weight.stride()
        self.dtype, self.device = weight.dtype, weight.device
        # The storage object (one per storage, kept while the storage lives): a weak
        # reference to it, dead once the storage is freed, tells a storage made later at
        # the same address from this one.
        self.storage = weakref.ref(weight.untyped_storage())

    def fits(self, weight: torch.Tensor) -> bool:
        """Whether ``weight`` shows no change since the copy was made."""
        return (self.ptr == weight.data_ptr() and self.version == _version(weight)
                and self.storage() is weight.untyped_storage()
                and self.shape == weight.shape and self.stride == weight.stride()
                and self.dtype == weight.dtype and self.device == weight.device)


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter; ``None`` for an inference tensor, which keeps none."""
    return None if t.is_inference() else t._version


#: The key of the copy in a frozen weight's store (``astrai.backends.frozen``).
_KEY = "linear.transposed"
_LOCK = threading.Lock()
_budget = [1 << 30]
#: What computes a call the ``transposed`` row hands on (``stats().handed``).
_HANDED = "F.linear"


def set_weight_copy_budget(nbytes: int) -> None:
    """Bound the bytes of all the ``transposed`` row's weight copies together (1 GiB unless
    set; 0: the row makes none). Copies held already are kept; ``release_weight_copies``
    frees them."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"the weight copy budget is a number of bytes >= 0, got {nbytes!r}")
    _budget[0] = nbytes


def _copies() -> list[_Copy]:
    """Every copy held."""
    return [c for store in derived_stores() if (c := store.get(_KEY)) is not None]


def _held() -> int:
    """The bytes of every copy held (the caller holds ``_LOCK``)."""
    return sum(c.t.nbytes for c in _copies())


def weight_copies() -> tuple[int, int]:
    """``(copies, bytes)`` the ``transposed`` row holds now."""
    with _LOCK:
        copies = _copies()
    return len(copies), sum(c.t.nbytes for c in copies)


def release_weight_copies() -> int:
    """Free every copy the ``transposed`` row holds (made again at the next call that
    needs one); returns the bytes freed."""
    with _LOCK:
        freed = 0
        for store in derived_stores():
            got = store.pop(_KEY, None)
            if got is not None:
                freed += got.t.nbytes
    return freed


#: Why a call gets no copy (``stats().handed``'s reasons).
_NOT_FROZEN = "a weight not declared frozen (dispatch_model(model, mode='inference'))"
_PAST_BUDGET = "past the weight copy budget (set_weight_copy_budget)"


def _copy_of(weight: torch.Tensor) -> torch.Tensor | str:
    """``weight`` as a contiguous ``[in, out]`` matrix: its own transpose where it is
    stored so (GPT-2's ``Conv1D`` is served as ``weight.t()``), else, for a weight
    declared frozen, its current copy, made now if it has none or the weight shows a
    change; else why not (the weight is not declared frozen, or the copy would pass the
    budget)."""
    t = weight.t()
    if t.is_contiguous():
        return t
    store = derived(weight)
    if store is None:
        return _NOT_FROZEN
    got = store.get(_KEY)
    if got is not None:
        if got.fits(weight):
            return got.t  # type: ignore[no-any-return]
        with _LOCK:  # the weight changed since: its copy goes, whatever serves it now
            store.pop(_KEY, None)
    with _LOCK:
        held = _held()
        if held + weight.nbytes > _budget[0]:
            warn_once(f"astrai: the linear row 'transposed' holds {held} bytes of weight "
                      f"copies and may hold {_budget[0]} (set_weight_copy_budget); a "
                      f"weight of {weight.nbytes} bytes gets no copy, its calls run "
                      f"F.linear (counted in stats().handed)")
            return _PAST_BUDGET
        made = store[_KEY] = _Copy(weight)
    return made.t


def _frozen_weights() -> bool | Unavailable:
    """``True`` while some weight is declared frozen in this process (the rows that
    multiply by copies of frozen weights have nothing to copy otherwise); else why not."""
    if not any_frozen():
        return Unavailable("no weight is declared frozen in this process, and the row "
                           "multiplies by copies of frozen weights only "
                           "(dispatch_model(model, mode=\"inference\") declares a model's)")
    return True


def _handed_off(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                row: str) -> bool:
    """Whether a CPU row leaves this call to ``F.linear``: traced, autograd recording,
    CPU autocast in force (``F.linear`` computes in its lower precision there), or a
    tensor subclass (counted in ``stats().handed`` outside tracing)."""
    if compiling() or not plain_call(x, weight, bias):
        if not compiling():
            count_handoff("linear", row, _HANDED, handoff_reason(x, weight, bias))
        return True
    return False


def onednn_available() -> bool | Unavailable:
    """``True`` where torch has oneDNN's linear (``torch.ops.mkldnn._linear_pointwise``);
    else why not. Where it is faster than MKL's product is the table's to say."""
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return Unavailable("this torch was built without oneDNN (mkldnn)")
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return Unavailable("this torch has no torch.ops.mkldnn._linear_pointwise")
    return True


def onednn_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` by oneDNN's linear; with autograd recording, with a
    tensor subclass, or any call but float32 CPU tensors: ``F.linear`` (counted in
    ``stats().handed`` outside tracing). Traced, the call stands in the graph as the
    operator ``astrai::onednn_linear`` where it would run eagerly. It equals ``F.linear``
    up to the order of the float32 sums."""
    if compiling():
        if traceable(x, weight, bias):
            return _ONEDNN_OPERATOR(x, weight, bias)
        return F.linear(x, weight, bias)
    if _handed_off(x, weight, bias, "onednn"):
        return F.linear(x, weight, bias)
    if not float32_cpu(x, weight, bias) or not weight.shape[1]:
        count_handoff("linear", "onednn", _HANDED, "in_features == 0" if not weight.shape[1]
                      else "not float32 CPU tensors")
        return F.linear(x, weight, bias)
    return _onednn(x, weight, bias)


def _onednn(x: torch.Tensor, weight: torch.Tensor,
            bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's product, which reads the bias as contiguous and has no primitive for
    ``in_features == 0`` (``F.linear``'s there)."""
    if not weight.shape[1]:
        return F.linear(x, weight, bias)
    if bias is not None:
        bias = bias.contiguous()
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")  # type: ignore[no-any-return]


#: The ``onednn`` row in a compiled graph (``astrai.backends.linear_operator``).
_ONEDNN_OPERATOR = linear_operator("onednn", _onednn)


def transposed_available() -> bool | Unavailable:
    """``True`` while some weight is declared frozen (the row multiplies by copies of
    frozen weights only); else why not. Where the copy is faster than the weight as
    stored is the table's to say."""
    return _frozen_weights()


def transposed_one_row_available() -> bool | Unavailable:
    """``transposed_available``, for the one-token row."""
    return _frozen_weights()


def transposed_linear(x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` as one product with the weight's contiguous ``[in, out]``
    copy (module docstring). A weight not declared frozen, traced, autograd recording,
    a tensor subclass, or ``in_features == 0``: ``F.linear``."""
    return _transposed(x, weight, bias, "transposed")


def transposed_one_linear(x: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """``transposed_linear`` as the ``transposed_one`` row (its hand-offs counted as
    that row's)."""
    return _transposed(x, weight, bias, "transposed_one")


def _transposed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                row: str) -> torch.Tensor:
    if _handed_off(x, weight, bias, row):
        return F.linear(x, weight, bias)
    if not weight.shape[1]:  # no product to take: the bias, or zeros
        count_handoff("linear", row, _HANDED, "in_features == 0")
        return F.linear(x, weight, bias)
    t = _copy_of(weight)
    if isinstance(t, str):
        count_handoff("linear", row, _HANDED, t)
        return F.linear(x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.mm(x2, t) if bias is None else torch.addmm(bias, x2, t)
    return out.view(*x.shape[:-1], t.shape[1])
