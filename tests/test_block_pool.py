"""Block pool bookkeeping and prefix caching, pinned with exact block ids (block_size 4)."""
import random

import pytest

from engine.core.block_pool import BlockPool, hash_block
from engine.sampling.sampling_params import SamplingParams
from engine.core.sequence import Sequence

BS = 4


def computed(pool: BlockPool, seq: Sequence, num_new_tokens: int, computed_blocks=()):
    """Allocate, pretend the forward ran, register full blocks."""
    assert pool.allocate_slots(seq, num_new_tokens, computed_blocks)
    seq.num_computed_tokens += num_new_tokens
    pool.cache_full_blocks(seq)


def ref_counts(pool: BlockPool) -> list[int]:
    return [b.ref_count for b in pool.blocks]


def free_order(pool: BlockPool) -> list[int]:
    return list(pool.free_queue)


def cached_ids(pool: BlockPool) -> list[int]:
    return sorted(b.block_id for b in pool.cached_blocks.values())


def test_allocation_order_from_fresh_pool():
    pool = BlockPool(10, BS)
    a, b = Sequence(list(range(10))), Sequence(list(range(100, 105)))
    assert pool.allocate_slots(a, 10)
    assert a.block_table == [0, 1, 2]
    assert pool.allocate_slots(b, 5)
    assert b.block_table == [3, 4]
    assert pool.num_free_blocks == 5
    assert pool.usage == pytest.approx(0.5)
    # a decode that still fits its last block takes nothing; the next one takes block 5
    a.num_computed_tokens = 10
    a.append_token(10)
    assert pool.allocate_slots(a, 1)
    assert a.block_table == [0, 1, 2]
    a.num_computed_tokens = 11
    a.append_token(11)
    assert pool.allocate_slots(a, 1)
    a.num_computed_tokens = 12
    a.append_token(12)
    assert pool.allocate_slots(a, 1)
    assert a.block_table == [0, 1, 2, 5]
    assert ref_counts(pool) == [1, 1, 1, 1, 1, 1, 0, 0, 0, 0]
    assert free_order(pool) == [6, 7, 8, 9]
    assert pool.max_tokens == 40


def test_allocate_fails_without_side_effects():
    pool = BlockPool(3, BS)
    seq = Sequence(list(range(13)))
    assert not pool.can_allocate(seq, 13)
    assert not pool.allocate_slots(seq, 13)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert pool.num_free_blocks == 3 and ref_counts(pool) == [0, 0, 0]
    assert pool.can_allocate(seq, 12)


def test_shared_prefix_ref_counts_and_free_order():
    pool = BlockPool(10, BS)
    a = Sequence(list(range(10)))
    computed(pool, a, 10)
    assert a.block_table == [0, 1, 2]
    assert cached_ids(pool) == [0, 1]          # block 2 holds 2 tokens: not cached
    b = Sequence(list(range(8)) + [100, 101, 102])
    blocks, num_cached = pool.get_computed_blocks(b)
    assert [blk.block_id for blk in blocks] == [0, 1] and num_cached == 8
    assert pool.allocate_slots(b, 3, blocks)
    assert b.block_table == [0, 1, 3]
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert ref_counts(pool) == [2, 2, 1, 1, 0, 0, 0, 0, 0, 0]

    pool.free(a)
    assert a.block_table == []
    assert ref_counts(pool) == [1, 1, 0, 1, 0, 0, 0, 0, 0, 0]
    assert free_order(pool) == [4, 5, 6, 7, 8, 9, 2]
    pool.free(b)                                # tail first: 3, then 1, then 0
    assert free_order(pool) == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]
    assert pool.num_free_blocks == 10 and pool.usage == 0.0
    assert cached_ids(pool) == [0, 1]           # free, but still cached


