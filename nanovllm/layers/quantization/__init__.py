"""Weight formats behind a registry keyed by name (config.json's quantization_config.quant_method,
vLLM's rule): a QuantizationConfig per format gives each layer its method at construction
(base.py); plain checkpoints are the "unquantized" format (unquantized.py). A new format is one
module here that registers its config class. Layers import base.py only; the checkpoint
(loader/checkpoint.py) asks quant_config_for_model for the config of what it opened."""
from typing import Any

from torch import nn

from nanovllm.layers.quantization.base import (CWeightView, EmbeddingMethodBase, FusedMoEMethodBase, LinearKernels,
                                               LinearMethodBase, QuantizationConfig, QuantizeMethodBase)
from nanovllm.layers.quantization.awq import AWQConfig
from nanovllm.layers.quantization.block_formats import ONLINE_FORMATS
from nanovllm.layers.quantization.compressed_tensors import CompressedTensorsConfig
from nanovllm.layers.quantization.fp8 import Fp8Config
from nanovllm.layers.quantization.gguf_config import GGUFConfig, OnlineQuantConfig
from nanovllm.layers.quantization.gptq import GPTQConfig
from nanovllm.layers.quantization.mxfp4 import Mxfp4Config
from nanovllm.layers.quantization.prequantized import PrequantizedConfig
from nanovllm.layers.quantization.unquantized import (UnquantizedConfig, UnquantizedEmbeddingMethod,
                                                      UnquantizedFusedMoEMethod, UnquantizedLinearMethod)

_REGISTRY: dict[str, type[QuantizationConfig]] = {}


def register_quantization_config(cls: type[QuantizationConfig]) -> type[QuantizationConfig]:
    """Class decorator: the format answers to cls.name from now on."""
    name = cls.name.lower()
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise ValueError(f"quantization method {name!r} is already registered ({_REGISTRY[name].__name__})")
    _REGISTRY[name] = cls
    return cls


register_quantization_config(UnquantizedConfig)
register_quantization_config(GGUFConfig)
register_quantization_config(CompressedTensorsConfig)
register_quantization_config(GPTQConfig)
register_quantization_config(AWQConfig)
register_quantization_config(Fp8Config)
register_quantization_config(Mxfp4Config)


def quantization_methods() -> list[str]:
    return sorted(_REGISTRY)


def quant_method_of(hf_config: Any) -> str | None:
    """config.json's quantization_config.quant_method (None: no quantization_config)."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    method = getattr(method, "value", method)  # transformers keeps some as enums
    if not isinstance(method, str) or not method:
        raise ValueError(f"config.json has a quantization_config without a quant_method: {qc!r}")
    return method.lower()


def prequantized_methods() -> list[str]:
    """The formats of checkpoints quantized by an outside tool (config.json names them)."""
    return sorted(name for name, cls in _REGISTRY.items() if issubclass(cls, PrequantizedConfig))


def check_quantization_name(quantization) -> None:
    """The model-free part of the `quantization=` check: None, a format to quantize a dense
    checkpoint into, or a pre-quantized checkpoint's own method (_check_argument matches it to
    the checkpoint)."""
    if quantization is not None and not isinstance(quantization, str):
        raise TypeError(f"quantization must be a str or None, got {type(quantization).__name__} {quantization!r}")
    if quantization is not None and quantization not in ONLINE_FORMATS and quantization not in prequantized_methods():
        raise ValueError(f"quantization {quantization!r} is not supported; choose one of {list(ONLINE_FORMATS)} "
                         f"to quantize a dense checkpoint at load, or {prequantized_methods()} naming a "
                         "pre-quantized checkpoint's own format (or leave it unset)")


def _check_argument(quantization: str | None, method: str | None, is_gguf: bool) -> None:
    """ValueError unless `quantization=` can apply to a checkpoint of config.json's method."""
    if quantization is not None and not isinstance(quantization, str):
        raise TypeError(f"quantization must be a str or None, got {type(quantization).__name__} {quantization!r}")
    if is_gguf:
        if quantization is not None:
            raise ValueError(f"quantization={quantization!r} cannot apply to a GGUF file, whose tensors keep the "
                             "formats the file stores them in; leave quantization unset")
        return
    if quantization in prequantized_methods() and (method is not None or quantization not in ONLINE_FORMATS):
        # ("mxfp4" names both a checkpoint's format and one `quantization=` makes of a dense one)
        if method != quantization:  # vLLM's rule: the argument may only confirm the checkpoint's own method
            raise ValueError(f"quantization={quantization!r} names a pre-quantized format, but config.json's "
                             f"quantization_config names {method!r}" if method else
                             f"quantization={quantization!r} names a pre-quantized format, but the checkpoint has no "
                             "quantization_config (a dense checkpoint); leave quantization unset, or choose one of "
                             f"{list(ONLINE_FORMATS)} to quantize it at load")
    elif quantization is not None:
        if quantization not in ONLINE_FORMATS:
            raise ValueError(f"quantization {quantization!r} is not supported; choose one of {list(ONLINE_FORMATS)} "
                             f"to quantize a dense checkpoint at load, or {prequantized_methods()} naming a "
                             "pre-quantized checkpoint's own format (or leave it unset)")
        if method is not None:
            raise ValueError(f"the checkpoint is already quantized ({method}); "
                             f"quantization={quantization!r} applies to dense checkpoints only")


