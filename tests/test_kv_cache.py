"""Tests of the paged KV cache: the pool's allocator and the per-step batch metadata."""

from __future__ import annotations

import pickle

import pytest
import torch

from astrai.errors import AstraiError
from astrai.kv_cache import (
    KVCacheFullError,
    KVPool,
    PagedBatch,
    decode_batch,
    extend_batch,
    prefill_batch,
)


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
