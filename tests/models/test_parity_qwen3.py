"""End-to-end parity: the engine's greedy tokens equal HF transformers' on tiny random Qwen3
checkpoints (fp32), for a batch of mixed-length prompts, some spanning several KV blocks."""

import pytest
import torch

from helpers import check_tokens_close, hf_greedy
from nanovllm import LLM, SamplingParams
from nanovllm.kernels import cpu_kernels
from nanovllm.layers.quantization import linear_layers
from nanovllm.platforms.cpu import can_pack_weights
from prompt_sets import mixed_prompts  # noqa: E402

MAX_NEW = 40


@pytest.mark.parametrize("fixture", ["qwen3_gqa", "qwen3_bias_tied"])
def test_greedy_matches_transformers(fixture, request):
    path = request.getfixturevalue(fixture)
    prompts = mixed_prompts()
    ref = hf_greedy(path, prompts, MAX_NEW)
    with LLM(path, kvcache_block_size=16, dtype="float32") as llm:
        # On CPU the projections run on the fp32 weights held once (the C kernels at every row
        # count: 6 prompts decode on the tiles, their prefill on the outer-product path; oneDNN-packed
        # where the C kernels do not build): this parity covers that path.
        layers = linear_layers(llm.llm_engine.model_runner.model)
        expected = {"c" if cpu_kernels.load() is not None else "packed"} if can_pack_weights(torch.float32) \
            else {"dense", "transposed"}  # MKL alone
        assert layers and all(m.quant_method.kernel in expected for m in layers)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
                            use_tqdm=False)
        assert llm.llm_engine.scheduler.kv_cache_manager.num_free_blocks == llm.llm_engine.num_kvcache_blocks
    assert all(len(o["token_ids"]) == MAX_NEW for o in outs)
    exact = check_tokens_close([o["token_ids"] for o in outs], ref)
    print(f"{fixture}: {exact}/{len(prompts)} prompts matched transformers exactly")
    # fp32 on identical math: differences would only come from near-ties, so demand most exact.
    assert exact >= len(prompts) - 1


def test_text_prompts_and_eos(qwen3_gqa):
    """String prompts are tokenized with the checkpoint's tokenizer; EOS ends a request with 'stop'."""
    with LLM(qwen3_gqa, kvcache_block_size=16) as llm:
        ids = llm.tokenizer.encode("the quick brown fox")
        ref_tokens, _ = hf_greedy(qwen3_gqa, [ids], 8)[0]
        out = llm.generate(["the quick brown fox"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)[0]
        assert out["token_ids"] == ref_tokens
        assert out["text"] == llm.tokenizer.decode(ref_tokens, skip_special_tokens=True)
        # Make the first greedy token an EOS id: generation must stop there with "stop".
        llm.llm_engine.scheduler.eos_token_ids = frozenset({ref_tokens[0]})
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
        assert out["token_ids"] == [ref_tokens[0]] and out["finish_reason"] == "stop"
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
        assert out["finish_reason"] == "stop"