def quant_config_for_model(path: str, hf_config: Any, quantization: str | None, packed_modules_mapping: dict,
                           gguf_tensors: dict[str, tuple[str, tuple[int, ...]]] | None = None,
                           input_planes: int = 0) -> QuantizationConfig:
    """The weight format of the checkpoint at path: a GGUF file's own (gguf_tensors: its tensor
    index, HF name -> (type, shape); None for a folder), the one its config.json names (its config
    and tensor index checked here, before any rank starts or any weight is allocated), or, with
    quantization= ("q8_0", ...), a dense checkpoint quantized at load. ValueError where
    `quantization=` cannot apply. input_planes: how the CPU block kernels round the inputs."""
    if gguf_tensors is not None:
        _check_argument(quantization, None, True)
        return GGUFConfig(gguf_tensors, packed_modules_mapping, input_planes)
    method = quant_method_of(hf_config)
    _check_argument(quantization, method, False)
    if quantization in ONLINE_FORMATS and method is None:
        return OnlineQuantConfig(quantization, input_planes)
    if method is None:
        return UnquantizedConfig()
    cls = _REGISTRY.get(method)
    if cls is None:
        raise ValueError(f"quantization method {method!r} (config.json quantization_config.quant_method) is not "
                         f"supported; supported: {prequantized_methods()}")
    config = cls.from_model(path, hf_config, packed_modules_mapping)
    if config is None:
        raise ValueError(f"config.json of {path!r} names quantization method {method!r}, but {cls.__name__} "
                         "does not recognise the checkpoint's quantization_config")
    config.input_planes = input_planes  # (before any layer asks it for a method)
    return config


def quantized_layers(model: nn.Module) -> list[nn.Module]:
    """The modules of model whose weights a method holds (linears, embeddings, LM heads)."""
    return [m for m in model.modules() if isinstance(getattr(m, "quant_method", None), QuantizeMethodBase)]


def linear_layers(model: nn.Module) -> list[nn.Module]:
    """The modules of model that multiply through a linear method (linears and LM heads)."""
    return [m for m in quantized_layers(model) if isinstance(m.quant_method, LinearMethodBase)]


def process_weights_after_loading(model: nn.Module, kernels: LinearKernels) -> str:
    """Every method turns its layer's loaded parameters into the form it multiplies from, with the
    kernels the machine offers; returns how the linear layers multiply (for the log)."""
    users: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            users[id(param)] = users.get(id(param), 0) + 1
    for layer in quantized_layers(model):
        params = list(layer.parameters(recurse=False))
        layer.quant_method.process_weights_after_loading(layer, kernels, any(users[id(p)] > 1 for p in params))
    return describe_linear_methods(model)


def describe_linear_methods(model: nn.Module) -> str:
    """The distinct method names of model's linear layers, e.g. "dense" or "dense, transposed"."""
    return ", ".join(sorted({layer.quant_method.name for layer in linear_layers(model)})) or "dense"


__all__ = [
    "CWeightView", "EmbeddingMethodBase", "FusedMoEMethodBase", "GGUFConfig", "LinearKernels", "LinearMethodBase",
    "ONLINE_FORMATS", "OnlineQuantConfig", "check_quantization_name", "QuantizationConfig", "QuantizeMethodBase", "UnquantizedConfig",
    "UnquantizedEmbeddingMethod", "UnquantizedFusedMoEMethod", "UnquantizedLinearMethod",
    "describe_linear_methods", "linear_layers", "prequantized_methods", "process_weights_after_loading",
    "quant_config_for_model", "quant_method_of", "quantization_methods", "quantized_layers",
    "register_quantization_config"]
