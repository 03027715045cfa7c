"""The one rule where the C kernels are absent (no C compiler, or NANOVLLM_CPU_KERNEL=0): every
weight format still runs, from a dense copy in the model dtype multiplied by torch. Dense
checkpoints are that already; pre-quantized ones are decoded (weight_only.py); the GGUF block
formats are dequantized here once at load by the `gguf` package's reference code, so the values
are the file's own (transformers reads a .gguf file the same way)."""
import logging

import torch

logger = logging.getLogger(__name__)

_said = False


def dequantized(rows: torch.Tensor, type_name: str, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Block rows (uint8 [..., row bytes]) of type_name as dense values [..., k] in dtype."""
    from gguf import GGMLQuantizationType, quants
    global _said
    if not _said:
        _said = True
        logger.warning("no C kernels here (no C compiler, or NANOVLLM_CPU_KERNEL=0): the block-quantized weights "
                       "are dequantized once to %s and multiplied by torch (several times their memory, slower)",
                       str(dtype).removeprefix("torch."))
    values = quants.dequantize(rows.contiguous().cpu().numpy(), GGMLQuantizationType[type_name.upper()])
    return torch.from_numpy(values.reshape(*rows.shape[:-1], k)).to(dtype)
