"""ModelRunner: loads the model, allocates the paged KV cache, builds each step's input tensors,
runs the forward pass and samples. The single-process Executor (LLMEngine calls run() once per
step), and each rank's runner under tensor parallelism."""
import logging
from contextlib import contextmanager

import numpy as np
import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.distributed.parallel import get_tp_size
from nanovllm.executor.abstract import Executor
from nanovllm.executor.step_runner import StepRunner
from nanovllm.engine.kv_groups import kv_groups, slots_per_block
from nanovllm.engine.scheduler import SchedulerOutput
from nanovllm.engine.sequence import Sequence
from nanovllm.kernels import cpu_kernels
from nanovllm.layers.attention import Attention
from nanovllm.layers.backends import AttentionBatch, get_backend, pick_backend_name
from nanovllm.layers.quantization import LinearKernels, process_weights_after_loading
from nanovllm.sample.prompt_logprobs import logits_positions, split_prompt_logits
from nanovllm.sample.sampler import RANDOM_SAMPLES, SampledTokens, Sampler
from nanovllm.sample.sampling_metadata import SamplingMetadata
from nanovllm.executor.compile import compile_fused_ops
from nanovllm.executor.state_cache import StateCache
from nanovllm.utils.context import Context, forward_context
from nanovllm.loader import load_model
from nanovllm.spec_decode.verify import verify

logger = logging.getLogger(__name__)


def linear_kernels(platform, dtype: torch.dtype, weight_dtype: torch.dtype | None = None) -> LinearKernels:
    """The kernels the layers' methods may use on this platform: the host CPU's C kernels where it
    wants them and they build (kernels/cpu_kernels.py), with the options it gives."""
    c_kernels = cpu_kernels.load() if platform.wants_c_kernels(dtype) else None
    return LinearKernels(c_kernels=c_kernels, **platform.linear_kernel_options(dtype, weight_dtype,
                                                                              c_kernels is not None))


def process_weights(model: torch.nn.Module, platform, kernels: LinearKernels) -> str:
    """Every layer's method turns its loaded weights into the form it multiplies from, with these
    kernels; returns how the linear layers multiply (for the log)."""
    described = process_weights_after_loading(model, kernels)
    platform.after_weights_processed()
    return described


