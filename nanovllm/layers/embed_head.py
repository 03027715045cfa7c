"""Vocab-parallel token embedding and LM head: each rank holds a contiguous slice of the
vocabulary. The embedding's table is held and read by its embedding method, the head multiplies
through its linear method (layers/quantization), each chosen at construction."""
import torch
import torch.distributed as dist
from torch import nn

from nanovllm.distributed.parallel import divide, get_tp_rank, get_tp_size
from nanovllm.layers.c_description import describes, weight_view
from nanovllm.layers.quantization.base import QuantizationConfig, method_for
from nanovllm.layers.quantization.parameter import TaggedWeights, copy_checked, shard_of


class VocabParallelBase(TaggedWeights):
    """A [num_embeddings, embedding_dim] table split over the ranks by rows."""

    tp_dim = 0  # as a linear layer's: the outputs (the vocabulary) are split over the ranks

    def __init__(self, num_embeddings: int, embedding_dim: int, prefix: str):
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_per_partition = divide(num_embeddings, self.tp_size, "vocabulary size")
        self.vocab_start_idx = self.num_embeddings_per_partition * self.tp_rank
        self.vocab_end_idx = self.vocab_start_idx + self.num_embeddings_per_partition
        self.prefix = prefix
        # The model dtype: a table held narrower (bf16 weights on CPU) still gives rows of it.
        self.dtype = torch.get_default_dtype()

    def rank_part(self, param: nn.Parameter, loaded: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the vocabulary (of a tensor laid out with them along param.output_dim)."""
        if self.tp_size == 1 or param.output_dim is None:
            return loaded
        return shard_of(loaded, param.output_dim, self.tp_rank, self.tp_size, "vocabulary size")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        copy_checked(param.data, self.rank_part(param, loaded), self.prefix or type(self).__name__)


class VocabParallelEmbedding(VocabParallelBase):
    def __init__(self, num_embeddings: int, embedding_dim: int, quant_config: QuantizationConfig | None = None,
                 prefix: str = ""):
        super().__init__(num_embeddings, embedding_dim, prefix)
        self.quant_method = method_for(quant_config, "embedding_method", self, prefix)
        self.quant_method.create_weights(self, self.num_embeddings_per_partition, embedding_dim,
                                         torch.get_default_dtype())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.quant_method.embedding(self, x)
        mask = (x >= self.vocab_start_idx) & (x < self.vocab_end_idx)
        y = self.quant_method.embedding(self, mask * (x - self.vocab_start_idx))
        y = mask.unsqueeze(-1) * y  # rows owned by other ranks become 0 before the sum
        dist.all_reduce(y)
        return y


class ParallelLMHead(VocabParallelBase):
    """logits = h W^T over this rank's vocab slice, gathered to rank 0 (other ranks get None)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = ""):
        if bias:
            raise ValueError("an LM head bias is not supported")
        super().__init__(num_embeddings, embedding_dim, prefix)
        # The linear-layer view of the table, for the methods (and the C decode's descriptors).
        self.input_size, self.output_size = embedding_dim, self.num_embeddings_per_partition
        self.is_tied = False
        self.quant_method = method_for(quant_config, "lm_head_method", self, prefix)
        self.quant_method.create_weights(self, embedding_dim, [self.num_embeddings_per_partition],
                                         torch.get_default_dtype())

    def tie_weights(self, embedding: VocabParallelEmbedding) -> None:
        """Multiply by the embedding's table itself (tie_word_embeddings).
        NOTE: a method that repacks the table must keep the form the embedding reads
        (process_weights_after_loading passes is_shared). A head whose method may not tie (one the
        checkpoint quantized on its own: GPTQ's lm_head: true, a compressed-tensors head not ignored)
        stays untied: it multiplies from its own tensors, beside the dense embedding table."""
        if not self.quant_method.may_tie:
            return
        mine = {name for name, _ in self.named_parameters(recurse=False)}
        theirs = {name for name, _ in embedding.named_parameters(recurse=False)}
        if mine != theirs:
            raise ValueError(f"cannot tie {self.prefix!r} to {embedding.prefix!r}: their weight formats differ "
                             f"({sorted(mine)} vs {sorted(theirs)})")
        for name, param in embedding.named_parameters(recurse=False):
            setattr(self, name, param)
        self.is_tied = True

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        logits = self.quant_method.apply(self, x, None)
        if self.tp_size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(logits, parts, dst=0)
        return torch.cat(parts, dim=-1) if self.tp_rank == 0 else None


# To the C decode step the embedding and the head are their method's view of the table.
describes(VocabParallelBase, subclasses=True)(weight_view)
