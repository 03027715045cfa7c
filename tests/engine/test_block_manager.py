"""KVCacheManager: block math, allocation, ref counts, chained hashes, verified hits, reuse after free."""
from nanovllm.engine.block_pool import compute_block_hash
from nanovllm.engine.kv_cache_manager import KVCacheManager
from nanovllm.engine.sequence import Sequence

BS = 4


def computed(bm: KVCacheManager, seq: Sequence) -> None:
    """Pretend the step computed every token of seq, as Scheduler.postprocess would record."""
    seq.num_computed_tokens = len(seq)
    bm.register_computed_blocks(seq)


def test_block_math_is_the_managers_own():
    seq = Sequence(list(range(20)))
    small, large = KVCacheManager(8, 4), KVCacheManager(8, 16)
    assert small.num_blocks_of(seq) == 5 and small.block_token_ids(seq, 4) == [16, 17, 18, 19]
    assert large.num_blocks_of(seq) == 2 and large.block_token_ids(seq, 1) == list(range(16, 20))
    small.allocate(seq)
    assert len(seq.block_table) == 5 and large.num_blocks_of(seq) == 2  # neither sees the other's size


def test_deallocate_forgets_cache_state_and_keeps_tokens():
    bm = KVCacheManager(8, BS)
    first = Sequence([1, 2, 3, 4, 5])
    bm.allocate(first)
    computed(bm, first)
    seq = Sequence([1, 2, 3, 4, 5, 6])
    bm.allocate(seq)
    assert seq.num_cached_tokens == seq.num_computed_tokens == 4
    seq.num_computed_tokens = 6
    seq.append_token(9)
    bm.deallocate(seq)
    assert seq.token_ids == [1, 2, 3, 4, 5, 6, 9] and seq.block_table == []
    assert seq.num_cached_tokens == 0 and seq.num_computed_tokens == 0


