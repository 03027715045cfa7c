"""BlockManager: the paged KV cache's bookkeeping (free list, ref counts, prefix-cache hash table)
and all block arithmetic of a sequence. The Scheduler calls it; it never touches tensors.
A block is hashed only once its K/V are computed.
"""
from collections import OrderedDict

import numpy as np
import xxhash

from nanovllm.engine.sequence import Sequence


def needs_prompt_logits(seq: Sequence) -> bool:
    """Whether seq's prefill still owes prompt logprobs: asked for, and no token sampled yet (a
    sequence recomputed after preemption already returned them)."""
    return seq.sampling_params.prompt_logprobs is not None and seq.num_completion_tokens == 0


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

    def set_hash(self, h: int, parent_hash: int | None, token_ids: list[int]) -> None:
        self.hash = h
        self.parent_hash = parent_hash
        self.token_ids = tuple(token_ids)

    def clear_hash(self) -> None:
        self.hash = None
        self.parent_hash = None
        self.token_ids = ()


class BlockManager:
    """Hands out KV blocks to sequences, and owns their block_table, num_cached_tokens and
    num_computed_tokens while they hold blocks (allocate sets them, deallocate clears them).

    NOTE: block_size is this engine's alone; a Sequence carries none, so another engine in the same
    process with another block size cannot change this one's block math.
    NOTE: a freed block keeps its hash and stays in the table until it is handed out again, so a
    later request with the same prefix still hits it. Free blocks are reused oldest-freed first.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int | None = None):
        """window: every layer of the model attends over at most this many tokens (a sliding window
        on all of them, Mistral's): a sequence's blocks wholly before it are handed back as it grows."""
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        # Parallel to seq.block_table: the hash of each full, registered block of the sequence.
        self.seq_block_hashes: dict[int, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def num_blocks_of(self, seq: Sequence) -> int:
        """Blocks that hold all len(seq) tokens of seq."""
        return -(-len(seq) // self.block_size)

    def block_token_ids(self, seq: Sequence, i: int) -> list[int]:
        """Token ids of seq's i-th block (the last one may be partial)."""
        assert 0 <= i < self.num_blocks_of(seq)
        return seq.token_ids[i * self.block_size: (i + 1) * self.block_size]

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        block.clear_hash()
        block.ref_count = 1
        return block_id

    def _lookup(self, h: int, parent_hash: int | None, token_ids: list[int]) -> int | None:
        block_id = self.hash_to_block_id.get(h)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        # Verify: a hash collision must never hand out another prefix's K/V.
        if block.hash != h or block.parent_hash != parent_hash or block.token_ids != tuple(token_ids):
            return None
        return block_id

    def _cached_prefix(self, seq: Sequence) -> list[tuple[int, int]]:
        """(block_id, hash) of the leading full blocks of seq already in the cache."""
        if not self.enable_prefix_caching or needs_prompt_logits(seq):
            # NOTE: prompt logprobs need the logits of every prompt position, so none may be skipped.
            return []
        hits: list[tuple[int, int]] = []
        parent = None
        for i in range(seq.num_tokens // self.block_size):
            tokens = self.block_token_ids(seq, i)
            h = compute_block_hash(tokens, parent)
            block_id = self._lookup(h, parent, tokens)
            if block_id is None:
                break
            hits.append((block_id, h))
            parent = h
        # NOTE: at least one token must be computed to get logits: when every block hits, the last
        # one is recomputed into a fresh block rather than written into a shared one.
        if hits and len(hits) * self.block_size >= seq.num_tokens:
            hits.pop()
        return hits

    def num_blocks_to_allocate(self, seq: Sequence) -> int:
        """How many blocks allocate(seq) would take off the free list."""
        hits = self._cached_prefix(seq)
        hit_free = sum(1 for block_id, _ in hits if self.blocks[block_id].ref_count == 0)
        return self.num_blocks_of(seq) - len(hits) + hit_free

    def can_allocate(self, seq: Sequence) -> bool:
        return self.num_blocks_to_allocate(seq) <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give seq blocks for all its tokens, reusing cached prefix blocks."""
        assert not seq.block_table
        hits = self._cached_prefix(seq)
        hashes = []
        for block_id, h in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            hashes.append(h)
        for _ in range(self.num_blocks_of(seq) - len(hits)):
            seq.block_table.append(self._take_free_block())
        self.seq_block_hashes[seq.seq_id] = hashes
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens

    def deallocate(self, seq: Sequence) -> None:
        """Free seq's blocks and forget its cache state (finish, abort, preemption): a later
        allocate() starts it from scratch, reusing whatever prefix blocks are still cached."""
        for block_id in reversed(seq.block_table[seq.num_released_blocks:]):
            self._release(block_id)
        self.seq_block_hashes.pop(seq.seq_id, None)
        seq.block_table = []
        seq.num_released_blocks = 0
        seq.num_cached_tokens = 0
        seq.num_computed_tokens = 0

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0
        if block.ref_count == 0:
            self.free_block_ids[block_id] = None  # its hash kept: a later prefix may still hit it

    def release_behind_window(self, seq: Sequence) -> None:
        """With a window on every layer: hand back seq's blocks that no query from its next
        position on can see (every token in them is window or more positions back)."""
        if self.window is None:
            return
        first_seen = max(0, seq.num_computed_tokens - self.window + 1)
        first_kept = min(first_seen // self.block_size, len(seq.block_table))
        for block_id in seq.block_table[seq.num_released_blocks:first_kept]:
            self._release(block_id)
        seq.num_released_blocks = max(seq.num_released_blocks, first_kept)

    def blocks_held_at_most(self, num_tokens: int) -> int:
        """The most blocks a sequence of num_tokens tokens holds at once (its whole prompt at
        admission, then, with a window, the window's blocks and the one being written)."""
        whole = -(-num_tokens // self.block_size)
        if self.window is None:
            return whole
        return min(whole, -(-self.window // self.block_size) + 2)

    def can_append(self, seq: Sequence, lookahead: int = 0) -> bool:
        """Whether the next decode step (computing token len(seq)-1, and lookahead proposed tokens
        after it) finds its slots."""
        needed = -(-(len(seq) + lookahead) // self.block_size) - len(seq.block_table)
        return needed <= 0 or self.num_free_blocks >= needed

    def may_append(self, seq: Sequence, lookahead: int = 0) -> None:
        """Blocks for seq's tokens and lookahead slots past them (proposals under verification:
        slots whose K/V a rejected proposal leaves are overwritten later, never hashed before)."""
        while len(seq.block_table) * self.block_size < len(seq) + lookahead:
            seq.block_table.append(self._take_free_block())

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Hash every full block whose K/V are all computed, so later requests can reuse it."""
        if not self.enable_prefix_caching:
            return
        hashes = self.seq_block_hashes.setdefault(seq.seq_id, [])
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            tokens = self.block_token_ids(seq, i)
            h = compute_block_hash(tokens, parent)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                block.set_hash(h, parent, tokens)
                self.hash_to_block_id[h] = block.block_id
            hashes.append(h)