def test_eviction_order_lru_and_tail_first():
    pool = BlockPool(4, BS)
    a = Sequence(list(range(12)))
    computed(pool, a, 12)
    assert a.block_table == [0, 1, 2] and cached_ids(pool) == [0, 1, 2]
    pool.free(a)
    assert free_order(pool) == [3, 2, 1, 0]
    x = Sequence(list(range(200, 204)))
    assert pool.allocate_slots(x, 4)
    assert x.block_table == [3]                 # the never-used block goes first
    assert cached_ids(pool) == [0, 1, 2]
    y = Sequence(list(range(300, 304)))
    assert pool.allocate_slots(y, 4)
    assert y.block_table == [2]                 # then a's tail block, evicting its hash
    assert cached_ids(pool) == [0, 1]
    assert pool.blocks[2].block_hash is None
    again = Sequence(list(range(13)))
    blocks, num_cached = pool.get_computed_blocks(again)
    assert [blk.block_id for blk in blocks] == [0, 1] and num_cached == 8


def test_lru_across_sequences():
    pool = BlockPool(6, BS)
    a, b = Sequence(list(range(8))), Sequence(list(range(50, 58)))
    computed(pool, a, 8)
    computed(pool, b, 8)
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    pool.free(b)                                # b freed first: evicted first
    pool.free(a)
    assert free_order(pool) == [4, 5, 3, 2, 1, 0]
    c = Sequence(list(range(100, 116)))
    assert pool.allocate_slots(c, 16)
    assert c.block_table == [4, 5, 3, 2]
    assert cached_ids(pool) == [0, 1]


def test_partial_last_block_never_cached():
    pool = BlockPool(4, BS)
    seq = Sequence(list(range(6)))
    computed(pool, seq, 6)
    assert seq.block_table == [0, 1]
    assert cached_ids(pool) == [0]
    assert pool.blocks[1].block_hash is None
    assert len(seq.block_hashes) == 1
    seq.append_token(6)
    seq.append_token(7)
    computed(pool, seq, 2)
    assert cached_ids(pool) == [0, 1]
    assert seq.block_hashes == [hash_block(None, [0, 1, 2, 3]),
                                hash_block(seq.block_hashes[0], [4, 5, 6, 7])]


def test_uncomputed_full_block_not_cached():
    pool = BlockPool(4, BS)
    seq = Sequence(list(range(8)))
    assert pool.allocate_slots(seq, 6)          # a chunk of 6: block 1 is allocated, half done
    seq.num_computed_tokens = 6
    pool.cache_full_blocks(seq)
    assert cached_ids(pool) == [0]


def test_lookup_never_covers_last_token():
    pool = BlockPool(8, BS)
    a = Sequence(list(range(8)))
    computed(pool, a, 8)
    assert cached_ids(pool) == [0, 1]
    same = Sequence(list(range(8)))
    blocks, num_cached = pool.get_computed_blocks(same)
    assert [blk.block_id for blk in blocks] == [0] and num_cached == 4
    longer = Sequence(list(range(9)))
    blocks, num_cached = pool.get_computed_blocks(longer)
    assert [blk.block_id for blk in blocks] == [0, 1] and num_cached == 8
    one = Sequence([0])
    assert pool.get_computed_blocks(one) == ([], 0)


def test_chain_breaks_at_first_miss():
    pool = BlockPool(8, BS)
    computed(pool, Sequence(list(range(12))), 12)
    other = Sequence([0, 1, 2, 3, 9, 9, 9, 9] + list(range(8, 13)))   # block 2 alone matches
    blocks, num_cached = pool.get_computed_blocks(other)
    assert [blk.block_id for blk in blocks] == [0] and num_cached == 4


def test_prefix_caching_disabled():
    pool = BlockPool(8, BS, enable_prefix_caching=False)
    a = Sequence(list(range(9)))
    computed(pool, a, 9)
    assert pool.cached_blocks == {} and a.block_hashes == []
    assert pool.get_computed_blocks(Sequence(list(range(9)))) == ([], 0)
    assert pool.prefix_cache_queries == 0 and pool.prefix_cache_hits == 0


