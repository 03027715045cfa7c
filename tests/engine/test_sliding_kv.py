"""KV memory under a sliding window on every layer (Mistral): a sequence's blocks behind the window
are handed back as it grows, so a cache of 6 blocks (96 tokens) runs requests of 220 tokens, two at
once, without preemption, with transformers' greedy tokens; a model with a full-attention layer
keeps every block and refuses such a request up front."""
import random

import pytest

from helpers import check_tokens_close, hf_greedy
from nanovllm import LLM, SamplingParams

BLOCK, NUM_BLOCKS, NEW = 16, 6, 200


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> str:
    from test_sliding_models import make_checkpoint
    return make_checkpoint("mistral", str(tmp_path_factory.mktemp("mistral")))


def small_cache_llm(path: str) -> LLM:
    from test_tp import kv_block_bytes
    return LLM(path, dtype="float32", kv_cache_dtype="float32", kvcache_block_size=BLOCK, max_model_len=512,
               cpu_kvcache_bytes=NUM_BLOCKS * kv_block_bytes(path, 1))


def test_blocks_behind_the_window_are_freed(mistral):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(20)] for _ in range(2)]
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    with small_cache_llm(mistral) as llm:
        assert llm.num_kvcache_blocks == NUM_BLOCKS and llm.scheduler.block_manager.window == 8
        held = []
        step = llm.step

        def spy():  # blocks held by the running sequences after each step
            out = step()
            bm = llm.scheduler.block_manager
            held.append(bm.num_blocks - bm.num_free_blocks)
            return out
        llm.step = spy
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.scheduler.num_preemptions == 0
        bm = llm.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks  # every block back once both finished
    assert max(held) <= 2 * 3  # each sequence: the window's block, the one being written, one between
    assert all(len(o["token_ids"]) == NEW for o in outs)  # 220 tokens each through a 96-token cache
    exact = check_tokens_close([o["token_ids"] for o in outs], hf_greedy(mistral, prompts, NEW, mask_eos=False))
    assert exact == len(prompts)


def test_a_full_attention_layer_keeps_every_block(tmp_path):
    from test_sliding_models import make_checkpoint
    path = make_checkpoint("gemma3", str(tmp_path))  # one full-attention layer
    with small_cache_llm(path) as llm:
        assert llm.scheduler.block_manager.window is None
        with pytest.raises(ValueError, match="KV cache blocks"):
            llm.generate([[5] * 20], SamplingParams(max_tokens=NEW, ignore_eos=True), use_tqdm=False)
