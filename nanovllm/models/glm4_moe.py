"""GLM-4.5 / 4.6 (Glm4MoeForCausalLM): attention with biased q/k/v (`attention_bias`), optional q/k
norm (`use_qk_norm`) and rotary over the first `partial_rotary_factor` of each head; the first
`first_k_dense_replace` layers dense, the others a sparse MoE block of `n_routed_experts` under
DeepSeek-V3's router (sigmoid scores, a correction bias in the choice, groups: moe_ops.GroupedTopK;
the weights renormalized where `norm_topk_prob`, times `routed_scaling_factor`) plus
`n_shared_experts` shared experts (one MLP of their summed size, ungated).

The C decode step runs the whole layer in its one call: the MoE block's router, experts (their
grouped rule: cpu_moe.c route_grouped) and ungated shared experts as Qwen-MoE's are."""
from collections.abc import Iterable

import torch
from torch import nn

from nanovllm.layers.c_description import CDescriber, CPart, describes
from nanovllm.layers.linear import ReplicatedLinear
from nanovllm.layers.moe import FusedMoE
from nanovllm.layers.quantization.base import QuantizationConfig
from nanovllm.layers.quantization.moe_ops import GroupedTopK
from nanovllm.models.decoder import DecoderForCausalLM, GatedMLP, gated_mlp
from nanovllm.models.moe_block import describe_experts_block
from nanovllm.models.qwen_moe import MoeMixin


class Glm4MoeBlock(nn.Module):
    """gate (the router, replicated), experts (with the router's correction bias), shared_experts."""

    def __init__(self, config, prefix: str, quant_config: QuantizationConfig | None):
        super().__init__()
        experts = int(config.n_routed_experts)
        self.gate = ReplicatedLinear(config.hidden_size, experts, bias=False, prefix=f"{prefix}.gate")
        grouped = GroupedTopK(int(config.n_group), int(config.topk_group), float(config.routed_scaling_factor))
        self.experts = FusedMoE(experts, config.num_experts_per_tok, config.hidden_size, config.moe_intermediate_size,
                                bool(config.norm_topk_prob), quant_config, f"{prefix}.experts", grouped=grouped)
        shared = int(getattr(config, "n_shared_experts", 0) or 0)
        self.shared_experts = GatedMLP(config, quant_config, f"{prefix}.shared_experts",
                                       config.moe_intermediate_size * shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.experts(x, self.gate(x))
        return y if self.shared_experts is None else y + self.shared_experts(x)


@describes(Glm4MoeBlock)
def _c_block(block: Glm4MoeBlock, c: CDescriber) -> CPart:
    """Its router, experts (their grouped rule) and ungated shared experts in the C step's one call."""
    return describe_experts_block(block, block.experts, block.gate, block.shared_experts, None, c)


class Glm4MoeForCausalLM(MoeMixin, DecoderForCausalLM):

    def __init__(self, config, quant_config: QuantizationConfig | None = None):
        self.use_qk_norm = bool(getattr(config, "use_qk_norm", False))
        DecoderForCausalLM.__init__(self, config, quant_config)  # (MoeMixin's router check is for softmax routers)

    def make_mlp(self, config, layer_idx: int, prefix: str, quant_config: QuantizationConfig | None) -> nn.Module:
        if layer_idx >= int(getattr(config, "first_k_dense_replace", 0)):
            return Glm4MoeBlock(config, prefix, quant_config)
        return gated_mlp(config, layer_idx, prefix, quant_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The router's correction bias (mlp.gate.e_score_correction_bias) goes to the experts' layer."""
        super().load_weights((name.replace(".mlp.gate.e_score_correction_bias", ".mlp.experts.e_score_correction_bias"),
                              tensor) for name, tensor in weights)

    def attention_biases(self, config) -> tuple[bool, bool]:
        """q/k/v biased where attention_bias, o never."""
        return bool(getattr(config, "attention_bias", False)), False
