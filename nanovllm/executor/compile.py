"""torch.compile of the small fused ops (RMSNorm, add + RMSNorm, SiLU-and-mul, RoPE).

ModelRunner calls compile_fused_ops once after loading the model when Config.compile_ops is on.
"""
import logging

from torch import nn

from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.rotary_embedding import RotaryEmbedding

logger = logging.getLogger(__name__)

# Elementwise and row-wise ops: eager runs each as several kernels with fp32 round trips; compiled,
# each becomes one fused kernel. Matmuls and attention are left to their own libraries.
FUSED_OP_TYPES = (RMSNorm, SiluAndMul, RotaryEmbedding)


def compile_fused_ops(model: nn.Module) -> int:
    """Compile every fused-op module of model in place; returns how many were wrapped.

    Instances of one class share their compiled code (dynamo inlines nn.Modules and guards on
    their type), and dynamic=True keeps one kernel for all token counts, so compilation happens
    once per op and dtype, at the first forward that reaches it.
    """
    count = 0
    for module in model.modules():
        if isinstance(module, FUSED_OP_TYPES):
            module.compile(dynamic=True)
            count += 1
    logger.info("torch.compile wraps %d fused-op modules", count)
    return count
