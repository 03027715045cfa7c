"""GPTQ checkpoints (AutoGPTQ / GPTQModel, quant_method "gptq"): 4- or 8-bit integers with one
fp16 scale and zero point per group of inputs (group_size, -1: one per output channel).

The format (AutoGPTQ's QuantLinear, checkpoint_format "gptq", vLLM's gptq.py reads the same):
qweight int32 [in * bits / 32, out], the values of 32 / bits consecutive inputs of an output in
one word, lowest bits first; qzeros int32 [groups, out * bits / 32], the zero points packed the
same way along the outputs and stored minus one ("v1": the zero point is the stored value + 1;
"gptq_v2" stores it as it is); scales [groups, out]; g_idx int32 [in], the group of each input
(desc_act: the groups were made in the order of decreasing activation, so inputs of one group are
scattered). w[o, i] = scales[g_idx[i], o] * (value[i, o] - zero[g_idx[i], o])."""
from typing import Any

import torch
from torch import nn

from nanovllm.layers.quantization.prequantized import PrequantizedConfig
from nanovllm.layers.quantization.weight_only import (QuantizedWeight, TensorSpec, WeightOnlyLinearMethod,
                                                      check_group_split, shared_g_idx, unpack_int32)


class GPTQConfig(PrequantizedConfig):
    name = "gptq"
    key_tensors = ("qweight",)

    def __init__(self, bits: int, group_size: int, desc_act: bool, v2: bool, header: dict, mapping: dict):
        super().__init__(header, mapping)
        self.bits, self.group_size, self.desc_act, self.v2 = bits, group_size, desc_act, v2

    @classmethod
    def parse(cls, qc: dict, header: dict, packed_modules_mapping: dict) -> "GPTQConfig":
        bits, group_size = qc.get("bits"), qc.get("group_size", -1)
        if bits not in (4, 8):
            raise ValueError(f"GPTQ with {bits}-bit weights is not supported (4 or 8)")
        if not isinstance(group_size, int) or (group_size <= 0 and group_size != -1):
            raise ValueError(f"GPTQ group_size {group_size!r} is not supported (a positive size, or -1: per channel)")
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
        if qc.get("dynamic"):
            raise ValueError("GPTQ per-module overrides (quantization_config.dynamic) are not supported")
        return cls(bits, group_size, bool(qc.get("desc_act", False)), fmt == "gptq_v2", header, packed_modules_mapping)

    def scheme_for(self, module: str) -> Any:
        return ("gptq", self.bits, self.group_size) if self.is_quantized_module(module) else None

    def method(self, scheme: Any, layer: nn.Module, modules: list[str]) -> WeightOnlyLinearMethod:
        return GPTQLinearMethod(self, all(f"{m}.g_idx" in self.header for m in modules))

    def input_groups(self, module: str) -> int | None:
        scales = self.header.get(f"{module}.scales")
        return None if scales is None or self.group_size <= 0 or self.desc_act else scales[1][0]

    def check_checkpoint(self) -> None:
        for module in self.modules_with("qweight"):
            self.require(module, f"GPTQ {self.bits}-bit", ["qweight", "qzeros", "scales"] + ["g_idx"] * self.desc_act)
            for name, dtype in (("qweight", "I32"), ("qzeros", "I32")):
                if self.header[f"{module}.{name}"][0] != dtype:
                    raise ValueError(f"{module}: GPTQ {name} is int32, the checkpoint's is "
                                     f"{self.header[f'{module}.{name}'][0]}")


class GPTQLinearMethod(WeightOnlyLinearMethod):
    def __init__(self, config: GPTQConfig, has_g_idx: bool):
        super().__init__()
        self.config = config
        self.has_g_idx = has_g_idx
        self.format_name = f"GPTQ {config.bits}-bit"

    def tensors(self, layer: nn.Module, input_size: int, output_sizes: list[int]) -> list[TensorSpec]:
        c, n, k = self.config, sum(output_sizes), input_size
        per = 32 // c.bits
        group = c.group_size if c.group_size > 0 else None
        # desc_act on a row-parallel layer: this rank's inputs may be of any group, so it loads every scale
        whole = c.desc_act and getattr(layer, "tp_dim", None) == 1 and layer.tp_size > 1
        if group is not None and not whole:
            check_group_split(layer, group)
        total = k * layer.tp_size if whole else k
        if group is not None and total % group:
            raise ValueError(f"{layer.prefix}: its {total} inputs are not whole GPTQ groups of {group}")
        groups, group_in = (total // group, None if whole else 0) if group else (1, None)
        specs = [TensorSpec("qweight", (k // per, n), torch.int32, output_dim=1, input_dim=0, packed_dim=0,
                            packed_factor=per),
                 TensorSpec("qzeros", (groups, n // per), torch.int32, output_dim=1, input_dim=group_in, packed_dim=1,
                            packed_factor=per),
                 TensorSpec("scales", (groups, n), torch.float32, output_dim=1, input_dim=group_in)]
        if self.has_g_idx:
            specs.append(TensorSpec("g_idx", (k,), torch.int64, input_dim=0, per_part=True))
        return specs

    def decode(self, layer: nn.Module, loaded: dict[str, torch.Tensor],
               per_part: dict[str, list[torch.Tensor]]) -> QuantizedWeight:
        c, k = self.config, self.k
        values = unpack_int32(loaded["qweight"], c.bits, 0)[:k].t()
        zeros = unpack_int32(loaded["qzeros"], c.bits, 1).t() + (0 if c.v2 else 1)
        g_idx = shared_g_idx(layer, per_part, "g_idx", zeros.shape[1]) if c.desc_act else None
        return QuantizedWeight(values.contiguous(), loaded["scales"].t().contiguous(),
                               c.group_size if c.group_size > 0 else k, zeros.contiguous(), g_idx)
