"""A paged KV cache for ragged batches (the SGLang layout).

Keys and values of every layer live in one pool of *slots*:
``k_buffer`` / ``v_buffer`` are ``[layers, slots, kv_heads, head_dim]``. Each
live request owns a row of ``req_to_token`` (``[max_requests, max_context]``,
int32) that maps its token positions to slots, so a request's context need not
be contiguous in the pool. Slot 0 is reserved as a padding slot by default.

``KVPool`` hands out request rows and slots and takes them back; the
bookkeeping lives on the host, the buffers on the pool's device. A
``PagedBatch`` describes one forward step over several requests and is what is
passed as ``kv_cache=`` to the ``attention`` facade; ``prefill_batch``,
``extend_batch`` and ``decode_batch`` build it. Every allocation of a request
row gets a fresh generation number and a batch records those of its rows, so a
batch kept after ``KVPool.free`` raises ``StaleBatchError`` when used instead of
touching the slots (or freeing the row) of whichever request owns them now.
"""

from __future__ import annotations

__all__ = [
    "KVCacheFullError",
    "KVPool",
    "PagedBatch",
    "StaleBatchError",
    "decode_batch",
    "extend_batch",
    "prefill_batch",
]

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

import torch

from astrai.errors import KVCacheFullError, StaleBatchError

T = TypeVar("T")


