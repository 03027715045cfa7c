"""Vocab-parallel token embedding and LM head: each rank holds a contiguous slice of the vocabulary."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.linear import copy_checked
from nanovllm.layers.linear_methods import LinearMethod
from nanovllm.distributed.parallel import divide, get_tp_rank, get_tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.num_embeddings = num_embeddings
        self.num_embeddings_per_partition = divide(num_embeddings, self.tp_size, "vocabulary size")
        self.vocab_start_idx = self.num_embeddings_per_partition * self.tp_rank
        self.vocab_end_idx = self.vocab_start_idx + self.num_embeddings_per_partition
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        # The model dtype: a table held narrower (bf16 weights on CPU, platforms/cpu.py) still
        # gives rows of this dtype.
        self.dtype = self.weight.dtype

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        size = self.num_embeddings_per_partition
        copy_checked(param.data, loaded.narrow(0, self.tp_rank * size, size) if self.tp_size > 1 else loaded,
                     type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(x, self.weight).to(self.dtype)
        mask = (x >= self.vocab_start_idx) & (x < self.vocab_end_idx)
        y = F.embedding(mask * (x - self.vocab_start_idx), self.weight).to(self.dtype)
        y = mask.unsqueeze(-1) * y  # rows owned by other ranks become 0 before the sum
        dist.all_reduce(y)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    """logits = h W^T over this rank's vocab slice, gathered to rank 0 (other ranks get None)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False):
        if bias:
            raise ValueError("an LM head bias is not supported")
        super().__init__(num_embeddings, embedding_dim)
        # NOTE: with tied embeddings self.weight is also the embedding table: a method that
        # repacks it must keep the dense form (install_linear_method tells it so).
        self.linear_method: LinearMethod = LinearMethod()

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        logits = self.linear_method.apply(self, x, None)
        if self.tp_size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(logits, parts, dst=0)
        return torch.cat(parts, dim=-1) if self.tp_rank == 0 else None
