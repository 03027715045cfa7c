"""Mixtral: Llama's attention with a sparse MoE block in every layer, its experts named w1 (gate),
w3 (up), w2 (down) under block_sparse_moe, the router's top-k always renormalized. Also from
llama.cpp's Mixtral GGUF files (a llama file with expert tensors)."""
from collections.abc import Iterable

import torch

from nanovllm.models.moe_block import EXPERT_PARTS, MIXTRAL_EXPERT_PARTS, expert_stacked_params
from nanovllm.models.decoder import DecoderForCausalLM
from nanovllm.models.llama import LlamaForCausalLM
from nanovllm.models.qwen_moe import MoeMixin


class MixtralForCausalLM(MoeMixin, LlamaForCausalLM):
    expert_parts = MIXTRAL_EXPERT_PARTS

    def renormalize(self, config) -> bool:
        return True

    def stacked_params(self):
        # Hub checkpoints name the experts' matrices w1 / w3 / w2, GGUF files (loader/gguf.py) by
        # the Qwen-MoE names: either loads the same parts.
        n = self.num_experts()
        return (expert_stacked_params(n, MIXTRAL_EXPERT_PARTS) + expert_stacked_params(n, EXPERT_PARTS)
                + DecoderForCausalLM.stacked_params(self))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        renamed = ((name.replace(".block_sparse_moe.", ".mlp."), tensor) for name, tensor in weights)
        super().load_weights(renamed)
