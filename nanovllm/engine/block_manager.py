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


class BlockManager:
    """Hands out KV blocks to sequences, and owns their block_tables, num_cached_tokens and
    num_computed_tokens while they hold blocks (allocate sets them, deallocate clears them).

    A sequence holds one block table per KV group (engine/kv_groups.py), all of equal length and all
    drawn from one free list; a group with a window hands back the blocks the window has passed.

    NOTE: block_size is this engine's alone; a Sequence carries none, so another engine in the same
    process with another block size cannot change this one's block math.
    NOTE: a freed block keeps its hash and stays in the table until it is handed out again, so a
    later request with the same prefix still hits it. Free blocks are reused oldest-freed first.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 windows: list[int | None] | None = None, num_state_slots: int = 0):
        """windows: each KV group's sliding window (None: full attention); default one full group.
        num_state_slots: linear-attention state slots (layers/gated_deltanet.py), one per sequence
        holding blocks; a sequence is admitted only with a free one."""
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = list(windows) if windows else [None]
        self.blocks = [Block(i) for i in range(num_blocks)]
        # (group, hash) -> block id: the same tokens' K/V differ between groups' layers.
        self.hash_to_block_id: dict[tuple[int, int], int] = {}
        self.free_block_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        # Parallel to each of seq's block tables: the hash of each full, registered block of the sequence.
        self.seq_block_hashes: dict[int, list[int]] = {}
        self.num_state_slots = num_state_slots
        self.free_state_slots: list[int] = list(range(num_state_slots))

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def window(self) -> int | None:
        """The window every layer slides over, when all do (one group, Mistral's)."""
        return self.windows[0] if self.num_groups == 1 else None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def num_blocks_of(self, seq: Sequence) -> int:
        """Blocks that hold all len(seq) tokens of seq (in each group's table)."""
        return -(-len(seq) // self.block_size)

    def block_token_ids(self, seq: Sequence, i: int) -> list[int]:
        """Token ids of seq's i-th block (the last one may be partial)."""
        assert 0 <= i < self.num_blocks_of(seq)
        return seq.token_ids[i * self.block_size: (i + 1) * self.block_size]

    def first_needed_block(self, group: int, num_computed: int) -> int:
        """The first block of a group's table that a query at position num_computed or later can see."""
        window = self.windows[group]
        if window is None:
            return 0
        return max(0, num_computed - window + 1) // self.block_size

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block_id.get((block.group, block.hash)) == block_id:
            del self.hash_to_block_id[(block.group, block.hash)]
        block.clear_hash()
        block.ref_count = 1
        return block_id

    def _lookup(self, group: int, h: int, parent_hash: int | None, token_ids: list[int]) -> int | None:
        block_id = self.hash_to_block_id.get((group, h))
        if block_id is None:
            return None
        block = self.blocks[block_id]
        # Verify: a hash collision must never hand out another prefix's K/V.
        if block.hash != h or block.parent_hash != parent_hash or block.token_ids != tuple(token_ids):
            return None
        return block_id

    def _cached_prefix(self, seq: Sequence) -> tuple[int, list[int], list[list[int | None]]]:
        """(blocks hit, their hashes, each group's cached block id per leading block or None): the
        longest run of leading full blocks whose K/V every group has where its layers read them (a
        full group: all of them; a sliding group: the ones its window sees from the first uncached
        position)."""
        if not self.enable_prefix_caching or needs_prompt_logits(seq):
            # NOTE: prompt logprobs need the logits of every prompt position, so none may be skipped.
            return 0, [], []
        full = [g for g, w in enumerate(self.windows) if w is None]
        hashes: list[int] = []
        found: list[list[int | None]] = [[] for _ in self.windows]
        parent = None
        # NOTE: at least one token must be computed to get logits: when every block would hit, the
        # last one is recomputed into a fresh block rather than written into a shared one.
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = self.block_token_ids(seq, i)
            h = compute_block_hash(tokens, parent)
            ids = [self._lookup(g, h, parent, tokens) for g in range(self.num_groups)]
            if any(ids[g] is None for g in full):
                break
            hashes.append(h)
            for g, block_id in enumerate(ids):
                found[g].append(block_id)
            parent = h
        for n in range(len(hashes), 0, -1):
            if all(b is not None for g in range(self.num_groups)
                   for b in found[g][self.first_needed_block(g, n * self.block_size): n]):
                return n, hashes[:n], found
        return 0, [], found

    def num_blocks_to_allocate(self, seq: Sequence) -> int:
        """How many blocks allocate(seq) would take off the free list."""
        n, _, found = self._cached_prefix(seq)
        total = 0
        for g in range(self.num_groups):
            hits = found[g][self.first_needed_block(g, n * self.block_size): n] if n else []
            total += self.num_blocks_of(seq) - n + sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return total

    def can_allocate(self, seq: Sequence) -> bool:
        if self.num_state_slots and not self.free_state_slots:
            return False
        return self.num_blocks_to_allocate(seq) <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give seq blocks for all its tokens in every group, reusing cached prefix blocks."""
        assert not seq.block_table
        n, hashes, found = self._cached_prefix(seq)
        tables = []
        for g in range(self.num_groups):
            first = self.first_needed_block(g, n * self.block_size) if n else 0
            table = []
            for block_id in found[g][first:n] if n else []:
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self.free_block_ids[block_id]
                block.ref_count += 1
                table.append(block_id)
            table += [self._take_free_block() for _ in range(self.num_blocks_of(seq) - n)]
            # A window's leading blocks no query will read again: stand-ins (the first held block),
            # counted as released like those release_behind_window hands back.
            tables.append([table[0]] * first + table)
        seq.block_tables = tables
        if self.num_state_slots:
            # NOTE: the slot's old contents are never read: the sequence's first step starts from zero state.
            seq.state_slot = self.free_state_slots.pop()
        # NOTE: every sliding group has the same window, hence the same leading count.
        seq.num_released_blocks = max(self.first_needed_block(g, n * self.block_size) if n else 0
                                      for g in range(self.num_groups))
        self.seq_block_hashes[seq.seq_id] = hashes
        seq.num_cached_tokens = n * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens

    def deallocate(self, seq: Sequence) -> None:
        """Free seq's blocks and forget its cache state (finish, abort, preemption): a later
        allocate() starts it from scratch, reusing whatever prefix blocks are still cached."""
        for g, table in enumerate(seq.block_tables):
            first = seq.num_released_blocks if self.windows[g] is not None else 0
            for block_id in reversed(table[first:]):
                self._release(block_id)
        self.seq_block_hashes.pop(seq.seq_id, None)
        if seq.state_slot is not None:
            self.free_state_slots.append(seq.state_slot)
            seq.state_slot = None
        seq.block_tables = [[]]
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
        """Hand back the blocks of seq's sliding groups that no query from its next position on can
        see (every token in them is window or more positions back)."""
        windowed = [g for g, w in enumerate(self.windows) if w is not None]
        if not windowed or not seq.block_table:
            return
        first_kept = min(self.first_needed_block(windowed[0], seq.num_computed_tokens), len(seq.block_table))
        for g in windowed:
            for block_id in seq.block_tables[g][seq.num_released_blocks:first_kept]:
                self._release(block_id)
        seq.num_released_blocks = max(seq.num_released_blocks, first_kept)

    def blocks_held_at_most(self, prompt_len: int, num_tokens: int) -> int:
        """The most blocks a sequence of a prompt_len-token prompt grown to num_tokens holds at
        once: its whole prompt in every group at admission, then each sliding group only its
        window's blocks and the one being written."""
        def held(n: int) -> int:
            whole = -(-n // self.block_size)
            return sum(whole if w is None else min(whole, -(-w // self.block_size) + 2) for w in self.windows)
        return max(self.num_groups * -(-prompt_len // self.block_size), held(num_tokens))

    def can_append(self, seq: Sequence, lookahead: int = 0) -> bool:
        """Whether the next decode step (computing token len(seq)-1, and lookahead proposed tokens
        after it) finds its slots."""
        needed = -(-(len(seq) + lookahead) // self.block_size) - len(seq.block_table)
        return needed <= 0 or self.num_free_blocks >= needed * self.num_groups

    def may_append(self, seq: Sequence, lookahead: int = 0) -> None:
        """Blocks for seq's tokens and lookahead slots past them (proposals under verification:
        slots whose K/V a rejected proposal leaves are overwritten later, never hashed before)."""
        while len(seq.block_table) * self.block_size < len(seq) + lookahead:
            for table in seq.block_tables:
                table.append(self._take_free_block())

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
            for g, table in enumerate(seq.block_tables):
                block = self.blocks[table[i]]
                if block.hash is None:
                    block.set_hash(h, parent, tokens, g)
                    self.hash_to_block_id[(g, h)] = block.block_id
            hashes.append(h)
