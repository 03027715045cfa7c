"""The C prefill attention over int8 (q8_0) KV caches (kernels/cpu_prefill_attention.c) against the
attention formula in float64 over the values as stored and the query as the format rounds it: long
contexts (many key and query tiles), cached prefixes (chunked prefill), several sequences per call,
every GQA group size, head sizes 64-256, blocks scattered over the cache; in the native, AVX2 and
plain C builds. Its one approximation: per key tile, the probabilities times the values' scales are
rounded to 16 bits (relative to the tile's largest), so it agrees with the formula to ~1e-4 where
the fp32 paths agree to ~1e-6; the int8 values themselves are ~100x further from the unrounded ones."""
import math
import os
import subprocess
import sys

import pytest
import torch

from nanovllm.kernels import cpu_kernels
from nanovllm.layers.backends import get_backend
from nanovllm.layers.backends.kv_formats import kv_format
from nanovllm.layers.backends.torch_backend import TorchMetadata


INT8 = kv_format("int8")
ATOL = 1e-3  # outputs are ~1 in size (values ~ N(0, 1)): a wrong mask, position or scale is off by > 1e-2


def formula(q, keys, values, first_position, scale):
    """softmax(scale q k^T) v in float64, query i at position first_position + i seeing keys 0..its
    position: q [Lq, H, D], keys / values [Lk, Hkv, D] -> [Lq, H, D]."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, 1)
    v = values.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    positions = torch.arange(q.shape[0]).unsqueeze(1) + first_position
    scores = scores.masked_fill(torch.arange(k.shape[0]).unsqueeze(0) > positions, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def scattered_cache(lens, kv_heads, head_dim, block_size, seed):
    """Random K/V of each sequence stored in int8 through a block table of shuffled blocks:
    (k_cache, v_cache, block_tables, the stored keys, the stored values) per sequence."""
    g = torch.Generator().manual_seed(seed)
    counts = [(n + block_size - 1) // block_size for n in lens]
    order = torch.randperm(2 * sum(counts), generator=g)
    shape = (2 * sum(counts), block_size, kv_heads, INT8.row_units(head_dim))
    k_cache, v_cache = torch.zeros(shape, dtype=torch.uint8), torch.zeros(shape, dtype=torch.uint8)
    tables = torch.full((len(lens), max(counts)), -1, dtype=torch.int32)
    keys, values, used = [], [], 0
    for s, n in enumerate(lens):
        blocks = order[used: used + counts[s]]
        used += counts[s]
        tables[s, : counts[s]] = blocks.to(torch.int32)
        slots = blocks.repeat_interleave(block_size)[:n] * block_size + torch.arange(n) % block_size
        k = torch.randn(n, kv_heads, head_dim, generator=g) * 2
        v = torch.randn(n, kv_heads, head_dim, generator=g)
        k_cache.view(-1, kv_heads, shape[-1])[slots] = INT8.quantize(k)
        v_cache.view(-1, kv_heads, shape[-1])[slots] = INT8.quantize(v)
        keys.append(INT8.dequantize(INT8.quantize(k)))
        values.append(INT8.dequantize(INT8.quantize(v)))
    return k_cache, v_cache, tables, keys, values


@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [
    (16, 8, 128, 16),   # Qwen3-0.6B: groups of 2
    (8, 2, 256, 32),    # Qwen3.5's full attention: groups of 4, wide rows
    (8, 8, 64, 16),     # no GQA
    (16, 2, 64, 8),     # groups of 8
    (6, 2, 96, 16),     # groups of 3, a head_dim of three blocks
])
def test_int8_prefill_matches_the_formula(kernels, heads, kv_heads, head_dim, block_size):
    lens = [300, 141, 70, 9]  # all tokens of each sequence
    new = [300, 77, 1, 9]     # the new ones (a whole prompt; a chunk after a prefix; one token; a short prompt)
    k_cache, v_cache, tables, keys, values = scattered_cache(lens, kv_heads, head_dim, block_size, seed=head_dim)
    q = torch.randn(sum(new), heads, head_dim, generator=torch.Generator().manual_seed(1))
    scale = 1 / math.sqrt(head_dim)
    out = cpu_kernels.paged_prefill_attention_q8(kernels, q, k_cache, v_cache, tables, new, lens, scale)
    start = 0
    for s in range(len(lens)):
        rows = slice(start, start + new[s])
        ref = formula(INT8.round_query(q[rows]), keys[s], values[s], lens[s] - new[s], scale)
        torch.testing.assert_close(out[rows].double(), ref, atol=ATOL, rtol=0)
        start += new[s]


def test_scale_and_large_scores(kernels):
    """Scores far from 0 (the online softmax's running max moving between tiles, most probabilities
    underflowing) and a scale other than 1 / sqrt(head_dim)."""
    lens = [400]
    k_cache, v_cache, tables, keys, values = scattered_cache(lens, 2, 128, 16, seed=5)
    q = torch.randn(400, 4, 128, generator=torch.Generator().manual_seed(2)) * 4
    out = cpu_kernels.paged_prefill_attention_q8(kernels, q, k_cache, v_cache, tables, [400], lens, 0.3)
    torch.testing.assert_close(out.double(), formula(INT8.round_query(q), keys[0], values[0], 0, 0.3),
                               atol=ATOL, rtol=0)


def test_backend_prefill_is_the_kernel_and_chunks_agree(kernels):
    """The torch backend's prefill over an int8 cache is this kernel (the same bytes out), and a prompt
    prefilled in one call or in two chunks (the second reading the first's keys from the cache) gets
    the same attention, to the kernel's rounding."""
    lens = [200]
    k_cache, v_cache, tables, keys, values = scattered_cache(lens, 2, 64, 16, seed=9)
    q = torch.randn(200, 4, 64, generator=torch.Generator().manual_seed(3))
    backend = get_backend("torch", "cpu", INT8)
    assert backend.prefill_in_c()
    k_new, v_new = keys[0], values[0]  # what the layer passes (already stored: the kernel reads the cache)
    whole = backend.prefill(q, k_new, v_new, k_cache, v_cache,
                            TorchMetadata(seqlens_q=[200], seqlens_k=[200], block_tables=tables, max_seqlen_k=200), 0.125)
    direct = cpu_kernels.paged_prefill_attention_q8(kernels, q, k_cache, v_cache, tables, [200], [200], 0.125)
    assert torch.equal(whole, direct)
    second = backend.prefill(q[120:], k_new[120:], v_new[120:], k_cache, v_cache,
                             TorchMetadata(seqlens_q=[80], seqlens_k=[200], block_tables=tables, max_seqlen_k=200),
                             0.125)
    torch.testing.assert_close(second, whole[120:], atol=ATOL, rtol=0)
    # a sliding window is not the kernel's: the torch path takes it, and still gives the formula
    windowed = backend.prefill(q, k_new, v_new, k_cache, v_cache,
                               TorchMetadata(seqlens_q=[200], seqlens_k=[200], block_tables=tables, max_seqlen_k=200),
                               0.125, window=1000)
    torch.testing.assert_close(windowed, whole, atol=ATOL, rtol=0)


def test_head_dim_the_kernel_does_not_take_is_an_error(kernels):
    shape = (4, 16, 1, INT8.row_units(1024))
    cache = torch.zeros(shape, dtype=torch.uint8)
    with pytest.raises(ValueError, match="head_dim"):
        cpu_kernels.paged_prefill_attention_q8(kernels, torch.zeros(3, 1, 1024), cache, cache,
                                               torch.zeros(1, 4, dtype=torch.int32), [3], [3], 1.0)


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
def test_int8_prefill_in_other_builds(other_build_cache, march):
    """The AVX2 build (what AVX2-only machines run) and the plain C one pass the same tests."""
    if os.uname().machine != "x86_64":
        pytest.skip("x86 builds")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "NANOVLLM_CPU_MARCH": march, "NANOVLLM_CACHE": str(other_build_cache)}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                          "tests/kernels/test_prefill_attention.py", "-k", "not other_builds"],
                         env=env, capture_output=True, text=True, timeout=600, cwd=root)
    assert out.returncode == 0 and "8 passed" in out.stdout, out.stdout[-3000:] + out.stderr[-2000:]
