"""ModelRunner: loads the model, allocates the paged KV cache, builds each step's input tensors,
runs the forward pass and samples. LLMEngine calls run() once per step."""
import logging
import mmap
from contextlib import contextmanager

import numpy as np
import torch
import torch.distributed as dist

from nanovllm.config import Config, available_ram_bytes
from nanovllm.executor.cuda_graph import DecodeGraphs
from nanovllm.engine.scheduler import SchedulerOutput
from nanovllm.engine.sequence import Sequence
from nanovllm.kernels import cpu_kernels
from nanovllm.layers.attention import Attention
from nanovllm.layers.backends import AttentionBatch, get_backend, pick_backend_name
from nanovllm.layers.linear import can_pack_weights, pack_linear_weights
from nanovllm.sample.sampler import SampledTokens, Sampler
from nanovllm.sample.sampling_metadata import SamplingMetadata
from nanovllm.models import get_model_class
from nanovllm.executor.compile import compile_fused_ops
from nanovllm.utils.context import Context, forward_context
from nanovllm.utils.cpu_memory import keep_freed_memory
from nanovllm.utils.loader import load_model

logger = logging.getLogger(__name__)

# Batch-1 decode reads every weight once; the C GEMV streams dense weights ~20% faster than oneDNN's
# packed one-row path (docs/performance.md), at the price of holding both forms.
DENSE_COPY_RAM_SHARE = 0.15


@contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class ModelRunner:
    def __init__(self, config: Config, rank: int = 0):
        if dist.is_initialized() and dist.get_world_size() != config.tensor_parallel_size:
            # The layers shard themselves by the process group's size, whoever started it.
            raise RuntimeError(f"a torch.distributed group of {dist.get_world_size()} ranks is already running "
                               f"(another engine?); exit() it before building a tensor_parallel_size="
                               f"{config.tensor_parallel_size} engine in this process")
        self.config = config
        self.rank = rank
        self.block_size = config.kvcache_block_size
        self.device = torch.device("cuda", rank) if config.device == "cuda" else torch.device("cpu")
        self.dtype = config.torch_dtype
        if self.device.type == "cpu":
            keep_freed_memory()
        hf_config = config.hf_config
        with default_dtype(self.dtype), self.device:
            self.model = get_model_class(hf_config)(hf_config)
        load_model(self.model, config.model)
        self.model.eval()
        self.packed_weights = can_pack_weights(self.device, self.dtype)
        self.gemv_kernels = None
        if self.packed_weights:
            self.gemv_kernels = cpu_kernels.load() if self.dense_copies_fit() else None
            pack_linear_weights(self.model, self.gemv_kernels)
        if config.compile_ops:
            compile_fused_ops(self.model)
        self.sampler = Sampler(config.device)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        backend_name = pick_backend_name(config.attention_backend, config.device, self.block_size, self.dtype)
        self.backend = get_backend(backend_name, config.device)
        self.backend.check_block_size(self.block_size)
        self.backend.check_dtype(self.dtype)
        for layer in self.attention_layers:
            layer.backend = self.backend
        use_graphs = self.device.type == "cuda" and not config.enforce_eager
        if rank == 0:
            logger.info("attention backend: %s, device: %s, dtype: %s, CUDA graphs: %s, compiled ops: %s, "
                        "oneDNN-packed weights: %s, C GEMV at batch 1: %s", self.backend.name, self.device,
                        self.dtype, use_graphs, config.compile_ops, self.packed_weights,
                        self.gemv_kernels is not None)
        self.num_kvcache_blocks = self.allocate_kv_cache()
        self.graphs: DecodeGraphs | None = None
        if use_graphs:
            self.graphs = DecodeGraphs(self.model, self.backend, config.max_num_seqs, config.max_model_len,
                                       self.block_size, hf_config.hidden_size, self.dtype, self.device)
            self.graphs.capture()

    def dense_copies_fit(self) -> bool:
        """Whether the linear weights can stay in RAM twice (dense for the one-row C GEMV, packed for
        oneDNN): when they take at most DENSE_COPY_RAM_SHARE of the available memory."""
        dense = sum(p.numel() * p.element_size() for name, p in self.model.named_parameters()
                    if p.dim() == 2 and "embed_tokens" not in name)
        return dense <= DENSE_COPY_RAM_SHARE * available_ram_bytes()

    # ---- KV cache ---------------------------------------------------------------------------
    def kv_block_bytes(self) -> int:
        layer = self.attention_layers[0]
        per_layer = self.block_size * layer.num_kv_heads * layer.head_dim * self.dtype.itemsize
        return 2 * len(self.attention_layers) * per_layer

    def kv_cache_budget_bytes(self) -> int:
        if self.device.type == "cpu":
            return self.config.cpu_kvcache_bytes
        self.warmup_model()
        # Return the warm-up's cached blocks first, so `used` holds the weights but not the
        # activations; those are counted once, as peak - current.
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        stats = torch.cuda.memory_stats(self.device)
        peak, current = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
        budget = int(total * self.config.gpu_memory_utilization - used - peak + current)
        logger.info("KV cache budget %.2f GiB (device total %.2f GiB, used %.2f GiB, activation peak %.2f GiB)",
                    budget / 2**30, total / 2**30, used / 2**30, (peak - current) / 2**30)
        return budget

    def allocate_kv_cache(self) -> int:
        block_bytes = self.kv_block_bytes()
        budget = self.kv_cache_budget_bytes()
        num_blocks = max(budget, 0) // block_bytes
        blocks_per_seq = -(-self.config.max_model_len // self.block_size)
        num_blocks = min(num_blocks, self.config.max_num_seqs * blocks_per_seq)
        if dist.is_initialized() and dist.get_world_size() > 1:
            # NOTE: rank 0's scheduler hands out block ids for every rank, so all must hold as many.
            count = torch.tensor([num_blocks], dtype=torch.int64, device=self.device)
            dist.all_reduce(count, op=dist.ReduceOp.MIN)
            num_blocks = int(count.item())
        if num_blocks < 1:
            raise ValueError(f"not even one KV cache block ({block_bytes} bytes) fits the memory budget "
                             f"({budget} bytes); raise gpu_memory_utilization / "
                             "cpu_kvcache_bytes or lower max_num_batched_tokens / max_num_seqs")
        layer = self.attention_layers[0]
        # [2 (K, V), num_layers, num_blocks, block_size, num_kv_heads, head_dim]
        shape = (2, len(self.attention_layers), num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
        self._kv_mmap = None
        self.kv_cache = self.zeroed_tensor(shape)
        for i, attn in enumerate(self.attention_layers):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        return num_blocks

    def zeroed_tensor(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A zero-filled tensor. On CPU it is backed by an anonymous mmap, whose pages the OS zeroes
        lazily on first touch: a multi-GB cache costs nothing at start-up.
        NOTE: it must be zeros, not garbage: attention reads (masked) unwritten slots, and a NaN
        there would poison the masked-out product."""
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        nbytes = int(np.prod(shape)) * self.dtype.itemsize
        self._kv_mmap = mmap.mmap(-1, nbytes)
        return torch.frombuffer(self._kv_mmap, dtype=self.dtype).view(shape)

    @torch.inference_mode()
    def warmup_model(self) -> None:
        """One forward at the largest prefill batch, without a KV cache, to measure peak memory."""
        cfg = self.config
        seq_len = min(cfg.max_num_batched_tokens, cfg.max_model_len)
        num_seqs = max(1, min(cfg.max_num_batched_tokens // seq_len, cfg.max_num_seqs))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        seqs = [Sequence([0] * seq_len) for _ in range(num_seqs)]
        input_ids, positions, context, _ = self.prepare_prefill(seqs, [seq_len] * num_seqs)
        context.slot_mapping = None  # nothing to store: the cache does not exist yet
        with forward_context(context):
            hidden_states = self.model(input_ids, positions)
        # Logits of the largest decode batch ([max_num_seqs, vocab]) are part of the peak too.
        self.model.compute_logits(hidden_states[-1:].expand(cfg.max_num_seqs, -1))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- step inputs ------------------------------------------------------------------------
    def slots_of(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        """Cache slots of positions [start, end) of seq."""
        if not seq.block_table:
            return np.full(end - start, -1, dtype=np.int64)
        pos = np.arange(start, end)
        table = np.asarray(seq.block_table, dtype=np.int64)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def prepare_prefill(self, seqs: list[Sequence], num_new_tokens: list[int]):
        """(input_ids, positions, context, logits_indices) of a prefill step: logits_indices picks
        each sequence's last new token."""
        input_ids, positions, slots, context_lens, logits_indices = [], [], [], [], []
        num_tokens = 0
        for seq, n in zip(seqs, num_new_tokens):
            start = seq.num_computed_tokens
            input_ids.extend(seq.uncomputed_token_ids(n))
            positions.append(np.arange(start, start + n))
            slots.append(self.slots_of(seq, start, start + n))
            context_lens.append(start + n)
            num_tokens += n
            logits_indices.append(num_tokens - 1)
        batch = AttentionBatch(is_prefill=True, num_new_tokens=list(num_new_tokens), context_lens=context_lens,
                               block_tables=[seq.block_table for seq in seqs], to_device=self.to_device)
        context = Context(is_prefill=True, slot_mapping=self.to_device(torch.from_numpy(np.concatenate(slots))),
                          attn_metadata=self.backend.prepare(batch))
        input_ids = self.to_device(torch.tensor(input_ids, dtype=torch.int64))
        positions = self.to_device(torch.from_numpy(np.concatenate(positions)))
        return input_ids, positions, context, self.to_device(torch.tensor(logits_indices))

    def prepare_decode(self, seqs: list[Sequence]):
        """(input_ids, positions, context) of a decode step: one new token per sequence."""
        input_ids = torch.tensor([seq.last_token for seq in seqs], dtype=torch.int64)
        positions = np.array([len(seq) - 1 for seq in seqs], dtype=np.int64)
        tables = [seq.block_table for seq in seqs]
        slots = np.array([t[p // self.block_size] * self.block_size + p % self.block_size
                          for t, p in zip(tables, positions)], dtype=np.int64)
        batch = AttentionBatch(is_prefill=False, num_new_tokens=[1] * len(seqs),
                               context_lens=(positions + 1).tolist(), block_tables=tables, to_device=self.to_device)
        context = Context(is_prefill=False, slot_mapping=self.to_device(torch.from_numpy(slots)),
                          attn_metadata=self.backend.prepare(batch))
        return self.to_device(input_ids), self.to_device(torch.from_numpy(positions)), context

    def prepare_sample(self, out: SchedulerOutput) -> SamplingMetadata:
        return SamplingMetadata.build(out.seqs, out.num_new_tokens, self.config.hf_config.vocab_size,
                                      self.config.eos_token_ids, self.device)

    # ---- forward and sample -----------------------------------------------------------------
    @torch.inference_mode()
    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, context: Context,
                  logits_indices: torch.Tensor | None) -> torch.Tensor | None:
        use_graph = (self.graphs is not None and not context.is_prefill
                     and self.graphs.can_replay(input_ids.shape[0], context))
        if use_graph:
            hidden_states = self.graphs.replay(input_ids, positions, context)
        else:
            with forward_context(context):
                hidden_states = self.model(input_ids, positions)
        if logits_indices is not None:
            hidden_states = hidden_states[logits_indices]
        return self.model.compute_logits(hidden_states)

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> SampledTokens | None:
        """One step: the token sampled for each scheduled sequence (rank 0; None on other ranks)."""
        metadata = self.prepare_sample(out) if self.rank == 0 else None
        if out.is_prefill:
            input_ids, positions, context, logits_indices = self.prepare_prefill(out.seqs, out.num_new_tokens)
        else:
            input_ids, positions, context = self.prepare_decode(out.seqs)
            logits_indices = None
        logits = self.run_model(input_ids, positions, context, logits_indices)
        if self.rank != 0:
            return None
        return self.sampler(logits, metadata).to_host(metadata)

    def exit(self) -> None:
        if self.graphs is not None:
            self.graphs.free()
            self.graphs = None
        self.kv_cache = None
        for attn in self.attention_layers:
            attn.k_cache = attn.v_cache = torch.tensor([])
        self._kv_mmap = None  # unmapped once the last view of it is gone