def held_bytes(model: torch.nn.Module) -> int:
    """The bytes of every tensor the model's layers hold (parameters, buffers, and what their
    methods multiply from), each storage once."""
    storages = {}
    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "streamed_weights"):
            tensors += method.streamed_weights(module)
    for t in tensors:
        if not isinstance(t, torch.Tensor) or not t.numel():
            continue
        if t.is_mkldnn:  # oneDNN's packed form: no storage to share, its elements' bytes
            storages[("packed", id(t))] = t.numel() * t.element_size()
        else:
            storage = t.untyped_storage()
            storages[(t.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


@contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class ModelRunner(Executor):
    can_time_steps = True  # its forwards need no other process

    def __init__(self, config: Config, rank: int = 0):
        if dist.is_initialized() and get_tp_size() != config.tensor_parallel_size:
            # The layers shard themselves by the process group's size, whoever started it.
            raise RuntimeError(f"a torch.distributed group of {get_tp_size()} ranks is already running "
                               f"(another engine?); exit() it before building a tensor_parallel_size="
                               f"{config.tensor_parallel_size} engine in this process")
        self.config = config
        self.rank = rank
        self.block_size = config.kvcache_block_size
        self.platform = platform = config.platform
        self.device = platform.device_of_rank(rank)
        self.dtype = config.torch_dtype
        platform.prepare_process()
        hf_config = config.hf_config
        # The weight format picks each layer's method as the model is built (layers/quantization).
        with default_dtype(self.dtype), self.device:
            self.model = config.model_class(hf_config, config.quant_config)
        load_model(self.model, config.checkpoint)
        self.model.eval()
        self.kernels = linear_kernels(platform, self.dtype, config.weight_dtype)
        self.linear_methods = process_weights(self.model, platform, self.kernels)
        self.weight_bytes = held_bytes(self.model)
        if config.compile_ops:
            compile_fused_ops(self.model)
        # The engine's seed drives every draw of requests without a seed of their own.
        generator = torch.Generator(device=self.device)
        generator.manual_seed(config.seed)
        self.sampler = Sampler(RANDOM_SAMPLES[platform.random_sample], generator)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.state_cache = StateCache(self.model, config)  # linear-attention layers' state slots, if any
        self.lora = None  # the layers' adapter slots (lora/layers.py) when the engine serves adapters
        if config.enable_lora:
            from nanovllm.engine_args import LORA_DTYPES
            from nanovllm.lora.layers import LoRAModel, slot_dtype
            lora_dtype = slot_dtype(LORA_DTYPES[config.lora_dtype], self.model, self.dtype, self.kernels.lora_triton)
            self.lora = LoRAModel(self.model, config.max_loras, config.max_lora_rank,
                                  config.max_cpu_loras or config.max_loras, lora_dtype,
                                  self.device, self.to_device, config.hf_config)
            self.lora.use_kernels(self.kernels.lora_triton,
                                  self.kernels.c_kernels if self.dtype == torch.float32 else None)
        self.kv_format = config.kv_format
        backend_name = pick_backend_name(config.attention_backend, config.device, self.block_size, self.dtype,
                                         self.kv_format)
        self.backend = get_backend(backend_name, config.device, self.kv_format, self.dtype)
        self.backend.check_block_size(self.block_size)
        self.backend.check_dtype(self.dtype)
        for layer in self.attention_layers:
            layer.backend = self.backend
        if rank == 0:
            logger.info("attention backend: %s, device: %s, dtype: %s, compiled ops: %s, linear layers: %s",
                        self.backend.name, self.device, self.dtype, config.compile_ops, self.linear_methods)
        self.kv_groups = kv_groups([layer.sliding_window for layer in self.attention_layers], self.split_kv_groups())
        self.num_kvcache_blocks = self.allocate_kv_cache()
        # What runs some steps in place of the eager forward (CUDA graphs; the CPU's C step), asked
        # in turn at every step (executor/step_runner.py).
        self.step_notes: list[str] = []
        self.step_runners: list[StepRunner] = self.build_step_runners(backend_name)

    def build_step_runners(self, backend_name: str) -> list[StepRunner]:
        """Decode steps captured as CUDA graphs, one per batch-size bucket, where the platform
        captures them (unless enforce_eager); the C step where the platform has one (the decode
        step whole, prefill steps' norms, rotary + KV store and SiLU between the matmuls). What
        keeps the C step off a model goes into step_notes (the start-up summary's WARNING)."""
        config, platform = self.config, self.platform
        if platform.has_decode_graphs:
            if config.enforce_eager:
                return []
            from nanovllm.executor.cuda_graph import DecodeGraphs
            graphs = DecodeGraphs(self.model, self.backend, config.max_num_seqs, config.max_model_len,
                                  self.block_size, config.hf_config.hidden_size, self.dtype, self.device, self.lora)
            graphs.capture()
            return [graphs]
        if not platform.has_c_decode_step:
            return []
        from nanovllm.executor.cpu_decode import build_fused_decode
        fused, note = build_fused_decode(self.model, backend_name, self.dtype, config.tensor_parallel_size)
        self.step_notes += [note] if note else []
        if fused is None:
            return []
        if self.rank == 0:
            layers = len(fused.modules)
            others = "" if fused.one_call_layers == layers else "; the others through their own modules"
            upto = "at every batch size" if fused.max_rows > config.max_num_seqs else f"up to {fused.max_rows} sequences"
            logger.debug("decode steps in C: one call %s (%d of %d layers%s), four per layer between the matmuls "
                         "(and in prefill steps)", upto, fused.one_call_layers, layers, others)
        return [fused]

    # ---- KV cache ---------------------------------------------------------------------------
    def split_kv_groups(self) -> bool:
        """Whether layers of different attention kinds get block tables of their own (engine/kv_groups.py):
        Config.split_kv_groups (not when a proposer reads the target's one table)."""
        return self.config.split_kv_groups

    def kv_token_bytes(self) -> int:
        """One cached token over every layer, K and V, in the cache's format (scales included)."""
        layer = self.attention_layers[0]
        return self.kv_format.token_bytes(len(self.attention_layers), layer.num_kv_heads, layer.head_dim)

    def kv_block_bytes(self) -> int:
        """One block: block_size tokens of as many layers as the largest KV group has."""
        layer = self.attention_layers[0]
        return self.block_size * self.kv_format.token_bytes(slots_per_block(self.kv_groups), layer.num_kv_heads,
                                                            layer.head_dim)

    def kv_cache_budget_bytes(self) -> int:
        return self.platform.kv_cache_budget_bytes(self.device, self.warmup_model, self.config.cpu_kvcache_bytes,
                                                   self.config.gpu_memory_utilization)

    def allocate_kv_cache(self) -> int:
        layer = self.attention_layers[0]
        reason = self.kv_format.head_dim_error(layer.head_dim)
        if reason is not None:
            raise ValueError(reason)
        block_bytes = self.kv_block_bytes()
        budget = self.kv_cache_budget_bytes()
        budget -= self.allocate_state_cache(budget)
        num_blocks = max(budget, 0) // block_bytes
        blocks_per_seq = -(-self.config.max_model_len // self.block_size) * len(self.kv_groups)
        num_blocks = min(num_blocks, self.config.max_num_seqs * blocks_per_seq)
        if self.config.runner == "pooling":
            num_blocks = min(num_blocks, 1)  # embeddings never store K/V; the structures want a block
        if get_tp_size() > 1:
            # NOTE: rank 0's scheduler hands out block ids for every rank, so all must hold as many.
            count = torch.tensor([num_blocks], dtype=torch.int64, device=self.device)
            dist.all_reduce(count, op=dist.ReduceOp.MIN)
            num_blocks = int(count.item())
        if num_blocks < 1:
            raise ValueError(f"not even one KV cache block ({block_bytes} bytes) fits the memory budget "
                             f"({budget} bytes); raise gpu_memory_utilization / "
                             "cpu_kvcache_bytes or lower max_num_batched_tokens / max_num_seqs")
        # [2 (K, V), layers per block (all of them with one KV group), num_blocks, block_size,
        #  num_kv_heads, a head's row in the format]; layer j of each group reads slot j.
        fmt = self.kv_format
        shape = (2, slots_per_block(self.kv_groups), num_blocks, self.block_size, layer.num_kv_heads,
                 fmt.row_units(layer.head_dim))
        self.kv_cache = self.platform.allocate_kv_cache(shape, fmt.storage, self.device, self.config.kvcache_prefault)
        self._kv_bytes = None  # the cache's bytes as a host array (kv_block_memory), made on first use
        for g, group in enumerate(self.kv_groups):
            for slot, i in enumerate(group.layers):
                attn = self.attention_layers[i]
                attn.k_cache, attn.v_cache = self.kv_cache[0, slot], self.kv_cache[1, slot]
                attn.kv_format = fmt
                attn.kv_group = g
        return num_blocks

    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.kv_cache.device)
        # [2, slots, n, ...] -> [n, 2, slots, ...]: each block's bytes in one row
        blocks = self.kv_cache.index_select(2, ids).movedim(2, 0).contiguous()
        return blocks.view(torch.uint8).reshape(len(block_ids), -1).cpu()

    def kv_block_memory(self, block_id: int) -> list[memoryview] | None:
        if not self.platform.kv_cache_in_host_memory:
            return None
        if self._kv_bytes is None:  # [2, slots, num_blocks, block_size, heads, a head's row in bytes]
            self._kv_bytes = self.kv_cache.view(torch.uint8).numpy()
        cache = self._kv_bytes
        return [memoryview(cache[kv, slot, block_id]).cast("B") for kv in range(2) for slot in range(cache.shape[1])]

    def write_kv_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        cache = self.kv_cache
        ids = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
        rows = data.to(cache.device).view(cache.dtype).reshape(len(block_ids), 2, *cache.shape[1:2], *cache.shape[3:])
        cache.index_copy_(2, ids, rows.movedim(0, 2))

    @property
    def state_layers(self) -> list:
        return self.state_cache.layers

    @property
    def num_state_slots(self) -> int:
        return self.state_cache.num_slots

    def allocate_state_cache(self, budget: int) -> int:
        """The state slots' bytes, taken from the budget before the KV cache's blocks."""
        # The C decode step where the platform has the CPU's kernels (fp32 activations; the state is
        # fp32), the Triton one where it offers that (a GPU).
        kernels = self.kernels
        return self.state_cache.allocate(budget, self.device,
                                         kernels.c_kernels if self.dtype == torch.float32 else None,
                                         self.rank, triton=kernels.state_triton)

    def state_batch(self, seqs: list[Sequence], num_new_tokens: list[int]):
        return self.state_cache.batch(seqs, num_new_tokens, self.to_device)

    @torch.inference_mode()
    def warmup_model(self) -> None:
        """One forward at the largest prefill batch, without a KV cache, to measure peak memory."""
        cfg = self.config
        seq_len = min(cfg.max_num_batched_tokens, cfg.max_model_len)
        num_seqs = max(1, min(cfg.max_num_batched_tokens // seq_len, cfg.max_num_seqs))
        self.platform.reset_peak_memory_stats(self.device)
        seqs = [Sequence([0] * seq_len) for _ in range(num_seqs)]
        input_ids, positions, context, _ = self.prepare_prefill(seqs, [seq_len] * num_seqs)
        context.drop_stores()  # nothing to store: the cache does not exist yet
        with forward_context(context):
            hidden_states = self.model(input_ids, positions)
        # Logits of the largest decode batch ([max_num_seqs, vocab]) are part of the peak too.
        self.model.compute_logits(hidden_states[-1:].expand(cfg.max_num_seqs, -1))
        self.platform.synchronize(self.device)

    @torch.inference_mode()
    def embed(self, token_lists: list[list[int]], pooling: str, normalize: bool = True,
              lora: tuple | None = None) -> torch.Tensor:
        """The prompts' pooled final hidden states [len(token_lists), hidden] (executor/pooling.py),
        in forwards of at most max_num_batched_tokens tokens (a longer prompt alone); nothing is
        stored in the KV cache. lora: (slot table, slot) to run every prompt with that slot's adapter."""
        from nanovllm.executor.pooling import pool
        out, batch, batch_tokens = [], [], 0
        budget = self.config.max_num_batched_tokens

        def run(prompts: list[list[int]]) -> None:
            seqs = [Sequence(list(p)) for p in prompts]
            input_ids, positions, context, _ = self.prepare_prefill(seqs, [len(p) for p in prompts])
            context.drop_stores()
            if lora is not None:
                self.lora.activate(lora[0])
                context.lora = self.lora.batch([lora[1]] * len(prompts), [len(p) for p in prompts])
            with forward_context(context):
                hidden_states = self.model(input_ids, positions)
            out.append(pool(hidden_states, [len(p) for p in prompts], pooling, normalize))

        for tokens in token_lists:
            if batch and batch_tokens + len(tokens) > budget:
                run(batch)
                batch, batch_tokens = [], 0
            batch.append(tokens)
            batch_tokens += len(tokens)
        if batch:
            run(batch)
        return torch.cat(out)

    # ---- step inputs ------------------------------------------------------------------------
    def slots_of(self, seq: Sequence, start: int, end: int, group: int = 0) -> np.ndarray:
        """Cache slots of positions [start, end) of seq in a KV group's blocks."""
        if not seq.block_table:
            return np.full(end - start, -1, dtype=np.int64)
        pos = np.arange(start, end)
        table = np.asarray(seq.block_tables[group], dtype=np.int64)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on this rank's device (the platform's copy: pinned on CUDA)."""
        return self.platform.to_device(t, self.device)

    def prepare_prefill(self, seqs: list[Sequence], num_new_tokens: list[int],
                        needs_prompt_logits: list[bool] | None = None):
        """(input_ids, positions, context, logits_indices) of a prefill step: logits_indices picks
        each sequence's last new token, and every new token of the rows that need prompt logits."""
        input_ids, positions, context_lens = [], [], []
        for seq, n in zip(seqs, num_new_tokens):
            start = seq.num_computed_tokens
            input_ids.extend(seq.uncomputed_token_ids(n))
            positions.append(np.arange(start, start + n))
            context_lens.append(start + n)
        logits_indices = logits_positions(num_new_tokens, needs_prompt_logits)
        groups = []
        for g in range(len(self.kv_groups)):
            slots = [self.slots_of(seq, seq.num_computed_tokens, seq.num_computed_tokens + n, g)
                     for seq, n in zip(seqs, num_new_tokens)]
            tables = [seq.block_tables[g] if seq.block_table else [] for seq in seqs]
            batch = AttentionBatch(is_prefill=True, num_new_tokens=list(num_new_tokens), context_lens=context_lens,
                                   block_tables=tables, to_device=self.to_device)
            groups.append((self.to_device(torch.from_numpy(np.concatenate(slots))), self.backend.prepare(batch)))
        context = Context(is_prefill=True, slot_mapping=groups[0][0], attn_metadata=groups[0][1],
                          more_groups=tuple(groups[1:]), state=self.state_batch(seqs, num_new_tokens))
        input_ids = self.to_device(torch.tensor(input_ids, dtype=torch.int64))
        positions = self.to_device(torch.from_numpy(np.concatenate(positions)))
        return input_ids, positions, context, self.to_device(torch.tensor(logits_indices))

    def prepare_decode(self, seqs: list[Sequence], drafts: list[list[int]] | None = None):
        """(input_ids, positions, context) of a decode step: one new token per sequence, or with
        drafts (speculative verification) a row for its last token and one per proposal after it,
        all over the sequence's block table."""
        input_ids, positions = [], []
        tables: list[list[list[int]]] = [[] for _ in self.kv_groups]
        for i, seq in enumerate(seqs):
            proposed = drafts[i] if drafts is not None else []
            start = len(seq) - 1
            input_ids += [seq.last_token, *proposed]
            positions += range(start, start + 1 + len(proposed))
            for g, table in enumerate(seq.block_tables):
                tables[g] += [table] * (1 + len(proposed))
        input_ids, positions, context = self.prepare_rows(input_ids, positions, *tables)
        context.state = self.state_batch(seqs, [1] * len(seqs))
        return input_ids, positions, context

    def prepare_rows(self, input_ids: list[int], positions: list[int], tables: list[list[int]],
                     *more_tables: list[list[int]]):
        """(input_ids, positions, context) of decode rows: each its token at its position, attending
        to every cached position before it in its block table (rows may share one: then all rows'
        K/V are stored before any row attends); more_tables: the rows' tables of KV groups past the first."""
        positions = np.array(positions, dtype=np.int64)
        groups = []
        for group_tables in (tables, *more_tables):
            slots = np.array([t[p // self.block_size] * self.block_size + p % self.block_size
                              for t, p in zip(group_tables, positions)], dtype=np.int64)
            batch = AttentionBatch(is_prefill=False, num_new_tokens=[1] * len(group_tables),
                                   context_lens=(positions + 1).tolist(), block_tables=group_tables,
                                   to_device=self.to_device)
            groups.append((self.to_device(torch.from_numpy(slots)), self.backend.prepare(batch)))
        context = Context(is_prefill=False, slot_mapping=groups[0][0], attn_metadata=groups[0][1],
                          more_groups=tuple(groups[1:]))
        input_ids = torch.tensor(input_ids, dtype=torch.int64)
        return self.to_device(input_ids), self.to_device(torch.from_numpy(positions)), context

    def prepare_sample(self, out: SchedulerOutput) -> SamplingMetadata:
        return SamplingMetadata.build(out.seqs, out.num_new_tokens, self.config.hf_config.vocab_size,
                                      self.config.eos_token_ids, self.device, self.to_device)

    # ---- forward and sample -----------------------------------------------------------------
    @torch.inference_mode()
    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, context: Context,
                  logits_indices: torch.Tensor | None) -> torch.Tensor | None:
        # NOTE: a step with adapter rows runs on a runner that knows adapters (runs_lora), else eagerly.
        for runner in self.step_runners:
            if (context.lora is None or runner.runs_lora) and runner.can_run(input_ids.shape[0], context):
                with forward_context(context):  # the modules a runner calls read its adapter rows
                    return runner.run(input_ids, positions, context, logits_indices)
        with forward_context(context):
            hidden_states = self.model(input_ids, positions)
        if logits_indices is not None:
            hidden_states = hidden_states[logits_indices]
        return self.model.compute_logits(hidden_states)

    @torch.inference_mode()
    def run(self, out: SchedulerOutput, drafts: list[list[int]] | None = None) -> SampledTokens | None:
        """One step: the tokens each scheduled sequence emits (rank 0; None on other ranks): one
        sampled token, or with proposals (drafts, beside a decode step) the ones verification
        accepts and the target's own after them (spec_decode/verify.py)."""
        metadata = self.prepare_sample(out) if self.rank == 0 and drafts is None else None
        if out.is_prefill:
            input_ids, positions, context, logits_indices = self.prepare_prefill(
                out.seqs, out.num_new_tokens, out.needs_prompt_logits)
        else:
            input_ids, positions, context = self.prepare_decode(out.seqs, drafts)
            logits_indices = None
        if out.lora_slots is not None:
            self.lora.activate(out.lora_slots)
            rows = out.num_new_tokens if drafts is None else [1 + len(d) for d in drafts]
            context.lora = self.lora.batch(out.lora_rows, rows)
        logits = self.run_model(input_ids, positions, context, logits_indices)
        if self.rank != 0:
            return None
        if drafts is not None:
            return verify(self.sampler, logits, out.seqs, drafts, self.config.hf_config.vocab_size,
                          self.config.eos_token_ids, self.device, self.to_device)
        prompt_logprobs = None
        if out.is_prefill and out.needs_prompt_logits is not None:
            logits, prompt_logprobs = split_prompt_logits(logits, out.seqs, out.num_new_tokens,
                                                          out.needs_prompt_logits)
        sampled = self.sampler(logits, metadata).to_host(metadata).as_tokens()
        sampled.prompt_logprobs = prompt_logprobs
        return sampled

    def broken_reason(self) -> str | None:
        """One process: a failed step leaves nothing behind that stops the next one."""
        return None

    def step_runner(self, kind: type[StepRunner]) -> StepRunner | None:
        """The step runner of that class in use (DecodeGraphs, FusedDecode), or None."""
        return next((r for r in self.step_runners if isinstance(r, kind)), None)

    def exit(self) -> None:
        for runner in self.step_runners:
            runner.free()
        self.step_runners = []
        self.kv_cache = self._kv_bytes = None
        for attn in self.attention_layers:
            attn.k_cache = attn.v_cache = torch.tensor([])  # the cache is freed once its last view is gone
