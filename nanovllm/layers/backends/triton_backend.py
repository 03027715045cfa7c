"""Triton attention backend: the project's own paged-attention kernels (nanovllm/kernels), for CUDA
machines without flash-attn. On CPU it runs only under TRITON_INTERPRET=1 (slow; for tests)."""
import importlib.util
import os
from dataclasses import dataclass

import torch

from nanovllm.layers.backends.base import AttentionBackend, AttentionBatch


def _triton_interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")


@dataclass
class TritonMetadata:
    """Prefill: cu_seqlens_q / cu_seqlens_k [num_seqs + 1] offsets, max_seqlen_q, and block_tables
    only when some sequence has a cached prefix (the kernel reads the prefix through it). Decode:
    block_tables [num_seqs, max_blocks] (-1 padded), context_lens [num_seqs] int32, and
    max_seqlen_k, which only guides the split count (the bound max_model_len under CUDA graphs)."""

    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    block_tables: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None


class TritonBackend(AttentionBackend):
    name = "triton"
    auto_devices = ("cuda",)

    def __init__(self, device: str = "cpu"):
        super().__init__(device)
        # Imported here: triton reads TRITON_INTERPRET when the kernels are defined.
        from nanovllm.kernels.triton_attention import paged_decode_attention, paged_prefill_attention
        self._decode = paged_decode_attention
        self._prefill = paged_prefill_attention

    @classmethod
    def unavailable_reason(cls, device: str) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "the triton package is not installed"
        if device == "cpu" and not _triton_interpreter_on():
            return ("Triton runs on CPU only in its interpreter: set TRITON_INTERPRET=1 before starting "
                    "(slow; meant for tests)")
        return None

    def prepare(self, batch: AttentionBatch) -> TritonMetadata:
        if batch.is_prefill:
            cu_q, cu_k = batch.cu_seqlens()
            tables = batch.block_table_tensor() if batch.has_cached_prefix else None
            return TritonMetadata(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(batch.num_new_tokens),
                                  max_seqlen_k=max(batch.context_lens), block_tables=tables)
        return self.decode_metadata(batch.block_table_tensor(), batch.context_lens_tensor(),
                                    max(batch.context_lens))

    def decode_metadata(self, block_tables, context_lens, max_seqlen_k: int) -> TritonMetadata:
        return TritonMetadata(block_tables=block_tables, context_lens=context_lens, max_seqlen_k=max_seqlen_k)

    def decode_tensors(self, metadata: TritonMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        return metadata.block_tables, metadata.context_lens

    def prefill(self, q, k, v, k_cache, v_cache, metadata: TritonMetadata, scale: float) -> torch.Tensor:
        # New tokens' keys come from k/v directly; only a cached prefix is read through the block table.
        return self._prefill(q, k, v, k_cache, v_cache, metadata.cu_seqlens_q, metadata.cu_seqlens_k,
                             metadata.max_seqlen_q, scale, metadata.block_tables)

    def decode(self, q, k_cache, v_cache, metadata: TritonMetadata, scale: float) -> torch.Tensor:
        return self._decode(q, k_cache, v_cache, metadata.block_tables, metadata.context_lens, scale,
                            max_context_len=metadata.max_seqlen_k)
