"""flash-attn attention over the paged KV cache (CUDA only): varlen prefill, paged decode.

Picked by layers/backends when flash-attn imports on CUDA; flash_attn is imported in __init__.
"""
import torch

from nanovllm.layers.backends import FLASH_BLOCK_MULTIPLE, AttentionBackend
from nanovllm.layers.backends.torch_backend import kv_store_for
from nanovllm.utils.context import Context


class FlashBackend(AttentionBackend):
    name = "flash"

    def __init__(self, device: str = "cuda"):
        if device != "cuda":
            raise ValueError(f"the flash attention backend runs on CUDA only, got device {device!r}")
        super().__init__(device)
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache
        self._store = kv_store_for(device)

    def check_block_size(self, block_size: int) -> None:
        if block_size % FLASH_BLOCK_MULTIPLE != 0:
            raise ValueError(f"the flash attention backend needs kvcache_block_size to be a multiple of "
                             f"{FLASH_BLOCK_MULTIPLE} (flash-attn's paged KV cache), got {block_size}")

    def check_dtype(self, dtype: torch.dtype) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"the flash attention backend computes in float16 or bfloat16, got dtype {dtype}")

    def store_kvcache(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        self._store(k, v, k_cache, v_cache, slot_mapping)

    def prefill(self, q, k, v, k_cache, v_cache, context: Context, scale: float) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]. Without a cached prefix the fresh K/V are the whole
        # key range; with one, the keys are read from the paged cache (this step's K/V were stored
        # there first), so cu_seqlens_k counts cached + new tokens.
        block_table = None
        if context.has_cached_prefix and k_cache.numel() > 0:
            k, v, block_table = k_cache, v_cache, context.block_tables
        return self._varlen(
            q, k, v, cu_seqlens_q=context.cu_seqlens_q, cu_seqlens_k=context.cu_seqlens_k,
            max_seqlen_q=context.max_seqlen_q, max_seqlen_k=context.max_seqlen_k,
            softmax_scale=scale, causal=True, block_table=block_table)

    def decode(self, q, k_cache, v_cache, context: Context, scale: float) -> torch.Tensor:
        # One query per sequence: [num_seqs, num_heads, head_dim] -> [num_seqs, 1, num_heads, head_dim].
        # NOTE: reads only context_lens and block_tables (fixed shapes), so CUDA graphs can replay it.
        out = self._with_kvcache(
            q.unsqueeze(1), k_cache, v_cache, cache_seqlens=context.context_lens,
            block_table=context.block_tables, softmax_scale=scale, causal=True)
        return out.squeeze(1)
