"""The configs that choose the GGUF block formats' methods (gguf.py) per layer: GGUFConfig for a
.gguf file (each layer in the format the file stores it), OnlineQuantConfig for
`quantization="q8_0" | ...` on a dense checkpoint (every layer quantized at load)."""
import logging
from typing import Any

from torch import nn

from nanovllm.layers.quantization.base import QuantizationConfig, QuantizeMethodBase
from nanovllm.layers.quantization.gguf import ONLINE_FORMATS, GGUFEmbeddingMethod, GGUFLinearMethod
from nanovllm.layers.quantization.prequantized import checkpoint_modules

logger = logging.getLogger(__name__)


class GGUFConfig(QuantizationConfig):
    """A .gguf file: each layer in the format the file stores its tensors (loader/gguf.py).
    Layers whose tensors are all F32 stay dense (the fp32 path)."""

    name = "gguf"

    def __init__(self, types: dict[str, str], packed_modules_mapping: dict):
        self.types = types  # HF tensor name -> lower-case GGUF type name
        self.packed_modules_mapping = packed_modules_mapping

    @classmethod
    def from_model(cls, path: str, hf_config: Any) -> "GGUFConfig | None":
        from nanovllm.loader.gguf import is_gguf_path, open_gguf
        from nanovllm.models import get_model_class
        if not is_gguf_path(path):
            return None
        types = {name: info.type_name for name, info in open_gguf(path).tensors.items()}
        return cls(types, getattr(get_model_class(hf_config), "packed_modules_mapping", {}))

    def method_for(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
        from nanovllm.layers.moe import FusedMoE
        if isinstance(layer, FusedMoE):  # the file's 3-D expert tensors, under their stacked names
            names = [f"{prefix}.{part}.weight" for part in ("gate_proj", "up_proj", "down_proj")]
            missing = [n for n in names if n not in self.types]
            if missing:
                raise ValueError(f"the GGUF file has no expert tensor for {missing} (layer {prefix})")
            gate, up, down = (self.types[n] for n in names)
            if gate != up:
                raise ValueError(f"{prefix}: gate ({gate}) and up ({up}) experts in different formats are not supported")
            if gate == down == "f32":
                return None
            from nanovllm.layers.quantization.gguf_moe import GGUFFusedMoEMethod
            return GGUFFusedMoEMethod((gate, down), input_planes=self.input_planes)
        if isinstance(layer, VocabParallelEmbedding) or (isinstance(layer, ParallelLMHead)
                                                         and "lm_head.weight" not in self.types):
            type_name = self.types["model.embed_tokens.weight"]  # a tied head multiplies by the table
            if type_name == "f32":
                return None
            if isinstance(layer, VocabParallelEmbedding):
                return GGUFEmbeddingMethod(type_name)
            return GGUFLinearMethod([type_name], input_planes=self.input_planes)
        names = [f"{m}.weight" for m in checkpoint_modules(layer, prefix, self.packed_modules_mapping)]
        missing = [n for n in names if n not in self.types]
        if missing:
            raise ValueError(f"the GGUF file has no tensor for {missing} (layer {prefix})")
        types = [self.types[n] for n in names]
        return None if all(t == "f32" for t in types) else GGUFLinearMethod(types, input_planes=self.input_planes)


class OnlineQuantConfig(QuantizationConfig):
    """quantization="q8_0" | ...: a dense checkpoint's linear layers, LM head and embedding
    quantized at load into one GGUF block format."""

    name = "online"

    def __init__(self, type_name: str):
        if type_name not in ONLINE_FORMATS:
            raise ValueError(f"quantization {type_name!r} is not supported; choose one of {list(ONLINE_FORMATS)}")
        self.type_name = type_name

    @classmethod
    def from_model(cls, path: str, hf_config: Any) -> None:
        return None  # chosen by the user (quantization=), never by the checkpoint

    def method_for(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from nanovllm.layers.embed_head import VocabParallelEmbedding
        from nanovllm.layers.moe import FusedMoE
        if isinstance(layer, FusedMoE):
            from nanovllm.layers.quantization.gguf_moe import GGUFFusedMoEMethod
            types = (self.type_for(layer.hidden_size, prefix), self.type_for(layer.intermediate_size, prefix))
            return GGUFFusedMoEMethod(types, online=True, input_planes=self.input_planes)
        embedding = isinstance(layer, VocabParallelEmbedding)
        type_name = self.type_for(layer.embedding_dim if embedding else layer.input_size, prefix)
        if embedding:
            return GGUFEmbeddingMethod(type_name, online=True)
        parts = len(getattr(layer, "output_partition_sizes", [0]))
        return GGUFLinearMethod([type_name] * parts, online=True, input_planes=self.input_planes)

    def type_for(self, k: int, prefix: str) -> str:
        """The format of a layer of k inputs (per rank): the chosen one, except q4_k where k is not
        whole blocks of 256, which becomes q5_0 (llama-quantize's fallback for Q4_K), said once."""
        if self.type_name != "q4_k" or k % 256 == 0:
            return self.type_name
        if not getattr(self, "fell_back", False):
            logger.info("q4_k: layers whose inputs are not whole blocks of 256 (%s: %d) are q5_0 instead", prefix, k)
            self.fell_back = True
        return "q5_0"
