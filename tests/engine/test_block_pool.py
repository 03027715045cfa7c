"""BlockPool (engine/block_pool.py): the free queue's order, ref counts, the verified prefix table, and
the eviction seat a second tier hangs from: a hashed block is shown to on_evict, hash and tokens
intact, just before it is handed out for other tokens; a block never hashed is not."""
from nanovllm.engine.block_pool import BlockPool, compute_block_hash
from nanovllm.engine.kv_cache_manager import KVCacheManager
from nanovllm.engine.sequence import Sequence


def test_free_queue_hands_out_the_oldest_freed_first():
    pool = BlockPool(4)
    a, b = pool.take_free_block(), pool.take_free_block()
    assert (a, b, pool.num_free_blocks) == (0, 1, 2)
    pool.release(b)
    pool.release(a)
    assert [pool.take_free_block() for _ in range(4)] == [2, 3, 1, 0]


def test_reuse_takes_a_cached_block_off_the_free_queue_once():
    pool = BlockPool(2)
    block = pool.take_free_block()
    h = compute_block_hash([1, 2], None)
    pool.cache(block, h, None, [1, 2], 0)
    pool.release(block)
    assert pool.is_free(block) and pool.lookup(0, h, None, [1, 2]) == block
    assert pool.lookup(0, h, None, [1, 3]) is None and pool.lookup(1, h, None, [1, 2]) is None
    pool.reuse(block)
    pool.reuse(block)
    assert pool.blocks[block].ref_count == 2 and pool.num_free_blocks == 1


def test_evicted_blocks_are_shown_before_they_are_overwritten():
    seen = []
    bm = KVCacheManager(2, 4, on_evict=lambda block: seen.append((block.hash, block.token_ids, block.group)))
    first = Sequence(list(range(10, 18)))  # 2 full blocks of 4
    bm.allocate(first)
    first.num_computed_tokens = 8
    bm.register_computed_blocks(first)
    hashes = list(bm.seq_block_hashes[first.seq_id])
    bm.deallocate(first)
    assert seen == []  # freed, still cached
    other = Sequence(list(range(50, 58)))
    bm.allocate(other)  # takes both blocks: both cached blocks are evicted, the last one freed first
    assert seen == [(hashes[1], tuple(range(14, 18)), 0), (hashes[0], tuple(range(10, 14)), 0)]
    bm.deallocate(other)
    bm.allocate(Sequence(list(range(60, 68))))  # the blocks were never hashed again: nothing to show
    assert len(seen) == 2
