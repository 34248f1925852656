"""Tests of the paged KV cache: the pool's allocator and the per-step batch metadata."""

from __future__ import annotations

import pickle

import pytest
import torch

import astrai.kv_cache
from astrai.errors import AstraiError
from astrai.kv_cache import (
    KVCacheFullError,
    KVPool,
    PagedBatch,
    StaleBatchError,
    decode_batch,
    extend_batch,
    prefill_batch,
)
from astrai.ops import attention


def make_pool(**overrides: object) -> KVPool:
    args: dict[str, object] = dict(
        layers=2, slots=32, kv_heads=2, head_dim=4, max_requests=4, max_context=12
    )
    args.update(overrides)
    return KVPool(**args)  # type: ignore[arg-type]


def contexts(pool: KVPool, batch: PagedBatch) -> list[list[int]]:
    """Each request's slots, read through req_to_token."""
    return [
        pool.req_to_token[int(r), :n].tolist()
        for r, n in zip(batch.req_pool_indices, batch.seq_lens_host, strict=True)
    ]


def flat(lists: list[list[int]]) -> list[int]:
    return [n for part in lists for n in part]


def free_counts(pool: KVPool) -> tuple[int, int]:
    return pool.num_free_slots, pool.num_free_requests


def fail_after_allocation(monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> None:
    """Make the next batch description raise ``exc`` once its slots are taken."""

    def boom(*args: object) -> None:
        raise exc

    monkeypatch.setattr(astrai.kv_cache, "_spans", boom)


class TestKVPool:
    def test_buffers_have_the_documented_shapes(self) -> None:
        """k/v buffers are [layers, slots, kv_heads, head_dim]; req_to_token is int32."""
        pool = make_pool(dtype=torch.float16)
        assert pool.k_buffer.shape == (2, 32, 2, 4) == pool.v_buffer.shape
        assert pool.k_buffer.dtype == torch.float16
        assert pool.req_to_token.shape == (4, 12)
        assert pool.req_to_token.dtype == torch.int32

    def test_slot_zero_is_reserved_for_padding(self) -> None:
        """Every slot but 0 is handed out; slot 0 never is."""
        pool = make_pool()
        assert pool.num_free_slots == 31
        slots = pool.alloc_slots(31)
        assert sorted(slots.tolist()) == list(range(1, 32))

    def test_slot_zero_is_usable_without_reservation(self) -> None:
        """With reserve_padding_slot=False all slots are handed out."""
        pool = make_pool(reserve_padding_slot=False)
        assert sorted(pool.alloc_slots(32).tolist()) == list(range(32))

    def test_alloc_and_release_slots_round_trip(self) -> None:
        """Released slots become free again and can be handed out anew."""
        pool = make_pool()
        a = pool.alloc_slots(10)
        assert pool.num_free_slots == 21
        pool.release_slots(a)
        assert pool.num_free_slots == 31
        assert len(set(pool.alloc_slots(31).tolist())) == 31

    def test_error_full_slots_says_asked_and_free(self) -> None:
        """Asking for more slots than are free raises KVCacheFullError with both numbers."""
        pool = make_pool()
        pool.alloc_slots(25)
        with pytest.raises(KVCacheFullError, match="asked for 7 slots, only 6 free") as info:
            pool.alloc_slots(7)
        assert (info.value.requested, info.value.free, info.value.what) == (7, 6, "slots")
        assert pool.num_free_slots == 6

    def test_error_full_request_rows(self) -> None:
        """Asking for more request rows than are free raises KVCacheFullError."""
        pool = make_pool()
        pool.alloc_requests(3)
        with pytest.raises(KVCacheFullError, match="asked for 2 request rows, only 1 free"):
            pool.alloc_requests(2)

    def test_error_type_is_memory_error_and_library_error(self) -> None:
        """KVCacheFullError is a MemoryError and an AstraiError, and pickles."""
        err = KVCacheFullError("slots", 3, 1, "pool has 4 slots")
        assert isinstance(err, MemoryError) and isinstance(err, AstraiError)
        again = pickle.loads(pickle.dumps(err))
        assert str(again) == str(err) and again.requested == 3

    def test_error_double_release_of_slots(self) -> None:
        """Releasing a slot twice is a ValueError naming the slot."""
        pool = make_pool()
        slots = pool.alloc_slots(2)
        pool.release_slots(slots)
        with pytest.raises(ValueError, match="not held"):
            pool.release_slots(slots[:1])

    def test_error_release_of_padding_slot(self) -> None:
        """Slot 0 cannot be released when it is reserved."""
        with pytest.raises(ValueError, match=r"outside \[1, 32\)"):
            make_pool().release_slots(torch.tensor([0]))

    def test_free_returns_rows_and_their_slots(self) -> None:
        """free() releases the request rows and every slot of their contexts."""
        pool = make_pool()
        batch = prefill_batch(pool, [3, 5])
        decode_batch(pool, batch.req_pool_indices)
        assert pool.num_free_slots == 31 - 10 and pool.num_free_requests == 2
        pool.free(batch.req_pool_indices)
        assert pool.num_free_slots == 31 and pool.num_free_requests == 4

    def test_error_free_unallocated_row(self) -> None:
        """Freeing a request row that is not allocated is a ValueError."""
        pool = make_pool()
        with pytest.raises(ValueError, match="request row 1 is not allocated"):
            pool.free([1])
        with pytest.raises(ValueError, match="out of range"):
            pool.free([9])

    def test_error_bad_constructor_arguments(self) -> None:
        """Non-positive sizes are rejected with the argument's name."""
        with pytest.raises(ValueError, match="kv_heads must be >= 1"):
            make_pool(kv_heads=0)
        with pytest.raises(ValueError, match="slots must be > 1"):
            make_pool(slots=1)

    def test_write_stores_at_slots_for_one_layer(self) -> None:
        """write() puts k/v at the given slots of the given layer only, in the pool dtype."""
        pool = make_pool(dtype=torch.float16)
        loc = pool.alloc_slots(3)
        k = torch.randn(3, 2, 4, requires_grad=True)
        v = torch.randn(3, 2, 4)
        pool.write(1, loc, k, v)
        torch.testing.assert_close(pool.k_buffer[1, loc], k.detach().half())
        torch.testing.assert_close(pool.v_buffer[1, loc], v.half())
        assert not pool.k_buffer[0].any() and pool.k_buffer.grad_fn is None

    def test_error_write_with_wrong_shape_or_layer(self) -> None:
        """write() names the expected shape and the layer range."""
        pool = make_pool()
        loc = pool.alloc_slots(2)
        with pytest.raises(ValueError, match=r"k has shape \(2, 3, 4\); the cache expects"):
            pool.write(0, loc, torch.zeros(2, 3, 4), torch.zeros(2, 2, 4))
        with pytest.raises(ValueError, match=r"layer_id 2 is out of range \[0, 2\)"):
            pool.write(2, loc, torch.zeros(2, 2, 4), torch.zeros(2, 2, 4))


class TestPrefillBatch:
    def test_metadata_of_ragged_prompts(self) -> None:
        """Lengths, indptrs and slots describe three ragged prompts."""
        pool = make_pool()
        batch = prefill_batch(pool, [3, 5, 1])
        assert batch.fwd == "prefill"
        assert batch.batch_size == 3 and batch.num_tokens == 9
        assert batch.seq_lens.tolist() == [3, 5, 1] == list(batch.extend_lens_host)
        assert batch.prefix_lens.tolist() == [0, 0, 0]
        assert batch.qo_indptr.tolist() == [0, 3, 8, 9] == batch.kv_indptr.tolist()
        assert (batch.max_seq_len, batch.max_extend_len) == (5, 5)
        loc = batch.out_cache_loc.tolist()
        assert len(set(loc)) == 9 and 0 not in loc
        assert flat(contexts(pool, batch)) == loc == batch.kv_indices.tolist()
        assert len(set(batch.req_pool_indices.tolist())) == 3

    def test_error_too_many_prompts_leaves_pool_unchanged(self) -> None:
        """A prefill the pool cannot hold raises and takes nothing."""
        pool = make_pool()
        with pytest.raises(KVCacheFullError, match="asked for 5 request rows, only 4 free"):
            prefill_batch(pool, [1] * 5)
        with pytest.raises(KVCacheFullError, match="asked for 33 slots, only 31 free"):
            prefill_batch(pool, [11, 11, 11])
        assert (pool.num_free_slots, pool.num_free_requests) == (31, 4)

    def test_error_prompt_longer_than_max_context(self) -> None:
        """A prompt longer than max_context raises KVCacheFullError naming the limit."""
        pool = make_pool()
        with pytest.raises(KVCacheFullError, match="max_context is 12"):
            prefill_batch(pool, [13])
        assert pool.num_free_requests == 4

    def test_error_empty_prefill(self) -> None:
        """A prefill of no prompts is a ValueError."""
        with pytest.raises(ValueError, match="at least one prompt"):
            prefill_batch(make_pool(), [])

    def test_error_empty_or_negative_prompts_take_nothing(self) -> None:
        """Prompts of <= 0 tokens are a ValueError that leaves every row and slot free."""
        pool = make_pool()
        for _ in range(5):
            for lens in ([3, 0], [-2], [0], [0, 0, 0, 0]):
                with pytest.raises(ValueError, match="at least one"):
                    prefill_batch(pool, lens)
        assert free_counts(pool) == (31, 4)
        assert prefill_batch(pool, [1, 1, 1, 1]).batch_size == 4

    @pytest.mark.parametrize("exc", [RuntimeError("device error"), KeyboardInterrupt()])
    def test_error_after_allocation_gives_everything_back(
        self, monkeypatch: pytest.MonkeyPatch, exc: BaseException
    ) -> None:
        """Any error once rows and slots are taken (even an interrupt) hands them back."""
        pool = make_pool()
        fail_after_allocation(monkeypatch, exc)
        for _ in range(5):
            with pytest.raises(type(exc)):
                prefill_batch(pool, [3, 2])
        assert free_counts(pool) == (31, 4)
        monkeypatch.undo()
        assert prefill_batch(pool, [3, 5, 11, 12]).num_tokens == 31

    def test_pool_built_under_inference_mode_works_outside_it(self) -> None:
        """A pool made under inference_mode serves steps outside it, and back, losing nothing."""
        with torch.inference_mode():
            pool = make_pool()
        batch = prefill_batch(pool, [3, 2])
        assert free_counts(pool) == (26, 2)
        loc = batch.out_cache_loc
        pool.write(0, loc, torch.ones(5, 2, 4), torch.ones(5, 2, 4))
        step = decode_batch(pool, batch.req_pool_indices)
        assert step.seq_lens.tolist() == [4, 3]
        with torch.inference_mode():
            pool.free(step.req_pool_indices)
            inner = prefill_batch(pool, [4])
            pool.write(1, inner.out_cache_loc, torch.ones(4, 2, 4), torch.ones(4, 2, 4))
        pool.free(inner)
        assert free_counts(pool) == (31, 4)
        assert bool(pool.k_buffer[0, loc].eq(1).all())


class TestDecodeBatch:
    def test_one_new_token_per_request(self) -> None:
        """A decode step appends one slot to each context and describes it."""
        pool = make_pool()
        first = prefill_batch(pool, [3, 5, 1])
        before = contexts(pool, first)
        step = decode_batch(pool, first.req_pool_indices)
        assert step.fwd == "decode"
        assert step.seq_lens.tolist() == [4, 6, 2]
        assert step.prefix_lens.tolist() == [3, 5, 1]
        assert step.extend_lens.tolist() == [1, 1, 1]
        assert step.qo_indptr.tolist() == [0, 1, 2, 3]
        assert step.kv_indptr.tolist() == [0, 4, 10, 12]
        after = contexts(pool, step)
        new = step.out_cache_loc.tolist()
        assert after == [[*b, n] for b, n in zip(before, new, strict=True)]
        assert step.kv_indices.tolist() == flat(after)
        assert not set(new) & set(first.out_cache_loc.tolist())

    def test_decode_of_a_subset_of_requests(self) -> None:
        """Only the listed requests grow."""
        pool = make_pool()
        first = prefill_batch(pool, [2, 2])
        row = int(first.req_pool_indices[1])
        step = decode_batch(pool, [row])
        assert step.seq_lens.tolist() == [3]
        assert pool.context_len(int(first.req_pool_indices[0])) == 2

    def test_error_context_overflow_leaves_pool_unchanged(self) -> None:
        """Growing past max_context raises KVCacheFullError and allocates nothing."""
        pool = make_pool()
        first = prefill_batch(pool, [12, 1])
        free = pool.num_free_slots
        with pytest.raises(KVCacheFullError, match="max_context is 12"):
            decode_batch(pool, first.req_pool_indices)
        assert pool.num_free_slots == free
        assert pool.context_len(int(first.req_pool_indices[1])) == 1

    def test_error_after_allocation_leaves_context_unchanged(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A decode step that fails once its slots are taken gives them back."""
        pool = make_pool()
        rows = prefill_batch(pool, [3, 2]).req_pool_indices
        fail_after_allocation(monkeypatch, RuntimeError("device error"))
        with pytest.raises(RuntimeError, match="device error"):
            decode_batch(pool, rows)
        assert free_counts(pool) == (26, 2)
        assert [pool.context_len(int(r)) for r in rows] == [3, 2]

    def test_error_decode_of_unallocated_row(self) -> None:
        """Decoding a request row that holds no request is a ValueError."""
        with pytest.raises(ValueError, match="request row 2 is not allocated"):
            decode_batch(make_pool(), [2])


class TestExtendBatch:
    def test_chunked_prefill_continues_a_context(self) -> None:
        """Extending by several tokens records the prefix and appends the new slots."""
        pool = make_pool()
        first = prefill_batch(pool, [4, 2])
        step = extend_batch(pool, first.req_pool_indices, [3, 5])
        assert step.prefix_lens.tolist() == [4, 2]
        assert step.seq_lens.tolist() == [7, 7]
        assert step.qo_indptr.tolist() == [0, 3, 8]
        assert step.kv_indptr.tolist() == [0, 7, 14]
        ctx = contexts(pool, step)
        assert ctx[0][4:] + ctx[1][2:] == step.out_cache_loc.tolist()

    def test_error_zero_or_mismatched_lengths(self) -> None:
        """Every request needs at least one new token and one length."""
        pool = make_pool()
        rows = prefill_batch(pool, [1, 1]).req_pool_indices
        with pytest.raises(ValueError, match="at least one new token"):
            extend_batch(pool, rows, [1, 0])
        with pytest.raises(ValueError, match="2 rows, 1 lengths"):
            extend_batch(pool, rows, [1])


def reuse_pool() -> KVPool:
    """One request row and four slots: a freed request's row and slots are reused next."""
    return make_pool(layers=1, slots=5, kv_heads=1, head_dim=2, max_requests=1)


def packed(n: int, value: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of ``n`` new tokens (one head of size 2), K/V filled with ``value``."""
    q = torch.arange(2.0 * n).view(n, 1, 2)
    return q, torch.full((n, 1, 2), value), torch.full((n, 1, 2), value + 1)


class TestStaleBatch:
    def test_error_stale_batch_cannot_write_into_reused_slots(self) -> None:
        """Attention through a batch whose request was freed raises; the new owner is intact."""
        pool = reuse_pool()
        a = prefill_batch(pool, [4])
        attention(*packed(4, 5.0), kv_cache=a, layer_id=0, fwd="prefill")
        a_slots = set(a.out_cache_loc.tolist())
        pool.free(a.req_pool_indices)
        b = prefill_batch(pool, [3])
        assert set(b.out_cache_loc.tolist()) < a_slots  # reused slots
        attention(*packed(3, 7.0), kv_cache=b, layer_id=0, fwd="prefill")
        k_before = pool.k_buffer.clone()
        with pytest.raises(StaleBatchError, match=r"request row 0 was freed.*generation 1, now 2"):
            attention(*packed(4, 99.0), kv_cache=a, layer_id=0, fwd="prefill")
        for use in (lambda: a.pool, lambda: a.out_cache_loc, lambda: a.kv_indices, a.check):
            with pytest.raises(StaleBatchError):
                use()
        torch.testing.assert_close(pool.k_buffer, k_before)
        assert not pool.k_buffer.eq(99.0).any()

        # B's next decode step sees B's keys only, exactly as in a pool A never used.
        got = attention(*packed(1, 1.0), kv_cache=decode_batch(pool, b.req_pool_indices),
                        layer_id=0, fwd="decode")
        fresh = reuse_pool()
        only_b = prefill_batch(fresh, [3])
        attention(*packed(3, 7.0), kv_cache=only_b, layer_id=0, fwd="prefill")
        want = attention(*packed(1, 1.0), kv_cache=decode_batch(fresh, only_b.req_pool_indices),
                         layer_id=0, fwd="decode")
        torch.testing.assert_close(got, want)

    def test_error_double_free_raises_and_keeps_the_new_owner(self) -> None:
        """Freeing a stale batch again raises instead of freeing the request now in its row."""
        pool = reuse_pool()
        a = prefill_batch(pool, [3])
        pool.free(a.req_pool_indices)
        b = prefill_batch(pool, [3])
        with pytest.raises(StaleBatchError, match="stale PagedBatch"):
            pool.free(a.req_pool_indices)
        row = int(b.req_pool_indices[0])
        assert pool.context_len(row) == 3 and free_counts(pool) == (1, 0)

    def test_free_takes_a_batch_and_checks_it(self) -> None:
        """free(batch) releases the batch's requests; freeing the batch again raises."""
        pool = make_pool()
        a = prefill_batch(pool, [3, 2])
        pool.free(a)
        assert free_counts(pool) == (31, 4)
        b = prefill_batch(pool, [1, 1, 1, 1])
        with pytest.raises(StaleBatchError, match="stale PagedBatch"):
            pool.free(a)
        assert free_counts(pool) == (27, 0)
        pool.free(b)
        assert free_counts(pool) == (31, 4)

    def test_error_stale_batch_cannot_decode_or_extend(self) -> None:
        """A stale batch's rows cannot be grown, whether or not the row was reused."""
        pool = reuse_pool()
        a = prefill_batch(pool, [1])
        pool.free(a.req_pool_indices)
        with pytest.raises(StaleBatchError, match=r"generation 1, now free"):
            decode_batch(pool, a.req_pool_indices)
        b = prefill_batch(pool, [1])
        with pytest.raises(StaleBatchError, match=r"generation 1, now 2"):
            extend_batch(pool, a.req_pool_indices, [1])
        assert pool.context_len(int(b.req_pool_indices[0])) == 1

    def test_batch_stays_valid_while_its_requests_live(self) -> None:
        """Freeing other requests, or growing its own, does not make a batch stale."""
        pool = make_pool()
        a = prefill_batch(pool, [3, 2])
        other = prefill_batch(pool, [4])
        decode_batch(pool, a.req_pool_indices)
        pool.free(other.req_pool_indices)
        prefill_batch(pool, [2])
        a.check()
        assert a.pool is pool and a.kv_indices.numel() == 5
        qkv = torch.randn(3, 5, 2, 4).unbind(0)
        out = attention(*qkv, kv_cache=a, layer_id=1, fwd="prefill")
        assert out.shape == (5, 8)

    def test_error_type_is_value_error_and_library_error(self) -> None:
        """StaleBatchError is a ValueError and an AstraiError, and pickles."""
        pool = reuse_pool()
        a = prefill_batch(pool, [1])
        pool.free(a.req_pool_indices)
        with pytest.raises(StaleBatchError) as info:
            a.check()
        err = info.value
        assert isinstance(err, ValueError) and isinstance(err, AstraiError)
        assert str(pickle.loads(pickle.dumps(err))) == str(err)
