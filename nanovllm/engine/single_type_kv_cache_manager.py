"""One manager per attention kind (vLLM v1's single-type KV cache managers): what a KV group's layers
read of a sequence's block table. Full attention reads every block; a sliding window only the blocks
its window reaches, so the rest can go back to the pool."""


class FullAttentionManager:
    window = None

    def __init__(self, block_size: int):
        self.block_size = block_size

    def first_needed_block(self, num_computed: int) -> int:
        """The first block of the table a query at position num_computed or later can see."""
        return 0

    def blocks_held(self, num_tokens: int) -> int:
        """The most blocks a sequence of num_tokens tokens holds in this group once past its prompt."""
        return -(-num_tokens // self.block_size)


class SlidingWindowManager(FullAttentionManager):
    def __init__(self, block_size: int, window: int):
        super().__init__(block_size)
        self.window = window

    def first_needed_block(self, num_computed: int) -> int:
        return max(0, num_computed - self.window + 1) // self.block_size

    def blocks_held(self, num_tokens: int) -> int:
        # the window's blocks, the one being written and one the window straddles
        return min(super().blocks_held(num_tokens), -(-self.window // self.block_size) + 2)


def manager_for(window: int | None, block_size: int) -> FullAttentionManager:
    return FullAttentionManager(block_size) if window is None else SlidingWindowManager(block_size, window)
