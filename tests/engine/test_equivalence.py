"""Equivalence: prefix caching, chunked prefill and preemption change scheduling, never tokens.
Every variant must give the plain run's greedy tokens and leave every KV block free."""
import pytest

from nanovllm import LLM, SamplingParams
from prompt_sets import SHARED, prompts_with_shared_prefix  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def generate(path: str, prompts, **engine_kwargs):
    with LLM(path, kvcache_block_size=16, **engine_kwargs) as llm:
        first = [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        bm = llm.llm_engine.scheduler.kv_cache_manager
        assert bm.num_free_blocks == llm.llm_engine.num_kvcache_blocks, "blocks leaked after generate"
        # Second call: every shared-prefix block is now cached (SHARED[:32] entirely so).
        second = [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert bm.num_free_blocks == llm.llm_engine.num_kvcache_blocks, "blocks leaked after the cached call"
        return first, second, llm.llm_engine.scheduler.num_preemptions


@pytest.fixture(scope="module")
def plain(qwen3_gqa):
    """Reference: no prefix cache, everything in one prefill, one prompt at a time."""
    with LLM(qwen3_gqa, kvcache_block_size=16, enable_prefix_caching=False) as llm:
        return [llm.generate([p], GREEDY, use_tqdm=False)[0]["token_ids"] for p in prompts_with_shared_prefix()]


def test_prefix_cache_on_equals_off(qwen3_gqa, plain):
    first, second, _ = generate(qwen3_gqa, prompts_with_shared_prefix())
    assert first == plain
    assert second == plain


def test_prefix_cache_hits_are_counted(qwen3_gqa):
    with LLM(qwen3_gqa, kvcache_block_size=16) as llm:
        llm.generate([SHARED + [7]], GREEDY, use_tqdm=False)
        seq = llm.llm_engine.add_request(SHARED[:32], GREEDY)  # fully cached prompt
        out = llm.llm_engine.scheduler.schedule()
        # One block hit; the last (cached) block is recomputed so the step has query tokens.
        assert seq.num_cached_tokens == 16 and out.num_new_tokens == [16]
        llm.llm_engine.abort_request(seq)


def test_chunked_prefill_equals_whole(qwen3_gqa, plain):
    first, second, _ = generate(qwen3_gqa, prompts_with_shared_prefix(), max_num_batched_tokens=20,
                                max_num_seqs=4)
    assert first == plain
    assert second == plain


def test_preemption_equals_no_preemption(qwen3_gqa, plain):
    # 2 layers x K/V x 16 tokens x 2 KV heads x 32 dims x 4 bytes = 16 KiB per block; 12 blocks.
    first, second, preemptions = generate(qwen3_gqa, prompts_with_shared_prefix(), cpu_kvcache_bytes=12 * 16384)
    assert preemptions > 0
    assert first == plain
    assert second == plain


def test_mixed_max_tokens_and_batches(qwen3_gqa, plain):
    """Requests finishing at different steps do not disturb the others."""
    prompts = prompts_with_shared_prefix()
    params = [SamplingParams(temperature=0, max_tokens=24 if i % 2 else 5, ignore_eos=True)
              for i in range(len(prompts))]
    with LLM(qwen3_gqa, kvcache_block_size=16, max_num_seqs=3) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    for i, (o, ref) in enumerate(zip(outs, plain)):
        assert o["token_ids"] == ref[: params[i].max_tokens]
        assert o["finish_reason"] == "length"
