"""KV groups (engine/kv_groups.py) and the KVCacheManager's block table per group: which layers share a
table, a sliding group's blocks handed back behind its window while the full group keeps its own,
prefix-cache hits per group (a hit needs the window's blocks, never another group's), counted by hand."""
from nanovllm.engine.kv_cache_manager import KVCacheManager
from nanovllm.engine.kv_groups import KVGroup, kv_groups, slots_per_block
from nanovllm.engine.sequence import Sequence

BS, W = 4, 6  # a query at position p sees p - 5 .. p: from position 9 on, block 0 is out of sight


def test_one_kind_of_layer_is_one_group():
    assert kv_groups([None] * 4) == [KVGroup(None, (0, 1, 2, 3))]
    assert kv_groups([8] * 3) == [KVGroup(8, (0, 1, 2))]  # Mistral: every layer slides
    assert kv_groups([8, None, 8], split=False) == [KVGroup(None, (0, 1, 2))]  # a draft reads one table


def test_mixed_layers_make_groups_of_the_smallest_kind():
    gemma3 = [512] * 5 + [None] + [512] * 5 + [None]  # five sliding per full layer
    groups = kv_groups(gemma3)
    assert groups == [KVGroup(None, (5, 11)), KVGroup(512, (0, 1)), KVGroup(512, (2, 3)), KVGroup(512, (4, 6)),
                      KVGroup(512, (7, 8)), KVGroup(512, (9, 10))]
    assert slots_per_block(groups) == 2
    gpt_oss = [128, None] * 3
    assert kv_groups(gpt_oss) == [KVGroup(None, (1, 3, 5)), KVGroup(128, (0, 2, 4))]
    uneven = kv_groups([None, 8, 8, 8])  # the last group of a kind may hold fewer layers
    assert [g.layers for g in uneven] == [(0,), (1,), (2,), (3,)]
    assert [g.layers for g in kv_groups([None, None, 8, 8, 8])] == [(0, 1), (2, 3), (4,)]


def computed(bm: KVCacheManager, seq: Sequence, n: int) -> None:
    """As the scheduler's postprocess: n more tokens computed, hashed, the window's passed blocks freed."""
    seq.num_computed_tokens += n
    bm.register_computed_blocks(seq)
    bm.release_behind_window(seq)


def test_a_sliding_group_frees_behind_its_window_and_the_full_group_keeps_all():
    bm = KVCacheManager(16, BS, windows=[None, W])
    seq = Sequence(list(range(10, 30)))  # 20 tokens: 5 blocks in each group
    assert bm.num_blocks_to_allocate(seq) == 10
    bm.allocate(seq)
    full, sliding = seq.block_tables
    assert len(full) == len(sliding) == 5 and not set(full) & set(sliding)
    computed(bm, seq, 20)  # next query at 20 sees 15..20: blocks 3 and 4 of the sliding group
    assert seq.num_released_blocks == 3
    assert bm.num_free_blocks == 16 - 5 - 2
    assert all(bm.pool.blocks[b].ref_count == 1 for b in full + sliding[3:])
    assert all(bm.pool.blocks[b].ref_count == 0 for b in sliding[:3])
    # Decode on: each group's table grows alike; the sliding group frees as the window moves.
    for token in range(30, 38):
        seq.append_token(token)
        assert bm.can_append(seq)
        bm.may_append(seq)
        computed(bm, seq, 1)
    assert len(seq.block_tables[0]) == len(seq.block_tables[1]) == 7
    held = [b for b in range(16) if bm.pool.blocks[b].ref_count]
    assert len(held) == 7 + 2  # the full group's 7, the window's 2 (next query 28 sees 23..28)
    bm.deallocate(seq)
    assert bm.num_free_blocks == 16 and all(b.ref_count == 0 for b in bm.pool.blocks)


def test_the_budget_counts_every_group():
    bm = KVCacheManager(16, BS, windows=[None, W, W])
    # 40 tokens: the full group's 10 blocks; each sliding group at most its window's 2 blocks and the two
    # around them (the window's start mid-block, the block being written).
    assert bm.blocks_held_at_most(4, 40) == 10 + 2 * 4
    assert bm.blocks_held_at_most(20, 21) == 3 * 5  # the whole prompt in each group at admission
    assert KVCacheManager(16, BS).blocks_held_at_most(4, 40) == 10
    seq = Sequence(list(range(8)))
    bm.allocate(seq)
    seq.append_token(99)
    seq.num_computed_tokens = 8
    assert bm.num_free_blocks == 16 - 6
    bm.may_append(seq)  # position 8 starts block 2 in each of the three tables
    assert bm.num_free_blocks == 16 - 9


def test_a_hit_takes_each_groups_own_blocks_and_only_the_windows_ones():
    bm = KVCacheManager(32, BS, windows=[None, W])
    prompt = list(range(100, 121))  # 21 tokens: 5 full blocks
    first = Sequence(prompt)
    bm.allocate(first)
    computed(bm, first, 21)
    full, sliding = [list(t) for t in first.block_tables]
    bm.deallocate(first)
    second = Sequence(prompt + [7])  # hits the 5 full blocks; resumes at 20, whose window starts at 15
    # Each group: 1 fresh block, and its hits off the free list (the full group's 5, the window's 2).
    assert bm.num_blocks_to_allocate(second) == (1 + 5) + (1 + 2)
    bm.allocate(second)
    assert second.num_cached_tokens == 20
    got_full, got_sliding = second.block_tables
    assert got_full[:5] == full[:5]  # the full group's own blocks, all of them
    assert got_sliding[3:5] == sliding[3:5]  # the sliding group's own, from the window's first block
    assert got_sliding[:3] == [sliding[3]] * 3  # stand-ins before it, never read
    assert second.num_released_blocks == 3
    assert not set(got_full) & set(got_sliding)
    bm.deallocate(second)
    assert bm.num_free_blocks == 32 and all(b.ref_count == 0 for b in bm.pool.blocks)


def test_no_hit_when_the_windows_blocks_were_reused():
    bm = KVCacheManager(12, BS, windows=[None, W])
    prompt = list(range(100, 117))  # 17 tokens: 4 full blocks
    first = Sequence(prompt)
    bm.allocate(first)
    computed(bm, first, 17)
    sliding = list(first.block_tables[1])
    bm.deallocate(first)
    # Another request takes the sliding group's block 3 off the free list.
    bm.pool.free_block_ids.move_to_end(sliding[3], last=False)
    bm.pool.take_free_block()
    again = Sequence(prompt + [7])
    bm.allocate(again)
    # Resuming at 16 needs the sliding blocks 2 and 3; block 3 is gone, resuming at 12 needs 1 and 2.
    assert again.num_cached_tokens == 12
    assert again.block_tables[1][1:3] == sliding[1:3]