def test_allocate_and_free_counts():
    bm = KVCacheManager(8, BS)
    seq = Sequence(list(range(10)))  # 3 blocks: 4 + 4 + 2
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert bm.num_free_blocks == 5
    assert all(bm.pool.blocks[b].ref_count == 1 for b in seq.block_table)
    bm.deallocate(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == []


def test_cannot_allocate_beyond_free():
    bm = KVCacheManager(2, BS)
    assert not bm.can_allocate(Sequence(list(range(9))))  # needs 3 blocks
    assert bm.can_allocate(Sequence(list(range(8))))


def test_hash_chains_parent():
    a = compute_block_hash([1, 2, 3, 4], None)
    assert a == compute_block_hash([1, 2, 3, 4], None)
    assert compute_block_hash([5, 6, 7, 8], a) != compute_block_hash([5, 6, 7, 8], None)
    assert compute_block_hash([5, 6, 7, 8], a) != compute_block_hash([5, 6, 7, 9], a)


def test_prefix_hit_shares_blocks_and_ref_counts():
    bm = KVCacheManager(8, BS)
    first = Sequence([1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.allocate(first)
    computed(bm, first)
    second = Sequence([1, 2, 3, 4, 5, 6, 7, 8, 42, 43])
    assert bm.num_blocks_to_allocate(second) == 1  # two full blocks hit, the third is new
    bm.allocate(second)
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] != first.block_table[2]
    assert second.num_cached_tokens == 8 and second.num_computed_tokens == 8
    assert [bm.pool.blocks[b].ref_count for b in second.block_table] == [2, 2, 1]
    bm.deallocate(first)
    assert [bm.pool.blocks[b].ref_count for b in second.block_table] == [1, 1, 1]
    bm.deallocate(second)
    assert bm.num_free_blocks == 8


def test_different_first_block_breaks_the_chain():
    bm = KVCacheManager(8, BS)
    first = Sequence([1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.allocate(first)
    computed(bm, first)
    # Same second block, different first block: no hit at all (hashes chain).
    other = Sequence([0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.num_blocks_to_allocate(other) == 3


def test_freed_blocks_stay_findable_until_reused():
    bm = KVCacheManager(4, BS)
    first = Sequence([1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.allocate(first)
    computed(bm, first)
    bm.deallocate(first)
    again = Sequence([1, 2, 3, 4, 5, 6, 7, 8, 10])
    # The two hit blocks sit on the free list: taking them still costs free blocks.
    assert bm.num_blocks_to_allocate(again) == 3
    bm.allocate(again)
    assert again.num_cached_tokens == 8
    assert again.block_table[:2] == first_table_prefix(bm, [1, 2, 3, 4, 5, 6, 7, 8])


def first_table_prefix(bm: KVCacheManager, tokens: list[int]) -> list[int]:
    h0 = compute_block_hash(tokens[:4], None)
    h1 = compute_block_hash(tokens[4:8], h0)
    return [bm.pool.hash_to_block_id[(0, h0)], bm.pool.hash_to_block_id[(0, h1)]]


def test_reused_block_loses_its_hash():
    bm = KVCacheManager(2, BS)
    first = Sequence([1, 2, 3, 4, 5, 6, 7, 8])
    bm.allocate(first)
    computed(bm, first)
    bm.deallocate(first)
    filler = Sequence([9, 9, 9, 9, 9, 9, 9, 9])  # takes both blocks, evicting the cached prefix
    bm.allocate(filler)
    assert filler.num_cached_tokens == 0
    bm.deallocate(filler)
    probe = Sequence([1, 2, 3, 4, 5])
    bm.allocate(probe)
    assert probe.num_cached_tokens == 0


def test_hit_is_verified_against_token_ids():
    bm = KVCacheManager(8, BS)
    first = Sequence([1, 2, 3, 4, 5])
    bm.allocate(first)
    computed(bm, first)
    h = compute_block_hash([1, 2, 3, 4], None)
    # Simulate a hash collision: another block's content stored under that hash.
    bm.pool.blocks[bm.pool.hash_to_block_id[(0, h)]].token_ids = (7, 7, 7, 7)
    probe = Sequence([1, 2, 3, 4, 6])
    bm.allocate(probe)
    assert probe.num_cached_tokens == 0


def test_fully_cached_prompt_still_computes_its_last_block():
    bm = KVCacheManager(8, BS)
    first = Sequence([1, 2, 3, 4, 5, 6, 7, 8])
    bm.allocate(first)
    computed(bm, first)
    same = Sequence([1, 2, 3, 4, 5, 6, 7, 8])
    bm.allocate(same)
    # Every block is cached, but the last one is recomputed in a fresh block: >= 1 query token.
    assert same.num_computed_tokens == 4 < len(same)
    assert same.block_table[0] == first.block_table[0]
    assert same.block_table[1] != first.block_table[1]


def test_no_prefix_caching_never_hits():
    bm = KVCacheManager(8, BS, enable_prefix_caching=False)
    first = Sequence([1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.allocate(first)
    computed(bm, first)
    second = Sequence([1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.allocate(second)
    assert second.num_cached_tokens == 0 and not set(first.block_table) & set(second.block_table)


def test_append_takes_a_block_only_at_a_block_boundary():
    bm = KVCacheManager(4, BS)
    seq = Sequence([1, 2, 3, 4])
    bm.allocate(seq)
    computed(bm, seq)
    seq.append_token(5)  # position 4 starts block 1
    assert bm.can_append(seq)
    bm.may_append(seq)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 2
    seq.num_computed_tokens = 5
    seq.append_token(6)  # position 5 fits in block 1
    bm.may_append(seq)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 2


def test_can_append_false_when_full():
    bm = KVCacheManager(1, BS)
    seq = Sequence([1, 2, 3, 4])
    bm.allocate(seq)
    seq.append_token(5)
    assert not bm.can_append(seq)
