"""Triton attention backend: the project's own paged-attention kernels (nanovllm/kernels), for CUDA
machines without flash-attn. On CPU it runs only under TRITON_INTERPRET=1 (slow; for tests)."""
import importlib.util
import os

import torch

from nanovllm.layers.backends.base import PagedBackend, PagedMetadata
from nanovllm.layers.backends.kv_formats import KVFormat


def _triton_interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")


class TritonBackend(PagedBackend):
    name = "triton"
    auto_devices = ("cuda",)

    def __init__(self, device: str = "cpu", kv_format=None):
        super().__init__(device, kv_format)
        # Imported here: triton reads TRITON_INTERPRET when the kernels are defined.
        from nanovllm.kernels.store_kvcache import store_kvcache_triton
        from nanovllm.kernels.triton_attention import paged_decode_attention, paged_prefill_attention
        self._decode = paged_decode_attention
        self._prefill = paged_prefill_attention
        self._store = store_kvcache_triton  # the kernels' own store, which also writes fp8 (on CPU: interpreted)

    @classmethod
    def unavailable_reason(cls, device: str) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "the triton package is not installed"
        if device == "cpu" and not _triton_interpreter_on():
            return ("Triton runs on CPU only in its interpreter: set TRITON_INTERPRET=1 before starting "
                    "(slow; meant for tests)")
        return None

    @classmethod
    def kv_format_error(cls, kv_format: KVFormat, dtype: torch.dtype) -> str | None:
        if kv_format.storage == dtype or kv_format.limit is not None:  # the activations' dtype, or fp8
            return None
        return (f"it reads KV caches in the activations' dtype ({dtype}) or fp8, not {kv_format.name}; "
                "the torch backend reads every format")

    def prefill(self, q, k, v, k_cache, v_cache, metadata: PagedMetadata, scale: float,
                window: int | None = None, softcap: float | None = None, sinks=None) -> torch.Tensor:
        # New tokens' keys come from k/v directly; only a cached prefix is read through the block table.
        return self._prefill(q, k, v, k_cache, v_cache, metadata.cu_seqlens_q, metadata.cu_seqlens_k,
                             metadata.max_seqlen_q, scale, metadata.block_tables, window=window, softcap=softcap,
                             sinks=sinks)

    def decode(self, q, k_cache, v_cache, metadata: PagedMetadata, scale: float,
               window: int | None = None, softcap: float | None = None, sinks=None) -> torch.Tensor:
        return self._decode(q, k_cache, v_cache, metadata.block_tables, metadata.context_lens, scale,
                            max_context_len=metadata.max_seqlen_k, window=window, softcap=softcap, sinks=sinks)
