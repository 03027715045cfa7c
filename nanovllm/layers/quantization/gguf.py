"""GGUF's block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q6_K, F16, BF16) as layer weights.

Two configs (gguf_config.py) give the same methods: GGUFConfig for a .gguf file (each tensor in the
format the file stores it, loader/gguf.py), and OnlineQuantConfig for `quantization="q8_0" | "q4_0" | ...` on a
safetensors checkpoint (every linear weight and the embedding quantized at load by the `gguf`
package's reference quantizers, so the blocks are bit-identical to theirs).

A layer holds its weight once, as raw rows of blocks (uint8 [rows, row bytes], the parameter
`weight`; the 32-weight formats interleaved by 8 rows in place) and multiplies from them with the
C kernels (kernels/cpu_quant.c): inputs are quantized once per call to 14-bit integers, the dot
products run in integers. A stacked layer (q/k/v, gate/up) whose
parts the file stores in different formats (Q4_K_M's Q6_K v next to Q4_K q and k) keeps one matrix
per part, chained so that the kernels write each part's outputs after the previous one's.
Tensor parallelism splits rows freely and columns only on block boundaries."""
import logging

import torch
from torch import nn

from nanovllm.kernels import cpu_kernels
from nanovllm.layers.quantization.base import CWeightView, EmbeddingMethodBase, LinearKernels, LinearMethodBase
from nanovllm.layers.quantization.block_formats import block_shape, row_bytes
from nanovllm.layers.quantization.gguf_dense import dequantized
from nanovllm.layers.quantization.parameter import tagged_parameter
from nanovllm.layers.quantization.quantizers import quantize_rows
from nanovllm.layers.quantization.unquantized import UnquantizedLinearMethod

logger = logging.getLogger(__name__)

def held_parts(kernels, param: nn.Parameter, type_name: str, k: int,
               one_matrix: bool = False) -> list[tuple[str, torch.Tensor]]:
    """The (C type, rows) the kernels multiply param's raw rows as: 8-row groups interleaved once
    (cpu_kernels.interleaved, in place: one copy at every moment), any last rows that
    do not fill a group as they are (one_matrix: then none is interleaved, for an embedding table,
    whose lookups read one matrix). Done once per parameter: a tied table's second user gets the
    first one's result, remembered on the parameter."""
    if getattr(param, "c_parts", None) is None:
        data, n = param.data.contiguous(), param.shape[0]
        param.data = data
        whole = 0 if one_matrix and n % cpu_kernels.INTERLEAVE else n - n % cpu_kernels.INTERLEAVE
        # the first rows' groups repacked where they are (a 150k-row table copied would be its size again)
        packed = cpu_kernels.interleaved(kernels, type_name, data[:whole], k, in_place=True) if whole else None
        if packed is None:
            param.c_parts = [(type_name, 0, n)]
        else:
            param.c_parts = [(packed[0], 0, whole)] + ([(type_name, whole, n)] if whole < n else [])
    return [(t, param.data[first:end]) for t, first, end in param.c_parts]


