"""Executor: the contract between LLMEngine and whatever runs the model (vLLM's executor/abstract.py).
ModelRunner is the single-process executor; distributed/tp_runner.py's TensorParallelRunner runs
rank 0's ModelRunner with workers beside it. Each answers every call, so the engine, the scheduler
and the speculator never ask which one they hold."""
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from nanovllm.engine.kv_groups import KVGroup
    from nanovllm.engine.scheduler import SchedulerOutput
    from nanovllm.lora.layers import LoRAModel
    from nanovllm.sample.sampler import SampledTokens


class Executor(ABC):
    """What the engine calls on the model side, once the KV cache exists."""

    num_kvcache_blocks: int  # blocks of the paged KV cache (every rank holds as many)
    # Whether this process can time a forward on its own (spec_decode/cost.py measures the steps'
    # cost through prepare_rows / run_model): not under tensor parallelism, whose forwards need every rank.
    can_time_steps: bool

    # ---- what the cache holds (the scheduler's block tables, the start-up line) -----------------
    kv_groups: "list[KVGroup]"  # the layers' KV groups (engine/kv_groups.py): one block table each
    num_state_slots: int  # slots of the state layers (linear attention, convolutions, Mamba-2; 0 without)
    # What keeps a faster step path (the CPU's C step) off some steps, for the start-up summary's WARNING.
    step_notes: list[str]
    weight_bytes: int  # the bytes this rank holds its weights in, each tensor once (the start-up summary)
    lora: "LoRAModel | None"  # rank 0's adapter slots (lora/layers.py) when the engine serves adapters

    @abstractmethod
    def kv_token_bytes(self) -> int:
        """One cached token over every layer, K and V, in the cache's format."""

    @abstractmethod
    def kv_block_bytes(self) -> int:
        """One block of the cache."""

    # ---- blocks in and out (the tier under the prefix cache, kv_offload/) ----------------------
    @abstractmethod
    def read_kv_blocks(self, block_ids: list[int]) -> "torch.Tensor":
        """A copy of these blocks' K/V, one uint8 row of kv_block_bytes() per block, on the host."""

    @abstractmethod
    def write_kv_blocks(self, block_ids: list[int], data: "torch.Tensor") -> None:
        """Fill these blocks with rows read_kv_blocks returned (this engine's or an earlier one's)."""

    @abstractmethod
    def kv_block_memory(self, block_id: int) -> list[memoryview] | None:
        """A block's bytes in the cache as writable host memory, in read_kv_blocks' row order (a read
        from a file lands there directly); None where the cache is not host memory."""

    # ---- steps ----------------------------------------------------------------------------------
    @abstractmethod
    def run(self, out: "SchedulerOutput", drafts: list[list[int]] | None = None) -> "SampledTokens | None":
        """One step over every rank; each row's emitted tokens (rank 0): one sampled token, or with
        proposals beside a decode step (drafts: per row, spec_decode/) the accepted ones and the
        target's own after them."""

    @abstractmethod
    def embed(self, token_lists: list[list[int]], pooling: str, normalize: bool = True,
              lora: tuple | None = None) -> "torch.Tensor":
        """The prompts' pooled final hidden states; ValueError where this executor cannot embed.
        lora: (the scheduler's slot table, the slot every prompt runs with) for an adapter's embeddings."""

    # ---- health and end -------------------------------------------------------------------------
    @abstractmethod
    def broken_reason(self) -> str | None:
        """Why no further step can run, or None while every rank is well."""

    @abstractmethod
    def exit(self) -> None:
        """Free the cache and end any worker; idempotent."""
