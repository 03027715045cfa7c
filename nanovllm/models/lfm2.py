"""LFM2 and LFM2-MoE (Liquid's hybrids): pre-norm layers, each either a gated short convolution
(layers/short_conv.py: its state a slot per sequence) or attention with q/k RMSNorm, then a SwiGLU
MLP; config.layer_types says which (`conv` / `full_attention`), else full_attn_idxs. The final
norm is the checkpoint's embedding_norm. LFM2's MLP width is adjusted from intermediate_size
(block_auto_adjust_ff_dim: 2/3 of it, times block_ffn_dim_multiplier, rounded up to
block_multiple_of). LFM2-MoE's layers past num_dense_layers hold a sparse block under a sigmoid
router whose choice adds expert_bias (use_expert_bias), renormalized where norm_topk_prob, times
routed_scaling_factor: DeepSeek-V3's rule with one group (models/glm4_moe.py's block).

The C decode step runs every layer in its one call (the short convolution's phase in
cpu_deltanet.c); prefills and batches past its rows run eager."""
import re
from collections.abc import Iterable
from types import SimpleNamespace

import torch
from torch import nn

from nanovllm.layers.c_description import CDescriber, CPart, describes
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.quantization.base import QuantizationConfig
from nanovllm.layers.short_conv import ShortConv
from nanovllm.models.decoder import (DecoderAttention, DecoderForCausalLM, GatedMLP, LayerStack, PreNormLayer, build_rope,
                                     pre_norm_layer_part)
from nanovllm.models.glm4_moe import Glm4MoeBlock
from nanovllm.models.moe_block import expert_stacked_params

CONV, FULL = "conv", "full_attention"


def lfm2_layer_types(config) -> list[str]:
    types = getattr(config, "layer_types", None)
    if types is None:
        full = getattr(config, "full_attn_idxs", None)
        full = range(config.num_hidden_layers) if full is None else set(full)
        types = [FULL if i in full else CONV for i in range(config.num_hidden_layers)]
    types = list(types)
    if len(types) != config.num_hidden_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {config.num_hidden_layers} layers")
    for i, kind in enumerate(types):
        if kind not in (CONV, FULL):
            raise ValueError(f"layer_types[{i}] is {kind!r}, not a layer type LFM2 runs ({CONV!r}, {FULL!r})")
    return types


