"""Per-engine state: two engines with different KV block sizes share one process, their generate()
calls interleaved, and each gives transformers' greedy tokens and its own tokens when run alone."""
import pytest

from helpers import hf_greedy
from nanovllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SHARED = list(range(3, 3 + 48))  # 3 full blocks of 16, 1 full block of 32 and part of a second
BATCHES = [
    [SHARED + [200] * 5, list(range(60, 130))],  # 53 and 70 tokens: longer than a block of either size
    [SHARED + [210] * 7, list(range(140, 150))],  # reuses SHARED's cached blocks
    [list(range(60, 130)), SHARED + [220]],  # a whole prompt seen before; SHARED again
]


def make_engine(path: str, block_size: int) -> LLM:
    # 128 KiB per 64 tokens of this model (2 layers x K/V x 2 heads x 32 dims x 4 bytes x 64).
    return LLM(path, dtype="float32", kvcache_block_size=block_size, cpu_kvcache_bytes=32 * 64 * 512)


def spy_cached_tokens(llm: LLM) -> list[int]:
    """Record the num_cached_tokens of every sequence a prefill step schedules."""
    cached, schedule = [], llm.llm_engine.scheduler.schedule

    def spy():
        out = schedule()
        if out.is_prefill:
            cached.extend(seq.num_cached_tokens for seq in out.seqs)
        return out
    llm.llm_engine.scheduler.schedule = spy
    return cached


def tokens_of(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    return [o["token_ids"] for o in llm.generate(batch, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(qwen3_gqa) -> list[list[list[int]]]:
    return [[tokens for tokens, _ in hf_greedy(qwen3_gqa, batch, GREEDY.max_tokens)] for batch in BATCHES]


def test_engines_with_different_block_sizes_do_not_disturb_each_other(qwen3_gqa, reference):
    alone = {}
    for block_size in (16, 32):
        with make_engine(qwen3_gqa, block_size) as llm:
            alone[block_size] = [tokens_of(llm, batch) for batch in BATCHES]
    assert alone[16] == reference and alone[32] == reference

    small, large = make_engine(qwen3_gqa, 16), make_engine(qwen3_gqa, 32)
    try:
        cached = {16: spy_cached_tokens(small), 32: spy_cached_tokens(large)}
        together = {16: [], 32: []}
        for batch in BATCHES:  # interleaved: each engine's call lands between two of the other's
            together[16].append(tokens_of(small, batch))
            together[32].append(tokens_of(large, batch))
        for llm in (small, large):
            assert llm.llm_engine.scheduler.kv_cache_manager.num_free_blocks == llm.llm_engine.num_kvcache_blocks
    finally:
        small.exit()
        large.exit()
    assert together[16] == reference and together[32] == reference
    # Prefix-cache hits in each engine's own block size: SHARED is 3 blocks of 16, or 1 block of 32
    # (+ 16 tokens that do not fill a second); 70 cached tokens are 4 blocks of 16 or 2 of 32.
    assert 48 in cached[16] and 64 in cached[16]
    assert 32 in cached[32] and 64 in cached[32] and 48 not in cached[32]
