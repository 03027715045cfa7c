"""BlockPool: the paged KV cache's blocks (vLLM v1's block pool): the free queue in eviction order
(oldest freed first), ref counts, and the prefix-cache table of hashed blocks, each hit verified
against the block's token ids. The KV cache manager (kv_cache_manager.py) draws from it and never
touches a block's fields itself. A hashed block taken for new tokens is evicted: `on_evict` sees it
first (the seat of a tier under the prefix cache that keeps evicted blocks outside RAM)."""
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import xxhash


def compute_block_hash(token_ids: list[int], parent_hash: int | None) -> int:
    """Chained xxhash64 of one full block: the parent block's hash, then this block's token ids."""
    h = xxhash.xxh64()
    if parent_hash is not None:
        h.update(parent_hash.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


class Block:
    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.parent_hash: int | None = None
        self.token_ids: tuple[int, ...] = ()
        self.group = 0  # the KV group whose K/V the hashed block holds

    def set_hash(self, h: int, parent_hash: int | None, token_ids: list[int], group: int) -> None:
        self.hash = h
        self.parent_hash = parent_hash
        self.token_ids = tuple(token_ids)
        self.group = group

    def clear_hash(self) -> None:
        self.hash = None
        self.parent_hash = None
        self.token_ids = ()


class BlockPool:
    """num_blocks blocks. NOTE: a freed block keeps its hash and stays in the table until it is
    handed out again, so a later request with the same prefix still hits it."""

    def __init__(self, num_blocks: int, on_evict: Callable[[Block], None] | None = None):
        assert num_blocks > 0
        self.blocks = [Block(i) for i in range(num_blocks)]
        # (group, hash) -> block id: the same tokens' K/V differ between groups' layers.
        self.hash_to_block_id: dict[tuple[int, int], int] = {}
        self.free_block_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.on_evict = on_evict

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def take_free_block(self) -> int:
        """The oldest freed block, for new tokens (its hash, if any, evicted); its ref count 1."""
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block_id.get((block.group, block.hash)) == block_id:
            if self.on_evict is not None:
                self.on_evict(block)
            del self.hash_to_block_id[(block.group, block.hash)]
        block.clear_hash()
        block.ref_count = 1
        return block_id

    def reuse(self, block_id: int) -> None:
        """One more sequence holds a cached block (taken off the free queue if none did)."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_block_ids[block_id]
        block.ref_count += 1

    def release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0
        if block.ref_count == 0:
            self.free_block_ids[block_id] = None  # its hash kept: a later prefix may still hit it

    def is_free(self, block_id: int) -> bool:
        return self.blocks[block_id].ref_count == 0

    def lookup(self, group: int, h: int, parent_hash: int | None, token_ids: list[int]) -> int | None:
        """The cached block of a group holding these tokens after this parent, or None."""
        block_id = self.hash_to_block_id.get((group, h))
        if block_id is None:
            return None
        block = self.blocks[block_id]
        # Verify: a hash collision must never hand out another prefix's K/V.
        if block.hash != h or block.parent_hash != parent_hash or block.token_ids != tuple(token_ids):
            return None
        return block_id

    def cache(self, block_id: int, h: int, parent_hash: int | None, token_ids: list[int], group: int) -> None:
        """Register a block whose K/V are computed under its hash (a block already hashed keeps its own)."""
        block = self.blocks[block_id]
        if block.hash is None:
            block.set_hash(h, parent_hash, token_ids, group)
            self.hash_to_block_id[(group, h)] = block_id
