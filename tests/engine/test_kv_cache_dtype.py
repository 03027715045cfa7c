"""kv_cache_dtype through the whole engine: the cache is allocated and written in the format asked
for, the budget counts that format's bytes, outputs stay within vLLM's top-5 rule of transformers
(fp32 exactly equal), and prefix-cache hits, chunked prefill and preemption read the stored format."""
import pytest
import torch

from helpers import check_tokens_close, hf_greedy
from nanovllm import LLM, SamplingParams
from nanovllm.layers.backends import kv_formats
from nanovllm.layers.backends.kv_formats import KV_FORMATS
from nanovllm.platforms.cuda import CudaPlatform
from prompt_sets import prompts_with_shared_prefix
from prompt_sets import mixed_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# Hand count for the "gqa" test shape (2 layers, 2 KV heads, head_dim 32): bytes of one head's row.
ROW_BYTES = {"float32": 128, "bfloat16": 64, "float16": 64, "int8": 34, "fp8": 32, "fp8_e4m3": 32, "fp8_e5m2": 32}
STORAGE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.uint8,
           "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@pytest.mark.parametrize("name", ["float32", "bfloat16", "int8", "fp8_e5m2"])
def test_budget_and_storage_follow_the_format(qwen3_gqa, name):
    budget = 40 * 16 * 2 * 2 * 2 * 128  # 40 fp32 blocks of 16 tokens
    with LLM(qwen3_gqa, kv_cache_dtype=name, cpu_kvcache_bytes=budget, kvcache_block_size=16) as llm:
        token_bytes = 2 * 2 * 2 * ROW_BYTES[name]  # layers x (K, V) x KV heads x row
        assert llm.llm_engine.model_runner.kv_token_bytes() == token_bytes
        assert llm.llm_engine.num_kvcache_blocks == budget // (16 * token_bytes)
        cache = llm.llm_engine.model_runner.kv_cache
        assert cache.dtype == STORAGE[name]
        assert cache.numel() * cache.element_size() == llm.llm_engine.num_kvcache_blocks * 16 * token_bytes


