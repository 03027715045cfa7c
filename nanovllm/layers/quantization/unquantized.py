"""Dense weights, the format of plain checkpoints: a linear layer's [output, input] matrix and the
embedding table and the stacked experts in the model dtype. After loading, the linear method picks the kernel the machine
has (LinearKernels): F.linear; MKL in the transposed orientation for wide layers; oneDNN on a
packed fp32 copy (where the C kernels do not build); otherwise fp32 and bf16 weights are held once,
dense, and read in place by the C kernels at every row count."""
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels import cpu_kernels
from nanovllm.layers.quantization.base import (CWeightView, EmbeddingMethodBase, FusedMoEMethodBase, LinearKernels,
                                               LinearMethodBase, QuantizationConfig, register_dense_method)
from nanovllm.layers.quantization.moe_ops import activate, c_experts, experts_reference, route

# The C kernels' name of a dense weight's element type (kernels/cpu_kernels.c, weight_types).
C_TYPE_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16"}


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [output_size, input_size] reordered once into oneDNN's blocked layout (an opaque tensor)."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) against a weight from pack_weight()."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def dense_c_view(weight: torch.Tensor) -> CWeightView | None:
    """A dense fp32 / bf16 matrix as the C kernels read it; None for another dtype or layout."""
    if weight.dtype not in C_TYPE_NAMES or weight.dim() != 2 or not weight.is_contiguous() or weight.numel() == 0:
        return None
    n, k = weight.shape
    return CWeightView(C_TYPE_NAMES[weight.dtype], weight, n, k, k * weight.element_size())


@register_dense_method(LinearMethodBase)
class UnquantizedLinearMethod(LinearMethodBase):
    """x W^T (+ bias) over the layer's dense weight, with the kernel chosen after loading."""

    def __init__(self):
        self.kernel = "dense"  # dense | transposed | packed | c
        self.c_kernels: cpu_kernels.CpuKernels | None = None
        self.c_dtype = "fp32"  # how the C kernel's weight is held (fp32 | bf16)
        self.c_linear = None  # the C kernel's description of the weight (cpu_kernels.Linear)

    @property
    def name(self) -> str:
        if self.kernel == "c":
            return f"dense {self.c_dtype}: C kernel at every row count"
        return {"dense": "dense", "transposed": "transposed", "packed": "oneDNN-packed"}[self.kernel]

    @property
    def c_only(self) -> bool:
        """Only the C kernels read the weight (the one-call decode step may take any batch)."""
        return self.kernel == "c"

    def create_weights(self, layer: nn.Module, input_size: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        layer.register_weight("weight", torch.empty(sum(output_partition_sizes), input_size, dtype=params_dtype),
                              output_dim=0, input_dim=1)

    def process_weights_after_loading(self, layer: nn.Module, kernels: LinearKernels, is_shared: bool) -> None:
        weight = layer.weight
        n, k = weight.shape
        # (a tied table may already be narrowed by its embedding's method)
        if kernels.c_kernels is not None and weight.dtype in (torch.float32, kernels.c_weight_dtype):
            # One copy, read in place by the C kernels at every row count: their outer-product path
            # from one panel of rows up is level with oneDNN on a packed copy and faster than MKL
            # (docs/performance.md, "Weights held once"). bf16 weights are narrowed once. NOTE: a shared weight
            # (tied embedding table) is narrowed for its other user too; the embedding gives its
            # rows in the model dtype whatever the table's.
            if kernels.c_weight_dtype == torch.bfloat16:
                weight.data = weight.data.to(torch.bfloat16)  # a no-op when already narrowed
                self.c_dtype = "bf16"
            self.kernel, self.c_kernels = "c", kernels.c_kernels
            self.c_linear = cpu_kernels.linear_struct(self.c_kernels, self.c_view(layer))
        elif kernels.onednn_packing:
            # oneDNN reads this copy; the dense one is freed unless another module (a tied
            # embedding) reads it.
            layer.packed_weight = pack_weight(weight)
            self.kernel = "packed"
            if not is_shared:
                weight.data = weight.data.new_empty(0)
        elif kernels.transposed_when_wide and n >= k:
            # MKL runs (W x^T)^T faster for outputs at least as wide as the input and 2-1024 rows
            # (docs/performance.md, "Linear orientation").
            self.kernel = "transposed"

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        kernel = self.kernel
        if kernel == "c":
            return cpu_kernels.linear(self.c_kernels, self.c_linear, x, bias)
        if kernel == "packed":
            return packed_linear(x, layer.packed_weight, bias)
        if kernel == "transposed":
            y = torch.mm(layer.weight, x.t()).t().contiguous()  # [num_tokens, output_size]
            return y if bias is None else y.add_(bias)
        return F.linear(x, layer.weight, bias)

    def c_view(self, layer: nn.Module) -> CWeightView | None:
        return dense_c_view(layer.weight) if self.kernel == "c" else None

    def streamed_weights(self, layer: nn.Module) -> list[torch.Tensor]:
        return [layer.packed_weight] if self.kernel == "packed" else [layer.weight]


@register_dense_method(EmbeddingMethodBase)
class UnquantizedEmbeddingMethod(EmbeddingMethodBase):
    """The table as loaded; with bf16 weights on a CPU (LinearKernels.c_weight_dtype) narrowed once,
    like the linear layers (a tied LM head's method may have done it already)."""

    name = "dense"
    c_only = True  # a lookup: no other kernel would serve larger batches faster

    def process_weights_after_loading(self, layer: nn.Module, kernels: LinearKernels, is_shared: bool) -> None:
        weight = layer.weight
        if kernels.c_kernels is not None and kernels.c_weight_dtype == torch.bfloat16:
            weight.data = weight.data.to(torch.bfloat16)

    def create_weights(self, layer: nn.Module, num_embeddings: int, embedding_dim: int,
                       params_dtype: torch.dtype) -> None:
        layer.register_weight("weight", torch.empty(num_embeddings, embedding_dim, dtype=params_dtype),
                              output_dim=0, input_dim=1)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, layer.weight).to(layer.dtype)

    def c_view(self, layer: nn.Module) -> CWeightView | None:
        return dense_c_view(layer.weight)


