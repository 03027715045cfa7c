"""Triton kernel that writes this step's K/V rows into the paged KV cache.

Used on CUDA by the attention backends (flash, triton, torch); the CPU path is the torch code in
layers/backends/torch_backend.py. Tested on CPU under TRITON_INTERPRET=1 against that code.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _store_kvcache_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                          k_token_stride, v_token_stride,
                          ROW_SIZE: tl.constexpr, BLOCK: tl.constexpr):
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
    tl.store(k_cache_ptr + slot * ROW_SIZE + offsets, k, mask=mask)
    tl.store(v_cache_ptr + slot * ROW_SIZE + offsets, v, mask=mask)


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, num_kv_heads, head_dim] with each token's heads laid out back to back."""
    num_kv_heads, head_dim = x.shape[1:]
    if x.stride(2) == 1 and x.stride(1) == head_dim:
        return x  # e.g. v, a column slice of the fused qkv output: rows are strided, heads are not
    return x.contiguous()


def store_kvcache_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> None:
    """Write k[i], v[i] ([num_tokens, num_kv_heads, head_dim]) to slot slot_mapping[i] of the caches
    ([num_blocks, block_size, num_kv_heads, head_dim]); slot -1 is skipped. No host sync, so it
    can be captured in a CUDA graph."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and slot_mapping.numel() == num_tokens
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (num_kv_heads, head_dim)
    # NOTE: slot * row_size addressing needs each layer's cache to be one contiguous block.
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    if num_tokens == 0:
        return
    k, v = _rows_contiguous(k), _rows_contiguous(v)
    row_size = num_kv_heads * head_dim
    _store_kvcache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
        ROW_SIZE=row_size, BLOCK=triton.next_power_of_2(row_size))
