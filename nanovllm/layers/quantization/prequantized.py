"""What the pre-quantized formats' configs (compressed_tensors.py, gptq.py, awq.py, fp8.py) share:
the checkpoint's tensor index read from the safetensors headers (names, dtypes, shapes; no data),
checked before the model is built, and the choice of a method per layer from the checkpoint names
of the layer's parts (a stacked q/k/v layer quantizes as its three parts do, or not at all)."""
import glob
import json
import os
import struct
from typing import Any

from torch import nn

from nanovllm.layers.quantization.base import FusedMoEMethodBase, LinearMethodBase, QuantizationConfig
from nanovllm.layers.quantization.modules import ROW_PARALLEL, checkpoint_modules

def checkpoint_header(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype, shape) of every tensor in path/*.safetensors, from the headers."""
    index: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with open(file, "rb") as f:
            head = f.read(8)
            size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if size <= 0 or size > os.path.getsize(file) - 8:
                raise ValueError(f"{file!r} is not a safetensors file (bad header length)")
            try:
                header = json.loads(f.read(size))
            except ValueError as e:
                raise ValueError(f"{file!r} has a malformed safetensors header: {e}") from e
        for name, info in header.items():
            if name != "__metadata__":
                index[name] = (info["dtype"], tuple(info["shape"]))
    return index


def config_dict(hf_config: Any) -> dict:
    qc = getattr(hf_config, "quantization_config", None)
    return qc if isinstance(qc, dict) else qc.to_dict()


class PrequantizedConfig(QuantizationConfig):
    """A checkpoint quantized by an outside tool. Subclasses say which scheme a checkpoint module
    has (`scheme_for`: None for a dense one) and make the method for a scheme (`method`)."""

    def __init__(self, header: dict, packed_modules_mapping: dict):
        self.header = header
        self.packed_modules_mapping = packed_modules_mapping

    @classmethod
    def from_model(cls, path: str, hf_config: Any, packed_modules_mapping: dict) -> "PrequantizedConfig | None":
        config = cls.parse(config_dict(hf_config), checkpoint_header(path), packed_modules_mapping)
        config.check_checkpoint()
        return config

    @classmethod
    def parse(cls, qc: dict, header: dict, packed_modules_mapping: dict) -> "PrequantizedConfig":
        raise NotImplementedError

    def scheme_for(self, module: str) -> Any:
        raise NotImplementedError

    def method(self, scheme: Any, layer: nn.Module, modules: list[str]) -> LinearMethodBase:
        raise NotImplementedError

    def check_checkpoint(self) -> None:
        """ValueError naming the first module whose tensors do not make up its scheme."""

    def input_groups(self, module: str) -> int | None:
        """How many groups of inputs share a scale in a module (None: one scale spans all its inputs,
        or its groups are scattered over the inputs, which any split keeps whole)."""
        return None

    def output_blocks(self, module: str) -> int | None:
        """How many blocks of outputs share scales in a module (block-scaled fp8), or None."""
        return None

    def check_tensor_parallel(self, tp_size: int, row_parallel_inputs: dict[str, int]) -> None:
        """ValueError naming the first module whose groups of inputs (row-parallel layers) or blocks
        of outputs (column-parallel) tp_size ranks would cut."""
        if tp_size == 1:
            return
        for module in sorted({name.rsplit(".", 1)[0] for name in self.header}):
            row = module.endswith(ROW_PARALLEL)
            count = self.input_groups(module) if row else self.output_blocks(module)
            if count and count % tp_size:
                what = "inputs" if row else "outputs"
                raise ValueError(f"tensor_parallel_size={tp_size} would split the {what} of {module} ({count} "
                                 f"quantization {'groups' if row else 'blocks'}) into parts that cut one; use a "
                                 f"tensor_parallel_size that divides {count}")

    def require(self, module: str, what: str, names: list[str]) -> None:
        """ValueError unless the checkpoint has module.<name> for every name."""
        missing = [n for n in names if f"{module}.{n}" not in self.header]
        if missing:
            raise ValueError(f"{module}: {what} weights need tensors {names}; the checkpoint has no "
                             f"{[f'{module}.{n}' for n in missing]}")

    # The tensors that mark a checkpoint module as quantized in this format.
    key_tensors: tuple[str, ...] = ()

    def is_quantized_module(self, module: str) -> bool:
        return any(f"{module}.{key}" in self.header for key in self.key_tensors)

    def modules_with(self, suffix: str) -> list[str]:
        return sorted(name[: -len(suffix) - 1] for name in self.header if name.endswith(f".{suffix}"))

    def lm_head_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        if not self.is_quantized_module(prefix):
            return None  # kept dense (llm-compressor's ignore=["lm_head"]), as most checkpoints keep it
        return self.linear_method(layer, prefix)

    def moe_method(self, layer: nn.Module, prefix: str) -> FusedMoEMethodBase | None:
        if any(self.is_quantized_module(m) for m in self.expert_modules(prefix)):
            raise ValueError(f"{prefix}: {self.name} mixture-of-experts weights are not supported")
        return None

    def linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        modules = checkpoint_modules(layer, prefix, self.packed_modules_mapping)
        schemes = [self.scheme_for(m) for m in modules]
        if all(s is None for s in schemes):
            return None
        if any(s != schemes[0] for s in schemes):
            raise ValueError(f"{prefix}: its stacked parts {modules} are quantized differently ({schemes}); "
                             "they must share one scheme")
        method = self.method(schemes[0], layer, modules)
        # "A16" formats too round their inputs as cpu_input_bits says: "auto" per group (the default
        # model's perplexity within 0.15% of transformers', GGUF's speed), 14 as vLLM keeps 16-bit
        # activations (within 0.01%; twice the integer work): docs/performance.md, "Input rounding"
        method.input_planes = self.input_planes
        return method

    def expert_modules(self, prefix: str) -> list[str]:
        return sorted({name.rsplit(".", 1)[0] for name in self.header if name.startswith(f"{prefix}.")})
