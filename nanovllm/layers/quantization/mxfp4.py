"""MXFP4 checkpoints (config.json quant_method "mxfp4": GPT-OSS as OpenAI ships it): the experts'
matrices stored as OCP microscaling FP4, `<name>_blocks` uint8 [..., rows, groups, 16] (32 E2M1
codes per group, two per byte, value 2j in the low nibble and 2j + 1 in the high one) and
`<name>_scales` uint8 [..., rows, groups] (E8M0 exponents: a group's scale is 2^(e - 127)).
Every other layer is dense.

The experts are held as GGUF's MXFP4 block rows (block_formats.py, "mxfp4": the exponent, then
16 bytes whose low nibbles are values 0-15 and high nibbles 16-31), one re-cut of the same codes
and exponents, so that the GGUF experts method (gguf_moe.py) and its C kernel multiply them as
they would a .gguf file's; `quantization="mxfp4"` on a dense checkpoint makes the same rows with
gguf.quants' quantizer (gguf_config.py, OnlineQuantConfig)."""
from typing import Any

import torch
from torch import nn

from nanovllm.layers.quantization.base import FusedMoEMethodBase
from nanovllm.layers.quantization.gguf_config import BlockFormatConfig
from nanovllm.layers.quantization.gguf_moe import GGUFFusedMoEMethod
from nanovllm.layers.quantization.prequantized import PrequantizedConfig

BLOCKS, SCALES = "_blocks", "_scales"


def gguf_rows(blocks: torch.Tensor, scales: torch.Tensor, what: str) -> torch.Tensor:
    """A checkpoint's OCP blocks [..., rows, groups, 16] and scales [..., rows, groups] as GGUF
    MXFP4 rows uint8 [..., rows, groups * 17]. ValueError naming `what` where they do not pair."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{what}: MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != 16 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(f"{what}: MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair "
                         "(blocks [..., groups, 16] with scales [..., groups] expected)")
    codes = torch.stack([blocks & 0x0F, blocks >> 4], -1).flatten(-2)  # [..., groups, 32] in order
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    rows = torch.cat([scales.unsqueeze(-1), packed], -1)  # [..., groups, 17]
    return rows.flatten(-2).contiguous()


class Mxfp4Config(PrequantizedConfig, BlockFormatConfig):
    """A checkpoint whose experts are MXFP4 (`*.experts.*_blocks` / `_scales`); the rest dense."""

    name = "mxfp4"
    key_tensors = ("gate_up_proj_blocks", "down_proj_blocks")

    @classmethod
    def parse(cls, qc: dict, header: dict, packed_modules_mapping: dict) -> "Mxfp4Config":
        return cls(header, packed_modules_mapping)

    def describe(self) -> str:
        return "an MXFP4 checkpoint"

    def check_checkpoint(self) -> None:
        for name, (dtype, shape) in sorted(self.header.items()):
            if not name.endswith(BLOCKS):
                continue
            if ".experts." not in f"{name}.":
                raise ValueError(f"{name}: MXFP4 is read for a mixture of experts' matrices only")
            scale_name = name[: -len(BLOCKS)] + SCALES
            scale = self.header.get(scale_name)
            if scale is None or dtype != "U8" or scale[0] != "U8" or not shape or shape[-1] != 16 or \
                    tuple(scale[1]) != tuple(shape[:-1]):
                raise ValueError(f"{name} {dtype} {list(shape)} and {scale_name} "
                                 f"{'(missing)' if scale is None else f'{scale[0]} {list(scale[1])}'} do not pair "
                                 "as MXFP4 (uint8 blocks [..., groups, 16] with uint8 scales [..., groups])")

    def check_tensor_parallel(self, tp_size: int, row_parallel_inputs: dict[str, int]) -> None:
        """The experts' down matrices split their inputs over the ranks: in whole blocks of 32."""
        for name, (_, shape) in sorted(self.header.items()):
            if name.endswith(f"down_proj{BLOCKS}") and shape[-2] % tp_size:
                raise ValueError(f"tensor_parallel_size={tp_size} would split {name} ({shape[-2]} MXFP4 blocks of "
                                 f"32 inputs) inside a block; use a tensor_parallel_size that divides {shape[-2]}")

    def scheme_for(self, module: str) -> Any:
        return None  # the dense layers

    def moe_method(self, layer: nn.Module, prefix: str) -> FusedMoEMethodBase | None:
        if not self.is_quantized_module(prefix):
            return None
        return GGUFFusedMoEMethod(("mxfp4", "mxfp4"), input_planes=self.input_planes)
