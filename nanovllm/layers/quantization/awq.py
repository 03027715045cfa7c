"""AWQ checkpoints (AutoAWQ's GEMM layout, quant_method "awq"): 4-bit integers with one fp16 scale
and zero point per group of inputs.

The format (AutoAWQ's WQLinear_GEMM; vLLM's awq.py reads the same): qweight int32 [in, out / 8],
eight outputs of an input per word in AWQ's interleaved order (the word's j-th lowest nibble holds
output 8c + [0, 2, 4, 6, 1, 3, 5, 7][j]); qzeros int32 [groups, out / 8], the zero points packed
the same way; scales [groups, out]. w[o, i] = scales[i // group, o] * (value[i, o] - zero[i // group, o])."""
from typing import Any

import torch
from torch import nn

from nanovllm.layers.quantization.prequantized import PrequantizedConfig
from nanovllm.layers.quantization.weight_only import (QuantizedWeight, TensorSpec, WeightOnlyLinearMethod,
                                                      check_group_split, unpack_int32)

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # the output in each nibble of a word, lowest nibble first


class AWQConfig(PrequantizedConfig):
    name = "awq"
    key_tensors = ("qweight",)

    def __init__(self, group_size: int, not_converted: list[str], header: dict, mapping: dict):
        super().__init__(header, mapping)
        self.group_size = group_size
        self.not_converted = not_converted

    @classmethod
    def parse(cls, qc: dict, header: dict, packed_modules_mapping: dict) -> "AWQConfig":
        bits = qc.get("bits", qc.get("w_bit"))
        group_size = qc.get("group_size", qc.get("q_group_size"))
        version = str(qc.get("version", "gemm")).lower()
        if bits != 4:
            raise ValueError(f"AWQ with {bits}-bit weights is not supported (4)")
        if not isinstance(group_size, int) or group_size <= 0:
            raise ValueError(f"AWQ group_size {group_size!r} is not supported (a positive size)")
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported (gemm)")
        if not qc.get("zero_point", True):
            raise ValueError("AWQ without zero points (zero_point: false) is not supported")
        return cls(group_size, list(qc.get("modules_to_not_convert") or []), header, packed_modules_mapping)

    def scheme_for(self, module: str) -> Any:
        if any(name in module for name in self.not_converted):
            return None
        return ("awq", self.group_size) if self.is_quantized_module(module) else None

    def method(self, scheme: Any, layer: nn.Module, modules: list[str]) -> WeightOnlyLinearMethod:
        return AWQLinearMethod(self.group_size)

    def input_groups(self, module: str) -> int | None:
        scales = self.header.get(f"{module}.scales")
        return None if scales is None else scales[1][0]

    def check_checkpoint(self) -> None:
        for module in self.modules_with("qweight"):
            self.require(module, "AWQ 4-bit", ["qweight", "qzeros", "scales"])


class AWQLinearMethod(WeightOnlyLinearMethod):
    format_name = "AWQ 4-bit"

    def __init__(self, group_size: int):
        super().__init__()
        self.group_size = group_size

    def tensors(self, layer: nn.Module, input_size: int, output_sizes: list[int]) -> list[TensorSpec]:
        n, k, group = sum(output_sizes), input_size, self.group_size
        check_group_split(layer, group)
        if k % group:
            raise ValueError(f"{layer.prefix}: its {k} inputs are not whole AWQ groups of {group}")
        return [TensorSpec("qweight", (k, n // 8), torch.int32, output_dim=1, input_dim=0, packed_dim=1, packed_factor=8),
                TensorSpec("qzeros", (k // group, n // 8), torch.int32, output_dim=1, input_dim=0, packed_dim=1,
                           packed_factor=8),
                TensorSpec("scales", (k // group, n), torch.float32, output_dim=1, input_dim=0)]

    def decode(self, layer: nn.Module, loaded: dict[str, torch.Tensor],
               per_part: dict[str, list[torch.Tensor]]) -> QuantizedWeight:
        values = unpack_int32(loaded["qweight"], 4, 1, AWQ_ORDER).t().contiguous()
        zeros = unpack_int32(loaded["qzeros"], 4, 1, AWQ_ORDER).t().contiguous()
        return QuantizedWeight(values, loaded["scales"].t().contiguous(), self.group_size, zeros)
