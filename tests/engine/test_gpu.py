"""CUDA-only checks (marker `gpu`, skipped without a GPU): flash backend vs torch backend, decode
graph replay vs eager (a dense and a mixture-of-experts model), bf16 parity with HF by vLLM's
top-5 rule (with fp8 KV caches too), KV cache sizing."""
import importlib.util

import pytest
import torch

from nanovllm import LLM
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.backends import AttentionBatch, available_backends, get_backend
from nanovllm.sampling_params import SamplingParams
from nanovllm.executor.cuda_graph import DecodeGraphs
from tests.helpers import hf_greedy, make_qwen3

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 6, 7], list(range(10, 40)), [3] * 17, list(range(60, 61)), list(range(100, 190))]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_qwen3(str(tmp_path_factory.mktemp("qwen3")))


def cuda_batch(is_prefill: bool, num_new_tokens: list[int], context_lens: list[int],
               block_tables: list[list[int]]) -> AttentionBatch:
    return AttentionBatch(is_prefill, num_new_tokens, context_lens, block_tables, to_device=lambda t: t.cuda())


# ---- flash backend vs torch backend ---------------------------------------------------------
def test_flash_backend_matches_torch_backend():
    pytest.importorskip("flash_attn")
    flash, ref = get_backend("flash", "cuda"), get_backend("torch", "cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 64, 256
    rand = lambda *shape: torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    k_cache, v_cache = rand(6, block_size, num_kv_heads, head_dim), rand(6, block_size, num_kv_heads, head_dim)
    scale = head_dim ** -0.5

    def slots(table, start, end):
        return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]

    # Prefill with a cached prefix: seq 0 has 260 cached tokens + 10 new, seq 1 is fresh (7 tokens).
    tables = [[2, 5], [0]]
    q, k, v = rand(17, num_heads, head_dim), rand(17, num_kv_heads, head_dim), rand(17, num_kv_heads, head_dim)
    slot_mapping = torch.tensor(slots(tables[0], 260, 270) + slots(tables[1], 0, 7), device="cuda")
    batch = cuda_batch(True, [10, 7], [270, 7], tables)
    flash_meta, ref_meta = flash.prepare(batch), ref.prepare(batch)
    assert flash_meta.cu_seqlens_k.tolist() == [0, 270, 277] and flash_meta.max_seqlen_k == 270
    assert flash_meta.block_tables.tolist() == [[2, 5], [0, -1]]
    flash.store_kvcache(k, v, k_cache, v_cache, slot_mapping)
    out_flash = flash.prefill(q, k, v, k_cache, v_cache, flash_meta, scale)
    out_ref = ref.prefill(q, k, v, k_cache, v_cache, ref_meta, scale)
    torch.testing.assert_close(out_flash, out_ref, rtol=2e-2, atol=2e-2)

    # Prefill without a prefix (fresh K/V only, varlen).
    q, k, v = rand(305, num_heads, head_dim), rand(305, num_kv_heads, head_dim), rand(305, num_kv_heads, head_dim)
    batch = cuda_batch(True, [5, 300], [5, 300], [[], []])
    assert flash.prepare(batch).block_tables is None  # no cached prefix: fresh K/V only
    empty = torch.empty(0, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(flash.prefill(q, k, v, empty, empty, flash.prepare(batch), scale),
                               ref.prefill(q, k, v, empty, empty, ref.prepare(batch), scale), rtol=2e-2, atol=2e-2)

    # Decode over the paged cache: context lengths 1, 257 and 512, tables padded with -1.
    q = rand(3, num_heads, head_dim)
    batch = cuda_batch(False, [1, 1, 1], [1, 257, 512], [[4], [1, 3], [5, 2]])
    torch.testing.assert_close(flash.decode(q, k_cache, v_cache, flash.prepare(batch), scale),
                               ref.decode(q, k_cache, v_cache, ref.prepare(batch), scale), rtol=2e-2, atol=2e-2)


def test_flash_backend_rejects_small_blocks():
    pytest.importorskip("flash_attn")
    with pytest.raises(ValueError, match="kvcache_block_size"):
        get_backend("flash", "cuda").check_block_size(16)


# ---- CUDA graphs ----------------------------------------------------------------------------
def test_graph_replay_matches_eager_and_hf(model_path, monkeypatch):
    # 17 prompts, max_num_seqs 20: buckets 1, 2, 4, 8, 16, 20. Staggered max_tokens shrink the
    # decode batch step by step through several buckets.
    prompts = [[(7 * i + j) % 250 + 3 for j in range(3 + i)] for i in range(17)]
    params = [SamplingParams(temperature=0, max_tokens=2 + i % 9, ignore_eos=True) for i in range(17)]
    graphed = LLM(model_path, dtype="float32", max_num_seqs=20)
    assert graphed.llm_engine.model_runner.step_runner(DecodeGraphs).sizes == [1, 2, 4, 8, 16, 20]
    replayed, replay = [], graphed.llm_engine.model_runner.step_runner(DecodeGraphs).replay

    def counting_replay(input_ids, positions, context):
        replayed.append(input_ids.shape[0])
        return replay(input_ids, positions, context)

    monkeypatch.setattr(graphed.llm_engine.model_runner.step_runner(DecodeGraphs), "replay", counting_replay)
    out_graph = [o["token_ids"] for o in graphed.generate(prompts, params, use_tqdm=False)]
    graphed.exit()
    assert graphed.llm_engine.model_runner is None
    assert 17 in replayed and 1 in replayed and len(set(replayed)) >= 5

    eager = LLM(model_path, dtype="float32", max_num_seqs=20, enforce_eager=True)
    assert eager.llm_engine.model_runner.step_runner(DecodeGraphs) is None
    out_eager = [o["token_ids"] for o in eager.generate(prompts, params, use_tqdm=False)]
    eager.exit()
    assert out_graph == out_eager
    for ours, (ref, _) in zip(out_graph[:4], hf_greedy(model_path, prompts[:4], max_new_tokens=5)):
        assert ours == ref[:len(ours)]  # max_tokens 2..5, greedy, fp32: HF's tokens exactly


def test_moe_graph_replay_matches_eager_and_hf(tmp_path):
    """A Qwen2-MoE (shared expert) on the Triton fused experts, in captured decode graphs and
    eagerly: the same tokens, and transformers' in fp32."""
    from tests.test_moe import make_moe

    path = make_moe(str(tmp_path / "moe"), "qwen2_moe_shared")
    prompts = [[(11 * i + j) % 250 + 3 for j in range(2 + 3 * i)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = []
    for eager in (False, True):
        engine = LLM(path, dtype="float32", max_num_seqs=8, enforce_eager=eager)
        assert (engine.llm_engine.model_runner.step_runner(DecodeGraphs) is None) == eager
        outs.append([o["token_ids"] for o in engine.generate(prompts, params, use_tqdm=False)])
        engine.exit()
    assert outs[0] == outs[1]
    for ours, (ref, _) in zip(outs[0], hf_greedy(path, prompts, max_new_tokens=8)):
        assert ours == ref


# ---- bf16 parity with HF (vLLM's top-5 rule) -------------------------------------------------
def engine_top5(engine: LLM, token_ids: list[int]) -> list[int]:
    """The engine's 5 most likely next tokens after token_ids (one eager prefill, no cache)."""
    runner = engine.llm_engine.model_runner
    input_ids, positions, context, logits_indices = runner.prepare_prefill([Sequence(token_ids)], [len(token_ids)])
    logits = runner.run_model(input_ids, positions, context, logits_indices)
    return logits[0].float().topk(5).indices.tolist()


def cuda_backends() -> list[str]:
    needs = {"flash": "flash_attn", "triton": "triton"}
    return [b for b in available_backends() if importlib.util.find_spec(needs.get(b, "torch")) is not None]


@pytest.mark.parametrize("backend, kv_cache_dtype", [(b, "auto") for b in cuda_backends()] + [
    ("auto", "fp8_e4m3"), ("auto", "fp8_e5m2")])  # fp8: the Triton store and kernels, under CUDA graphs
def test_bf16_parity_with_hf_top5(model_path, backend, kv_cache_dtype):
    engine = LLM(model_path, dtype="bfloat16", attention_backend=backend, kv_cache_dtype=kv_cache_dtype)
    if kv_cache_dtype != "auto":
        assert engine.llm_engine.model_runner.backend.name == "triton"
        assert engine.llm_engine.model_runner.kv_cache.dtype == engine.config.kv_format.storage
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ours = [o["token_ids"] for o in engine.generate(PROMPTS, params, use_tqdm=False)]
    hf = hf_greedy(model_path, PROMPTS, max_new_tokens=12)
    for prompt, our_tokens, (hf_tokens, hf_logits) in zip(PROMPTS, ours, hf):
        for i, (a, b) in enumerate(zip(our_tokens, hf_tokens)):
            if a != b:  # first divergence: each side's token is in the other's top 5
                assert a in hf_logits[i].topk(5).indices.tolist(), (prompt, i)
                assert b in engine_top5(engine, prompt + our_tokens[:i]), (prompt, i)
                break
    engine.exit()


# ---- KV cache sizing ------------------------------------------------------------------------
def test_kv_cache_fills_gpu_memory_utilization(model_path):
    # A long max_model_len and many seqs, so the cache is sized by memory, not by the request cap.
    path = make_qwen3(model_path + "_long", max_position_embeddings=1 << 20)
    total = torch.cuda.mem_get_info()[1]
    util = min(0.2, 16 * 2**30 / total)  # at most 16 GiB: the cap below is 32 GiB
    engine = LLM(path, dtype="bfloat16", gpu_memory_utilization=util, enforce_eager=True,
                       max_model_len=1 << 20, max_num_seqs=64, max_num_batched_tokens=4096)
    runner = engine.llm_engine.model_runner
    cache_bytes = runner.kv_cache.numel() * runner.kv_cache.element_size()
    assert cache_bytes == engine.llm_engine.num_kvcache_blocks * runner.kv_block_bytes()
    assert cache_bytes < 64 * (1 << 20) * runner.kv_block_bytes() // runner.block_size  # not capped
    free, _ = torch.cuda.mem_get_info()
    used = total - free
    # Everything on the device now (context, weights, cache) is util * total, less the activation
    # headroom kept free; the tiny model's headroom is well under 2% of any GPU.
    assert total * (util - 0.02) <= used <= total * util
    engine.exit()


def test_no_kv_block_fits_is_a_clear_error(model_path):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(model_path, dtype="bfloat16", gpu_memory_utilization=1e-4, enforce_eager=True)
