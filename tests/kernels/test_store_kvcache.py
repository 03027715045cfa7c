"""The Triton KV-store kernel equals the torch store exactly (TRITON_INTERPRET=1 on CPU, see conftest)."""
import pytest
import torch

from nanovllm.layers.backends.base import store_kvcache_torch

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LAYOUTS = [  # (num_kv_heads, head_dim): one head, GQA-like, a row size that is not a power of two
    (1, 8),
    (2, 16),
    (3, 24),
]


def store_loop(k, v, k_cache, v_cache, slot_mapping) -> None:
    """A third reference, one token at a time, straight from the slot definition."""
    block_size = k_cache.shape[1]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_cache[slot // block_size, slot % block_size] = k[i]
            v_cache[slot // block_size, slot % block_size] = v[i]


def make_case(num_kv_heads, head_dim, dtype, num_tokens=7, num_blocks=3, block_size=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # Non-zero caches, so a write to a wrong slot or to a skipped one shows.
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    # k, v as the model makes them: column slices of one fused qkv tensor (strided rows).
    q_size, kv_size = 2 * num_kv_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=g).to(dtype)
    _, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v = v.view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[1::3] = -1  # tokens 1, 4, ...: padding
    return k, v, k_cache, v_cache, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,head_dim", LAYOUTS)
def test_triton_store_equals_torch_store(dtype, num_kv_heads, head_dim):
    from nanovllm.kernels.store_kvcache import store_kvcache_triton

    k, v, k_cache, v_cache, slots = make_case(num_kv_heads, head_dim, dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache_torch(k, v, k_ref, v_ref, slots)
    k_loop, v_loop = k_cache.clone(), v_cache.clone()
    store_loop(k, v, k_loop, v_loop, slots)
    assert torch.equal(k_ref, k_loop) and torch.equal(v_ref, v_loop)

    k_out, v_out = k_cache.clone().to(DEVICE), v_cache.clone().to(DEVICE)
    store_kvcache_triton(k.to(DEVICE), v.to(DEVICE), k_out, v_out, slots.to(DEVICE))
    assert torch.equal(k_out.cpu(), k_ref)
    assert torch.equal(v_out.cpu(), v_ref)
    # The skipped tokens' rows went nowhere: exactly one slot changed per stored token.
    changed = (k_out.cpu() != k_cache).flatten(2).any(-1).sum().item()
    assert changed == int((slots >= 0).sum()) == 5


def test_triton_store_int32_slots_and_contiguous_input():
    from nanovllm.kernels.store_kvcache import store_kvcache_triton

    k, v, k_cache, v_cache, slots = make_case(2, 16, torch.float32, seed=1)
    k, v = k.contiguous(), v.clone()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_loop(k, v, k_ref, v_ref, slots)
    k_out, v_out = k_cache.clone().to(DEVICE), v_cache.clone().to(DEVICE)
    store_kvcache_triton(k.to(DEVICE), v.to(DEVICE), k_out, v_out, slots.to(torch.int32).to(DEVICE))
    assert torch.equal(k_out.cpu(), k_ref) and torch.equal(v_out.cpu(), v_ref)


def test_triton_store_all_skipped_and_empty():
    from nanovllm.kernels.store_kvcache import store_kvcache_triton

    k, v, k_cache, v_cache, slots = make_case(1, 8, torch.float32, num_tokens=3, seed=2)
    k_out, v_out = k_cache.clone().to(DEVICE), v_cache.clone().to(DEVICE)
    store_kvcache_triton(k.to(DEVICE), v.to(DEVICE), k_out, v_out, torch.full((3,), -1, device=DEVICE))
    assert torch.equal(k_out.cpu(), k_cache) and torch.equal(v_out.cpu(), v_cache)
    empty = torch.empty(0, 1, 8, device=DEVICE)
    store_kvcache_triton(empty, empty, k_out, v_out, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(k_out.cpu(), k_cache)


def fp8_inputs(dtype: torch.dtype) -> torch.Tensor:
    """Every finite fp16 value (ties, subnormals, both zeros, past fp8's range), and fp32 values
    from 1e-30 to 1e30 of both signs, as token rows of 8 heads x 128."""
    every_f16 = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
    every_f16 = every_f16[every_f16.isfinite()].float()
    wide = torch.logspace(-30, 30, 4096) * torch.tensor([1.0, -1.0]).repeat(2048)
    x = torch.cat([every_f16, wide] if dtype == torch.float32 else [every_f16]).to(dtype)
    return x[: x.numel() // 1024 * 1024].view(-1, 8, 128)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_store_writes_fp8_bytes_of_the_reference(name, dtype):
    # Bit for bit what KVFormat.quantize (torch: clamp, then round to nearest even) writes.
    from nanovllm.kernels.store_kvcache import store_kvcache_triton
    from nanovllm.layers.backends.kv_formats import KV_FORMATS

    fmt = KV_FORMATS[name]
    x = fp8_inputs(dtype)
    rows = x.shape[0]
    slots = torch.randperm(rows + 8, generator=torch.Generator().manual_seed(3))[:rows]
    slots[5] = -1
    k_cache = torch.full((rows + 8, 1, 8, 128), 0.5).to(fmt.storage)  # a value no input row leaves behind
    v_cache = k_cache.clone()
    store_kvcache_triton(x.to(DEVICE), (-x).to(DEVICE), k_out := k_cache.to(DEVICE), v_out := v_cache.to(DEVICE),
                         slots.to(DEVICE))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    k_ref.view(-1, 8, 128)[slots[keep]] = fmt.quantize(x[keep])
    v_ref.view(-1, 8, 128)[slots[keep]] = fmt.quantize(-x[keep])
    assert torch.equal(k_out.cpu().view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_out.cpu().view(torch.uint8), v_ref.view(torch.uint8))
