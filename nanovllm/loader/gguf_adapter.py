"""llama.cpp's LoRA adapter files (convert_lora_to_gguf.py's output) as low-rank pairs under the
HuggingFace names the engine's LoRA targets use.

Such a file says `general.type = adapter`, `adapter.type = lora` and `adapter.lora.alpha`, and holds
per base tensor `<name>.lora_a` [r, in] and `<name>.lora_b` [out, r] (numpy order; ggml's ne reversed),
named as the base model's GGUF tensors (blk.N.attn_q.weight ...). llama.cpp scales each update by
alpha / r (by 1 where alpha is 0 or absent: llama_adapter_lora_weight::get_scale), ignores tensors
ending in _norm.weight, and, for llama, its converter permuted the q and k rows of lora_b as it
permutes the base weights: they are put back in HF order here. Nothing is executed: the file is read
by gguf_reader.py, and quantized A / B tensors are dequantized by the gguf package."""
import logging

import numpy as np
import torch

from nanovllm.loader.gguf import unpermute_rows
from nanovllm.loader.gguf_families import ARCHITECTURES, PERMUTED_QK, hf_name
from nanovllm.loader.gguf_reader import PLAIN, GGUFMetadata

logger = logging.getLogger(__name__)

# Our HF architecture -> the GGUF architecture llama.cpp's files of it name.
GGUF_ARCH_OF = {hf: arch for arch, hf in ARCHITECTURES.items()}
GGUF_ARCH_OF.setdefault("MistralForCausalLM", "llama")


def is_gguf_file(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _as_float(tensor) -> torch.Tensor:
    """A tensor of the file as fp32, in numpy order (rows first)."""
    shape = tuple(int(d) for d in reversed(tensor.shape))
    kind = tensor.tensor_type.name
    if kind in PLAIN:
        return torch.from_numpy(np.array(tensor.data, dtype=np.float32).reshape(shape))
    if kind == "BF16":
        bits = np.array(tensor.data).view(np.uint16).astype(np.uint32) << 16
        return torch.from_numpy(bits.view(np.float32).reshape(shape))
    from gguf import quants
    return torch.from_numpy(np.asarray(quants.dequantize(np.asarray(tensor.data), tensor.tensor_type),
                                       dtype=np.float32).reshape(shape))


def read_gguf_adapter(path: str, what: str, hf_config) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """module HF name -> (A [r, in], B [out, r], alpha with alpha / r llama.cpp's scale) of a GGUF
    adapter file for a model of hf_config. ValueError naming what is wrong (what: the adapter's name)."""
    try:
        meta = GGUFMetadata(path)
    except ValueError as e:
        raise ValueError(f"{what}: {path!r} is not a readable GGUF file: {e}") from None
    try:
        fields = meta.fields
        if fields.get("general.type") != "adapter" or fields.get("adapter.type", "lora") != "lora":
            raise ValueError(f"{what}: {path!r} is a GGUF file of general.type {fields.get('general.type')!r} / "
                             f"adapter.type {fields.get('adapter.type')!r}, not a LoRA adapter (general.type = "
                             "adapter, adapter.type = lora: llama.cpp's convert_lora_to_gguf.py writes them)")
        arch = fields.get("general.architecture")
        ours = next(iter(getattr(hf_config, "architectures", None) or []), None)
        expected = GGUF_ARCH_OF.get(ours)
        if expected is None or arch != expected:
            raise ValueError(f"{what}: the adapter is for general.architecture {arch!r}, the model is {ours} "
                             f"({expected or 'no GGUF adapter architecture'})")
        alpha = float(fields.get("adapter.lora.alpha", 0.0) or 0.0)
        halves: dict[str, dict[str, torch.Tensor]] = {}
        for tensor in meta.tensors:
            name = tensor.name
            if name.endswith("_norm.weight"):
                logger.warning("%s: tensor %s is not a LoRA pair; ignored, as llama.cpp does", what, name)
                continue
            base, _, half = name.rpartition(".lora_")
            if half not in ("a", "b"):
                raise ValueError(f"{what}: tensor {name!r} is neither <name>.lora_a nor <name>.lora_b")
            module = hf_name(base, arch)
            if module is None or not module.endswith(".weight") or "embed_tokens" in module or module == "lm_head.weight":
                raise ValueError(f"{what}: tensor {name!r} updates {base!r}, which is no linear projection LoRA "
                                 "applies to in this engine")
            halves.setdefault(module[: -len(".weight")], {})[half] = _as_float(tensor)
    finally:
        meta.close()
    pairs = {}
    heads = getattr(hf_config, "num_attention_heads", 0)
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    for module, ab in halves.items():
        if set(ab) != {"a", "b"}:
            raise ValueError(f"{what}: {module} has lora_{''.join(ab)} without its other half")
        a, b = ab["a"], ab["b"]
        if arch in PERMUTED_QK and module.endswith(("q_proj", "k_proj")):
            b = unpermute_rows(b, heads if module.endswith("q_proj") else kv_heads)
        rank = a.shape[0] if a.dim() == 2 else 0
        pairs[module] = (a, b, alpha if alpha else float(rank))  # no alpha: scale 1, as llama.cpp
    return pairs
