"""Hybrid linear-attention models (Qwen3.5 dense and MoE, Qwen3-Next; models/qwen3_next.py,
layers/gated_deltanet.py) against transformers' greedy tokens (fp32, its torch fallback of the
gated delta rule): prompts longer than a 64-token chunk, chunked prefill splitting a chunk, batches
of mixed lengths, forced preemption; the chunked rule against the one-token rule; a reused state
slot starts from zero; bad configs named."""
import random

import pytest
import torch

from helpers import check_tokens_close, hf_greedy, save_decisive
from nanovllm import LLM, SamplingParams

VOCAB, MAX_NEW = 256, 12
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=16, linear_value_head_dim=24, linear_conv_kernel_dim=4,
             max_position_embeddings=512, rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=2, pad_token_id=0,
             tie_word_embeddings=False)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=64)


def make_checkpoint(name: str, path: str) -> str:
    import transformers
    if name == "qwen3_5":
        config, family = transformers.Qwen3_5TextConfig(**SHAPE), "Qwen3_5"
    elif name == "qwen3_5_moe":
        config, family = transformers.Qwen3_5MoeTextConfig(**SHAPE, **MOE), "Qwen3_5Moe"
    else:
        config, family = transformers.Qwen3NextConfig(**SHAPE, **MOE, decoder_sparse_step=1), "Qwen3Next"
    config.architectures = [f"{family}ForCausalLM"]
    torch.manual_seed(3)
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    return save_decisive(model, path, VOCAB)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def checkpoint(request, tmp_path_factory) -> tuple[str, str]:
    return request.param, make_checkpoint(request.param, str(tmp_path_factory.mktemp(request.param)))


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 9, 70, 150)]  # past one and two chunks


def generate(path: str, batch, **engine) -> tuple[list[list[int]], int]:
    engine = dict(dict(dtype="float32", kvcache_block_size=16, cpu_kvcache_bytes=8 << 20), **engine)
    with LLM(path, **engine) as llm:
        outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
        return [o["token_ids"] for o in outs], llm.scheduler.num_preemptions


@pytest.mark.parametrize("engine", [{}, {"max_num_batched_tokens": 40, "max_num_seqs": 2}], ids=["whole", "chunked"])
def test_greedy_matches_transformers(checkpoint, engine):
    """Whole prefills of a mixed batch; or chunks of 40 tokens (a 64-token delta-rule chunk split
    across steps, two sequences at a time, decode rows beside prefill rows)."""
    _, path = checkpoint
    ref = hf_greedy(path, prompts(), MAX_NEW, mask_eos=False)
    ours, _ = generate(path, prompts(), **engine)
    assert check_tokens_close(ours, ref) == len(ref)


def test_preemption_recomputes_the_state(checkpoint):
    """A cache too small for all four at once: sequences preempted and recomputed from their
    tokens (their state slots freed and taken again from zero) give the same tokens."""
    _, path = checkpoint
    rng = random.Random(1)
    batch = [[rng.randrange(3, VOCAB) for _ in range(40)] for _ in range(4)]
    want, _ = generate(path, batch)
    # 4 state slots (3 linear layers: conv inputs and delta state, fp32) and 13 blocks of 16 tokens of
    # the one full layer (K and V, 2 heads of 32, fp32): 3 blocks each at admission, 4 each by the end
    channels = 2 * 2 * 16 + 4 * 24
    slot = 3 * 4 * (channels * 3 + 4 * 16 * 24)
    got, preempted = generate(path, batch, max_num_seqs=4, kv_cache_dtype="float32",
                              cpu_kvcache_bytes=4 * slot + 13 * (2 * 16 * 2 * 32 * 4))
    assert preempted > 0
    assert got == want


def test_tp2_matches_tp1(checkpoint):
    """Two ranks, each with half the key and value heads of every linear layer (their conv channels,
    A_log, dt_bias) and half the full layers' heads: the tokens of one rank, chunked and mixed."""
    _, path = checkpoint
    engine = dict(max_num_batched_tokens=40, max_num_seqs=2)
    want, _ = generate(path, prompts(), **engine)
    got, _ = generate(path, prompts(), tensor_parallel_size=2, **engine)
    assert got == want


def test_a_reused_slot_starts_from_zero(tmp_path):
    """One state slot: the second request takes the slot the first left full of its state, and
    still decodes as it does alone."""
    path = make_checkpoint("qwen3_5", str(tmp_path))
    first, second = prompts()[3], prompts()[0]  # a one-token prompt: a stale conv history would move it
    alone, _ = generate(path, [second])
    with LLM(path, dtype="float32", cpu_kvcache_bytes=8 << 20, max_num_seqs=1) as llm:
        assert llm.scheduler.block_manager.num_state_slots == 1
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
        llm.generate([first], params, use_tqdm=False)
        layer = llm.model_runner.state_layers[0]
        assert layer.state.delta.abs().sum() > 0  # the first request's state is left in the slot
        again = llm.generate([second], params, use_tqdm=False)[0]["token_ids"]
    assert again == alone[0]


def test_chunked_rule_equals_the_one_token_rule():
    """delta_rule_chunked (the UT transform, chunks of 64) against the recurrence token by token,
    from a nonzero state, over lengths around a chunk."""
    from nanovllm.layers.gated_deltanet import delta_rule_chunked, delta_rule_step, l2_normalized
    g = torch.Generator().manual_seed(0)
    heads, dk, dv = 3, 8, 5
    for length in (1, 63, 64, 65, 150):
        q = l2_normalized(torch.randn(heads, length, dk, generator=g)) * dk ** -0.5
        k = l2_normalized(torch.randn(heads, length, dk, generator=g))
        v = torch.randn(heads, length, dv, generator=g)
        decay = -torch.rand(heads, length, generator=g) * 0.5
        beta = torch.rand(heads, length, generator=g)
        start = torch.randn(heads, dk, dv, generator=g)
        state, out = start.clone(), []
        for t in range(length):
            out.append(delta_rule_step(state.unsqueeze(0), q[None, :, t], k[None, :, t], v[None, :, t],
                                       decay[None, :, t], beta[None, :, t])[0])
        chunked_state = start.clone()
        chunked = delta_rule_chunked(chunked_state, q, k, v, decay, beta)
        torch.testing.assert_close(chunked, torch.stack(out, 1), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(chunked_state, state, rtol=1e-4, atol=1e-4)


def test_bad_configs_are_named(tmp_path):
    import transformers

    from nanovllm.models.qwen3_next import hybrid_layer_types
    config = transformers.Qwen3_5TextConfig(**SHAPE)
    config.layer_types = ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"layer_types\[1\] is 'sliding_attention'"):
        hybrid_layer_types(config)
    path = make_checkpoint("qwen3_5", str(tmp_path / "k"))
    import json
    import os
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["linear_conv_kernel_dim"] = 12
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="linear_conv_kernel_dim is 12"):
        LLM(path, dtype="float32", cpu_kvcache_bytes=8 << 20)
