"""flash-attn attention over the paged KV cache (CUDA only): varlen prefill, paged decode.

Picked by 'auto' on CUDA when its rules below hold; flash_attn itself is imported in __init__.
"""
import importlib.util

import torch

from nanovllm.layers.backends.base import PagedBackend, PagedMetadata

# flash-attn's paged KV kernels address the cache in pages of a multiple of this many tokens.
FLASH_BLOCK_MULTIPLE = 256


class FlashBackend(PagedBackend):
    name = "flash"
    auto_devices = ("cuda",)

    def __init__(self, device: str = "cuda", kv_format=None):
        super().__init__(device, kv_format)
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache

    @classmethod
    def unavailable_reason(cls, device: str) -> str | None:
        if device != "cuda":
            return "flash-attn runs on CUDA only"
        if importlib.util.find_spec("flash_attn") is None:
            return "flash-attn is not installed"
        return None

    @classmethod
    def block_size_error(cls, block_size: int) -> str | None:
        if block_size % FLASH_BLOCK_MULTIPLE != 0:
            return (f"kvcache_block_size {block_size} is not a multiple of {FLASH_BLOCK_MULTIPLE} "
                    "(flash-attn's paged KV cache)")
        return None

    @classmethod
    def dtype_error(cls, dtype: torch.dtype) -> str | None:
        if dtype not in (torch.float16, torch.bfloat16):
            return f"flash-attn computes in fp16/bf16 only, the model runs in {dtype}"
        return None

    @staticmethod
    def window_size(window: int | None) -> tuple[int, int]:
        """flash-attn's (left, right): keys before the query it may see (-1: all), none after."""
        return (-1, -1) if window is None else (window - 1, 0)

    @staticmethod
    def check_sinks(sinks) -> None:
        if sinks is not None:
            raise ValueError("flash-attn has no attention sinks; run this model with attention_backend='triton'")

    def prefill(self, q, k, v, k_cache, v_cache, metadata: PagedMetadata, scale: float,
                window: int | None = None, softcap: float | None = None, sinks=None) -> torch.Tensor:
        self.check_sinks(sinks)
        # q: [num_tokens, num_heads, head_dim]. Without a cached prefix the fresh K/V are the whole
        # key range; with one, the keys are read from the paged cache (this step's K/V were stored
        # there first), so cu_seqlens_k counts cached + new tokens.
        block_table = None
        if metadata.block_tables is not None and k_cache.numel() > 0:
            k, v, block_table = k_cache, v_cache, metadata.block_tables
        return self._varlen(
            q, k, v, cu_seqlens_q=metadata.cu_seqlens_q, cu_seqlens_k=metadata.cu_seqlens_k,
            max_seqlen_q=metadata.max_seqlen_q, max_seqlen_k=metadata.max_seqlen_k,
            softmax_scale=scale, causal=True, block_table=block_table, window_size=self.window_size(window),
            softcap=softcap or 0.0)

    def decode(self, q, k_cache, v_cache, metadata: PagedMetadata, scale: float,
               window: int | None = None, softcap: float | None = None, sinks=None) -> torch.Tensor:
        self.check_sinks(sinks)
        # One query per sequence: [num_seqs, num_heads, head_dim] -> [num_seqs, 1, num_heads, head_dim].
        # NOTE: reads only context_lens and block_tables (fixed shapes), so CUDA graphs can replay it.
        out = self._with_kvcache(
            q.unsqueeze(1), k_cache, v_cache, cache_seqlens=metadata.context_lens,
            block_table=metadata.block_tables, softmax_scale=scale, causal=True, window_size=self.window_size(window),
            softcap=softcap or 0.0)
        return out.squeeze(1)
