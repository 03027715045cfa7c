"""Triton attention backend: the project's own paged-attention kernels (nanovllm/kernels), for CUDA
machines without flash-attn. On CPU it runs only under TRITON_INTERPRET=1 (slow; for tests)."""
import torch

from nanovllm.kernels.triton_attention import paged_decode_attention, paged_prefill_attention
from nanovllm.layers.backends import AttentionBackend
from nanovllm.layers.backends.torch_backend import kv_store_for
from nanovllm.utils.context import Context


class TritonBackend(AttentionBackend):
    name = "triton"

    def __init__(self, device: str = "cpu"):
        super().__init__(device)
        self._store = kv_store_for(device)  # the Triton store kernel on CUDA

    def store_kvcache(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        self._store(k, v, k_cache, v_cache, slot_mapping)

    def prefill(self, q, k, v, k_cache, v_cache, context: Context, scale: float) -> torch.Tensor:
        # New tokens' keys come from k/v directly; only a cached prefix is read through the block
        # table, which ModelRunner provides exactly when some sequence has one.
        block_tables = context.block_tables if context.has_cached_prefix else None
        return paged_prefill_attention(q, k, v, k_cache, v_cache, context.cu_seqlens_q, context.cu_seqlens_k,
                                       context.max_seqlen_q, scale, block_tables)

    def decode(self, q, k_cache, v_cache, context: Context, scale: float) -> torch.Tensor:
        return paged_decode_attention(q, k_cache, v_cache, context.block_tables, context.context_lens, scale,
                                      max_context_len=context.max_seqlen_k)
