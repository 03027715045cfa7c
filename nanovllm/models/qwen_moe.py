"""Qwen3-MoE and Qwen2-MoE: the dense models' attention with a sparse MoE block (moe_block.py)
in every layer that is_sparse_layer names (mlp_only_layers and decoder_sparse_step; the others
keep a gated MLP of intermediate_size); Qwen2-MoE adds a shared expert with a sigmoid gate."""
from nanovllm.layers.moe import FusedMoE
from nanovllm.loader.weights import StackedParam
from nanovllm.models.decoder import gated_mlp
from nanovllm.models.moe_block import (EXPERT_PARTS, SparseMoeBlock, check_router_options, expert_stacked_params,
                                       is_sparse_layer)
from nanovllm.models.qwen2 import Qwen2ForCausalLM
from nanovllm.models.qwen3 import Qwen3ForCausalLM


class MoeMixin:
    """make_mlp and the expert tensors' names (expert_parts: checkpoint part -> stacked parameter,
    shard) for a decoder with sparse MoE blocks."""

    expert_parts = EXPERT_PARTS

    def shared_expert_size(self, config) -> int:
        return 0

    def renormalize(self, config) -> bool:
        return bool(getattr(config, "norm_topk_prob", False))

    def __init__(self, config, quant_config=None):
        check_router_options(config)  # before any layer is built
        super().__init__(config, quant_config)

    def make_mlp(self, config, layer_idx, prefix, quant_config):
        if is_sparse_layer(config, layer_idx):
            return SparseMoeBlock(config, prefix, quant_config, self.renormalize(config),
                                  self.shared_expert_size(config))
        return gated_mlp(config, layer_idx, prefix, quant_config)

    def stacked_params(self) -> list[StackedParam]:
        # NOTE: the experts' entries first: the dense ones (".gate_proj.") would match them too.
        return expert_stacked_params(self.num_experts(), self.expert_parts) + super().stacked_params()

    def num_experts(self) -> int:
        return max((m.num_experts for m in self.modules() if isinstance(m, FusedMoE)), default=0)


class Qwen3MoeForCausalLM(MoeMixin, Qwen3ForCausalLM):
    """Qwen3's attention (q/k norm) with sparse MoE blocks."""


class Qwen2MoeForCausalLM(MoeMixin, Qwen2ForCausalLM):

    def shared_expert_size(self, config) -> int:
        return int(getattr(config, "shared_expert_intermediate_size", 0) or 0)

    def attention_biases(self, config) -> tuple[bool, bool]:
        return bool(getattr(config, "qkv_bias", True)), False
