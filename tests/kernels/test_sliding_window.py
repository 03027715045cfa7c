"""Sliding-window attention and Gemma 2's logit soft-capping in every attention path against a
plain-torch formula (softmax of the scaled scores, capped by softcap * tanh(s / softcap), with keys
outside [p - window + 1, p] masked): the torch backend's prefill (fresh and
over a cached prefix) and decode (the C kernel, whole-sequence and split plans, and the torch
fallbacks), and the Triton kernels (interpreted on CPU), with windows below, at and above the
context and not aligned to the block size."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from nanovllm.kernels import cpu_kernels  # noqa: E402
from nanovllm.layers.backends.base import store_kvcache_torch  # noqa: E402
from nanovllm.layers.backends.torch_backend import TorchBackend, TorchMetadata  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Triton: compiled on CUDA, else interpreted
SCALE = 0.3
HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 32, 16


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, window: int | None,
              softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [n, H, D] at the last n positions of keys/values [L, Hkv, D]."""
    n, length = q.shape[0], keys.shape[0]
    group = q.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * SCALE
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(length - n, length)[:, None]
    k_pos = torch.arange(length)[None, :]
    seen = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is None:
        probs = scores.softmax(-1)
    else:  # exp(s_t) / (sum_u exp(s_u) + exp(sink_h)), written out
        top = torch.maximum(scores.amax(-1, keepdim=True), sinks.view(-1, 1, 1))
        e = (scores - top).exp()
        probs = e / (e.sum(-1, keepdim=True) + (sinks.view(-1, 1, 1) - top).exp())
    return torch.einsum("hqk,khd->qhd", probs, v)


SINKS = torch.tensor([0.5, -1.0, 2.0, 3.5])  # per query head (HEADS = 4); 3.5 outweighs most scores