def test_prompt_logprobs_skip_the_cache():
    pool = BlockPool(8, BS)
    computed(pool, Sequence(list(range(9))), 9)
    seq = Sequence(list(range(9)), SamplingParams(prompt_logprobs=1))
    assert pool.get_computed_blocks(seq) == ([], 0)


def test_hit_and_query_counters():
    pool = BlockPool(8, BS)
    a = Sequence(list(range(10)))
    assert pool.get_computed_blocks(a) == ([], 0)
    assert (pool.prefix_cache_queries, pool.prefix_cache_hits) == (0, 0)  # a lookup alone
    pool.record_lookup(a, 0)
    assert (pool.prefix_cache_queries, pool.prefix_cache_hits) == (10, 0)
    computed(pool, a, 10)
    b = Sequence(list(range(9)) + [77, 78])
    blocks, num_cached = pool.get_computed_blocks(b)
    assert num_cached == 8
    pool.record_lookup(b, num_cached)
    assert (pool.prefix_cache_queries, pool.prefix_cache_hits) == (21, 8)


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(8, BS)
    a, b = Sequence(list(range(6))), Sequence(list(range(6)))
    assert pool.allocate_slots(a, 6) and pool.allocate_slots(b, 6)
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    a.num_computed_tokens = b.num_computed_tokens = 6
    pool.cache_full_blocks(a)
    pool.cache_full_blocks(b)
    assert cached_ids(pool) == [0]
    assert pool.blocks[2].block_hash is None
    assert a.block_hashes == b.block_hashes
    pool.free(a)
    pool.free(b)
    assert free_order(pool) == [4, 5, 6, 7, 1, 0, 3, 2]
    c = Sequence(list(range(5)))
    blocks, _ = pool.get_computed_blocks(c)
    assert [blk.block_id for blk in blocks] == [0]


def test_touching_evictable_blocks_counts_against_free():
    pool = BlockPool(4, BS)
    a = Sequence(list(range(9)))
    computed(pool, a, 9)
    pool.free(a)
    assert free_order(pool) == [3, 2, 1, 0]
    x, y = Sequence(list(range(200, 204))), Sequence(list(range(300, 304)))
    assert pool.allocate_slots(x, 4) and pool.allocate_slots(y, 4)
    assert (x.block_table, y.block_table) == ([3], [2])
    assert free_order(pool) == [1, 0]
    b = Sequence(list(range(8)) + [50])
    blocks, num_cached = pool.get_computed_blocks(b)
    assert [blk.block_id for blk in blocks] == [0, 1] and num_cached == 8
    # two cached blocks leave the free queue, plus one new block: 3 > 2
    assert not pool.can_allocate(b, 1, blocks)
    assert not pool.allocate_slots(b, 1, blocks)
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert free_order(pool) == [1, 0] and ref_counts(pool) == [0, 0, 1, 1]
    pool.free(y)
    assert pool.allocate_slots(b, 1, blocks)
    assert b.block_table == [0, 1, 2]
    assert ref_counts(pool) == [1, 1, 1, 1] and free_order(pool) == []


def test_shuffle_free_blocks():
    pool = BlockPool(8, BS)
    expected = list(range(8))
    random.Random(0).shuffle(expected)
    assert expected != list(range(8))
    pool.shuffle_free_blocks(random.Random(0))
    assert free_order(pool) == expected
    seq = Sequence(list(range(9)))
    assert pool.allocate_slots(seq, 9)
    assert seq.block_table == expected[:3]
    pool.free(seq)
    assert free_order(pool) == expected[3:] + expected[2::-1]