@register_dense_method(FusedMoEMethodBase)
class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    """Dense experts in the model dtype: the C experts kernel on a CPU that has the C kernels
    (kernels/cpu_moe.c: fp32 weights, or bf16 when the platform holds them so), the Triton
    kernel on CUDA, the grouped torch loop otherwise. One copy of the weights, read by whichever."""

    name = "dense experts"

    def __init__(self):
        self.c_kernels = None
        self.c_moe = None  # kernels/cpu_kernels.py, MoeExperts over the stacked weights
        self.use_triton = False  # LinearKernels.fused_moe_triton

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size: int,
                       params_dtype: torch.dtype) -> None:
        layer.register_weight("w13_weight", torch.empty(num_experts, 2 * intermediate_size, hidden_size,
                                                        dtype=params_dtype), output_dim=1, input_dim=2)
        layer.register_weight("w2_weight", torch.empty(num_experts, hidden_size, intermediate_size,
                                                       dtype=params_dtype), output_dim=1, input_dim=2)

    def process_weights_after_loading(self, layer: nn.Module, kernels: LinearKernels, is_shared: bool) -> None:
        self.use_triton = kernels.fused_moe_triton
        if kernels.c_kernels is None:
            return
        for param in (layer.w13_weight, layer.w2_weight):
            param.data = param.data.to(kernels.c_weight_dtype).contiguous()
        views = [[dense_c_view(w[e]) for e in range(layer.num_experts)] for w in (layer.w13_weight, layer.w2_weight)]
        self.c_kernels = kernels.c_kernels
        self.c_moe = c_experts(self.c_kernels, layer, views[0], views[1])

    def apply(self, layer: nn.Module, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        if self.c_moe is not None and x.dtype == torch.float32:
            return cpu_kernels.moe_experts(self.c_kernels, self.c_moe, x, router_logits)
        weights, ids = route(layer, router_logits)
        if self.use_triton:
            from nanovllm.kernels.fused_moe import fused_experts
            return fused_experts(x, layer.w13_weight, layer.w2_weight, weights, ids, layer.biases,
                                 lambda gate, up: activate(gate, up, layer.activation))
        return experts_reference(x, layer.w13_weight, layer.w2_weight, weights, ids, layer.biases, layer.activation)

    @property
    def c_only(self) -> bool:
        return self.c_moe is not None

    def c_struct(self, layer: nn.Module):
        return self.c_moe

    def streamed_weights(self, layer: nn.Module) -> list[torch.Tensor]:
        return [layer.w13_weight, layer.w2_weight]


class UnquantizedConfig(QuantizationConfig):
    """Plain checkpoints: every layer dense."""

    name = "unquantized"

    @classmethod
    def from_model(cls, path: str, hf_config: Any, packed_modules_mapping: dict) -> "UnquantizedConfig | None":
        return cls() if getattr(hf_config, "quantization_config", None) is None else None
