"""How a linear layer multiplies: each linear layer and the LM head hold a LinearMethod and call
`self.linear_method.apply(self, x, bias)`. Built with the plain F.linear one; the platform's
weight processing after loading (platforms/cpu.py) installs the others with install_linear_method.
"""
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels import cpu_kernels


class LinearMethod:
    """x W^T (+ bias) with F.linear on the layer's dense weight [output_size, input_size]."""

    name = "dense"

    def process_weights(self, layer: nn.Module, is_shared: bool) -> None:
        """Turn the loaded layer.weight into the form apply() reads, once. is_shared: another
        module uses the same weight (a tied embedding), so its dense form must stay."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


class TransposedLinearMethod(LinearMethod):
    """x W^T computed as (W x^T)^T: MKL runs this orientation faster for outputs at least as wide
    as the input and 2-1024 rows (docs/performance.md, "Linear orientation")."""

    name = "transposed"

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = torch.mm(layer.weight, x.t()).t().contiguous()  # [num_tokens, output_size]
        return y if bias is None else y.add_(bias)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [output_size, input_size] reordered once into oneDNN's blocked layout (an opaque tensor)."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) against a weight from pack_weight()."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


class PackedLinearMethod(LinearMethod):
    """oneDNN on a packed copy of the weight (layer.packed_weight, fp32). The dense weight is
    freed (left empty) unless another module shares it."""

    name = "oneDNN-packed"
    keeps_dense_weight = False

    def process_weights(self, layer: nn.Module, is_shared: bool) -> None:
        layer.packed_weight = pack_weight(layer.weight)
        if not (is_shared or self.keeps_dense_weight):
            layer.weight.data = layer.weight.data.new_empty(0)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return packed_linear(x, layer.packed_weight, bias)


class PackedCKernelLinearMethod(PackedLinearMethod):
    """PackedLinearMethod, but inputs of at most c_rows rows (decode at a few sequences) go to the
    C kernel on a dense copy of the weight, held in dense_dtype: fp32, or bf16 for half the bytes
    per step (widened inside the kernel, so the products are the fp32 ones of the upcast weights)."""

    keeps_dense_weight = True

    def __init__(self, kernels: cpu_kernels.CpuKernels, dense_dtype: torch.dtype = torch.float32, c_rows: int = 1):
        self.kernels = kernels
        self.dense_dtype = dense_dtype
        self.c_rows = c_rows
        self.name = f"oneDNN-packed fp32 + C kernel at <= {c_rows} rows ({str(dense_dtype).removeprefix('torch.')})"

    def process_weights(self, layer: nn.Module, is_shared: bool) -> None:
        super().process_weights(layer, is_shared)
        # NOTE: a shared weight (tied embedding table) is narrowed for its other user too; the
        # embedding gives its rows in the model dtype whatever the table's (layers/embed_head.py).
        layer.weight.data = layer.weight.data.to(self.dense_dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] <= self.c_rows:
            return cpu_kernels.linear(self.kernels, x, layer.weight, bias)
        return packed_linear(x, layer.packed_weight, bias)


def linear_layers(model: nn.Module) -> list[nn.Module]:
    """The modules of model that multiply through a LinearMethod (linears and LM heads)."""
    return [m for m in model.modules() if isinstance(getattr(m, "linear_method", None), LinearMethod)]


def install_linear_method(model: nn.Module, method: LinearMethod,
                          where: Callable[[nn.Module], bool] | None = None) -> int:
    """Give every linear layer of model (those where(layer) accepts) `method`, after it has
    processed the layer's loaded weight. Returns the number of layers changed."""
    users: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            users[id(param)] = users.get(id(param), 0) + 1
    changed = 0
    for layer in linear_layers(model):
        if where is not None and not where(layer):
            continue
        method.process_weights(layer, is_shared=users[id(layer.weight)] > 1)
        layer.linear_method = method
        changed += 1
    return changed
