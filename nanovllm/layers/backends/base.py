"""The attention-backend interface: the step metadata a backend builds from the scheduled batch, its
CUDA-graph hooks, its rules (availability, block size, dtype), and the one KV store they share.

ModelRunner calls prepare() once per step; the Attention layers call store_kvcache / prefill / decode.
"""
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from nanovllm.layers.backends.kv_formats import KV_FORMATS, KVFormat


def store_kvcache_torch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> None:
    """Write each token's K/V row to its slot (block_id * block_size + offset); slot -1 is skipped."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def kv_store_for(device: str):
    """The KV store of a device: the Triton kernel on CUDA (it never syncs with the host, so CUDA
    graphs can capture it), the torch code above elsewhere."""
    if device == "cuda":
        from nanovllm.kernels.store_kvcache import store_kvcache_triton
        return store_kvcache_triton
    return store_kvcache_torch


@dataclass
class AttentionBatch:
    """One scheduled step as the backends see it, in host-side numbers (one entry per sequence).

    num_new_tokens: query tokens this step (1 each in decode). context_lens: keys after this step
    (cached prefix + new tokens). block_tables: each sequence's block ids. to_device: the runner's
    host->device copy.
    """

    is_prefill: bool
    num_new_tokens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    to_device: Callable[[torch.Tensor], torch.Tensor]

    @property
    def rows_share_tables(self) -> bool:
        """Whether decode rows share a block table (several query rows of one sequence, each over
        the positions before it): a row attends to K/V other rows of the step store, so every
        row's K/V is stored before any row attends."""
        return len({id(t) for t in self.block_tables}) < len(self.block_tables)

    @property
    def has_cached_prefix(self) -> bool:
        """Whether some sequence attends to keys it does not compute this step."""
        return any(k > q for q, k in zip(self.num_new_tokens, self.context_lens))

    def block_table_tensor(self) -> torch.Tensor:
        """[num_seqs, max_blocks] int32 on the device, padded with -1."""
        width = max(len(t) for t in self.block_tables)
        table = np.full((len(self.block_tables), width), -1, dtype=np.int32)
        for i, blocks in enumerate(self.block_tables):
            table[i, : len(blocks)] = blocks
        return self.to_device(torch.from_numpy(table))

    def context_lens_tensor(self) -> torch.Tensor:
        """[num_seqs] int32 on the device."""
        return self.to_device(torch.tensor(self.context_lens, dtype=torch.int32))

    def cu_seqlens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_seqs + 1] int32 offsets of each sequence's new tokens and of its whole key range."""
        cu_q = np.cumsum([0] + self.num_new_tokens).astype(np.int32)
        cu_k = np.cumsum([0] + self.context_lens).astype(np.int32)
        return self.to_device(torch.from_numpy(cu_q)), self.to_device(torch.from_numpy(cu_k))


@dataclass
class GraphTables:
    """Static decode tensors a CUDA graph reads: rows [0, graph_bs) belong to one replay."""

    block_tables: torch.Tensor  # [max_bs, max_blocks_per_seq] int32, -1 past a sequence's blocks
    context_lens: torch.Tensor  # [max_bs] int32
    max_seqlen_k: int  # NOTE: frozen into the graphs, so the bound (max_model_len), not a batch's value

    @classmethod
    def allocate(cls, max_bs: int, max_blocks_per_seq: int, max_seqlen_k: int,
                 device: torch.device | str) -> "GraphTables":
        tables = cls(torch.empty(max_bs, max_blocks_per_seq, dtype=torch.int32, device=device),
                     torch.empty(max_bs, dtype=torch.int32, device=device), max_seqlen_k)
        tables.pad_rows(0, max_bs)
        return tables

    def pad_rows(self, start: int, end: int) -> None:
        """Padding rows attend to one key of block 0: a real block, so every kernel reads finite values."""
        self.context_lens[start:end] = 1
        self.block_tables[start:end] = 0

    def fill(self, block_tables: torch.Tensor, context_lens: torch.Tensor, graph_bs: int) -> None:
        """Copy a live batch (bs <= graph_bs rows, a table of any width up to the buffer's) into rows
        [0, bs) and pad rows [bs, graph_bs)."""
        bs, width = block_tables.shape
        assert bs <= graph_bs <= self.context_lens.shape[0] and width <= self.block_tables.shape[1]
        self.context_lens[:bs].copy_(context_lens)
        self.block_tables[:bs, :width].copy_(block_tables)
        self.block_tables[:bs, width:] = -1
        self.pad_rows(bs, graph_bs)

    def fits(self, block_tables: torch.Tensor) -> bool:
        return block_tables.shape[1] <= self.block_tables.shape[1]


