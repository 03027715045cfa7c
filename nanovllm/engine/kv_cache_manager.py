"""KVCacheManager: what the Scheduler asks of the paged KV cache (vLLM v1's KV cache manager), and all
block arithmetic of a sequence. It holds a BlockPool (free queue, ref counts, the prefix-cache table;
block_pool.py), one manager per KV group's attention kind (single_type_kv_cache_manager.py) and the
recurrent-state slots (state_pool.py); it never touches tensors. A block is hashed only once its K/V
are computed. With a tier under the prefix cache (kv_offload/), the leading blocks it holds past the
cache's own hits are read back instead of prefilled: allocate() starts the read, finish_load() takes
the blocks that came back."""
from collections.abc import Callable

from nanovllm.engine.block_pool import Block, BlockPool, compute_block_hash
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.single_type_kv_cache_manager import manager_for
from nanovllm.engine.state_pool import StatePool
from nanovllm.kv_offload.block_file import BlockKey


def needs_prompt_logits(seq: Sequence) -> bool:
    """Whether seq's prefill still owes prompt logprobs: asked for, and no token sampled yet (a
    sequence recomputed after preemption already returned them)."""
    return seq.sampling_params.prompt_logprobs is not None and seq.num_completion_tokens == 0


class KVCacheManager:
    """Hands out KV blocks to sequences, and owns their block_tables, num_cached_tokens and
    num_computed_tokens while they hold blocks (allocate sets them, deallocate clears them).

    A sequence holds one block table per KV group (engine/kv_groups.py), all of equal length and all
    drawn from one pool; a group with a window hands back the blocks the window has passed.

    NOTE: block_size is this engine's alone; a Sequence carries none, so another engine in the same
    process with another block size cannot change this one's block math.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 windows: list[int | None] | None = None, num_state_slots: int = 0,
                 on_evict: Callable[[Block], None] | None = None, tier=None):
        """windows: each KV group's sliding window (None: full attention); default one full group.
        num_state_slots: the state layers' slots, one per sequence holding blocks.
        on_evict: sees each hashed block before its K/V are overwritten (block_pool.py).
        tier: a KVTier (kv_offload/tier.py) under the prefix cache, for models whose layers all attend
        in full (a window's blocks would need their own rules); None: none."""
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = list(windows) if windows else [None]
        self.managers = [manager_for(w, block_size) for w in self.windows]
        self.pool = BlockPool(num_blocks, on_evict)
        self.states = StatePool(num_state_slots)
        # Parallel to each of seq's block tables: the hash of each full, registered block of the sequence.
        self.seq_block_hashes: dict[int, list[int]] = {}
        self.tier = tier if enable_prefix_caching and all(w is None for w in self.windows) else None
        # seq_id -> the keys of its blocks being read from the tier (each block's groups in turn)
        self.loading: dict[int, list[BlockKey]] = {}
        # Blocks hashed since the connector last took them: (block id, key), to write to the tier.
        self.unsaved: list[tuple[int, BlockKey]] = []

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def window(self) -> int | None:
        """The window every layer slides over, when all do (one group, Mistral's)."""
        return self.windows[0] if self.num_groups == 1 else None

    @property
    def num_state_slots(self) -> int:
        return self.states.num_slots

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_blocks_of(self, seq: Sequence) -> int:
        """Blocks that hold all len(seq) tokens of seq (in each group's table)."""
        return -(-len(seq) // self.block_size)

    def block_token_ids(self, seq: Sequence, i: int) -> list[int]:
        """Token ids of seq's i-th block (the last one may be partial)."""
        assert 0 <= i < self.num_blocks_of(seq)
        return seq.token_ids[i * self.block_size: (i + 1) * self.block_size]

    def first_needed_block(self, group: int, num_computed: int) -> int:
        """The first block of a group's table that a query at position num_computed or later can see."""
        return self.managers[group].first_needed_block(num_computed)

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
        parent = seq.cache_salt
        # NOTE: at least one token must be computed to get logits: when every block would hit, the
        # last one is recomputed into a fresh block rather than written into a shared one.
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = self.block_token_ids(seq, i)
            h = compute_block_hash(tokens, parent)
            ids = [self.pool.lookup(g, h, parent, tokens) for g in range(self.num_groups)]
            if any(ids[g] is None for g in full):
                break
            hashes.append(h)
            for g, block_id in enumerate(ids):
                found[g].append(block_id)
            parent = h
        # Backward from the longest full-attention hit: the first length whose blocks every sliding
        # group's window needs are cached too (a window may have lost a block the full groups kept).
        for n in range(len(hashes), 0, -1):
            if all(b is not None for g in range(self.num_groups)
                   for b in found[g][self.first_needed_block(g, n * self.block_size): n]):
                return n, hashes[:n], found
        return 0, [], found

    def _tier_prefix(self, seq: Sequence, n: int, hashes: list[int]) -> list[list[BlockKey]]:
        """Past the cache's n hit blocks, each leading full block the tier holds in every group: its
        groups' keys. The same rule as the cache's: the last block is always computed."""
        keys: list[list[BlockKey]] = []
        parent = hashes[-1] if hashes else seq.cache_salt
        for i in range(n, (seq.num_tokens - 1) // self.block_size):
            tokens = self.block_token_ids(seq, i)
            h = compute_block_hash(tokens, parent)
            block = [BlockKey(g, h, parent, tuple(tokens)) for g in range(self.num_groups)]
            if not all(self.tier.contains(key) for key in block):
                break
            keys.append(block)
            parent = h
        return keys

    def num_blocks_to_allocate(self, seq: Sequence) -> int:
        """How many blocks allocate(seq) would take off the free queue."""
        n, _, found = self._cached_prefix(seq)
        total = 0
        for g in range(self.num_groups):
            hits = found[g][self.first_needed_block(g, n * self.block_size): n] if n else []
            total += self.num_blocks_of(seq) - n + sum(1 for b in hits if self.pool.is_free(b))
        return total

    def can_allocate(self, seq: Sequence) -> bool:
        return self.states.can_take() and self.num_blocks_to_allocate(seq) <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> bool:
        """Give seq blocks for all its tokens in every group, reusing cached prefix blocks. Returns
        whether the blocks after them are being read from the tier (seq then waits for finish_load)."""
        assert not seq.block_table
        n, hashes, found = self._cached_prefix(seq)
        tables = []
        for g in range(self.num_groups):
            first = self.first_needed_block(g, n * self.block_size) if n else 0
            table = []
            for block_id in found[g][first:n] if n else []:
                self.pool.reuse(block_id)
                table.append(block_id)
            table += [self.pool.take_free_block() for _ in range(self.num_blocks_of(seq) - n)]
            # A window's leading blocks no query will read again: stand-ins (the first held block),
            # counted as released like those release_behind_window hands back.
            tables.append([table[0]] * first + table)
        seq.block_tables = tables
        seq.state_slot = self.states.take()
        # NOTE: every sliding group has the same window, hence the same leading count.
        seq.num_released_blocks = max(self.first_needed_block(g, n * self.block_size) if n else 0
                                      for g in range(self.num_groups))
        self.seq_block_hashes[seq.seq_id] = hashes
        seq.num_cached_tokens = n * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens
        if seq.num_completion_tokens == 0:
            seq.num_cached_prompt_tokens = seq.num_cached_tokens
        if self.tier is None or needs_prompt_logits(seq):
            return False
        keys = self._tier_prefix(seq, n, hashes)
        self.tier.stats.query_tokens += ((seq.num_tokens - 1) // self.block_size - n) * self.block_size
        if not keys:
            return False
        self.loading[seq.seq_id] = [key for block in keys for key in block]
        block_ids = [seq.block_tables[g][i] for i in range(n, n + len(keys)) for g in range(self.num_groups)]
        self.tier.start_load(seq.seq_id, self.loading[seq.seq_id], block_ids)
        return True

    def finish_load(self, seq: Sequence, num_keys: int) -> None:
        """The tier filled seq's blocks of its first num_keys keys: those blocks (whole ones only)
        are registered as computed."""
        keys = self.loading.pop(seq.seq_id)
        num_blocks = min(num_keys, len(keys)) // self.num_groups
        hashes = self.seq_block_hashes[seq.seq_id]
        first = len(hashes)
        for i in range(first, first + num_blocks):
            block = keys[(i - first) * self.num_groups:(i - first + 1) * self.num_groups]
            for g, key in enumerate(block):
                self.pool.cache(seq.block_tables[g][i], key.hash, key.parent_hash, list(key.token_ids), g)
            hashes.append(block[0].hash)
        seq.num_cached_tokens += num_blocks * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens
        if seq.num_completion_tokens == 0:
            seq.num_cached_prompt_tokens = seq.num_cached_tokens
        self.tier.stats.hit_tokens += num_blocks * self.block_size

    def take_unsaved(self) -> list[tuple[int, BlockKey]]:
        """The blocks hashed since the last call, for the tier (each with its key)."""
        unsaved, self.unsaved = self.unsaved, []
        return unsaved

    def deallocate(self, seq: Sequence) -> None:
        """Free seq's blocks and forget its cache state (finish, abort, preemption): a later
        allocate() starts it from scratch, reusing whatever prefix blocks are still cached."""
        for g, table in enumerate(seq.block_tables):
            first = seq.num_released_blocks if self.windows[g] is not None else 0
            for block_id in reversed(table[first:]):
                self.pool.release(block_id)
        if self.loading.pop(seq.seq_id, None) is not None:
            self.tier.cancel(seq.seq_id)
        self.seq_block_hashes.pop(seq.seq_id, None)
        self.states.free(seq.state_slot)
        seq.state_slot = None
        seq.block_tables = [[]]
        seq.num_released_blocks = 0
        seq.num_cached_tokens = 0
        seq.num_computed_tokens = 0

    def release_behind_window(self, seq: Sequence) -> None:
        """Hand back the blocks of seq's sliding groups that no query from its next position on can
        see (every token in them is window or more positions back)."""
        windowed = [g for g, w in enumerate(self.windows) if w is not None]
        if not windowed or not seq.block_table:
            return
        first_kept = min(self.first_needed_block(windowed[0], seq.num_computed_tokens), len(seq.block_table))
        for g in windowed:
            for block_id in seq.block_tables[g][seq.num_released_blocks:first_kept]:
                self.pool.release(block_id)
        seq.num_released_blocks = max(seq.num_released_blocks, first_kept)

    def blocks_held_at_most(self, prompt_len: int, num_tokens: int) -> int:
        """The most blocks a sequence of a prompt_len-token prompt grown to num_tokens holds at
        once: its whole prompt in every group at admission, then each sliding group only its
        window's blocks and the one being written."""
        held = sum(manager.blocks_held(num_tokens) for manager in self.managers)
        return max(self.num_groups * -(-prompt_len // self.block_size), held)

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
                table.append(self.pool.take_free_block())

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Hash every full block whose K/V are all computed, so later requests can reuse it."""
        if not self.enable_prefix_caching:
            return
        hashes = self.seq_block_hashes.setdefault(seq.seq_id, [])
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else seq.cache_salt
            tokens = self.block_token_ids(seq, i)
            h = compute_block_hash(tokens, parent)
            for g, table in enumerate(seq.block_tables):
                self.pool.cache(table[i], h, parent, tokens, g)
                if self.tier is not None:
                    self.unsaved.append((table[i], BlockKey(g, h, parent, tuple(tokens))))
            hashes.append(h)