def check_split(name: str, type_name: str, k: int, tp_size: int) -> None:
    """ValueError unless k inputs of type_name split over tp_size ranks on block boundaries."""
    size = block_shape(type_name)[0]
    if k % tp_size or (k // tp_size) % size:
        raise ValueError(f"tensor_parallel_size={tp_size} would split {name} ({type_name}, {k} inputs) into parts of "
                         f"{k / tp_size:g} inputs, not whole {type_name} blocks of {size}; use a tensor_parallel_size "
                         f"that divides {k // size} blocks")


class GGUFLinearMethod(LinearMethodBase):
    """x W^T over raw block rows, one matrix per run of parts in the same format.

    types: the format of each stacked part (one entry for a plain layer). online: the checkpoint
    gives dense weights, quantized into types[0] after loading. input_planes: how the kernels
    round the inputs (CWeightView.input_planes)."""

    c_only = True

    def __init__(self, types: list[str], online: bool = False, input_planes: int = 0):
        self.types = types
        self.online = online
        self.input_planes = input_planes
        self.c_kernels = None
        self.c_linear = None
        self.views: CWeightView | None = None
        self.parts: dict[int, torch.Tensor] = {}
        self.triton_parts: list | None = None  # on a GPU: each part as gguf_triton.hold keeps it
        self.dense: UnquantizedLinearMethod | None = None  # without C kernels: a dequantized copy

    @classmethod
    def holding(cls, layer: nn.Module, type_name: str, rows: torch.Tensor, k: int,
                input_planes: int) -> "GGUFLinearMethod":
        """The method of a layer whose weight another format decoded into block rows (uint8 [n, row
        bytes] of type_name, k inputs), registered here as layer.weight."""
        method = cls([type_name], input_planes=input_planes)
        method.sizes, method.k = [rows.shape[0]], k
        layer.register_weight("weight", rows, output_dim=0, input_dim=1)
        return method

    @property
    def name(self) -> str:
        how = "dequantized, torch" if self.dense is not None else "C kernel"
        return f"{'/'.join(dict.fromkeys(self.types))} ({how}{', quantized at load' if self.online else ''})"

    @property
    def mixed(self) -> bool:
        return len(set(self.types)) > 1

    def create_weights(self, layer: nn.Module, input_size: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        what = getattr(layer, "prefix", "") or type(layer).__name__
        for type_name in set(self.types):
            row_bytes(type_name, input_size, what)  # whole blocks on this rank, else a ValueError
        self.sizes = list(output_partition_sizes)
        self.k = input_size
        self.params_dtype = params_dtype
        if self.online:
            layer.register_weight("weight", torch.empty(sum(self.sizes), input_size, dtype=params_dtype),
                                  output_dim=0, input_dim=1)
        elif not self.mixed:
            layer.register_weight("weight", torch.empty(sum(self.sizes), row_bytes(self.types[0], input_size, what),
                                                        dtype=torch.uint8), output_dim=0, input_dim=1)
        else:
            # One matrix per part, filled by load_part; the parameter only names the checkpoint seat.
            param = tagged_parameter(torch.empty(0, dtype=torch.uint8), self.load_part, output_dim=0, input_dim=1)
            layer.register_parameter("weight", param)
            self.layer_ref = layer

    def load_part(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        layer = self.layer_ref
        index = layer.shard_index(shard_id)
        if self.types[index] == "f32" and loaded.dtype == torch.float32:
            loaded = loaded.contiguous().view(torch.uint8)  # an F32 part beside block-format ones: its bytes
        part = layer.rank_part(param, loaded)
        expected = (self.sizes[index], row_bytes(self.types[index], self.k, layer.prefix))
        if tuple(part.shape) != expected or part.dtype != torch.uint8:
            raise ValueError(f"{layer.prefix}[{shard_id}]: a {self.types[index]} part of shape {expected} was expected, "
                             f"got {part.dtype} {tuple(part.shape)}")
        self.parts[index] = part.contiguous().clone()

    def process_weights_after_loading(self, layer: nn.Module, kernels: LinearKernels, is_shared: bool) -> None:
        what = getattr(layer, "prefix", "") or type(layer).__name__
        weight = layer.weight
        triton = kernels.triton_weight_only
        self.c_kernels = None if triton else kernels.c_kernels
        # (a tied table may have been quantized, or quantized and dequantized, by its embedding)
        if self.online and weight.dtype != torch.uint8 and not getattr(weight, "dequantized", False):
            weight.data = quantize_rows(weight.data, self.types[0]).to(weight.device)
        if self.mixed:
            if len(self.parts) != len(self.types):
                raise ValueError(f"{what}: parts {sorted(self.parts)} of {len(self.types)} were loaded")
            params = [nn.Parameter(self.parts[i], requires_grad=False) for i in range(len(self.types))]
            self.held = params  # the parts' rows, as the kernels read them
            types = self.types
        else:
            params, types = [weight], self.types[:1]
        if triton:
            from nanovllm.layers.quantization import gguf_triton
            self.triton_parts = [gguf_triton.held_once(p, t, self.k, self.params_dtype) for p, t in zip(params, types)]
            del self.parts
            self.layer_ref = None
            return
        if self.c_kernels is None:  # the rule without C kernels (gguf_dense.py)
            self.hold_dense(layer, params, types, kernels, is_shared)
            return
        tied = getattr(layer, "is_tied", False)  # the embedding reads the same rows
        held = [part for param, t in zip(params, types) for part in held_parts(self.c_kernels, param, t, self.k, tied)]
        views = None
        for type_name, data in reversed(held):
            views = CWeightView(type_name, data, data.shape[0], self.k, data.shape[1], next=views,
                                input_planes=self.input_planes)
        self.views = views
        self.c_linear = cpu_kernels.linear_struct(self.c_kernels, views)
        del self.parts
        self.layer_ref = None

    def hold_dense(self, layer: nn.Module, params: list, types: list[str], kernels: LinearKernels,
                   is_shared: bool) -> None:
        """The layer's weight dequantized into the model dtype, multiplied by the dense method."""
        parts = [p.data if p.dtype != torch.uint8 else dequantized(p.data, t, self.k, self.params_dtype)
                 for p, t in zip(params, types)]  # (a tied table its embedding dequantized already)
        layer.weight.data = torch.cat(parts) if len(parts) > 1 else parts[0]
        layer.weight.dequantized = True  # (a tied embedding that comes later must not quantize it again)
        self.held = None
        self.dense = UnquantizedLinearMethod()
        self.dense.process_weights_after_loading(layer, kernels, is_shared)
        self.c_only = False
        del self.parts
        self.layer_ref = None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.triton_parts is not None:
            from nanovllm.layers.quantization.gguf_triton import linear
            return linear(self.triton_parts, x, bias)
        if self.dense is not None:
            return self.dense.apply(layer, x, bias)
        dtype = x.dtype
        y = cpu_kernels.linear(self.c_kernels, self.c_linear, x.to(torch.float32),
                               None if bias is None else bias.to(torch.float32))
        return y if dtype == torch.float32 else y.to(dtype)

    def c_view(self, layer: nn.Module) -> CWeightView | None:
        return self.views

    def streamed_weights(self, layer: nn.Module) -> list[torch.Tensor]:
        if self.dense is not None:
            return self.dense.streamed_weights(layer)
        if self.triton_parts is not None:
            return [t for p in self.triton_parts for t in ([p] if isinstance(p, torch.Tensor) else
                                                          (p.q, p.scales, p.zeros, p.mins)) if t is not None]
        out, view = [], self.views
        while view is not None:
            out.append(view.data)
            view = view.next
        return out


class GGUFEmbeddingMethod(EmbeddingMethodBase):
    """The table as raw block rows; a lookup dequantizes the rows it reads (C kernels)."""

    c_only = True

    def __init__(self, type_name: str, online: bool = False):
        self.type_name = type_name
        self.online = online
        self.c_kernels = None
        self.c_table = None
        self.view = None
        self.triton_table = None  # on a GPU: the table as gguf_triton.hold keeps it

    @property
    def name(self) -> str:
        return self.type_name

    def create_weights(self, layer: nn.Module, num_embeddings: int, embedding_dim: int,
                       params_dtype: torch.dtype) -> None:
        self.k = embedding_dim
        self.params_dtype = params_dtype
        if self.online:
            data = torch.empty(num_embeddings, embedding_dim, dtype=params_dtype)
        else:
            data = torch.empty(num_embeddings, row_bytes(self.type_name, embedding_dim, layer.prefix), dtype=torch.uint8)
        layer.register_weight("weight", data, output_dim=0, input_dim=1)

    def process_weights_after_loading(self, layer: nn.Module, kernels: LinearKernels, is_shared: bool) -> None:
        triton = kernels.triton_weight_only
        self.c_kernels = None if triton else kernels.c_kernels
        # (the same rule as the linear method's, for a table its tied head reached first)
        if self.online and layer.weight.dtype != torch.uint8 and not getattr(layer.weight, "dequantized", False):
            layer.weight.data = quantize_rows(layer.weight.data, self.type_name).to(layer.weight.device)
        if not triton and self.c_kernels is None:  # the rule without C kernels (gguf_dense.py)
            if layer.weight.dtype == torch.uint8:
                layer.weight.data = dequantized(layer.weight.data, self.type_name, self.k, self.params_dtype)
                layer.weight.dequantized = True  # (a tied head must not quantize it again)
            return
        if triton:
            from nanovllm.layers.quantization.gguf_triton import held_once
            self.triton_table = held_once(layer.weight, self.type_name, self.k, self.params_dtype)
            return
        (type_name, data), = held_parts(self.c_kernels, layer.weight, self.type_name, self.k, one_matrix=True)
        self.view = CWeightView(type_name, data, data.shape[0], self.k, data.shape[1])
        self.c_table = cpu_kernels.linear_struct(self.c_kernels, self.view)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        if layer.weight.dtype != torch.uint8:  # dequantized: no C kernels here
            return torch.nn.functional.embedding(ids, layer.weight).to(layer.dtype)
        if self.triton_table is not None:
            from nanovllm.layers.quantization.gguf_triton import rows
            return rows(self.triton_table, ids.reshape(-1)).reshape(*ids.shape, self.k).to(layer.dtype)
        rows = cpu_kernels.rows_to_f32(self.c_kernels, self.c_table, ids.reshape(-1).cpu())
        return rows.reshape(*ids.shape, self.k).to(device=ids.device, dtype=layer.dtype)

    def c_view(self, layer: nn.Module) -> CWeightView | None:
        return self.view
