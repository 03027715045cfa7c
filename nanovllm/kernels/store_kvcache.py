"""Triton kernel that writes this step's K/V rows into the paged KV cache.

Used on CUDA by the attention backends (flash, triton, torch) and by the triton backend everywhere;
the CPU path is the torch code in layers/backends/. Tested on CPU under TRITON_INTERPRET=1 against
that code.

fp8 caches (kv_cache_dtype "fp8_e4m3" / "fp8_e5m2", vLLM's at scale 1): each value is clamped to
the format's largest finite value and rounded to nearest even, bit for bit what KVFormat.quantize
(torch's conversion) writes. The rounding is done here in fp32 and integer arithmetic rather than
by Triton's fp8 cast: that cast needs sm_89+ for e4m3, and its interpreter rounds values below the
smallest subnormal away from zero, so the tests would not pin the GPU's behaviour.
"""
import math

import torch
import triton
import triton.language as tl

FP8_FORMATS = (torch.float8_e4m3fn, torch.float8_e5m2)  # the fp8 storage dtypes


@triton.jit
def fp8_round(x, MANT: tl.constexpr, EMIN: tl.constexpr, LIMIT: tl.constexpr):
    """x (fp32) clamped to +-LIMIT and rounded to nearest even on the fp8 grid: the value the cache
    will hold, still in fp32 (exact: fp8 values are fp32 values)."""
    a = tl.minimum(tl.abs(x), LIMIT)
    # The grid's spacing near a is 2^(e - MANT), e = a's exponent, never below EMIN (subnormals).
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, EMIN)
    # Adding 2^(e - MANT + 23) moves a to a binade whose fp32 ulp is that spacing, so the add
    # rounds a to the grid (nearest even, fp32's rounding); the subtraction is exact.
    magic = ((e - MANT + 23 + 127) << 23).to(tl.float32, bitcast=True)
    r = (a + magic) - magic
    return tl.where(x < 0, -r, r)


@triton.jit
def fp8_bits(x, MANT: tl.constexpr, EMIN: tl.constexpr, LIMIT: tl.constexpr):
    """The fp8 bit pattern (uint8) of fp8_round(x): sign, biased exponent, mantissa."""
    r = tl.abs(fp8_round(x, MANT, EMIN, LIMIT))
    rb = r.to(tl.int32, bitcast=True)
    e = ((rb >> 23) & 0xFF) - 127
    normal = ((e + 1 - EMIN) << MANT) | ((rb >> (23 - MANT)) & ((1 << MANT) - 1))
    # Below 2^EMIN the code is r / 2^(EMIN - MANT), an integer below 2^MANT, exactly (the clamp
    # only keeps the unused lane of larger values from overflowing the conversion).
    subnormal = (tl.minimum(r, 2.0 ** EMIN) * (2.0 ** (MANT - EMIN))).to(tl.int32)
    code = tl.where(e >= EMIN, normal, subnormal)
    sign = (x.to(tl.int32, bitcast=True) >> 24) & 0x80  # -0.0 and tiny negatives keep their sign, as torch's
    return (code | sign).to(tl.uint8)


@triton.jit
def _store_kvcache_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                          k_token_stride, v_token_stride,
                          ROW_SIZE: tl.constexpr, BLOCK: tl.constexpr, FP8: tl.constexpr,
                          MANT: tl.constexpr, EMIN: tl.constexpr, LIMIT: tl.constexpr):
    # One program per new token: copy its [num_kv_heads * head_dim] K row and V row to its slot.
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # -1: padding (CUDA graph rows, warm-up); nothing to store
        return
    offsets = tl.arange(0, BLOCK)
    mask = offsets < ROW_SIZE
    src = token.to(tl.int64)
    k = tl.load(k_ptr + src * k_token_stride + offsets, mask=mask)
    v = tl.load(v_ptr + src * v_token_stride + offsets, mask=mask)
    if FP8:  # the caches are passed as uint8 views
        k = fp8_bits(k.to(tl.float32), MANT, EMIN, LIMIT)
        v = fp8_bits(v.to(tl.float32), MANT, EMIN, LIMIT)
    tl.store(k_cache_ptr + slot * ROW_SIZE + offsets, k, mask=mask)
    tl.store(v_cache_ptr + slot * ROW_SIZE + offsets, v, mask=mask)


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, num_kv_heads, head_dim] with each token's heads laid out back to back."""
    num_kv_heads, head_dim = x.shape[1:]
    if x.stride(2) == 1 and x.stride(1) == head_dim:
        return x  # e.g. v, a column slice of the fused qkv output: rows are strided, heads are not
    return x.contiguous()


def fp8_constants(dtype: torch.dtype) -> dict:
    """The fp8 kernels' constexprs for a cache of dtype, from torch's description of the format:
    mantissa bits, the smallest normal exponent, the largest finite value (e4m3's as placeholders
    for other dtypes)."""
    f = torch.finfo(dtype if dtype in FP8_FORMATS else torch.float8_e4m3fn)
    return dict(MANT=round(-math.log2(f.eps)), EMIN=round(math.log2(f.smallest_normal)), LIMIT=f.max)


def store_kvcache_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> None:
    """Write k[i], v[i] ([num_tokens, num_kv_heads, head_dim]) to slot slot_mapping[i] of the caches
    ([num_blocks, block_size, num_kv_heads, head_dim]), converted to the caches' dtype (an fp8 one
    as described above); slot -1 is skipped. No host sync, so it can be captured in a CUDA graph."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and slot_mapping.numel() == num_tokens
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (num_kv_heads, head_dim)
    # NOTE: slot * row_size addressing needs each layer's cache to be one contiguous block.
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    if num_tokens == 0:
        return
    fp8, constants = k_cache.dtype in FP8_FORMATS, fp8_constants(k_cache.dtype)
    if fp8:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    k, v = _rows_contiguous(k), _rows_contiguous(v)
    row_size = num_kv_heads * head_dim
    _store_kvcache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
        ROW_SIZE=row_size, BLOCK=triton.next_power_of_2(row_size), FP8=fp8, **constants)
