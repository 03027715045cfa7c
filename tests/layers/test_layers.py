"""Each layer against an independent formula: RMSNorm and RoPE vs HF, attention backends vs naive
attention over the same paged cache, SiLU-and-mul, linear weight loaders, and the sampler."""
import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.backends import AttentionBatch
from nanovllm.layers.backends.torch_backend import TorchBackend, TorchMetadata
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.quantization import (LinearKernels, UnquantizedLinearMethod, describe_linear_methods,
                                          process_weights_after_loading)
from nanovllm.platforms.cpu import can_pack_weights
from nanovllm.layers.rotary_embedding import get_rope, rope_settings
from nanovllm.sample.sampler import Sampler, exponential_race_sample, inverse_cdf_sample
from nanovllm.sample.sampling_metadata import SamplingMetadata


def test_rmsnorm_matches_hf_and_fused_add():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    torch.manual_seed(0)
    x, res = torch.randn(5, 32), torch.randn(5, 32)
    ours, ref = RMSNorm(32, eps=1e-6), Qwen3RMSNorm(32, eps=1e-6)
    w = torch.randn(32)
    ours.weight.data.copy_(w)
    ref.weight.data.copy_(w)
    torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=0)
    y, new_res = ours(x, res)
    torch.testing.assert_close(new_res, x + res)
    torch.testing.assert_close(y, ref(x + res))


