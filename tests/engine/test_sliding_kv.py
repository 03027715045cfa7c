"""KV memory under a sliding window on every layer (Mistral): a sequence's blocks behind the window
are handed back as it grows, so a cache of 6 blocks (96 tokens) runs requests of 220 tokens, two at
once, without preemption, with transformers' greedy tokens; a model with a full-attention layer
beside sliding ones (engine/kv_groups.py) frees its sliding layers' blocks while the full layer
keeps its own, and refuses up front a request whose full-layer blocks do not fit."""
import random

import pytest

from helpers import check_tokens_close, hf_greedy
from nanovllm import LLM, SamplingParams

BLOCK, NUM_BLOCKS, NEW = 16, 6, 200


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> str:
    from sliding_checkpoints import make_checkpoint
    return make_checkpoint("mistral", str(tmp_path_factory.mktemp("mistral")))


def small_cache_llm(path: str) -> LLM:
    from tp_workloads import kv_block_bytes
    return LLM(path, dtype="float32", kv_cache_dtype="float32", kvcache_block_size=BLOCK, max_model_len=512,
               cpu_kvcache_bytes=NUM_BLOCKS * kv_block_bytes(path, 1))


def test_blocks_behind_the_window_are_freed(mistral):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(20)] for _ in range(2)]
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    with small_cache_llm(mistral) as llm:
        assert llm.llm_engine.num_kvcache_blocks == NUM_BLOCKS and llm.llm_engine.scheduler.kv_cache_manager.window == 8
        held = []
        step = llm.llm_engine.step

        def spy():  # blocks held by the running sequences after each step
            out = step()
            bm = llm.llm_engine.scheduler.kv_cache_manager
            held.append(bm.num_blocks - bm.num_free_blocks)
            return out
        llm.llm_engine.step = spy
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.llm_engine.scheduler.num_preemptions == 0
        bm = llm.llm_engine.scheduler.kv_cache_manager
        assert bm.num_free_blocks == bm.num_blocks  # every block back once both finished
    assert max(held) <= 2 * 3  # each sequence: the window's block, the one being written, one between
    assert all(len(o["token_ids"]) == NEW for o in outs)  # 220 tokens each through a 96-token cache
    exact = check_tokens_close([o["token_ids"] for o in outs], hf_greedy(mistral, prompts, NEW, mask_eos=False))
    assert exact == len(prompts)


def test_sliding_layers_free_theirs_beside_a_full_layer(tmp_path):
    """Gemma 3 (sliding, full, sliding layers): the full layer keeps every block, the sliding ones
    only their window's, so the cache that holds 96 tokens of every layer runs a 190-token request;
    one that would need more of the full layer's blocks than there are is refused up front."""
    from sliding_checkpoints import make_checkpoint
    path = make_checkpoint("gemma3", str(tmp_path))
    new = 170
    prompt = [random.Random(1).randrange(3, 256) for _ in range(20)]
    with small_cache_llm(path) as llm:
        bm = llm.llm_engine.scheduler.kv_cache_manager
        assert bm.windows == [None, 8, 8]  # a block table per layer: blocks of one layer each
        assert llm.llm_engine.num_kvcache_blocks == 3 * NUM_BLOCKS
        from nanovllm.engine.llm_engine import startup_summary
        summary = startup_summary(llm.config, llm.llm_engine.model_runner, llm.llm_engine.num_kvcache_blocks)
        assert f"KV cache {NUM_BLOCKS * BLOCK} tokens" in summary  # its bytes' worth of every layer
        assert f"{3 * NUM_BLOCKS} blocks of {BLOCK} tokens x 1 layers" in summary
        assert "block tables: 1 of full layers, 2 of window-8 layers" in summary
        held, step = [], llm.llm_engine.step

        def spy():
            out = step()
            seqs = list(llm.llm_engine.scheduler.running)
            if seqs:
                seq = seqs[0]
                live = [len({b for b in table[seq.num_released_blocks if g else 0:]})
                        for g, table in enumerate(seq.block_tables)]
                held.append((bm.num_blocks - bm.num_free_blocks, live))
            return out
        llm.llm_engine.step = spy
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=new, ignore_eos=True),
                           use_tqdm=False)[0]
        assert llm.llm_engine.scheduler.num_preemptions == 0 and bm.num_free_blocks == bm.num_blocks
        with pytest.raises(ValueError, match="KV cache blocks"):  # 250 tokens: 16 blocks of the full layer
            llm.generate([prompt], SamplingParams(max_tokens=230, ignore_eos=True), use_tqdm=False)
    assert len(out["token_ids"]) == new
    total, live = held[-1]
    assert live[0] == -(-(20 + new - 1) // BLOCK)  # the full layer: every block of the sequence
    assert max(max(live[1:]) for _, live in held) <= 3  # each sliding layer: the window's and two more
    assert max(total for total, _ in held) <= 12 + 2 * 3
    assert check_tokens_close([out["token_ids"]], hf_greedy(path, [prompt], new, mask_eos=False)) == 1
