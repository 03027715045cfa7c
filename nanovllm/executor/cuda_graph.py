"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed with inputs copied into
static buffers. ModelRunner captures them once after allocating the KV cache (CUDA only). The
attention backend keeps the static copies of its own decode metadata (its graph hooks).

The bucket choice and the buffer padding are plain functions, tested on CPU.
"""
import logging
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.executor.step_runner import StepRunner
from nanovllm.layers.backends import AttentionBackend
from nanovllm.utils.context import Context, forward_context

logger = logging.getLogger(__name__)

MAX_GRAPH_BATCH_SIZE = 512


def graph_batch_sizes(max_num_seqs: int, limit: int = MAX_GRAPH_BATCH_SIZE) -> list[int]:
    """Captured batch sizes, ascending: 1, 2, 4, 8, then every 16, and the cap min(max_num_seqs,
    limit) itself, so every decode batch up to the cap has a bucket."""
    cap = min(max_num_seqs, limit)
    sizes = [s for s in (1, 2, 4, 8) if s < cap] + list(range(16, cap, 16))
    return sizes + [cap]


def pick_graph_batch_size(sizes: list[int], batch_size: int) -> int | None:
    """The smallest captured size >= batch_size, or None (run eagerly) when the batch is larger."""
    for size in sizes:
        if size >= batch_size:
            return size
    return None


@dataclass
class DecodeBuffers:
    """Static tensors the graphs read and write: rows [0, graph_bs) of each belong to a replay. The
    attention backend keeps the static copies of its own decode metadata (init_graph_buffers)."""

    input_ids: torch.Tensor     # [max_bs] int64
    positions: torch.Tensor     # [max_bs] int64
    slot_mapping: torch.Tensor  # [max_bs] int64, -1 = do not store
    outputs: torch.Tensor       # [max_bs, hidden_size] model dtype
    backend: AttentionBackend
    lora_slots: torch.Tensor | None = None  # [max_bs] int64: each row's adapter slot, -1 none (adapters served)

    @classmethod
    def allocate(cls, backend: AttentionBackend, max_bs: int, max_blocks_per_seq: int, max_seqlen_k: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device | str,
                 lora: bool = False) -> "DecodeBuffers":
        """max_seqlen_k: the bound every captured graph is built with (max_model_len); lora: the
        graphs read each row's adapter slot."""
        backend.init_graph_buffers(max_bs, max_blocks_per_seq, max_seqlen_k, device)
        buffers = cls(
            input_ids=torch.zeros(max_bs, dtype=torch.int64, device=device),
            positions=torch.zeros(max_bs, dtype=torch.int64, device=device),
            slot_mapping=torch.empty(max_bs, dtype=torch.int64, device=device),
            outputs=torch.zeros(max_bs, hidden_size, dtype=dtype, device=device),
            backend=backend,
            lora_slots=torch.empty(max_bs, dtype=torch.int64, device=device) if lora else None,
        )
        buffers.pad_rows(0, max_bs)
        return buffers

    def pad_rows(self, start: int, end: int) -> None:
        """Make rows [start, end) harmless padding: store nothing, at position 0 (the backend pads
        its rows to attend to one key of a real block)."""
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slot_mapping[start:end] = -1
        if self.lora_slots is not None:
            self.lora_slots[start:end] = -1

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, context: Context, graph_bs: int) -> None:
        """Copy one decode batch (bs <= graph_bs rows, block table of any width up to the buffer's)
        into rows [0, bs) and pad rows [bs, graph_bs)."""
        bs = input_ids.shape[0]
        assert bs <= graph_bs <= self.input_ids.shape[0]
        self.input_ids[:bs].copy_(input_ids)
        self.positions[:bs].copy_(positions)
        self.slot_mapping[:bs].copy_(context.slot_mapping)
        if self.lora_slots is not None:  # (a decode row is one token: the rows' slots are the tokens')
            if context.lora is None:
                self.lora_slots[:bs] = -1
            else:
                self.lora_slots[:bs].copy_(context.lora.device_row_slots)
        self.pad_rows(bs, graph_bs)
        self.backend.fill_graph_buffers(context.attn_metadata, graph_bs)

    def context(self, graph_bs: int, lora=None) -> Context:
        """The decode Context a graph of graph_bs rows is captured with. NOTE: everything in it is
        frozen into the graph: views of the static tensors, and host-side ints at their bounds.
        lora: the LoRAModel whose slots the graphs read (its graph_batch over lora_slots)."""
        batch = None if lora is None else lora.graph_batch(self.lora_slots[:graph_bs])
        return Context(is_prefill=False, slot_mapping=self.slot_mapping[:graph_bs],
                       attn_metadata=self.backend.graph_metadata(graph_bs), lora=batch)