class AttentionBackend:
    """Interface. Shapes: q [num_tokens, num_heads, head_dim]; k, v [num_tokens, num_kv_heads,
    head_dim]; caches [num_blocks, block_size, num_kv_heads, head_dim]. `metadata` is what this
    backend's prepare() (or graph_metadata()) returned for the step."""

    name: ClassVar[str] = "base"
    # The devices on which 'auto' may pick it ('auto' tries the backends in the registry's order).
    auto_devices: ClassVar[tuple[str, ...]] = ()

    def __init__(self, device: str = "cpu", kv_format: KVFormat | None = None):
        self.device = device
        self.kv_format = kv_format or KV_FORMATS["float32"]
        self._store = kv_store_for(device)
        self.graph_tables: GraphTables | None = None

    # ---- rules, stated once per backend: each returns why not, or None --------------------------
    @classmethod
    def unavailable_reason(cls, device: str) -> str | None:
        """Why this backend cannot run on device here (a missing package, a device it does not support)."""
        return None

    @classmethod
    def block_size_error(cls, block_size: int) -> str | None:
        return None

    @classmethod
    def dtype_error(cls, dtype: torch.dtype) -> str | None:
        return None

    @classmethod
    def kv_format_error(cls, kv_format: KVFormat, dtype: torch.dtype) -> str | None:
        """Why this backend cannot read caches stored in kv_format under activations of dtype. By
        default: it reads caches holding the activations' own dtype."""
        if kv_format.storage != dtype:
            return (f"it reads KV caches in the activations' dtype ({dtype}), not {kv_format.name}; "
                    f"give kv_cache_dtype={str(dtype).removeprefix('torch.')!r}")
        return None

    @classmethod
    def check_block_size(cls, block_size: int) -> None:
        """Raise ValueError if this backend cannot work with the given KV block size."""
        reason = cls.block_size_error(block_size)
        if reason is not None:
            raise ValueError(f"attention_backend={cls.name!r}: {reason}")

    @classmethod
    def check_dtype(cls, dtype: torch.dtype) -> None:
        """Raise ValueError if this backend cannot compute in the given dtype."""
        reason = cls.dtype_error(dtype)
        if reason is not None:
            raise ValueError(f"attention_backend={cls.name!r}: {reason}")

    # ---- per step -------------------------------------------------------------------------------
    def prepare(self, batch: AttentionBatch) -> Any:
        """The metadata this backend's kernels read for one step (built once, read by every layer)."""
        raise NotImplementedError

    def store_kvcache(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        self._store(k, v, k_cache, v_cache, slot_mapping)

    def prefill(self, q, k, v, k_cache, v_cache, metadata, scale: float, window: int | None = None,
                softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """window: sliding-window attention, each query over the last `window` keys up to itself.
        softcap: each scaled score s becomes softcap * tanh(s / softcap) before the softmax.
        sinks: [num_heads] logits that join each head's softmax denominator (attention sinks)."""
        raise NotImplementedError

    def decode(self, q, k_cache, v_cache, metadata, scale: float, window: int | None = None,
               softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    # ---- CUDA graphs (decode) -------------------------------------------------------------------
    # Every bundled backend's decode reads a block table and the context lengths: the static copies
    # live in GraphTables, and a backend only says how they map onto its metadata (the two hooks
    # at the end). A backend whose decode reads more tensors overrides the hooks in between.
    def init_graph_buffers(self, max_bs: int, max_blocks_per_seq: int, max_seqlen_k: int,
                           device: torch.device | str) -> None:
        """Allocate the static tensors the captured graphs read (for the largest batch and table)."""
        self.graph_tables = GraphTables.allocate(max_bs, max_blocks_per_seq, max_seqlen_k, device)

    def free_graph_buffers(self) -> None:
        self.graph_tables = None

    def graph_metadata(self, graph_bs: int) -> Any:
        """The decode metadata a graph of graph_bs rows is captured with: views of the static tensors.
        NOTE: a graph reads the addresses it saw at capture, so fill_graph_buffers writes into these."""
        t = self.graph_tables
        return self.decode_metadata(t.block_tables[:graph_bs], t.context_lens[:graph_bs], t.max_seqlen_k)

    def fill_graph_buffers(self, metadata: Any, graph_bs: int) -> None:
        """Copy a live decode batch's metadata into the static tensors, padding up to graph_bs rows."""
        block_tables, context_lens = self.decode_tensors(metadata)
        self.graph_tables.fill(block_tables, context_lens, graph_bs)

    def fits_graph_buffers(self, metadata: Any) -> bool:
        """Whether a live decode batch's block table fits the static one."""
        return self.graph_tables.fits(self.decode_tensors(metadata)[0])

    def decode_metadata(self, block_tables: torch.Tensor, context_lens: torch.Tensor, max_seqlen_k: int) -> Any:
        """This backend's decode metadata over device tensors alone (no host lists: a graph replays it)."""
        raise NotImplementedError(f"the {self.name} attention backend has no CUDA-graph support")

    def decode_tensors(self, metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(block_tables, context_lens) of a decode metadata object."""
        raise NotImplementedError(f"the {self.name} attention backend has no CUDA-graph support")


@dataclass
class PagedMetadata:
    """The metadata of backends whose kernels take varlen offsets and block tables (flash, triton).

    Prefill: cu_seqlens_q / cu_seqlens_k [num_seqs + 1] offsets of the new tokens and of the whole
    key ranges, their maxima, and block_tables only when some sequence has a cached prefix (then
    the keys are read from the paged cache). Decode: block_tables [num_seqs, max_blocks] (-1
    padded), context_lens [num_seqs] int32, and max_seqlen_k (the bound max_model_len under CUDA
    graphs).
    """

    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    block_tables: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None


class PagedBackend(AttentionBackend):
    """A backend whose step metadata is PagedMetadata; subclasses supply prefill and decode."""

    def prepare(self, batch: AttentionBatch) -> PagedMetadata:
        if batch.is_prefill:
            cu_q, cu_k = batch.cu_seqlens()
            tables = batch.block_table_tensor() if batch.has_cached_prefix else None
            return PagedMetadata(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(batch.num_new_tokens),
                                 max_seqlen_k=max(batch.context_lens), block_tables=tables)
        return self.decode_metadata(batch.block_table_tensor(), batch.context_lens_tensor(),
                                    max(batch.context_lens))

    def decode_metadata(self, block_tables, context_lens, max_seqlen_k: int) -> PagedMetadata:
        return PagedMetadata(block_tables=block_tables, context_lens=context_lens, max_seqlen_k=max_seqlen_k)

    def decode_tensors(self, metadata: PagedMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        return metadata.block_tables, metadata.context_lens
