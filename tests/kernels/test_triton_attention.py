"""Triton paged-attention kernels and backend vs the torch backend (the reference).

Without CUDA the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 must be
set before the kernels are first imported); with CUDA the same tests run the compiled kernels.
"""
import os
import subprocess
import sys

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from helpers import make_qwen3  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.config import Config  # noqa: E402
from nanovllm.kernels import attention_tuning, triton_attention as ta  # noqa: E402
from nanovllm.layers.backends.base import store_kvcache_torch  # noqa: E402
from nanovllm.layers.backends.kv_formats import KV_FORMATS  # noqa: E402
from nanovllm.layers.backends.torch_backend import TorchBackend, TorchMetadata  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SCALE = 0.3  # not head_dim ** -0.5, so a kernel that ignores the scale argument fails


def tolerance(dtype: torch.dtype) -> dict:
    # fp32: 1e-4 relative. bf16: both sides round p and the output to 8 mantissa bits (vLLM-like).
    return dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1.5e-2)


def build_case(lens: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
               block_size: int, dtype: torch.dtype, seed: int = 0, device: str = DEVICE):
    """Random sequences given as (new tokens, total keys): the whole key range already written to
    a paged cache whose blocks are shuffled and whose unused slots hold garbage.

    Returns q / k / v of the new tokens (packed), the caches, block tables padded with -1, and the
    cumulative lengths.
    """
    gen = torch.Generator(device).manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen, device=device).to(dtype)  # noqa: E731
    blocks_per_seq = [-(-k_len // block_size) for _, k_len in lens]
    num_blocks = sum(blocks_per_seq) + 2
    k_cache, v_cache = randn(num_blocks, block_size, num_kv_heads, head_dim), randn(num_blocks, block_size,
                                                                                     num_kv_heads, head_dim)
    free = torch.randperm(num_blocks, generator=gen, device=device).tolist()
    tables, qs, ks, vs = [], [], [], []
    for (q_len, k_len), n in zip(lens, blocks_per_seq):
        table = [free.pop() for _ in range(n)]
        keys, values = randn(k_len, num_kv_heads, head_dim), randn(k_len, num_kv_heads, head_dim)
        pos = torch.arange(k_len)
        slots = (torch.tensor(table)[pos // block_size] * block_size + pos % block_size).to(device)
        store_kvcache_torch(keys, values, k_cache, v_cache, slots)
        tables.append(table + [-1] * (max(blocks_per_seq) - n))
        qs.append(randn(q_len, num_heads, head_dim))
        ks.append(keys[k_len - q_len:])
        vs.append(values[k_len - q_len:])
    block_tables = torch.tensor(tables, dtype=torch.int32, device=device)
    cu = lambda xs: torch.tensor([0] + xs, device=device).cumsum(0).to(torch.int32)  # noqa: E731
    cu_q, cu_k = cu([q for q, _ in lens]), cu([k for _, k in lens])
    return torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, block_tables, cu_q, cu_k


def prefill_metadata(lens, block_tables) -> TorchMetadata:
    """The torch backend's prefill metadata: block tables only when some sequence has a prefix."""
    has_prefix = any(k > q for q, k in lens)
    return TorchMetadata(seqlens_q=[q for q, _ in lens], seqlens_k=[k for _, k in lens],
                         block_tables=block_tables if has_prefix else None)


def in_format(kv: str | None, *caches: torch.Tensor):
    """(the torch backend over caches in KV format kv, the caches stored in it); None: as they are."""
    if kv is None:
        return TorchBackend(), caches
    fmt = KV_FORMATS[kv]
    return TorchBackend(kv_format=fmt), tuple(fmt.quantize(c) for c in caches)


def check_decode(context_lens, group, block_size, dtype, num_splits, head_dim=32, num_kv_heads=2, seed=0, kv=None):
    lens = [(1, c) for c in context_lens]
    q, _, _, k_cache, v_cache, tables, _, _ = build_case(lens, group * num_kv_heads, num_kv_heads, head_dim,
                                                         block_size, dtype, seed)
    reference, (k_cache, v_cache) = in_format(kv, k_cache, v_cache)
    ctx_lens = torch.tensor(context_lens, dtype=torch.int32, device=q.device)
    ref = reference.decode(q, k_cache, v_cache, TorchMetadata(block_tables=tables, context_lens=ctx_lens), SCALE)
    out = ta.paged_decode_attention(q, k_cache, v_cache, tables, ctx_lens, SCALE, max(context_lens), num_splits)
    torch.testing.assert_close(out, ref, **tolerance(dtype))


def check_prefill(lens, group, block_size, dtype, tiles=(None, None), head_dim=32, num_kv_heads=2, seed=0, kv=None):
    q, k, v, k_cache, v_cache, tables, cu_q, cu_k = build_case(lens, group * num_kv_heads, num_kv_heads,
                                                               head_dim, block_size, dtype, seed)
    reference, (k_cache, v_cache) = in_format(kv, k_cache, v_cache)
    metadata = prefill_metadata(lens, tables)
    ref = reference.prefill(q, k, v, k_cache, v_cache, metadata, SCALE)
    out = ta.paged_prefill_attention(q, k, v, k_cache, v_cache, cu_q, cu_k, max(q for q, _ in lens), SCALE,
                                     metadata.block_tables, block_m=tiles[0], block_n=tiles[1])
    torch.testing.assert_close(out, ref, **tolerance(dtype))


# Contexts: one token, exactly one 16-block, mid-block ends, and a long one beside short ones.
DECODE_LENS = [1, 16, 37, 150]


@pytest.mark.parametrize("group, num_kv_heads, block_size, dtype, num_splits, head_dim", [
    (1, 2, 16, torch.float32, 1, 32),
    (2, 2, 16, torch.float32, 3, 32),  # split-K with a split count that is not a power of two
    (4, 2, 256, torch.float32, 1, 64),
    (4, 1, 16, torch.bfloat16, 2, 32),
    (2, 2, 256, torch.bfloat16, 1, 24),  # head_dim not a power of two: padded and masked
    (3, 2, 16, torch.float32, 2, 16),  # a group size that is not a power of two (e.g. 28 / 4 heads)
])
def test_decode_matches_torch(group, num_kv_heads, block_size, dtype, num_splits, head_dim):
    check_decode(DECODE_LENS, group, block_size, dtype, num_splits, head_dim, num_kv_heads)


@pytest.mark.parametrize("kv, dtype, num_splits", [
    ("fp8_e4m3", torch.float32, 1),
    ("fp8_e5m2", torch.float32, 2),
    ("fp8_e4m3", torch.bfloat16, 2),
    ("fp8_e5m2", torch.float16, 1),
])
def test_decode_reads_fp8_caches(kv, dtype, num_splits):
    # The reference dequantizes a gathered copy of the same stored bytes.
    check_decode(DECODE_LENS, 2, 16, dtype, num_splits, kv=kv)


def test_decode_split_count_larger_than_context():
    # 8 splits over 1-3 tiles: most splits are empty and must weigh nothing in the merge.
    check_decode([3, 40], group=2, block_size=16, dtype=torch.float32, num_splits=8, num_kv_heads=1)


# (new tokens, total keys): no prefix (1 and 70 tokens), prefixes ending mid-block and on a block
# edge, a long prefix with few new tokens, all in one batch.
PREFILL_LENS = [(1, 1), (6, 29), (5, 37), (3, 150), (70, 70)]


@pytest.mark.parametrize("group, num_kv_heads, block_size, dtype, tiles, head_dim", [
    (1, 2, 16, torch.float32, (None, None), 32),
    (2, 2, 16, torch.float32, (16, 16), 32),  # small tiles: many causal diagonal tiles
    (4, 2, 256, torch.float32, (None, None), 32),
    (2, 2, 256, torch.bfloat16, (None, None), 24),
    (4, 1, 16, torch.bfloat16, (32, 16), 32),  # two key tiles per diagonal
])
def test_prefill_matches_torch(group, num_kv_heads, block_size, dtype, tiles, head_dim):
    check_prefill(PREFILL_LENS, group, block_size, dtype, tiles, head_dim, num_kv_heads)


@pytest.mark.parametrize("kv, dtype", [("fp8_e4m3", torch.float32), ("fp8_e5m2", torch.bfloat16)])
def test_prefill_over_fp8_caches(kv, dtype):
    # Cached prefixes read as stored, and the fresh keys and values rounded as the cache will hold
    # them (fp32 would differ by up to fp8's 2^-4 relative step, far past the tolerance).
    check_prefill(PREFILL_LENS, 2, 16, dtype, (16, 16), kv=kv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_without_cache(dtype):
    # The warm-up pass: no cached prefix and an empty cache; keys come from k/v alone.
    lens = [(1, 1), (40, 40), (9, 9)]
    q, k, v, _, _, _, cu_q, cu_k = build_case(lens, 4, 2, 32, 16, dtype)
    empty = torch.tensor([], dtype=dtype, device=q.device)
    ref = TorchBackend().prefill(q, k, v, empty, empty, prefill_metadata(lens, None), SCALE)
    out = ta.paged_prefill_attention(q, k, v, empty, empty, cu_q, cu_k, 40, SCALE, None, block_m=16, block_n=16)
    torch.testing.assert_close(out, ref, **tolerance(dtype))


def test_bad_head_counts_raise():
    q, _, _, k_cache, v_cache, tables, _, _ = build_case([(1, 5)], 3, 2, 16, 16, torch.float32)
    lens = torch.tensor([5], dtype=torch.int32, device=q.device)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ta.paged_decode_attention(q, k_cache, v_cache, tables, lens, SCALE)
    cu = torch.tensor([0, 1], dtype=torch.int32, device=q.device)
    k = k_cache[0, :1]  # [1, 2, 16]
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ta.paged_prefill_attention(q, k, k, k_cache, v_cache, cu, cu, 1, SCALE)


def test_num_splits_heuristic(monkeypatch):
    monkeypatch.setattr(attention_tuning, "_num_sms", lambda index: 132)
    choose_num_splits = attention_tuning.choose_num_splits
    cuda = torch.device("cuda", 0)
    # 1 seq x 8 KV heads = 8 programs: 2 * 132 / 8 = 33 by occupancy, 4096 / 256 = 16 by length.
    assert choose_num_splits(1, 8, 4096, cuda) == 16
    assert choose_num_splits(1, 8, 512, cuda) == 2  # short context: few splits
    assert choose_num_splits(4, 8, 0, cuda) == 8  # unknown length: 264 / 32 = 8.25 -> 8
    assert choose_num_splits(32, 8, 4096, cuda) == 1  # 256 programs fill 132 SMs
    assert choose_num_splits(1, 8, 4096, torch.device("cpu")) == 1


# ---- engine -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return make_qwen3(str(tmp_path_factory.mktemp("qwen3_gqa")), "gqa")


def generate_twice(path: str, backend: str, kv_cache_dtype: str = "float32") -> tuple[list[list[int]], list[bool]]:
    """Two rounds of greedy generation; the second reuses the first round's cached prefix blocks.
    Also returns, per prefill step, whether some sequence had a cached prefix."""
    first = [5 + (i * 7) % 200 for i in range(40)]
    rounds = [[first, [3, 4, 5]], [first[:36] + [9, 9], [11] * 21]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = LLM(path, device=DEVICE, attention_backend=backend, dtype="float32", kv_cache_dtype=kv_cache_dtype, max_num_seqs=4,
              max_num_batched_tokens=32, max_model_len=128, enforce_eager=True)  # 32: chunked prefill
    runner_backend = llm.llm_engine.model_runner.backend
    prefill, prefix_flags = runner_backend.prefill, []

    def recording_prefill(q, k, v, k_cache, v_cache, metadata, scale, **options):
        prefix_flags.append(metadata.block_tables is not None)  # the table comes with a cached prefix
        return prefill(q, k, v, k_cache, v_cache, metadata, scale, **options)

    runner_backend.prefill = recording_prefill
    try:
        tokens = [o["token_ids"] for prompts in rounds for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.exit()
    return tokens, prefix_flags


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "fp8_e4m3"])
def test_engine_greedy_tokens_match_torch_backend(model_path, kv_cache_dtype):
    # fp8: the Triton store and kernels hold and read the same values as the torch backend's (C) ones,
    # through chunked prefill and prefix-cache hits.
    triton_tokens, prefix_flags = generate_twice(model_path, "triton", kv_cache_dtype)
    torch_tokens, _ = generate_twice(model_path, "torch", kv_cache_dtype)
    assert any(prefix_flags) and not all(prefix_flags)  # both prefill kernel variants ran
    assert triton_tokens == torch_tokens


def test_triton_on_cpu_needs_interpreter(model_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        Config(model_path, device="cpu", attention_backend="triton")


@pytest.mark.slow
def test_kernels_build_for_hopper_without_spills():
    # The interpreter never compiles; this does, for sm_90, with the launchers' own tile table,
    # and fails on a build error, a register spill or a shared-memory overflow. No GPU needed.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root
    result = subprocess.run([sys.executable, os.path.join(root, "scripts", "check_triton_build.py"), "--quick"],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    assert result.stdout.count(" ok") == 6  # prefill, decode (split-K), merge; prefill, decode, store over fp8


# ---- GPU: realistic sizes ---------------------------------------------------------------------
@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("head_dim, group", [(64, 1), (128, 4), (256, 2)])
def test_decode_realistic_sizes(block_size, head_dim, group):
    gen = torch.Generator().manual_seed(1)
    context_lens = torch.randint(1, 4097, (48,), generator=gen).tolist() + [1, 4096]
    for num_splits in (None, 1, 8):  # the heuristic's choice, and forced values
        check_decode(context_lens, group, block_size, torch.bfloat16, num_splits, head_dim, num_kv_heads=8)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("head_dim, group", [(64, 1), (128, 4), (256, 2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_prefill_realistic_sizes(block_size, head_dim, group, dtype):
    lens = [(1, 1), (1000, 1000), (300, 2348), (17, 4000), (2048, 2048), (129, 129), (64, 576)]
    check_prefill(lens, group, block_size, dtype, head_dim=head_dim, num_kv_heads=8)
