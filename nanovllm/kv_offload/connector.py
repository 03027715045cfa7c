"""TierConnector: the engine's side of the tier, between two steps (vLLM's offloading connector). Before
a step, the sequences whose blocks the tier has read (and copied into the cache, through the
Executor's write_kv_blocks) go back to the queue; after it, the blocks hashed in it are copied out of
the cache (read_kv_blocks) and queued to be written. The scheduler and the KV cache manager never
touch the cache's tensors."""
import logging

from nanovllm.kv_offload.stores import DiskStore
from nanovllm.kv_offload.tier import KVTier

logger = logging.getLogger(__name__)

GiB = 1 << 30


def build_tier(config, executor) -> KVTier | None:
    """The tier the settings ask for, or None: none asked, or one this engine cannot use (a WARNING
    says why); ValueError for a directory it cannot write."""
    if config.kv_offloading_backend is None:
        return None
    why_not = None
    if not config.enable_prefix_caching:
        why_not = "prefix caching is off"
    elif executor.num_state_slots:
        why_not = "this model's linear-attention layers keep a state per sequence, not per block"
    elif any(group.window is not None for group in executor.kv_groups):
        why_not = "this model has sliding-window layers"
    elif config.speculative_config is not None and config.speculative_config.reads_target_block_table:
        why_not = "the draft model's KV cache shares the target's blocks"
    if why_not is not None:
        logger.warning("KV offloading is off: %s", why_not)
        return None
    from nanovllm.kv_offload.fingerprint import fingerprint
    block_bytes = executor.kv_block_bytes()
    disk = None
    if config.kv_offloading_dir is not None:
        key = fingerprint(config, executor.kv_groups, block_bytes)
        disk = DiskStore(config.kv_offloading_dir, int(config.kv_offloading_dir_size * GiB), key)
    ram = int(config.kv_offloading_size * GiB) if config.kv_offloading_size else 0
    return KVTier(block_bytes, ram, disk)


class TierConnector:
    def __init__(self, tier: KVTier, scheduler, executor):
        self.tier = tier
        self.scheduler = scheduler
        self.executor = executor
        tier.fill = executor.write_kv_blocks
        tier.block_memory = executor.kv_block_memory

    def before_step(self) -> None:
        """Hand every sequence whose read finished back to the scheduler."""
        for seq_id, num_filled in self.tier.finished_loads().items():
            self.scheduler.loaded(seq_id, num_filled)

    def after_step(self) -> None:
        """Queue the blocks the step hashed to be written (their K/V copied out now: a block may be
        handed to new tokens once its sequence ends)."""
        unsaved = self.scheduler.kv_cache_manager.take_unsaved()
        if unsaved:
            block_ids = [block_id for block_id, _ in unsaved]
            self.tier.save([key for _, key in unsaved], self.executor.read_kv_blocks(block_ids))

    def wait(self, timeout: float) -> None:
        """With only reads in flight, until one finishes (or timeout): the engine loop does not spin."""
        if self.scheduler.loading:
            self.tier.wait(timeout)

    def close(self) -> None:
        self.tier.close()
