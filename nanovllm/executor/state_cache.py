"""The state layers' slots (layers/sequence_state.py: Gated DeltaNet, convolutions, Mamba-2) beside
the paged KV cache: one slot per sequence the scheduler admits (the KVCacheManager hands them out),
each holding every state layer's state; ModelRunner allocates them from its memory budget and
builds each step's StateBatch."""
import logging

import torch
import torch.distributed as dist
from torch import nn

from nanovllm.config import Config
from nanovllm.distributed.parallel import get_tp_size
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sequence_state import SequenceStateLayer, StateBatch

logger = logging.getLogger(__name__)


class StateCache:
    def __init__(self, model: nn.Module, config: Config):
        self.layers = [m for m in model.modules() if isinstance(m, SequenceStateLayer)]
        if self.layers and config.speculative_config is not None:
            raise ValueError("speculative decoding is not supported for models with state layers (linear "
                             "attention, convolutions, Mamba-2: a rejected proposal would have to roll their state back)")
        self.config = config
        self.num_slots = 0

    def allocate(self, budget: int, device, c_kernels, rank: int, triton: bool = False) -> int:
        """One slot per sequence up to max_num_seqs, at most half the budget (the rest is the KV
        cache's); every rank the same count. c_kernels: the CPU's C kernels for the decode step, or
        None; triton: the decode step in Triton (kernels/triton_deltanet.py). Returns the slots' bytes."""
        if not self.layers:
            return 0
        per_slot = sum(layer.slot_bytes() for layer in self.layers)
        slots = min(self.config.max_num_seqs, max(budget, 0) // 2 // per_slot)
        if self.config.runner == "pooling":
            slots = min(slots, 1)
        if get_tp_size() > 1:  # rank 0's scheduler hands out the slots of every rank
            count = torch.tensor([slots], dtype=torch.int64, device=device)
            dist.all_reduce(count, op=dist.ReduceOp.MIN)
            slots = int(count.item())
        if slots < 1:
            raise ValueError(f"not even one sequence-state slot ({per_slot} bytes) fits half the memory "
                             f"budget ({budget} bytes); raise cpu_kvcache_bytes / gpu_memory_utilization")
        if slots < self.config.max_num_seqs and rank == 0:
            logger.info("sequence state (linear attention, convolutions, Mamba-2) for %d sequences at once "
                        "(max_num_seqs %d): half the KV budget",
                        slots, self.config.max_num_seqs)
        for layer in self.layers:
            layer.attach_state(layer.new_state(slots, device), c_kernels, triton)
        self.num_slots = slots
        return slots * per_slot

    def batch(self, seqs: list[Sequence], num_new_tokens: list[int], to_device) -> StateBatch | None:
        """The state layers' view of a step (None without such layers; slots None for
        sequences the scheduler did not admit: the warm-up's, embeddings', each run from zero state)."""
        if not self.layers:
            return None
        fresh = [seq.num_computed_tokens == 0 for seq in seqs]
        if any(seq.state_slot is None for seq in seqs):
            return StateBatch(None, list(num_new_tokens), fresh)
        slots = to_device(torch.tensor([seq.state_slot for seq in seqs], dtype=torch.int64))
        return StateBatch(slots, list(num_new_tokens), fresh)