def case(lens: list[tuple[int, int]], seed: int = 0):
    """Sequences of (new tokens, keys) written whole to a paged cache with shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-k // BLOCK) for _, k in lens]
    num_blocks = sum(per_seq) + 1
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=gen)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    seqs, tables = [], []
    for (q_len, k_len), n in zip(lens, per_seq):
        table = [free.pop() for _ in range(n)]
        keys, values = torch.randn(k_len, KV_HEADS, DIM, generator=gen), torch.randn(k_len, KV_HEADS, DIM, generator=gen)
        pos = torch.arange(k_len)
        store_kvcache_torch(keys, values, k_cache, v_cache, torch.tensor(table)[pos // BLOCK] * BLOCK + pos % BLOCK)
        seqs.append((torch.randn(q_len, HEADS, DIM, generator=gen), keys, values))
        tables.append(table + [-1] * (max(per_seq) - n))
    return seqs, k_cache, v_cache, torch.tensor(tables, dtype=torch.int32)


WINDOWS = [None, 1, 7, 16, 40, 500]
LENS = [(5, 5), (37, 37), (3, 50), (20, 90)]  # fresh prompts, chunks over a cached prefix


CAPS = [None, 1.5]  # 1.5: below the scaled scores' spread, so the cap changes every softmax


@pytest.mark.parametrize("softcap", CAPS)
@pytest.mark.parametrize("window", WINDOWS)
def test_torch_prefill(window, softcap):
    seqs, k_cache, v_cache, tables = case(LENS)
    meta = TorchMetadata(seqlens_q=[q for q, _ in LENS], seqlens_k=[k for _, k in LENS], block_tables=tables)
    q = torch.cat([s[0] for s in seqs])
    k = torch.cat([s[1][-len(s[0]):] for s in seqs])
    v = torch.cat([s[2][-len(s[0]):] for s in seqs])
    got = TorchBackend().prefill(q, k, v, k_cache, v_cache, meta, SCALE, window, softcap)
    want = torch.cat([reference(*s, window, softcap) for s in seqs])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("softcap", CAPS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("lens", [[1, 2, 17, 33, 100, 150], [1300], [600, 2100]])  # split plans from 2 x 512
def test_decode_paths(window, lens, softcap):
    seqs, k_cache, v_cache, tables = case([(1, n) for n in lens], seed=len(lens))
    q = torch.cat([s[0] for s in seqs])
    context_lens = torch.tensor(lens, dtype=torch.int32)
    want = torch.cat([reference(*s, window, softcap) for s in seqs])
    backend = TorchBackend()
    meta = TorchMetadata(seqlens_k=list(lens), block_tables=tables, context_lens=context_lens, max_seqlen_k=max(lens))
    def check():
        got = backend.decode(q, k_cache, v_cache, meta, SCALE, window, softcap)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    if backend.cpu_kernel is not None:  # the C kernel
        check()
    backend.cpu_kernel = None  # the torch fallbacks: length groups, and one padded batch
    check()
    meta.seqlens_k = None
    check()


def test_c_kernel_with_more_threads_than_sequences():
    if cpu_kernels.load() is None:
        pytest.skip("the C kernels did not build")
    seqs, k_cache, v_cache, tables = case([(1, 3000)], seed=9)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        got = cpu_kernels.paged_decode_attention(cpu_kernels.load(), seqs[0][0], k_cache, v_cache, 0, tables,
                                                 torch.tensor([3000], dtype=torch.int32), 3000, SCALE, 1100)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(got, reference(*seqs[0], 1100), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("window, softcap", [(None, None), (7, None), (40, None), (None, 1.5), (7, 1.5)])
def test_triton_kernels(window, softcap):
    pytest.importorskip("triton")
    from nanovllm.kernels import triton_attention as ta

    seqs, k_cache, v_cache, tables = case(LENS)
    q = torch.cat([s[0] for s in seqs])
    k = torch.cat([s[1][-len(s[0]):] for s in seqs])
    v = torch.cat([s[2][-len(s[0]):] for s in seqs])
    cu = lambda xs: torch.tensor([0] + xs, device=DEVICE).cumsum(0).to(torch.int32)  # noqa: E731
    on = lambda *ts: [t.to(DEVICE) for t in ts]  # noqa: E731
    got = ta.paged_prefill_attention(*on(q, k, v, k_cache, v_cache), cu([a for a, _ in LENS]), cu([b for _, b in LENS]),
                                     max(a for a, _ in LENS), SCALE, tables.to(DEVICE), block_m=16, block_n=16,
                                     window=window, softcap=softcap)
    torch.testing.assert_close(got.cpu(), torch.cat([reference(*s, window, softcap) for s in seqs]), rtol=1e-4,
                               atol=1e-5)
    lens = [1, 17, 90, 150]
    seqs, k_cache, v_cache, tables = case([(1, n) for n in lens], seed=3)
    q = torch.cat([s[0] for s in seqs])
    want = torch.cat([reference(*s, window, softcap) for s in seqs])
    for splits in (1, 3):
        got = ta.paged_decode_attention(*on(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)), SCALE,
                                        max_context_len=max(lens), num_splits=splits, block_n=16, window=window,
                                        softcap=softcap)
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("window", [None, 7])
def test_attention_sinks(window):
    """GPT-OSS's sinks through the torch prefill, every decode path and the Triton kernels."""
    seqs, k_cache, v_cache, tables = case(LENS, seed=4)
    meta = TorchMetadata(seqlens_q=[q for q, _ in LENS], seqlens_k=[k for _, k in LENS], block_tables=tables)
    q = torch.cat([s[0] for s in seqs])
    k = torch.cat([s[1][-len(s[0]):] for s in seqs])
    v = torch.cat([s[2][-len(s[0]):] for s in seqs])
    want = torch.cat([reference(*s, window, None, SINKS) for s in seqs])
    got = TorchBackend().prefill(q, k, v, k_cache, v_cache, meta, SCALE, window, None, SINKS)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    triton = None
    try:
        from nanovllm.kernels import triton_attention as triton
    except ImportError:
        pass
    cu = lambda xs: torch.tensor([0] + xs, device=DEVICE).cumsum(0).to(torch.int32)  # noqa: E731
    on = lambda *ts: [t.to(DEVICE) for t in ts]  # noqa: E731
    if triton is not None:
        got = triton.paged_prefill_attention(*on(q, k, v, k_cache, v_cache), cu([a for a, _ in LENS]),
                                             cu([b for _, b in LENS]), max(a for a, _ in LENS), SCALE,
                                             tables.to(DEVICE), block_m=16, block_n=16, window=window,
                                             sinks=SINKS.to(DEVICE))
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)
    for lens in ([1, 17, 90, 150], [1300]):
        seqs, k_cache, v_cache, tables = case([(1, n) for n in lens], seed=5)
        q = torch.cat([s[0] for s in seqs])
        context_lens = torch.tensor(lens, dtype=torch.int32)
        want = torch.cat([reference(*s, window, None, SINKS) for s in seqs])
        backend = TorchBackend()
        meta = TorchMetadata(seqlens_k=list(lens), block_tables=tables, context_lens=context_lens,
                             max_seqlen_k=max(lens))
        results = []
        if backend.cpu_kernel is not None:
            results.append(backend.decode(q, k_cache, v_cache, meta, SCALE, window, None, SINKS))
        backend.cpu_kernel = None
        results.append(backend.decode(q, k_cache, v_cache, meta, SCALE, window, None, SINKS))
        if triton is not None:
            results += [triton.paged_decode_attention(*on(q, k_cache, v_cache, tables, context_lens), SCALE,
                                                      max_context_len=max(lens), num_splits=splits, block_n=16,
                                                      window=window, sinks=SINKS.to(DEVICE)).cpu()
                        for splits in (1, 3)]
        for got in results:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
