"""The KV cache's storage formats (layers/backends/kv_formats.py) and the attention over them
(kernels/cpu_attention.c's decode, cpu_kv_formats.c's store, the torch backend's prefill), against independent references: gguf.quants' Q8_0 quantizer, torch's
own dtype conversions, and attention written out as the softmax formula over the dequantized rows."""
import math

import numpy as np
import pytest
import torch

from nanovllm.kernels import cpu_kernels
from nanovllm.layers.backends import get_backend
from nanovllm.layers.backends.kv_formats import KV_FORMATS, kv_format
from nanovllm.layers.backends.torch_backend import TorchMetadata


FORMATS = list(KV_FORMATS)


def edge_rows(n: int, head_dim: int, seed: int = 0) -> torch.Tensor:
    """Rows with the values that stress rounding: gaussian, large (past fp8's range), tiny
    (subnormal in fp16 / fp8), exact ties, zeros and an all-zero block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, head_dim, generator=g) * torch.logspace(-3, 3, n).unsqueeze(1)
    x[0, :32] = 0.0
    x[1, :8] = torch.tensor([1e-9, -3e-8, 6e-5, -2.0**-16, 2.0**-10, 500.0, -70000.0, 1.0 + 2.0**-8])
    x[2, :4] = torch.tensor([0.5, 1.5, 2.5, -2.5])  # ties after scaling in some formats
    return x


def test_int8_is_llamacpp_q8_0():
    """int8 rows are byte for byte what gguf.quants (llama.cpp's reference quantizer) writes for Q8_0."""
    from gguf import GGMLQuantizationType, quants
    x = edge_rows(16, 128)
    ours = KV_FORMATS["int8"].quantize(x).numpy()
    ref = quants.quantize(x.numpy(), GGMLQuantizationType.Q8_0)
    assert ours.shape == ref.shape and np.array_equal(ours, ref)
    back = quants.dequantize(ref, GGMLQuantizationType.Q8_0)
    assert torch.equal(KV_FORMATS["int8"].dequantize(torch.from_numpy(ours)), torch.from_numpy(back))


@pytest.mark.parametrize("name", ["bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"])
def test_float_formats_round_as_torch(name):
    fmt = KV_FORMATS[name]
    x = edge_rows(8, 64)
    expected = x.clamp(-fmt.limit, fmt.limit).to(fmt.storage) if fmt.limit else x.to(fmt.storage)
    assert fmt.quantize(x).dtype == fmt.storage
    assert torch.equal(fmt.quantize(x).view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("name", FORMATS)
def test_c_store_writes_the_reference_bytes(kernels, name):
    """kv_store_rows (the C KV store) writes the bytes the Python reference writes, into the slots
    given (slot -1 skipped), for K and V alike."""
    fmt = KV_FORMATS[name]
    num_tokens, heads, head_dim, block_size, blocks = 12, 3, 64, 16, 4
    k, v = edge_rows(num_tokens * heads, head_dim, 1), edge_rows(num_tokens * heads, head_dim, 2)
    k, v = k.view(num_tokens, heads, head_dim), v.view(num_tokens, heads, head_dim)
    slots = torch.tensor([5, 17, 3, -1, 40, 41, 0, 63, 20, 21, 22, 9])
    shape = (blocks, block_size, heads, fmt.row_units(head_dim))
    k_cache, v_cache = torch.zeros(shape, dtype=fmt.storage), torch.zeros(shape, dtype=fmt.storage)
    cpu_kernels.store_kv(kernels, k, v, k_cache, v_cache, fmt.c_type, slots)
    kept = slots >= 0
    ref_k, ref_v = torch.zeros(shape, dtype=fmt.storage), torch.zeros(shape, dtype=fmt.storage)
    ref_k.view(-1, heads, shape[-1])[slots[kept]] = fmt.quantize(k[kept])
    ref_v.view(-1, heads, shape[-1])[slots[kept]] = fmt.quantize(v[kept])
    assert torch.equal(k_cache.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), ref_v.view(torch.uint8))
    assert kernels.kv_row_bytes(fmt.c_type, head_dim) == fmt.row_bytes(head_dim)


def reference_attention(q, keys, values, q_positions, scale):
    """softmax(scale q k^T) v per query row, keys 0..position (causal), GQA: q [Lq, H, D], keys and
    values [Lk, Hkv, D] -> [Lq, H, D], in float64."""
    group = q.shape[1] // keys.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, pos in enumerate(q_positions):
        for h in range(q.shape[1]):
            kh, vh = keys[: pos + 1, h // group].double(), values[: pos + 1, h // group].double()
            p = torch.softmax(scale * (kh @ q[i, h].double()), dim=0)
            out[i, h] = p @ vh
    return out


def paged_cache(fmt, rows, table, block_size, num_blocks, cache=None):
    """rows [L, Hkv, D] stored through the block table into cache (a fresh one in fmt if None)."""
    heads, head_dim = rows.shape[1:]
    if cache is None:
        cache = torch.zeros(num_blocks, block_size, heads, fmt.row_units(head_dim), dtype=fmt.storage)
    slots = torch.tensor([table[t // block_size] * block_size + t % block_size for t in range(rows.shape[0])])
    cache.view(-1, heads, cache.shape[-1])[slots] = fmt.quantize(rows)
    return cache


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("head_dim", [64, 40])
def test_decode_and_prefill_match_the_formula(kernels, name, head_dim):
    """Decode (the C kernel, one query per sequence) and prefill (the new tokens of each sequence,
    with and without a cached prefix, causal) read every format and give the attention formula over
    the values as stored."""
    fmt = KV_FORMATS[name]
    if fmt.head_dim_error(head_dim):
        pytest.skip(fmt.head_dim_error(head_dim))
    torch.manual_seed(0)
    heads, kv_heads, block_size, num_blocks = 6, 2, 16, 24
    scale = 1 / math.sqrt(head_dim)
    lens, new = [37, 70, 5], [37, 9, 5]  # context lengths; new tokens of the prefill (the first: no prefix)
    tables = [[3, 7, 1], [0, 10, 11, 2, 20], [23]]
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    keys = [torch.randn(n, kv_heads, head_dim) * 2 for n in lens]
    values = [torch.randn(n, kv_heads, head_dim) for n in lens]
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, fmt.row_units(head_dim), dtype=fmt.storage)
    v_cache = torch.zeros_like(k_cache)
    for s in range(3):
        paged_cache(fmt, keys[s], tables[s], block_size, num_blocks, k_cache)
        paged_cache(fmt, values[s], tables[s], block_size, num_blocks, v_cache)
    stored_k = [fmt.dequantize(fmt.quantize(k)) for k in keys]
    stored_v = [fmt.dequantize(fmt.quantize(v)) for v in values]
    # decode: the last token of each sequence
    q = torch.randn(3, heads, head_dim)
    out = cpu_kernels.paged_decode_attention(kernels, q, k_cache, v_cache, fmt.c_type, block_tables,
                                             torch.tensor(lens, dtype=torch.int32), max(lens), scale)
    for s in range(3):
        ref = reference_attention(fmt.round_query(q[s: s + 1]), stored_k[s], stored_v[s], [lens[s] - 1], scale)
        torch.testing.assert_close(out[s: s + 1].double(), ref, atol=2e-5, rtol=1e-4)
    # prefill: the last new[s] tokens of each sequence (their K/V fresh, as the layer passes them;
    # the first sequence has no cached prefix, the others read theirs from the cache)
    q = torch.randn(sum(new), heads, head_dim)
    k_new = torch.cat([keys[s][lens[s] - new[s]:] for s in range(3)])
    v_new = torch.cat([values[s][lens[s] - new[s]:] for s in range(3)])
    meta = TorchMetadata(seqlens_q=new, seqlens_k=lens, block_tables=block_tables, max_seqlen_k=max(lens))
    out = get_backend("torch", "cpu", fmt).prefill(q, k_new, v_new, k_cache, v_cache, meta, scale)
    start = 0
    for s in range(3):
        positions = list(range(lens[s] - new[s], lens[s]))
        ref = reference_attention(fmt.round_query(q[start: start + new[s]]), stored_k[s], stored_v[s], positions,
                                  scale)
        # int8: the C prefill kernel rounds probabilities to 16 bits (tests/kernels/test_prefill_attention.py)
        atol = 1e-3 if fmt.blocked else 2e-5
        torch.testing.assert_close(out[start: start + new[s]].double(), ref, atol=atol, rtol=1e-4)
        start += new[s]


def decode_matches_formula_over_threads(kernels, fmt, heads, kv_heads, head_dim, block_size, lens, tables,
                                        num_blocks, scale):
    """Random K/V of each sequence stored through its block table, one query per sequence decoded
    with one and two threads: the formula's attention over the stored values, every sequence."""
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, fmt.row_units(head_dim), dtype=fmt.storage)
    v_cache = torch.zeros_like(k_cache)
    stored = []
    for n, table in zip(lens, tables):
        keys, values = torch.randn(n, kv_heads, head_dim) * 2, torch.randn(n, kv_heads, head_dim)
        paged_cache(fmt, keys, table, block_size, num_blocks, k_cache)
        paged_cache(fmt, values, table, block_size, num_blocks, v_cache)
        stored.append((fmt.dequantize(fmt.quantize(keys)), fmt.dequantize(fmt.quantize(values))))
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(len(lens), heads, head_dim)
    for threads in (1, 2):
        with torch_threads(threads):
            out = cpu_kernels.paged_decode_attention(kernels, q, k_cache, v_cache, fmt.c_type, block_tables,
                                                     torch.tensor(lens, dtype=torch.int32), max(lens), scale)
        for s in range(len(lens)):
            ref = reference_attention(fmt.round_query(q[s: s + 1]), *stored[s], [lens[s] - 1], scale)
            torch.testing.assert_close(out[s: s + 1].double(), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["float32", "float16", "int8"])
def test_long_contexts_split_over_threads(kernels, name):
    """Few sequences behind long contexts: the decode kernel splits each sequence's tokens in chunks
    read by different threads and merges their partial softmaxes (decode_plan); contexts of
    different lengths, the shorter one ending inside an earlier chunk than the longer, give the
    formula's attention."""
    torch.manual_seed(4)
    decode_matches_formula_over_threads(kernels, KV_FORMATS[name], heads=4, kv_heads=2, head_dim=64, block_size=16,
                                        lens=[3000, 1100], tables=[list(range(0, 188)), list(range(300, 369))],
                                        num_blocks=400, scale=0.125)


@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16", "int8"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 256), (16, 8, 128), (8, 1, 64), (4, 4, 128), (6, 2, 96)])
def test_grouped_heads_and_wide_rows(kernels, name, heads, kv_heads, head_dim):
    """Every group size the decode kernel has a path for (GQA groups of 4 at head_dim 256 as
    Qwen3.5's full layers, 2 at 128 as Qwen3's, 8, none, and an odd group of 3), over blocks scattered
    through the cache and contexts that end mid-block and mid-chunk (the rows ahead prefetched from the
    next block of the table), with one and two threads: the formula's attention over the stored values."""
    torch.manual_seed(heads * 31 + head_dim)
    block_size, lens = 16, [1203, 77, 40]
    blocks = [-(-n // block_size) for n in lens]
    order = torch.randperm(sum(blocks) + 5).tolist()
    tables = [order[sum(blocks[:s]): sum(blocks[: s + 1])] for s in range(3)]
    decode_matches_formula_over_threads(kernels, KV_FORMATS[name], heads, kv_heads, head_dim, block_size, lens,
                                        tables, len(order), head_dim ** -0.5)


class torch_threads:
    def __init__(self, n: int):
        self.n, self.old = n, torch.get_num_threads()

    def __enter__(self):
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.old)


@pytest.mark.parametrize("name", ["bfloat16", "int8", "fp8_e4m3"])
def test_torch_path_matches_the_c_kernels(kernels, name):
    """The torch backend without the C kernels (no compiler): store, prefill and decode over the
    same format give the C path's results."""
    fmt = kv_format(name)
    torch.manual_seed(2)
    heads, kv_heads, head_dim, block_size = 4, 2, 32, 16
    results = []
    for use_c in (True, False):
        backend = get_backend("torch", "cpu", fmt)
        if not use_c:
            backend.cpu_kernel = None
        g = torch.Generator().manual_seed(3)
        k_cache = torch.zeros(6, block_size, kv_heads, fmt.row_units(head_dim), dtype=fmt.storage)
        v_cache = torch.zeros_like(k_cache)
        table = torch.tensor([[4, 1, 5]], dtype=torch.int32)
        n = 40
        q, k, v = (torch.randn(n, h, head_dim, generator=g) for h in (heads, kv_heads, kv_heads))
        slots = torch.tensor([int(table[0, t // block_size]) * block_size + t % block_size for t in range(n)])
        backend.store_kvcache(k, v, k_cache, v_cache, slots)
        meta = TorchMetadata(seqlens_q=[n], seqlens_k=[n], block_tables=table, max_seqlen_k=n)
        pre = backend.prefill(q, k, v, k_cache, v_cache, meta, 0.2)
        meta = TorchMetadata(seqlens_k=[n], block_tables=table, context_lens=torch.tensor([n], dtype=torch.int32),
                             max_seqlen_k=n)
        dec = backend.decode(q[-1:], k_cache, v_cache, meta, 0.2)
        results.append((k_cache.view(torch.uint8).clone(), pre, dec))
    (kc, pre_c, dec_c), (kt, pre_t, dec_t) = results
    assert torch.equal(kc, kt)
    # int8: the C prefill kernel rounds probabilities to 16 bits (tests/kernels/test_prefill_attention.py)
    atol = 1e-3 if fmt.blocked else 1e-5
    torch.testing.assert_close(pre_c, pre_t, atol=atol, rtol=1e-4)
    torch.testing.assert_close(dec_c, dec_t, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(pre_c[-1:], dec_c, atol=atol, rtol=1e-4)  # the last row is the decode query's


def test_round_query_is_q8_0_with_an_fp32_scale():
    # By hand: a block of 32 with max |q| 2.54 has d = 0.02; q / d rounded to nearest even.
    q = torch.zeros(2, 32)
    q[0, :4] = torch.tensor([2.54, -1.0, 0.01, 0.03])  # 0.01 / 0.02 = 0.5 -> 0 (even), 0.03 / 0.02 = 1.5 -> 2
    rounded = KV_FORMATS["int8"].round_query(q)
    d = torch.tensor(2.54) / 127
    expected = torch.tensor([127.0, -50.0, 0.0, 2.0]) * d
    torch.testing.assert_close(rounded[0, :4], expected, rtol=1e-6, atol=0)
    assert torch.equal(rounded[1], torch.zeros(32))  # a block of zeros stays zero
    for name in ("float32", "float16", "fp8_e4m3"):  # only int8 multiplies a rounded query
        assert KV_FORMATS[name].round_query(q) is q


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
def test_int8_decode_in_other_builds(other_build_cache, march):
    """The int8 decode's integer dot products in the AVX2 build (what AVX2-only machines run) and the
    plain C one give the formula's attention over the rounded query, as the native build does; and
    so do the grouped paths (int8, float16, bfloat16) at every group size."""
    import os
    import subprocess
    import sys
    if os.uname().machine != "x86_64":
        pytest.skip("x86 builds")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "NANOVLLM_CPU_MARCH": march, "NANOVLLM_CACHE": str(other_build_cache)}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                          "tests/kernels/test_kv_formats.py", "-k",
                          # ("float16" selects bfloat16's cases too)
                          "(formula and int8) or (split_over and int8) or (grouped and (int8 or float16))"],
                         env=env, capture_output=True, text=True, timeout=600, cwd=root)
    assert out.returncode == 0 and "17 passed" in out.stdout, out.stdout[-3000:] + out.stderr[-2000:]