class DecodeGraphs(StepRunner):
    """Captures the model's decode forward for each bucket and replays the right one. With adapters
    (lora: a LoRAModel whose updates the graphs can hold, graph_ready), every graph is captured with
    the adapter kernels reading each row's slot from a static buffer: steps with adapter rows and
    without replay the same graphs."""

    def __init__(self, model: nn.Module, backend: AttentionBackend, max_num_seqs: int, max_model_len: int,
                 block_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device, lora=None):
        self.model = model
        self.device = device
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.lora = lora if lora is not None and lora.graph_ready() else None
        self.runs_lora = self.lora is not None
        if lora is not None and self.lora is None:
            logger.warning("decode steps with adapter rows run eagerly: graphs hold the adapters' updates by the "
                           "Triton kernels on models without MoE experts (the experts' adapters read the rows' "
                           "slots on the host)")
        max_blocks_per_seq = -(-max_model_len // block_size)
        self.buffers = DecodeBuffers.allocate(backend, self.sizes[-1], max_blocks_per_seq, max_model_len,
                                              hidden_size, dtype, device, lora=self.runs_lora)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest bucket first: later (smaller) graphs reuse its memory from the one shared pool."""
        buf = self.buffers
        if self.lora is not None:  # the slots the graphs read, all in place before any is captured
            self.lora.allocate_all()
        # NOTE: replays and Triton launches use the current device, so TP workers must set it
        # (torch.cuda.set_device); capture selects it here.
        with torch.cuda.device(self.device):
            self.pool = torch.cuda.graph_pool_handle()
            for graph_bs in reversed(self.sizes):
                graph = torch.cuda.CUDAGraph()
                with forward_context(buf.context(graph_bs, self.lora)):
                    # Warm-up outside the graph: lazy inits (cuBLAS handles, Triton/inductor compiles).
                    buf.outputs[:graph_bs] = self.model(buf.input_ids[:graph_bs], buf.positions[:graph_bs])
                    with torch.cuda.graph(graph, pool=self.pool):
                        buf.outputs[:graph_bs] = self.model(buf.input_ids[:graph_bs], buf.positions[:graph_bs])
                self.graphs[graph_bs] = graph
                torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def can_replay(self, batch_size: int, context: Context) -> bool:
        """Whether a decode batch has a bucket and its metadata fits the backend's static tensors."""
        fits = self.buffers.backend.fits_graph_buffers(context.attn_metadata)
        return fits and pick_graph_batch_size(self.sizes, batch_size) is not None

    def can_run(self, num_tokens: int, context: Context) -> bool:
        # NOTE: the graphs read one block table and no state slots: a model with several KV groups,
        # or with linear-attention layers (context.state), decodes eagerly.
        return (not context.is_prefill and not context.more_groups and context.state is None
                and self.can_replay(num_tokens, context))

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, context: Context,
            logits_indices: torch.Tensor | None) -> torch.Tensor | None:
        return self.model.compute_logits(self.replay(input_ids, positions, context))

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, context: Context) -> torch.Tensor:
        """Hidden states [bs, hidden_size] of one decode batch; a view valid until the next replay."""
        bs = input_ids.shape[0]
        graph_bs = pick_graph_batch_size(self.sizes, bs)
        assert graph_bs is not None, f"no graph for decode batch {bs}; check can_replay first"
        self.buffers.fill(input_ids, positions, context, graph_bs)
        self.graphs[graph_bs].replay()
        return self.buffers.outputs[:bs]

    def free(self) -> None:
        self.graphs.clear()
        self.pool = None
        self.buffers.backend.free_graph_buffers()
        self.buffers = None
