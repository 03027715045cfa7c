"""FP8 checkpoints (quant_method "fp8", vLLM's Fp8Config; e.g. Qwen's *-FP8 models): float8_e4m3fn
weights with one fp32 scale per tensor (`weight_scale`) or per block of outputs x inputs
(`weight_block_size` [128, 128]: `weight_scale_inv` [ceil(out / 128), ceil(in / 128)]).
w[o, i] = weight[o, i] * scale (of the block of o and i). The activation scheme (dynamic, or static
with an `input_scale`) is not run: the fp8 weights multiply unquantized activations, as vLLM runs
fp8 checkpoints on GPUs without fp8 (weight-only, Marlin)."""
import logging
from typing import Any

import torch
from torch import nn

from nanovllm.layers.quantization.prequantized import PrequantizedConfig
from nanovllm.layers.quantization.weight_only import QuantizedWeight, TensorSpec, WeightOnlyLinearMethod, check_group_split

logger = logging.getLogger(__name__)


class Fp8Config(PrequantizedConfig):
    name = "fp8"
    key_tensors = ("weight_scale", "weight_scale_inv")

    def __init__(self, block: tuple[int, int] | None, ignored: list[str], header: dict, mapping: dict):
        super().__init__(header, mapping)
        self.block = block
        self.ignored = ignored

    @classmethod
    def parse(cls, qc: dict, header: dict, packed_modules_mapping: dict) -> "Fp8Config":
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"fp8 format {fmt!r} is not supported (e4m3)")
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"fp8 activation_scheme {scheme!r} is not supported (dynamic, static)")
        logger.info("fp8 checkpoint: its %s activation quantization is not run; the fp8 weights multiply "
                    "unquantized activations (weight-only)", scheme)
        block = qc.get("weight_block_size")
        if block is not None and (len(block) != 2 or any(not isinstance(b, int) or b <= 0 for b in block)):
            raise ValueError(f"fp8 weight_block_size {block!r} is not supported ([outputs, inputs] per scale)")
        ignored = list(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or [])
        return cls(tuple(block) if block else None, ignored, header, packed_modules_mapping)

    def scheme_for(self, module: str) -> Any:
        if any(name in module for name in self.ignored):
            return None
        return ("fp8", self.block) if self.is_quantized_module(module) else None

    def method(self, scheme: Any, layer: nn.Module, modules: list[str]) -> WeightOnlyLinearMethod:
        return Fp8LinearMethod(self.block, all(f"{m}.input_scale" in self.header for m in modules))

    def input_groups(self, module: str) -> int | None:
        scales = self.header.get(f"{module}.weight_scale_inv")
        return None if scales is None else scales[1][1]

    def output_blocks(self, module: str) -> int | None:
        scales = self.header.get(f"{module}.weight_scale_inv")
        return None if scales is None else scales[1][0]

    def check_checkpoint(self) -> None:
        scale = "weight_scale_inv" if self.block else "weight_scale"
        for module in sorted({n.rsplit(".", 1)[0] for n in self.header if n.endswith((".weight_scale", ".weight_scale_inv"))}):
            self.require(module, f"fp8 ({'block' if self.block else 'per-tensor'} scales)", ["weight", scale])
            dtype = self.header[f"{module}.weight"][0]
            if dtype != "F8_E4M3":
                raise ValueError(f"{module}: fp8 weights are float8_e4m3fn (F8_E4M3), the checkpoint's are {dtype}")


class Fp8LinearMethod(WeightOnlyLinearMethod):
    format_name = "fp8"

    def __init__(self, block: tuple[int, int] | None, static_inputs: bool):
        super().__init__()
        self.block = block
        self.static_inputs = static_inputs

    def tensors(self, layer: nn.Module, input_size: int, output_sizes: list[int]) -> list[TensorSpec]:
        n, k = sum(output_sizes), input_size
        specs = [TensorSpec("weight", (n, k), torch.float8_e4m3fn, output_dim=0, input_dim=1)]
        if self.block:
            bo, bi = self.block
            check_group_split(layer, bi)
            specs.append(TensorSpec("weight_scale_inv", (-(-n // bo), -(-k // bi)), torch.float32, output_dim=0,
                                    input_dim=1, packed_dim=0, packed_factor=bo))
        else:
            specs.append(TensorSpec("weight_scale", None, torch.float32, per_part=True))
        if self.static_inputs:  # loaded and unused: activations are not quantized
            specs.append(TensorSpec("input_scale", None, torch.float32, per_part=True))
        return specs

    def decode(self, layer: nn.Module, loaded: dict[str, torch.Tensor],
               per_part: dict[str, list[torch.Tensor]]) -> QuantizedWeight:
        n, k = sum(self.sizes), self.k
        if self.block:
            bo, bi = self.block
            return QuantizedWeight(loaded["weight"], loaded["weight_scale_inv"].repeat_interleave(bo, 0)[:n], bi)
        scales = torch.cat([s.reshape(1, 1).expand(size, 1) for s, size in zip(per_part["weight_scale"], self.sizes)])
        return QuantizedWeight(loaded["weight"], scales, k)