def lfm2_mlp_size(config) -> int:
    """The dense MLP's width as transformers' Lfm2MLP computes it."""
    size = int(config.intermediate_size)
    if getattr(config, "block_auto_adjust_ff_dim", False):
        size = int(2 * size / 3)
        multiplier = getattr(config, "block_ffn_dim_multiplier", None)
        if multiplier is not None:
            size = int(multiplier * size)
            step = int(config.block_multiple_of)
            size = step * ((size + step - 1) // step)
    return size


class Lfm2Layer(PreNormLayer):
    def __init__(self, config, layer_idx: int, kind: str, rope, quant_config, prefix: str, make_mlp):
        super().__init__()
        self.kind = kind
        if kind == CONV:
            self.conv = ShortConv(config, quant_config, f"{prefix}.conv")
        else:
            self.self_attn = DecoderAttention(config, False, False, True, rope, quant_config, f"{prefix}.self_attn")
        self.mlp = make_mlp(config, layer_idx, f"{prefix}.mlp", quant_config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def mix(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.conv(hidden_states) if self.kind == CONV else self.self_attn(positions, hidden_states)


@describes(Lfm2Layer)
def _c_layer(layer: Lfm2Layer, c: CDescriber) -> CPart:
    return pre_norm_layer_part(layer, layer.conv if layer.kind == CONV else layer.self_attn, c)


class Lfm2Model(LayerStack):
    def __init__(self, config, quant_config: QuantizationConfig | None, make_mlp, prefix: str = "model"):
        super().__init__()
        rope = build_rope(config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, quant_config,
                                                   f"{prefix}.embed_tokens")
        self.layers = nn.ModuleList(Lfm2Layer(config, i, kind, rope, quant_config, f"{prefix}.layers.{i}", make_mlp)
                                    for i, kind in enumerate(lfm2_layer_types(config)))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


# checkpoint name parts -> ours (in order; the experts' before the dense MLP's)
_RENAMES = [(re.compile(p), r) for p, r in (
    (r"\.feed_forward\.experts\.(\d+)\.w1\.", r".mlp.experts.\1.gate_proj."),
    (r"\.feed_forward\.experts\.(\d+)\.w3\.", r".mlp.experts.\1.up_proj."),
    (r"\.feed_forward\.experts\.(\d+)\.w2\.", r".mlp.experts.\1.down_proj."),
    (r"\.feed_forward\.expert_bias$", r".mlp.experts.e_score_correction_bias"),
    (r"\.feed_forward\.w1\.", r".mlp.gate_proj."), (r"\.feed_forward\.w3\.", r".mlp.up_proj."),
    (r"\.feed_forward\.w2\.", r".mlp.down_proj."), (r"\.feed_forward\.", r".mlp."),
    (r"\.operator_norm\.", r".input_layernorm."), (r"\.ffn_norm\.", r".post_attention_layernorm."),
    (r"\.self_attn\.q_layernorm\.", r".self_attn.q_norm."), (r"\.self_attn\.k_layernorm\.", r".self_attn.k_norm."),
    (r"\.self_attn\.out_proj\.", r".self_attn.o_proj."), (r"^model\.embedding_norm\.", r"model.norm."))]


class Lfm2ForCausalLM(DecoderForCausalLM):
    """LFM2 (dense MLPs)."""

    packed_modules_mapping = {**DecoderForCausalLM.packed_modules_mapping,
                              "in_proj_b": ("in_proj", 0), "in_proj_c": ("in_proj", 1), "in_proj_x": ("in_proj", 2)}

    def __init__(self, config, quant_config: QuantizationConfig | None = None):
        nn.Module.__init__(self)
        if getattr(config, "rms_norm_eps", None) is None:
            config.rms_norm_eps = config.norm_eps  # the one eps of every norm, as the shared blocks read it
        self.model = Lfm2Model(config, quant_config, self.make_mlp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=quant_config, prefix="lm_head")
        if getattr(config, "tie_word_embeddings", True):
            self.lm_head.tie_weights(self.model.embed_tokens)

    def make_mlp(self, config, layer_idx: int, prefix: str, quant_config: QuantizationConfig | None) -> nn.Module:
        return GatedMLP(config, quant_config, prefix, lfm2_mlp_size(config))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self.renamed(weights))

    @staticmethod
    def renamed(weights: Iterable[tuple[str, torch.Tensor]]):
        """Checkpoint names as ours; the short convolutions' in_proj cut into its B, C and x rows
        (each split over the ranks on its own); a multimodal checkpoint's text model only."""
        for name, tensor in weights:
            if name.startswith(("model.vision_tower.", "model.multi_modal_projector.", "model.audio")):
                continue
            name = name.replace("model.language_model.", "model.", 1)
            for pattern, repl in _RENAMES:
                name = pattern.sub(repl, name)
            if ".conv.in_proj." in name:
                for part, rows in zip("bcx", tensor.chunk(3)):
                    yield name.replace(".conv.in_proj.", f".conv.in_proj_{part}."), rows
            else:
                yield name, tensor


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    """LFM2-MoE: the first num_dense_layers dense (intermediate_size as given), the others sparse."""

    def make_mlp(self, config, layer_idx: int, prefix: str, quant_config: QuantizationConfig | None) -> nn.Module:
        if layer_idx < int(getattr(config, "num_dense_layers", 0)):
            return GatedMLP(config, quant_config, prefix)
        rules = SimpleNamespace(hidden_size=config.hidden_size, n_routed_experts=config.num_experts,
                                num_experts_per_tok=config.num_experts_per_tok, n_group=1, topk_group=1,
                                routed_scaling_factor=getattr(config, "routed_scaling_factor", 1.0),
                                moe_intermediate_size=config.moe_intermediate_size,
                                norm_topk_prob=getattr(config, "norm_topk_prob", True), n_shared_experts=0)
        return Glm4MoeBlock(rules, prefix, quant_config)

    def stacked_params(self):
        experts = max((m.mlp.experts.num_experts for m in self.model.layers if isinstance(m.mlp, Glm4MoeBlock)),
                      default=0)
        return expert_stacked_params(experts) + super().stacked_params()
