"""Linear layers, tensor-parallel aware. Each parameter carries a weight_loader that copies its
rank's shard of a checkpoint tensor into place (used by utils/loader.py)."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels import cpu_kernels
from nanovllm.distributed.parallel import divide, get_tp_rank, get_tp_size


def copy_checked(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor for {what} has shape {tuple(loaded.shape)}, "
                         f"expected {tuple(param.shape)}")
    param.copy_(loaded)


def linear_transposed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T computed as (W x^T)^T. On CPU, MKL runs this orientation 1.2-2x faster when the
    output is at least as wide as the input and x has 2-1024 rows (docs/performance.md)."""
    y = torch.mm(weight, x.t()).t().contiguous()  # [num_tokens, output_size]
    return y if bias is None else y.add_(bias)


def can_pack_weights(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether linear weights can be held in oneDNN's packed layout: fp32 on CPU. Measured here (AVX2,
    2 cores): 1.3-2x faster than MKL from 1 to 64 rows, equal or better above (docs/performance.md).
    bf16 is left to MKL: it was not measured on a CPU with bf16 units."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [output_size, input_size] reordered once into oneDNN's blocked layout (an opaque tensor)."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) against a weight from pack_weight()."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def switch_to_packed_weight(module: nn.Module, keep_dense: bool, gemv_kernels=None) -> None:
    """Make a layer (with .weight, .packed_weight, .gemv_kernels) multiply by a oneDNN-packed copy of
    its weight from now on (after loading; see can_pack_weights). With gemv_kernels (the C kernels),
    one-row inputs use the C GEMV on the dense weight instead, which is then kept; otherwise the
    dense weight is freed (left empty) unless keep_dense."""
    module.packed_weight = pack_weight(module.weight)
    module.gemv_kernels = gemv_kernels
    if not keep_dense and gemv_kernels is None:
        module.weight.data = module.weight.data.new_empty(0)


def project(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ bias) with whichever form of the weight the layer holds (see switch_to_packed_weight)."""
    if layer.packed_weight is None:
        return layer.matmul(x, layer.weight, bias)
    if layer.gemv_kernels is not None and x.shape[0] == 1:
        return cpu_kernels.gemv(layer.gemv_kernels, x, layer.weight, bias)
    return packed_linear(x, layer.packed_weight, bias)


def pack_linear_weights(model: nn.Module, gemv_kernels=None) -> int:
    """pack_weight() every layer that has one; a weight another module also uses (a tied embedding)
    keeps its dense copy. gemv_kernels: see switch_to_packed_weight. Returns the number of layers
    packed."""
    users: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            users[id(param)] = users.get(id(param), 0) + 1
    packed = 0
    for module in model.modules():
        if hasattr(module, "pack_weight"):
            module.pack_weight(keep_dense=users[id(module.weight)] > 1, gemv_kernels=gemv_kernels)
            packed += 1
    return packed


def pick_linear(output_size: int, input_size: int):
    """The matmul of a layer built on the current default device: decided once, at build time."""
    if torch.get_default_device().type == "cpu" and output_size >= input_size:
        return linear_transposed
    return F.linear


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
        self.matmul = pick_linear(output_size, input_size)
        self.packed_weight: torch.Tensor | None = None
        self.gemv_kernels = None
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

    def pack_weight(self, keep_dense: bool = False, gemv_kernels=None) -> None:
        switch_to_packed_weight(self, keep_dense, gemv_kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(self, x, self.bias)


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
        y = project(self, x, self.bias if self.tp_rank == 0 else None)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y
