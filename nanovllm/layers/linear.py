"""Linear layers, tensor-parallel aware. How a layer's weights are stored and multiplied is its
quant_method, chosen at construction by the quantization config (layers/quantization); the method
registers the parameters through register_weight, each tagged with its output / input / packed
dims, and the weight loaders here shard and place checkpoint tensors by those tags."""
import torch
import torch.distributed as dist
from torch import nn

from nanovllm.distributed.parallel import divide, get_tp_rank, get_tp_size
from nanovllm.layers.c_description import describes, weight_view
from nanovllm.layers.quantization.base import QuantizationConfig, method_for
from nanovllm.layers.quantization.parameter import TaggedWeights, copy_checked, in_param_units, shard_of


class LinearBase(TaggedWeights):
    """y = x W^T (+ b) for this rank's W, logically [output_size, input_size].

    tp_dim: which logical dimension is split across ranks (0: output, 1: input, None: replicated).
    lora: the layer's adapter slots (lora/layers.py LoRALayer) when the engine serves adapters.
    """

    lora = None

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_dim: int | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 output_partition_sizes: list[int] | None = None):
        super().__init__()
        self.tp_dim = tp_dim
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.input_size = input_size
        self.output_size = output_size
        self.output_partition_sizes = output_partition_sizes or [output_size]
        self.prefix = prefix
        self.quant_method = method_for(quant_config, "linear_method", self, prefix)
        self.quant_method.create_weights(self, input_size, self.output_partition_sizes, torch.get_default_dtype())
        if bias:
            self.register_weight("bias", torch.empty(output_size), output_dim=0)
        else:
            self.register_parameter("bias", None)

    def sharded_dim(self, param: nn.Parameter) -> int | None:
        """param's dimension split across ranks (None: each rank loads it whole)."""
        if self.tp_size == 1 or self.tp_dim is None:
            return None
        return param.output_dim if self.tp_dim == 0 else param.input_dim

    def rank_part(self, param: nn.Parameter, loaded: torch.Tensor) -> torch.Tensor:
        dim = self.sharded_dim(param)
        what = f"{self.prefix or type(self).__name__} checkpoint tensor dimension"
        return loaded if dim is None else shard_of(loaded, dim, self.tp_rank, self.tp_size, what)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        copy_checked(param.data, self.rank_part(param, loaded), self.prefix or type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x, self.bias)
        return y if self.lora is None else self.lora.add(x, y)


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank (a mixture of experts' router); no communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = ""):
        super().__init__(input_size, output_size, bias, None, quant_config, prefix)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 output_partition_sizes: list[int] | None = None):
        super().__init__(input_size, divide(output_size, get_tp_size(), "output size"), bias, 0, quant_config,
                         prefix, output_partition_sizes)


class StackedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections stored as one, each checkpoint tensor loaded into its
    part of the outputs (shard_index maps a loader's shard id to the part)."""

    def shard_index(self, shard_id) -> int:
        raise NotImplementedError

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        what = f"{self.prefix or type(self).__name__}[{shard_id}]"
        if shard_id is None or param.output_dim is None:
            raise ValueError(f"{what}: this parameter is not stacked from per-part checkpoint tensors")
        index = self.shard_index(shard_id)
        dim = param.output_dim
        offset = in_param_units(param, dim, sum(self.output_partition_sizes[:index]), what)
        size = in_param_units(param, dim, self.output_partition_sizes[index], what)
        copy_checked(param.data.narrow(dim, offset, size), self.rank_part(param, loaded), what)


class MergedColumnParallelLinear(StackedColumnParallelLinear):
    """Several column-parallel projections stored as one (e.g. gate_proj + up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = ""):
        self.output_sizes = output_sizes
        tp_size = get_tp_size()
        parts = [divide(size, tp_size, "output size") for size in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, quant_config, prefix, parts)

    def shard_index(self, shard_id: int) -> int:
        return shard_id


class QKVParallelLinear(StackedColumnParallelLinear):
    """q, k and v projections stored as one; heads split across ranks."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int | None = None, bias: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = ""):
        tp_size = get_tp_size()
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.head_size = head_size
        self.num_heads = divide(total_num_heads, tp_size, "number of attention heads")
        self.num_kv_heads = divide(total_num_kv_heads, tp_size, "number of KV heads")
        q_size, kv_size = self.num_heads * head_size, self.num_kv_heads * head_size
        output_size = (total_num_heads + 2 * total_num_kv_heads) * head_size
        super().__init__(hidden_size, output_size, bias, quant_config, prefix, [q_size, kv_size, kv_size])

    def shard_index(self, shard_id: str) -> int:
        return "qkv".index(shard_id)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs summed with all_reduce."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = ""):
        super().__init__(divide(input_size, get_tp_size(), "input size"), output_size, bias, 1, quant_config, prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: the bias is added on rank 0 only, so the all_reduce counts it once.
        y = self.quant_method.apply(self, x, self.bias if self.tp_rank == 0 else None)
        if self.lora is not None:  # this rank's columns of A: the all-reduce sums the partial updates
            y = self.lora.add(x, y)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y


# To the C decode step every linear layer is its method's view of its weights, with its bias.
describes(LinearBase, subclasses=True)(weight_view)