def test_reset_prefix_cache():
    pool = BlockPool(4, BS)
    a = Sequence(list(range(9)))
    computed(pool, a, 9)
    pool.free(a)
    assert cached_ids(pool) == [0, 1]
    pool.reset_prefix_cache()
    assert pool.cached_blocks == {} and all(b.block_hash is None for b in pool.blocks)
    assert pool.get_computed_blocks(Sequence(list(range(9)))) == ([], 0)
    assert pool.num_free_blocks == 4


def test_num_cached_tokens_kept_after_output():
    """A re-admission (after preemption) with output tokens does not rewrite num_cached_tokens."""
    pool = BlockPool(8, BS)
    computed(pool, Sequence(list(range(9))), 9)
    seq = Sequence(list(range(5)))
    blocks, n = pool.get_computed_blocks(seq)
    assert pool.allocate_slots(seq, 1, blocks) and seq.num_cached_tokens == 4
    pool.free(seq)
    seq.num_computed_tokens = 0
    seq.num_preemptions = 1                     # as Scheduler._preempt leaves it
    seq.append_token(5)
    seq.append_token(6)
    seq.append_token(7)
    seq.append_token(8)                         # 9 tokens now: 8 cached
    blocks, n = pool.get_computed_blocks(seq)
    assert n == 8 and pool.allocate_slots(seq, 1, blocks)
    assert seq.num_computed_tokens == 8 and seq.num_cached_tokens == 4


def test_readmission_during_prefill_is_not_a_cache_hit():
    """A sequence preempted mid-prefill finds its own blocks again: that is not a prefix hit."""
    pool = BlockPool(8, BS)
    seq = Sequence(list(range(9)))
    assert pool.allocate_slots(seq, 8)
    seq.num_computed_tokens = 8
    pool.cache_full_blocks(seq)
    pool.free(seq)
    seq.num_computed_tokens = 0
    seq.num_preemptions = 1                     # as Scheduler._preempt leaves it
    blocks, n = pool.get_computed_blocks(seq)
    assert n == 8 and pool.allocate_slots(seq, 1, blocks)
    assert seq.num_computed_tokens == 8 and seq.num_cached_tokens == 0


def test_shuffle_accepts_numpy_generator():
    np = pytest.importorskip("numpy")
    pool = BlockPool(8, BS)
    pool.shuffle_free_blocks(np.random.default_rng(3))
    assert sorted(free_order(pool)) == list(range(8)) and free_order(pool) != list(range(8))


def test_prefix_cache_cap_evicts_least_recently_freed_and_never_blocks_in_use():
    pool = BlockPool(10, BS, max_cached_blocks=2)
    a = Sequence(list(range(9)))                 # 2 full blocks + 1 token
    computed(pool, a, 9)
    assert cached_ids(pool) == a.block_table[:2]
    b = Sequence(list(range(100, 109)))
    computed(pool, b, 9)                         # cap reached, a's blocks are in use: not cached
    assert cached_ids(pool) == a.block_table[:2]
    pool.free(a)                                 # a's cached blocks become evictable
    c = Sequence(list(range(200, 209)))
    computed(pool, c, 9)
    assert len(pool.cached_blocks) == 2 and cached_ids(pool) == sorted(c.block_table[:2])
    c_table = list(c.block_table)
    pool.free(b)
    pool.free(c)
    assert list(pool.free_cached) == [i for i in free_order(pool) if pool.blocks[i].block_hash]
    d = Sequence(list(range(200, 204)) + [7, 7, 7, 7, 7])   # c's first block, then a new one
    computed(pool, d, 9, pool.get_computed_blocks(d)[0])
    assert d.block_table[0] == c_table[0] and d.num_cached_tokens == 4
    assert cached_ids(pool) == sorted(d.block_table[:2])       # c's 2nd block made room
    assert not pool.free_cached
    # uncapped, all three prefixes stay cached: the cap is what evicted a's
    pool = BlockPool(10, BS)
    for seq in (Sequence(list(range(9))), Sequence(list(range(100, 109)))):
        computed(pool, seq, 9)
    assert len(pool.cached_blocks) == 4