def layer0_rows(llm, prompt):
    """The cached K and V rows of layer 0 for prompt's tokens, as stored (bytes)."""
    seq = llm.llm_engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=4))
    llm.llm_engine.step()  # the prefill
    attn = llm.llm_engine.model_runner.attention_layers[0]
    block_size = attn.k_cache.shape[1]
    slots = torch.tensor([seq.block_table[t // block_size] * block_size + t % block_size for t in range(len(prompt))])
    rows = [(c if c.element_size() > 1 else c.view(torch.uint8)).view(-1, *c.shape[2:]).index_select(0, slots)
            for c in (attn.k_cache, attn.v_cache)]
    while not llm.llm_engine.is_finished():
        llm.llm_engine.step()
    return rows, seq


@pytest.mark.parametrize("name", ["bfloat16", "float16", "int8", "fp8_e4m3", "fp8_e5m2"])
def test_cache_holds_the_format_asked_for(qwen3_gqa, name):
    """Layer 0's K and V depend on the prompt alone: stored in `name`, they are the format's
    rounding of what an fp32 cache holds, byte for byte (a format stored as another fails here)."""
    prompt = list(range(5, 45))
    common = dict(enable_prefix_caching=False, kvcache_block_size=16)
    with LLM(qwen3_gqa, kv_cache_dtype="float32", **common) as llm:
        (k32, v32), _ = layer0_rows(llm, prompt)
    fmt = KV_FORMATS[name]
    with LLM(qwen3_gqa, kv_cache_dtype=name, **common) as llm:
        (k, v), _ = layer0_rows(llm, prompt)
    for ours, ref in ((k, k32), (v, v32)):
        expected = fmt.quantize(ref)
        expected = expected.view(torch.uint8) if expected.element_size() == 1 else expected
        assert ours.dtype == expected.dtype and torch.equal(ours.view(torch.uint8), expected.view(torch.uint8))


@pytest.fixture(scope="module")
def hf_reference(qwen3_gqa):
    return hf_greedy(qwen3_gqa, mixed_prompts(seed=5), 12)


@pytest.mark.parametrize("name", ["float32", "auto", "int8"])
def test_greedy_against_transformers(qwen3_gqa, hf_reference, name):
    with LLM(qwen3_gqa, kv_cache_dtype=name) as llm:
        outs = llm.generate(mixed_prompts(seed=5), GREEDY, use_tqdm=False)
    tokens = [o["token_ids"] for o in outs]
    if name == "float32":
        assert tokens == [ref for ref, _ in hf_reference]
    else:
        check_tokens_close(tokens, hf_reference)


def run(path, prompts, **kwargs):
    with LLM(path, kvcache_block_size=16, **kwargs) as llm:
        first = [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        second = [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]  # prefix-cache hits
        return first, second, llm.llm_engine.scheduler.num_preemptions


@pytest.mark.parametrize("name", ["int8", "bfloat16"])
def test_prefix_hits_chunks_and_preemption_read_the_stored_format(qwen3_gqa, name):
    """Outside fp32 every prefill reads the keys as stored, so a prefix-cache hit, a chunked prefill
    or a recomputation after preemption gives the tokens of one whole prefill without the cache
    (a block read in another format than written would not)."""
    prompts = prompts_with_shared_prefix()
    plain, _, _ = run(qwen3_gqa, prompts, kv_cache_dtype=name, enable_prefix_caching=False)
    first, second, _ = run(qwen3_gqa, prompts, kv_cache_dtype=name)
    assert first == plain and second == plain
    chunked, _, _ = run(qwen3_gqa, prompts, kv_cache_dtype=name, max_num_batched_tokens=20, max_num_seqs=4)
    assert chunked == plain
    block = 16 * 2 * 2 * 2 * ROW_BYTES[name]
    preempted, _, preemptions = run(qwen3_gqa, prompts, kv_cache_dtype=name, cpu_kvcache_bytes=12 * block)
    assert preemptions > 0 and preempted == plain


def test_bad_values_are_clear_errors(qwen3_gqa, qwen3_bias_tied):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(qwen3_gqa, kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="head_dim 24 is not a multiple"):
        LLM(qwen3_bias_tied, kv_cache_dtype="int8")
    # CUDA runs the activations' dtype (what flash-attn and the Triton kernels read) and fp8 (Triton)
    cuda = CudaPlatform()
    assert kv_formats.resolve("auto", torch.bfloat16, cuda).name == "bfloat16"
    assert kv_formats.resolve("fp8", torch.bfloat16, cuda).name == "fp8_e4m3"
    assert kv_formats.resolve("fp8_e5m2", torch.float16, cuda).name == "fp8_e5m2"
    with pytest.raises(ValueError, match=r"cannot run on cuda .* it runs \['auto', 'bfloat16', 'fp8', "):
        kv_formats.resolve("int8", torch.bfloat16, cuda)


@pytest.fixture(scope="module")
def long_qwen3(tmp_path_factory):
    from helpers import make_qwen3
    return make_qwen3(str(tmp_path_factory.mktemp("long_qwen3")), max_position_embeddings=2048, seed=6)


@pytest.mark.parametrize("name", ["float32", "float16"])
def test_long_prompts_decode_as_transformers(long_qwen3, name):
    """Prompts of 1100-1500 tokens, one and two at a time: the C decode step splits each sequence's
    tokens over the threads (its rotary and KV store first, then the chunks, then the merge) and
    keeps transformers' greedy tokens (fp32 KV exactly, 16-bit by vLLM's top-5 rule)."""
    prompts = [[3 + (i * 37 + j * 11) % 250 for j in range(n)] for i, n in enumerate((1100, 1500))]
    ref = hf_greedy(long_qwen3, prompts, 8)
    with LLM(long_qwen3, kv_cache_dtype=name, max_model_len=1600) as llm:
        assert llm.llm_engine.model_runner.step_runners, "the C decode step runs"
        singles = [llm.generate([p], GREEDY, use_tqdm=False)[0]["token_ids"][:8] for p in prompts]
        pair = [o["token_ids"][:8] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert singles == pair
    if name == "float32":
        assert pair == [tokens for tokens, _ in ref]
    else:
        check_tokens_close(pair, ref)


def test_prompt_logprobs_read_the_stored_format(qwen3_gqa):
    """Prompt logprobs under an int8 cache: a prompt chunked over four steps gives those of one
    prefill (every chunk reads the keys as stored), and they stay near the fp32 cache's (the
    rounding of q8_0 blocks moves a logprob by hundredths, not more)."""
    prompt = [5 + (7 * j) % 240 for j in range(70)]
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)

    def logprobs(**kwargs):
        with LLM(qwen3_gqa, kvcache_block_size=16, enable_prefix_caching=False, **kwargs) as llm:
            entries = llm.generate([prompt], sp, use_tqdm=False)[0]["prompt_logprobs"]
        return torch.tensor([entries[j][prompt[j]] for j in range(1, len(prompt))])

    whole = logprobs(kv_cache_dtype="int8")
    chunked = logprobs(kv_cache_dtype="int8", max_num_batched_tokens=20, max_num_seqs=1)
    # Equal but for the C prefill kernel's 16-bit probabilities, rounded per key tile (a chunk's tiles
    # are not the whole prompt's: ~1e-4 apart, tests/kernels/test_prefill_attention.py); a chunk
    # reading the prefix in another format than it was stored moves them by hundredths.
    torch.testing.assert_close(chunked, whole, atol=2e-3, rtol=0)
    fp32 = logprobs(kv_cache_dtype="float32")
    assert (whole - fp32).abs().max() < 0.05 and not torch.equal(whole, fp32), (whole - fp32).abs().max()
