"""Linear layers, tensor-parallel aware. Each parameter carries a weight_loader that copies its
rank's shard of a checkpoint tensor into place (used by utils/loader.py); the multiplication
itself is the layer's LinearMethod (layers/linear_methods.py)."""
import torch
import torch.distributed as dist
from torch import nn

from nanovllm.distributed.parallel import divide, get_tp_rank, get_tp_size
from nanovllm.layers.linear_methods import LinearMethod


def copy_checked(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor for {what} has shape {tuple(loaded.shape)}, "
                         f"expected {tuple(param.shape)}")
    param.copy_(loaded)


class LinearBase(nn.Module):
    """y = x W^T (+ b) with W of shape [output_size, input_size] on this rank.

    tp_dim is the weight dimension split across ranks (0: output, 1: input, None: replicated).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_dim: int | None = None):
        super().__init__()
        self.tp_dim = tp_dim
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.linear_method: LinearMethod = LinearMethod()
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def _shard(self, loaded: torch.Tensor, dim: int) -> torch.Tensor:
        size = divide(loaded.size(dim), self.tp_size, "checkpoint tensor dimension")
        return loaded.narrow(dim, self.tp_rank * size, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if self.tp_dim is not None and self.tp_size > 1 and (self.tp_dim < loaded.dim()):
            loaded = self._shard(loaded, self.tp_dim)
        copy_checked(param.data, loaded, type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self, x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, divide(output_size, get_tp_size(), "output size"), bias, tp_dim=0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections stored as one (e.g. gate_proj + up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        if self.tp_size > 1:
            loaded = self._shard(loaded, 0)
        copy_checked(param.data.narrow(0, offset, size), loaded, f"{type(self).__name__}[{shard_id}]")


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections stored as one; heads split across ranks."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int | None = None, bias: bool = False):
        tp_size = get_tp_size()
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.head_size = head_size
        self.num_heads = divide(total_num_heads, tp_size, "number of attention heads")
        self.num_kv_heads = divide(total_num_kv_heads, tp_size, "number of KV heads")
        output_size = (total_num_heads + 2 * total_num_kv_heads) * head_size
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q_size = self.num_heads * self.head_size
        kv_size = self.num_kv_heads * self.head_size
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        if self.tp_size > 1:
            loaded = self._shard(loaded, 0)
        copy_checked(param.data.narrow(0, offset, size), loaded, f"{type(self).__name__}[{shard_id}]")


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs summed with all_reduce."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(divide(input_size, get_tp_size(), "input size"), output_size, bias, tp_dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: the bias is added on rank 0 only, so the all_reduce counts it once.
        y = self.linear_method.apply(self, x, self.bias if self.tp_rank == 0 else None)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y