def test_rope_matches_hf():
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb
    config = Qwen3Config(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         max_position_embeddings=128, rope_theta=5000.0)
    theta, scaling = rope_settings(config)
    assert theta == 5000.0
    rope = get_rope(32, 32, 128, theta, scaling)
    torch.manual_seed(0)
    positions = torch.tensor([0, 3, 17, 100, 127])
    q, k = torch.randn(5, 2, 32), torch.randn(5, 1, 32)
    q1, k1 = rope(positions, q, k)
    cos, sin = Qwen3RotaryEmbedding(config)(q, positions.unsqueeze(0))
    # HF layout: [batch, heads, seq, dim]
    q2, k2 = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(q1, q2[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k1, k2[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_rope_theta_from_legacy_field():
    class Legacy:
        rope_theta = 123.0
    assert rope_settings(Legacy()) == (123.0, None)


def test_silu_and_mul():
    x = torch.randn(3, 8)
    torch.testing.assert_close(SiluAndMul()(x), F.silu(x[:, :4]) * x[:, 4:])


def test_packed_linear_loaders_place_shards():
    qkv = QKVParallelLinear(8, head_size=2, total_num_heads=4, total_num_kv_heads=2, bias=False)
    q, k, v = torch.randn(8, 8), torch.randn(4, 8), torch.randn(4, 8)
    for shard_id, w in (("q", q), ("k", k), ("v", v)):
        qkv.weight.weight_loader(qkv.weight, w, shard_id)
    torch.testing.assert_close(qkv.weight.data, torch.cat([q, k, v]))
    merged = MergedColumnParallelLinear(8, [6, 6])
    g, u = torch.randn(6, 8), torch.randn(6, 8)
    merged.weight.weight_loader(merged.weight, u, 1)
    merged.weight.weight_loader(merged.weight, g, 0)
    x = torch.randn(2, 8)
    torch.testing.assert_close(merged(x), torch.cat([x @ g.T, x @ u.T], -1))
    row = RowParallelLinear(8, 4, bias=True)
    with pytest.raises(ValueError, match="shape"):
        row.weight.weight_loader(row.weight, torch.randn(4, 9))


@pytest.mark.skipif(not can_pack_weights(torch.float32), reason="no oneDNN in this torch")
def test_onednn_packed_weights_match_plain_matmul():
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.qkv = QKVParallelLinear(32, head_size=8, total_num_heads=4, total_num_kv_heads=2, bias=True)
    model.down = RowParallelLinear(48, 32, bias=True)
    model.embed = VocabParallelEmbedding(100, 32)
    model.head = ParallelLMHead(100, 32)
    model.head.tie_weights(model.embed)
    model.untied_head = ParallelLMHead(100, 32)
    for p in model.parameters():
        p.data.normal_()
    dense = {name: p.detach().clone() for name, p in model.named_parameters(remove_duplicate=False)}
    linears = (model.qkv, model.down, model.head, model.untied_head)
    assert all(type(m.quant_method) is UnquantizedLinearMethod and m.quant_method.kernel == "dense"
               for m in linears)  # built dense
    assert process_weights_after_loading(model, LinearKernels(onednn_packing=True)) == "oneDNN-packed"
    assert all(m.quant_method.kernel == "packed" for m in linears)
    for rows in (1, 3, 70):
        x, h = torch.randn(rows, 32), torch.randn(rows, 48)
        torch.testing.assert_close(model.qkv(x), x @ dense["qkv.weight"].T + dense["qkv.bias"])
        torch.testing.assert_close(model.down(h), h @ dense["down.weight"].T + dense["down.bias"])
        torch.testing.assert_close(model.head(x), x @ dense["embed.weight"].T)
        torch.testing.assert_close(model.untied_head(x), x @ dense["untied_head.weight"].T)
    # The tied table still embeds; the dense copies only the packed layers used are freed.
    torch.testing.assert_close(model.embed(torch.tensor([3, 97])), dense["embed.weight"][[3, 97]])
    assert model.qkv.weight.numel() == model.down.weight.numel() == model.untied_head.weight.numel() == 0
    assert model.qkv.packed_weight.shape == dense["qkv.weight"].shape


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_bf16_weights_are_held_once_for_the_c_kernels(monkeypatch):
    """bf16 weights (fp32 activations) are narrowed once and read in place by the C kernels at every
    row count (output widths not a multiple of the kernels' row groups included): one copy, nothing
    packed beside it, and x W^T of the bf16-rounded weights to fp32 rounding."""
    from nanovllm.kernels import cpu_kernels
    kernels = cpu_kernels.load()
    assert kernels is not None
    calls = []
    real_linear = cpu_kernels.linear
    monkeypatch.setattr(cpu_kernels, "linear", lambda *a: calls.append(1) or real_linear(*a))
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.qkv = QKVParallelLinear(32, head_size=8, total_num_heads=3, total_num_kv_heads=1, bias=True)  # 40 wide
    model.down = RowParallelLinear(48, 30, bias=True)
    model.head = ParallelLMHead(101, 32)
    for p in model.parameters():
        p.data.normal_()
    # the weights rounded to bf16, the biases kept in fp32
    rounded = {name: (p.detach().to(torch.bfloat16) if name.endswith("weight") else p.detach()).double()
               for name, p in model.named_parameters()}
    process_weights_after_loading(model, LinearKernels(c_kernels=kernels, c_weight_dtype=torch.bfloat16))
    layers = (model.qkv, model.down, model.head)
    assert all(m.quant_method.kernel == "c" and m.quant_method.c_only for m in layers)
    assert all(m.weight.dtype == torch.bfloat16 and m.weight.data_ptr() == m.quant_method.c_linear.data
               and not hasattr(m, "packed_weight") for m in layers)
    assert describe_linear_methods(model) == "dense bf16: C kernel at every row count"
    for rows in (1, 3, 16, 17, 33, 70):
        x, h = torch.randn(rows, 32), torch.randn(rows, 48)
        want = {"qkv": x.double() @ rounded["qkv.weight"].T + rounded["qkv.bias"],
                "down": h.double() @ rounded["down.weight"].T + rounded["down.bias"],
                "head": x.double() @ rounded["head.weight"].T}
        for name, got in (("qkv", model.qkv(x)), ("down", model.down(h)), ("head", model.head(x))):
            torch.testing.assert_close(got.double(), want[name], rtol=1e-5, atol=1e-4, msg=f"{name} rows={rows}")
    assert len(calls) == 3 * 6


# ---- attention over the paged cache -----------------------------------------------------------
def naive_attention(q, k, v, scale, q_offset):
    """q [Lq, H, D], k/v [Lk, Hkv, D]; query i sits at position q_offset + i."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    mask = torch.arange(k.shape[0])[None, :] > (q_offset + torch.arange(q.shape[0]))[:, None]
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def paged_setup(lens, block_size=4, num_kv_heads=2, head_dim=8, num_blocks=32):
    """Random K/V for each sequence written into a paged cache via shuffled block tables."""
    torch.manual_seed(0)
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_blocks).tolist()
    tables, ks, vs = [], [], []
    for n in lens:
        nb = math.ceil(n / block_size)
        table = [free.pop() for _ in range(nb)]
        k, v = torch.randn(n, num_kv_heads, head_dim), torch.randn(n, num_kv_heads, head_dim)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)])
        TorchBackend().store_kvcache(k, v, k_cache, v_cache, slots)
        tables.append(table)
        ks.append(k)
        vs.append(v)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    return k_cache, v_cache, block_tables, ks, vs


def test_store_skips_padding_slots():
    k_cache = torch.zeros(2, 4, 1, 2)
    v_cache = torch.zeros_like(k_cache)
    k = torch.ones(3, 1, 2)
    TorchBackend().store_kvcache(k, 2 * k, k_cache, v_cache, torch.tensor([5, -1, 0]))
    assert k_cache.view(-1, 2)[[0, 5]].eq(1).all() and k_cache.sum() == 4
    assert v_cache.view(-1, 2)[[0, 5]].eq(2).all()


@pytest.mark.parametrize("num_heads", [2, 4, 8])
def test_decode_matches_naive(num_heads):
    lens = [1, 5, 12, 9]
    k_cache, v_cache, tables, ks, vs = paged_setup(lens)
    q = torch.randn(len(lens), num_heads, 8)
    meta = TorchMetadata(context_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables)
    out = TorchBackend().decode(q, k_cache, v_cache, meta, 0.3)
    for i, n in enumerate(lens):
        ref = naive_attention(q[i: i + 1], ks[i], vs[i], 0.3, n - 1)
        torch.testing.assert_close(out[i: i + 1], ref, rtol=1e-5, atol=1e-5)


def test_grouped_decode_matches_naive():
    """The CPU path groups sequences by length (8 per group) and pads each group only to its own
    longest context: 19 sequences of scattered lengths give 3 groups, one partial."""
    lens = [(7 * i) % 61 + 1 for i in range(19)]
    k_cache, v_cache, tables, ks, vs = paged_setup(lens, num_blocks=160)
    q = torch.randn(len(lens), 4, 8)
    meta = TorchMetadata(context_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables, seqlens_k=lens)
    backend = TorchBackend("cpu")
    backend.cpu_kernel = None  # the pure-torch path (the C kernel has its own test below)
    out = backend.decode(q, k_cache, v_cache, meta, 0.3)
    assert len(meta.decode_groups) == 3
    for i, n in enumerate(lens):
        ref = naive_attention(q[i: i + 1], ks[i], vs[i], 0.3, n - 1)
        torch.testing.assert_close(out[i: i + 1], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [(2, 2, 8, 4), (8, 2, 8, 4),
                                                                        (6, 2, 24, 16), (16, 8, 128, 16),
                                                                        (4, 2, 20, 12)])
@pytest.mark.parametrize("copies", [1, 6])
def test_cpu_kernel_decode_matches_naive(num_heads, num_kv_heads, head_dim, block_size, copies):
    """The C decode kernel (built here with the system compiler) against naive attention: GQA
    groups 1/3/4/2, contexts ending mid-block and on block edges, scattered block tables, blocks
    and head dims off its 8-token and 8-lane steps (12 tokens, 20 dims); 6
    sequences (KV heads split across work items) and 36 (one item per sequence)."""
    from nanovllm.kernels import cpu_kernels
    assert cpu_kernels.load() is not None
    lens = [1, block_size, block_size + 1, 3 * block_size - 1, 37, 2] * copies
    k_cache, v_cache, tables, ks, vs = paged_setup(lens, block_size, num_kv_heads, head_dim,
                                                   num_blocks=64 * copies)
    q = torch.randn(len(lens), num_heads, head_dim)
    backend = TorchBackend("cpu")
    assert backend.cpu_kernel is not None
    meta = backend.prepare(AttentionBatch(is_prefill=False, num_new_tokens=[1] * len(lens), context_lens=lens,
                                          block_tables=[[b for b in t if b >= 0] for t in tables.tolist()],
                                          to_device=lambda t: t))  # as ModelRunner.prepare_decode builds it
    assert torch.equal(meta.block_tables, tables) and meta.max_seqlen_k == max(lens)
    out = backend.decode(q, k_cache, v_cache, meta, 0.3)
    assert meta.decode_groups is None  # the kernel ran, not the torch path
    for i, n in enumerate(lens):
        ref = naive_attention(q[i: i + 1], ks[i], vs[i], 0.3, n - 1)
        torch.testing.assert_close(out[i: i + 1], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("query_block", [None, 2])
@pytest.mark.parametrize("num_heads", [2, 4])
def test_prefill_with_cached_prefix_matches_naive(num_heads, query_block, monkeypatch):
    """query_block 2: the queries over a cached prefix a block of 2 rows at a time (the last one
    alone), each block's keys up to its own last query."""
    from nanovllm.layers.backends import torch_backend
    if query_block is not None:
        monkeypatch.setattr(torch_backend, "PREFIX_QUERY_BLOCK", query_block)
    k_lens, q_lens = [10, 7, 13], [3, 7, 5]  # the second has no cached prefix
    k_cache, v_cache, tables, ks, vs = paged_setup(k_lens)
    qs = [torch.randn(n, num_heads, 8) for n in q_lens]
    new_k = torch.cat([k[-n:] for k, n in zip(ks, q_lens)])
    new_v = torch.cat([v[-n:] for v, n in zip(vs, q_lens)])
    meta = TorchMetadata(block_tables=tables, seqlens_q=q_lens, seqlens_k=k_lens)
    out = TorchBackend().prefill(torch.cat(qs), new_k, new_v, k_cache, v_cache, meta, 0.5)
    start = 0
    for q, k, v, nq, nk in zip(qs, ks, vs, q_lens, k_lens):
        ref = naive_attention(q, k, v, 0.5, nk - nq)
        torch.testing.assert_close(out[start: start + nq], ref, rtol=1e-5, atol=1e-5)
        start += nq


# ---- sampler ----------------------------------------------------------------------------------
def sample(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    return Sampler()(logits, SamplingMetadata.from_temperatures(temperatures)).token_ids


def test_sampler_greedy_rows_take_argmax():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    temps = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.7, 0.0])
    out = sample(logits, temps)
    greedy = temps == 0
    assert torch.equal(out[greedy], logits.argmax(-1)[greedy])
    assert torch.equal(sample(logits, torch.zeros(6)), logits.argmax(-1))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sampler_follows_softmax_chi_square(temperature):
    torch.manual_seed(1)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 20000
    draws = sample(logits.expand(n, -1).clone(), torch.full((n,), temperature))
    observed = torch.bincount(draws, minlength=6).double()
    expected = torch.softmax(logits.double() / temperature, -1) * n
    chi2 = ((observed - expected) ** 2 / expected).sum().item()
    # 5 degrees of freedom: P(chi2 > 20.5) = 0.001, so a correct sampler fails 1 run in 1000.
    assert chi2 < 20.5, (chi2, observed, expected)


@pytest.mark.parametrize("draw", [exponential_race_sample, inverse_cdf_sample])
def test_both_random_draws_follow_probs_chi_square(draw):
    """Each device's draw picks token i with probability p_i, zero-probability tokens never."""
    torch.manual_seed(2)
    probs = torch.tensor([0.0, 0.4, 0.25, 0.0, 0.2, 0.1, 0.05, 0.0])
    n = 20000
    draws = draw(probs.expand(n, -1).clone(), {})
    observed = torch.bincount(draws, minlength=8).double()
    assert observed[probs == 0].sum() == 0
    keep = probs > 0
    expected = probs.double()[keep] * n
    chi2 = ((observed[keep] - expected) ** 2 / expected).sum().item()
    assert chi2 < 20.5, (chi2, observed)  # 5 degrees of freedom, P = 0.001


@pytest.mark.parametrize("chunk", [1, 3, 4, 1024])
def test_inverse_cdf_chunks_follow_probs_chi_square(chunk, monkeypatch):
    """The two-level draw (chunk, then token in it) over chunk sizes that split the vocabulary
    unevenly (a short last chunk, empty chunks) and a 152k-sized vocabulary with mass spread over
    chunk boundaries and the tail."""
    import nanovllm.sample.sampler as sampler_module
    monkeypatch.setattr(sampler_module, "CDF_CHUNK", chunk)
    torch.manual_seed(3)
    vocab = 8 if chunk < 1024 else 151936
    hot = [1, 2, 4, 5, 6] if chunk < 1024 else [0, 1023, 1024, 70001, 151935]
    probs = torch.zeros(vocab)
    probs[hot] = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    n = 20000 if chunk < 1024 else 4000
    draws = torch.cat([inverse_cdf_sample(probs.expand(min(n - i, 1000), -1).clone(), {})
                       for i in range(0, n, 1000)])
    observed = torch.bincount(draws, minlength=vocab).double()
    assert observed.sum() == n and observed[hot].sum() == n  # zero-probability tokens never drawn
    expected = probs.double()[hot] * n
    chi2 = ((observed[hot] - expected) ** 2 / expected).sum().item()
    assert chi2 < 18.5, (chi2, observed[hot])  # 4 degrees of freedom, P = 0.001
