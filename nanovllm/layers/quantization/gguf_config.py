"""The configs that choose the GGUF block formats' methods (gguf.py) per layer: GGUFConfig for a
.gguf file (each layer in the format the file stores it), OnlineQuantConfig for
`quantization="q8_0" | ...` on a dense checkpoint (every layer quantized at load)."""
import logging
from typing import Any

from torch import nn

from nanovllm.layers.quantization.base import (EmbeddingMethodBase, FusedMoEMethodBase, LinearMethodBase,
                                               QuantizationConfig)
from nanovllm.layers.quantization.block_formats import ONLINE_FORMATS
from nanovllm.layers.quantization.gguf import GGUFEmbeddingMethod, GGUFLinearMethod, check_split
from nanovllm.layers.quantization.gguf_moe import GGUFFusedMoEMethod
from nanovllm.layers.quantization.modules import ROW_PARALLEL, checkpoint_modules

logger = logging.getLogger(__name__)


class BlockFormatConfig(QuantizationConfig):
    """What both configs share (the MXFP4 checkpoint's too): the block formats' methods (gguf.py,
    gguf_moe.py) on every device, the C kernels on a CPU and the Triton ones on a GPU."""


class GGUFConfig(BlockFormatConfig):
    """A .gguf file: each layer in the format the file stores its tensors (loader/gguf.py).
    Layers whose tensors are all F32 stay dense (the fp32 path)."""

    name = "gguf"

    def __init__(self, tensors: dict[str, tuple[str, tuple[int, ...]]], packed_modules_mapping: dict,
                 input_planes: int = 0):
        # HF tensor name -> (lower-case GGUF type name, shape)
        self.types = {name: type_name for name, (type_name, _) in tensors.items()}
        self.inputs = {name: shape[-1] for name, (_, shape) in tensors.items()}
        self.packed_modules_mapping = packed_modules_mapping
        self.input_planes = input_planes

    @classmethod
    def from_model(cls, path: str, hf_config: Any, packed_modules_mapping: dict) -> None:
        return None  # built by the checkpoint (loader/checkpoint.py) from the file's tensor index

    def describe(self) -> str:
        return "a GGUF file"

    def check_tensor_parallel(self, tp_size: int, row_parallel_inputs: dict[str, int]) -> None:
        for name, type_name in self.types.items():
            if name.removesuffix(".weight").endswith(ROW_PARALLEL):
                check_split(name, type_name, self.inputs[name], tp_size)

    def moe_method(self, layer: nn.Module, prefix: str) -> FusedMoEMethodBase | None:
        # the file's 3-D expert tensors, under their stacked names
        names = [f"{prefix}.{part}.weight" for part in ("gate_proj", "up_proj", "down_proj")]
        missing = [n for n in names if n not in self.types]
        if missing:
            raise ValueError(f"the GGUF file has no expert tensor for {missing} (layer {prefix})")
        gate, up, down = (self.types[n] for n in names)
        if gate != up:
            raise ValueError(f"{prefix}: gate ({gate}) and up ({up}) experts in different formats are not supported")
        if gate == down == "f32":
            return None
        return GGUFFusedMoEMethod((gate, down), input_planes=self.input_planes)

    def embedding_method(self, layer: nn.Module, prefix: str) -> EmbeddingMethodBase | None:
        type_name = self.types["model.embed_tokens.weight"]
        return None if type_name == "f32" else GGUFEmbeddingMethod(type_name)

    def lm_head_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        if "lm_head.weight" in self.types:
            return self.linear_method(layer, prefix)
        type_name = self.types["model.embed_tokens.weight"]  # a tied head multiplies by the table
        return None if type_name == "f32" else GGUFLinearMethod([type_name], input_planes=self.input_planes)

    def linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        names = [f"{m}.weight" for m in checkpoint_modules(layer, prefix, self.packed_modules_mapping)]
        missing = [n for n in names if n not in self.types]
        if missing:
            raise ValueError(f"the GGUF file has no tensor for {missing} (layer {prefix})")
        types = [self.types[n] for n in names]
        return None if all(t == "f32" for t in types) else GGUFLinearMethod(types, input_planes=self.input_planes)


class OnlineQuantConfig(BlockFormatConfig):
    """quantization="q8_0" | ...: a dense checkpoint's linear layers, LM head and embedding
    quantized at load into one GGUF block format."""

    name = "online"

    def __init__(self, type_name: str, input_planes: int = 0):
        if type_name not in ONLINE_FORMATS:
            raise ValueError(f"quantization {type_name!r} is not supported; choose one of {list(ONLINE_FORMATS)}")
        self.type_name = type_name
        self.input_planes = input_planes
        self.fell_back = False

    @classmethod
    def from_model(cls, path: str, hf_config: Any, packed_modules_mapping: dict) -> None:
        return None  # chosen by the user (quantization=), never by the checkpoint

    def describe(self) -> str:
        return f"quantization={self.type_name!r}"

    def check_tensor_parallel(self, tp_size: int, row_parallel_inputs: dict[str, int]) -> None:
        for name, k in row_parallel_inputs.items():
            check_split(name, self.type_name, k, tp_size)

    def moe_method(self, layer: nn.Module, prefix: str) -> FusedMoEMethodBase | None:
        types = (self.type_for(layer.hidden_size, prefix), self.type_for(layer.intermediate_size, prefix))
        return GGUFFusedMoEMethod(types, online=True, input_planes=self.input_planes)

    def embedding_method(self, layer: nn.Module, prefix: str) -> EmbeddingMethodBase | None:
        return GGUFEmbeddingMethod(self.type_for(layer.embedding_dim, prefix), online=True)

    def lm_head_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        return self.linear_method(layer, prefix)

    def linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        type_name = self.type_for(layer.input_size, prefix)
        parts = len(getattr(layer, "output_partition_sizes", [0]))
        return GGUFLinearMethod([type_name] * parts, online=True, input_planes=self.input_planes)

    def type_for(self, k: int, prefix: str) -> str:
        """The format of a layer of k inputs (per rank): the chosen one, except q4_k where k is not
        whole blocks of 256, which becomes q5_0 (llama-quantize's fallback for Q4_K), said once."""
        if self.type_name != "q4_k" or k % 256 == 0:
            return self.type_name
        if not self.fell_back:
            logger.info("q4_k: layers whose inputs are not whole blocks of 256 (%s: %d) are q5_0 instead", prefix, k)
            self.fell_back = True
        return "q5_0"
