"""Mixtral: Llama's attention with a sparse MoE block in every layer, its experts named w1 (gate),
w3 (up), w2 (down) under block_sparse_moe, the router's top-k always renormalized."""
from collections.abc import Iterable

import torch

from nanovllm.layers.moe import MIXTRAL_EXPERT_PARTS
from nanovllm.models.llama import LlamaForCausalLM
from nanovllm.models.qwen_moe import MoeMixin


class MixtralForCausalLM(MoeMixin, LlamaForCausalLM):
    expert_parts = MIXTRAL_EXPERT_PARTS

    def __init__(self, config, quant_config=None):
        if getattr(config, "sliding_window", None):
            raise ValueError(f"Mixtral sliding-window attention (sliding_window={config.sliding_window}) is not "
                             "supported")
        super().__init__(config, quant_config)

    def renormalize(self, config) -> bool:
        return True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        renamed = ((name.replace(".block_sparse_moe.", ".mlp."), tensor) for name, tensor in weights)
        super().load_weights(renamed)