class KVPool:
    """Paged K/V storage plus the allocator of its request rows and slots.

    ``k_buffer[layer, slot]`` holds one token's keys (``[kv_heads, head_dim]``);
    ``req_to_token[row, pos]`` is the slot of position ``pos`` of the request in
    ``row``. With ``reserve_padding_slot`` (the default) slot 0 is never handed
    out, so padded index tensors may point at it safely. The buffers are normal
    tensors even when the pool is built under ``torch.inference_mode()``, so the
    pool stays usable outside it.
    """

    def __init__(
        self,
        layers: int,
        slots: int,
        kv_heads: int,
        head_dim: int,
        max_requests: int,
        max_context: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        reserve_padding_slot: bool = True,
    ) -> None:
        for name, value in (("layers", layers), ("slots", slots), ("kv_heads", kv_heads),
                            ("head_dim", head_dim), ("max_requests", max_requests),
                            ("max_context", max_context)):
            if value < 1:
                raise ValueError(f"KVPool: {name} must be >= 1, got {value}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"KVPool: dtype must be a floating dtype (K/V would be truncated "
                             f"otherwise), got {dtype}; e.g. torch.bfloat16 or torch.float32")
        first = 1 if reserve_padding_slot else 0
        if slots <= first:
            raise ValueError(f"KVPool: slots must be > {first} (slot 0 is reserved), got {slots}")
        self.layers, self.slots, self.kv_heads, self.head_dim = layers, slots, kv_heads, head_dim
        self.max_requests, self.max_context = max_requests, max_context
        self.dtype = dtype
        self.device = torch.device(device)
        self.first_slot = first
        shape = (layers, slots, kv_heads, head_dim)
        # Inference tensors could not be updated in place outside inference mode.
        with torch.inference_mode(False):
            self.k_buffer = torch.zeros(shape, dtype=dtype, device=self.device)
            self.v_buffer = torch.zeros(shape, dtype=dtype, device=self.device)
            self.req_to_token = torch.zeros(
                (max_requests, max_context), dtype=torch.int32, device=self.device
            )
            self._slot_used = torch.zeros(slots, dtype=torch.bool)
        # Host-side bookkeeping: free lists and, per request row, its length (None =
        # free) and the generation of its current allocation. ``_frees`` counts
        # ``free`` calls, so a batch knows cheaply whether it must re-check its rows.
        self._free_slots = torch.arange(first, slots, dtype=torch.int64)
        self._free_rows: list[int] = list(range(max_requests))
        self._row_len: list[int | None] = [None] * max_requests
        self._row_gen: list[int] = [0] * max_requests
        self._last_gen = 0
        self._frees = 0

    def __repr__(self) -> str:
        return (
            f"KVPool(layers={self.layers}, slots={self.slots}, kv_heads={self.kv_heads}, "
            f"head_dim={self.head_dim}, max_requests={self.max_requests}, "
            f"max_context={self.max_context}, dtype={self.dtype}, device={self.device}, "
            f"free_slots={self.num_free_slots}, free_requests={self.num_free_requests})"
        )

    # -- capacity ----------------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        """Slots not held by any request."""
        return int(self._free_slots.numel())

    @property
    def num_free_requests(self) -> int:
        """Request rows not held by any request."""
        return len(self._free_rows)

    def context_len(self, row: int) -> int:
        """How many positions the request in ``row`` holds; ``ValueError`` if it is free."""
        self._check_row(row)
        length = self._row_len[row]
        assert length is not None
        return length

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.max_requests:
            raise ValueError(f"request row {row} is out of range [0, {self.max_requests})")
        if self._row_len[row] is None:
            raise ValueError(f"request row {row} is not allocated")

    def _check_generations(self, rows: Sequence[int], generations: Sequence[int]) -> None:
        """``StaleBatchError`` unless each row still holds the allocation of that generation."""
        for row, gen in zip(rows, generations, strict=True):
            if self._row_len[row] is None or self._row_gen[row] != gen:
                now = "now free" if self._row_len[row] is None else f"now {self._row_gen[row]}"
                raise StaleBatchError(
                    f"stale PagedBatch: request row {row} was freed since the batch was "
                    f"built (generation {gen}, {now}); build a new batch for live requests"
                )

    # -- allocation ----------------------------------------------------------
    def alloc_requests(self, n: int) -> list[int]:
        """Take ``n`` free request rows (each starts with an empty context)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} request rows")
        if n > len(self._free_rows):
            raise KVCacheFullError(
                "request rows", n, len(self._free_rows), f"pool has {self.max_requests}"
            )
        rows, self._free_rows = self._free_rows[:n], self._free_rows[n:]
        for row in rows:
            self._last_gen += 1
            self._row_len[row] = 0
            self._row_gen[row] = self._last_gen
        return rows

    def alloc_slots(self, n: int) -> torch.Tensor:
        """Take ``n`` free slots; returns their indices (int64, on the pool's device)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        free = self.num_free_slots
        if n > free:
            reserved = ", slot 0 reserved for padding" if self.first_slot else ""
            raise KVCacheFullError("slots", n, free, f"pool has {self.slots} slots{reserved}")
        out = self._free_slots[:n]
        on_device = out.to(self.device)
        self._slot_used[out] = True  # the only update that can fail comes first
        self._free_slots = self._free_slots[n:]
        return on_device

    def release_slots(self, slots: torch.Tensor) -> None:
        """Give ``slots`` back to the pool; ``ValueError`` on a slot that is not held."""
        host = slots.detach().to("cpu", torch.int64).reshape(-1)
        if host.numel() == 0:
            return
        bad = host[(host < self.first_slot) | (host >= self.slots)]
        if bad.numel():
            raise ValueError(f"slots {bad.tolist()} are outside [{self.first_slot}, {self.slots})")
        if len(set(host.tolist())) != host.numel() or not bool(self._slot_used[host].all()):
            unheld = host[~self._slot_used[host]].tolist()
            raise ValueError(f"slots are not held (double free?): {unheld or 'duplicates'}")
        free = torch.cat([self._free_slots, host])
        self._slot_used[host] = False
        self._free_slots = free

    def free(self, req_pool_indices: PagedBatch | torch.Tensor | Sequence[int]) -> None:
        """Release request rows together with every slot their contexts hold.

        Given a ``PagedBatch``, its rows are freed after checking that the batch is
        not stale, so a second ``free`` of it raises ``StaleBatchError``.
        """
        if isinstance(req_pool_indices, PagedBatch):
            req_pool_indices = req_pool_indices.req_pool_indices
        rows = [int(r) for r in req_pool_indices]
        if len(set(rows)) != len(rows):
            raise ValueError(f"request rows listed twice: {rows}")
        for row in rows:
            self._check_row(row)
        if not rows:
            return
        held = [self.req_to_token[row, : self._row_len[row] or 0] for row in rows]
        self.release_slots(torch.cat(held))
        for row in rows:
            self._row_len[row] = None
            self._free_rows.append(row)
        self._frees += 1

    # -- storage -------------------------------------------------------------
    def write(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` (``[n, kv_heads, head_dim]``) of ``layer_id`` at slots ``loc``.

        The values are cast to the pool's dtype and detached: the cache keeps no
        autograd history.
        """
        if not 0 <= layer_id < self.layers:
            raise ValueError(f"layer_id {layer_id} is out of range [0, {self.layers})")
        want = (loc.numel(), self.kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != want:
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)}; the cache expects {want} "
                    "([new tokens, kv_heads, head_dim])"
                )
        index = loc.to(self.device, torch.int64)
        self.k_buffer[layer_id].index_copy_(0, index, k.detach().to(self.dtype))
        self.v_buffer[layer_id].index_copy_(0, index, v.detach().to(self.dtype))


class _Checked(Generic[T]):
    """A ``PagedBatch`` field (stored under ``_name``) read through the batch's check."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.stored = "_" + name

    def __get__(self, batch: PagedBatch | None, owner: type | None = None) -> T:
        if batch is None:  # looked up on the class (help(), documentation tools)
            return self  # type: ignore[return-value]
        if batch._pool._frees != batch._frees_seen:
            batch.check()
        value: T = getattr(batch, self.stored)
        return value


@dataclass(frozen=True, eq=False)
class PagedBatch:
    """One forward step over a ragged batch of requests in a ``KVPool``.

    Per request ``i`` (row ``req_pool_indices[i]``): ``seq_lens[i]`` positions of
    context including the ``extend_lens[i]`` new tokens, ``prefix_lens[i]`` of
    them already cached. The new tokens are packed: request ``i``'s are
    ``qo_indptr[i]:qo_indptr[i+1]`` and go to slots ``out_cache_loc``.
    ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]`` are the slots of request ``i``'s
    whole context. Index tensors are int64 on the pool's device; the ``*_host``
    tuples carry the lengths as Python ints so kernels need not synchronise.

    ``pool``, ``req_pool_indices``, ``out_cache_loc`` and ``kv_indices`` raise
    ``StaleBatchError`` once a request of the batch has been freed: its row and
    slots may belong to another request by then. The check is one integer
    comparison unless the pool freed something since the batch last checked.
    """

    fwd: Literal["prefill", "decode"]
    seq_lens: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    seq_lens_host: tuple[int, ...]
    extend_lens_host: tuple[int, ...]
    _pool: KVPool
    _req_pool_indices: torch.Tensor
    _out_cache_loc: torch.Tensor
    _kv_indices: torch.Tensor
    _rows: tuple[int, ...]
    _generations: tuple[int, ...]
    _frees_seen: int

    def check(self) -> None:
        """Raise ``StaleBatchError`` if a request of the batch was freed since it was built."""
        pool = self._pool
        if pool._frees != self._frees_seen:
            pool._check_generations(self._rows, self._generations)
            object.__setattr__(self, "_frees_seen", pool._frees)

    pool = _Checked["KVPool"]()  # the pool the batch lives in
    req_pool_indices = _Checked[torch.Tensor]()  # request row of each request
    out_cache_loc = _Checked[torch.Tensor]()  # slots of the new tokens, packed
    kv_indices = _Checked[torch.Tensor]()  # slots of every request's whole context, packed

    @property
    def batch_size(self) -> int:
        """Number of requests."""
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        """Number of new tokens (rows of the packed q/k/v)."""
        return sum(self.extend_lens_host)

    @property
    def max_seq_len(self) -> int:
        """Longest context in the batch."""
        return max(self.seq_lens_host)

    @property
    def max_extend_len(self) -> int:
        """Most new tokens of any request."""
        return max(self.extend_lens_host)


def _indptr(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])


def _spans(starts: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each i, the pairs ``(i, starts[i] + j)`` for ``j < lengths[i]``, flattened."""
    total = int(lengths.sum())
    owner = torch.repeat_interleave(torch.arange(lengths.numel()), lengths, output_size=total)
    offset = torch.arange(total) - _indptr(lengths)[owner]
    return owner, starts[owner] + offset


def extend_batch(
    pool: KVPool,
    req_pool_indices: torch.Tensor | Sequence[int],
    extend_lens: Sequence[int],
    fwd: Literal["prefill", "decode"] = "prefill",
) -> PagedBatch:
    """Append ``extend_lens[i]`` new tokens to each request and describe the step.

    Slots for the new tokens are allocated and recorded in ``req_to_token``.
    Nothing changes when the step fails: every argument is checked before
    anything is taken (``ValueError``, or ``KVCacheFullError`` when the pool cannot
    hold the step), and an error after that gives the slots back.
    """
    rows = [int(r) for r in req_pool_indices]
    lens = [int(n) for n in extend_lens]
    if not rows or len(rows) != len(lens):
        raise ValueError(
            f"need one extend length per request: {len(rows)} rows, {len(lens)} lengths"
        )
    if len(set(rows)) != len(rows):
        raise ValueError(f"request rows listed twice: {rows}")
    if min(lens) < 1:
        raise ValueError(f"every request needs at least one new token, got {lens}")
    prefix = [pool.context_len(r) for r in rows]
    for row, old, n in zip(rows, prefix, lens, strict=True):
        if old + n > pool.max_context:
            raise KVCacheFullError(
                f"positions in request row {row}", n, pool.max_context - old,
                f"max_context is {pool.max_context}",
            )
    loc = pool.alloc_slots(sum(lens))
    try:
        return describe_failure(pool, rows, prefix, lens, loc, fwd)
    except BaseException:
        for row, old in zip(rows, prefix, strict=True):
            pool._row_len[row] = old
        pool.release_slots(loc)
        raise


def describe_failure(
    pool: KVPool,
    rows: list[int],
    prefix: list[int],
    lens: list[int],
    loc: torch.Tensor,
    fwd: Literal["prefill", "decode"],
) -> PagedBatch:
    """Record the new tokens' slots ``loc`` in ``req_to_token`` and build the batch."""
    rows_t = torch.tensor(rows, dtype=torch.int64)
    prefix_t = torch.tensor(prefix, dtype=torch.int64)
    ext_t = torch.tensor(lens, dtype=torch.int64)
    seq_t = prefix_t + ext_t
    owner, pos = _spans(prefix_t, ext_t)
    dev = pool.device
    pool.req_to_token[rows_t[owner].to(dev), pos.to(dev)] = loc.to(torch.int32)
    for row, length in zip(rows, seq_t.tolist(), strict=True):
        pool._row_len[row] = length
    kv_owner, kv_pos = _spans(torch.zeros_like(seq_t), seq_t)
    kv_indices = pool.req_to_token[rows_t[kv_owner].to(dev), kv_pos.to(dev)].long()
    return PagedBatch(
        fwd=fwd,
        seq_lens=seq_t.to(dev),
        prefix_lens=prefix_t.to(dev),
        extend_lens=ext_t.to(dev),
        qo_indptr=_indptr(ext_t).to(dev),
        kv_indptr=_indptr(seq_t).to(dev),
        seq_lens_host=tuple(seq_t.tolist()),
        extend_lens_host=tuple(lens),
        _pool=pool,
        _req_pool_indices=rows_t.to(dev),
        _out_cache_loc=loc,
        _kv_indices=kv_indices,
        _rows=tuple(rows),
        _generations=tuple(pool._row_gen[row] for row in rows),
        _frees_seen=pool._frees,
    )


def prefill_batch(pool: KVPool, prompt_lens: Sequence[int]) -> PagedBatch:
    """Start ``len(prompt_lens)`` new requests and describe their prefill step.

    Every argument is checked, request rows and slots together, before anything
    is taken, and an error after that gives back what was taken: a failed call
    (``ValueError``, ``KVCacheFullError`` or any other) leaves the pool unchanged.
    """
    lens = [int(n) for n in prompt_lens]
    if not lens:
        raise ValueError("prefill_batch needs at least one prompt")
    if min(lens) < 1:
        raise ValueError(f"every prompt needs at least one token, got {lens}")
    if len(lens) > pool.num_free_requests:
        raise KVCacheFullError(
            "request rows", len(lens), pool.num_free_requests, f"pool has {pool.max_requests}"
        )
    if sum(lens) > pool.num_free_slots:
        raise KVCacheFullError("slots", sum(lens), pool.num_free_slots, "for the prompts")
    too_long = [n for n in lens if n > pool.max_context]
    if too_long:
        raise KVCacheFullError(
            "positions for one prompt", max(too_long), pool.max_context,
            f"max_context is {pool.max_context}",
        )
    rows = pool.alloc_requests(len(lens))
    try:
        return extend_batch(pool, rows, lens, fwd="prefill")
    except BaseException:
        pool.free(rows)
        raise


def decode_batch(pool: KVPool, req_pool_indices: torch.Tensor | Sequence[int]) -> PagedBatch:
    """One new token for each listed request: a decode step."""
    rows = [int(r) for r in req_pool_indices]
    return extend_batch(pool, rows, [1] * len(rows), fwd="decode")
