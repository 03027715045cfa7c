"""Granite 4.0-H (GraniteMoeHybridForCausalLM): pre-norm layers, each either a Mamba-2 mixer
(layers/mamba2.py: its conv and SSM states a slot per sequence) or attention (scale
attention_multiplier; rotary only where position_embedding_type is "rope", else no positions at
all), then a sparse MoE block (a softmax top-k router, renormalized) beside an ungated shared MLP
(or the shared MLP alone where num_local_experts is 0). Granite's multipliers: the embeddings times
embedding_multiplier, each branch's output times residual_multiplier before it joins the stream,
the logits divided by logits_scaling. config.layer_types (`mamba` / `linear_attention`,
`attention` / `full_attention`) says which mixer a layer has.

The C one-call decode step runs every layer (the Mamba-2 mixer a layer kind of it, phase_mamba2 in
kernels/cpu_deltanet.c) with the multipliers (DecoderModel's embed_scale, residual_scale,
logit_scale); where it cannot, each Mamba-2 layer's decode step is one C call (mamba2_decode)."""
import re
from collections.abc import Iterable

import torch
from torch import nn

from nanovllm.layers.c_description import CDescriber, CModel, CPart, describe, describes
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import ReplicatedLinear
from nanovllm.layers.mamba2 import Mamba2Mixer, in_proj_parts, is_in_proj, mamba2_inner
from nanovllm.layers.moe import FusedMoE
from nanovllm.layers.quantization.base import QuantizationConfig
from nanovllm.models.decoder import (DecoderAttention, DecoderForCausalLM, GatedMLP, LayerStack, PreNormLayer, build_rope,
                                     pre_norm_layer_part)
from nanovllm.models.moe_block import describe_experts_block, expert_stacked_params

MAMBA, ATTENTION = "mamba", "attention"
_KINDS = {"mamba": MAMBA, "linear_attention": MAMBA, "attention": ATTENTION, "full_attention": ATTENTION}


def granite_layer_kinds(config) -> list[str]:
    types = getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None)
    if types is None or len(types) != config.num_hidden_layers:
        raise ValueError(f"layer_types must name each of the {config.num_hidden_layers} layers' mixer, got {types!r}")
    for i, kind in enumerate(types):
        if kind not in _KINDS:
            raise ValueError(f"layer_types[{i}] is {kind!r}, not a layer type Granite 4.0-H runs {sorted(_KINDS)}")
    return [_KINDS[kind] for kind in types]


class GraniteMoeBlock(nn.Module):
    """gate (the router), experts (renormalized top-k: the softmax of the chosen logits) and the
    ungated shared MLP; the shared MLP alone without experts."""

    def __init__(self, config, prefix: str, quant_config: QuantizationConfig | None):
        super().__init__()
        experts = int(getattr(config, "num_local_experts", 0) or 0)
        self.gate = self.experts = None
        if experts:
            self.gate = ReplicatedLinear(config.hidden_size, experts, bias=False, prefix=f"{prefix}.gate")
            self.experts = FusedMoE(experts, config.num_experts_per_tok, config.hidden_size, config.intermediate_size,
                                    True, quant_config, f"{prefix}.experts")
        self.shared_mlp = GatedMLP(config, quant_config, f"{prefix}.shared_mlp", config.shared_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.shared_mlp(x)
        return y if self.experts is None else y + self.experts(x, self.gate(x))


class GraniteHybridLayer(PreNormLayer):
    def __init__(self, config, kind: str, rope, quant_config, prefix: str):
        super().__init__()
        self.kind = kind
        self.branch_scale = float(getattr(config, "residual_multiplier", 1.0))
        if kind == MAMBA:
            self.mamba = Mamba2Mixer(config, quant_config, f"{prefix}.mamba")
        else:
            self.self_attn = DecoderAttention(config, *(2 * [bool(getattr(config, "attention_bias", False))]), False,
                                              rope, quant_config, f"{prefix}.self_attn",
                                              scale=float(getattr(config, "attention_multiplier", 0) or 0) or None)
            self.self_attn.use_rope = getattr(config, "position_embedding_type", None) == "rope"
        self.mlp = GraniteMoeBlock(config, f"{prefix}.mlp", quant_config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def mix(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.mamba(hidden_states) if self.kind == MAMBA else self.self_attn(positions, hidden_states)


class GraniteHybridModel(LayerStack):
    def __init__(self, config, quant_config: QuantizationConfig | None, prefix: str = "model"):
        super().__init__()
        rope = build_rope(config)
        self.embedding_multiplier = float(getattr(config, "embedding_multiplier", 1.0))
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, quant_config,
                                                   f"{prefix}.embed_tokens")
        self.layers = nn.ModuleList(GraniteHybridLayer(config, kind, rope, quant_config, f"{prefix}.layers.{i}")
                                    for i, kind in enumerate(granite_layer_kinds(config)))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier


class GraniteMoeHybridForCausalLM(DecoderForCausalLM):
    packed_modules_mapping = {**DecoderForCausalLM.packed_modules_mapping,
                              "in_proj_z": ("in_proj", 0), "in_proj_x": ("in_proj", 1), "in_proj_dt": ("in_proj", 2),
                              "in_proj_B": ("bc_proj", 0), "in_proj_C": ("bc_proj", 1)}

    def __init__(self, config, quant_config: QuantizationConfig | None = None):
        nn.Module.__init__(self)
        self.config = config
        self.model = GraniteHybridModel(config, quant_config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=quant_config, prefix="lm_head")
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_scaling = float(getattr(config, "logits_scaling", 1.0) or 1.0)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden_states)
        return None if logits is None else logits / self.logits_scaling

    def stacked_params(self):
        experts = max((layer.mlp.experts.num_experts for layer in self.model.layers if layer.mlp.experts is not None),
                      default=0)
        return expert_stacked_params(experts) + super().stacked_params()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self.renamed(weights))

    def renamed(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """Checkpoint names as ours: the Mamba-2 in_proj cut into z, x, B, C and dt rows (each split
        over the ranks on its own, or B and C whole); the shared MLP's and each expert's input_linear
        into gate and up rows; the router as the MoE block's gate."""
        config = self.config
        inner = mamba2_inner(config)
        bc = int(config.mamba_n_groups) * int(config.mamba_d_state)
        for name, tensor in weights:
            name = name.replace(".block_sparse_moe.router.layer.", ".mlp.gate.")
            name = re.sub(r"(?<!\.mlp)\.shared_mlp\.", ".mlp.shared_mlp.", name)  # (a GGUF file's are ours already)
            if is_in_proj(name):
                yield from in_proj_parts(name, tensor, inner, bc)
            elif name.endswith(".input_linear.weight"):  # gate rows then up rows
                gate, up = tensor.chunk(2, dim=-2)
                base = name[: -len("input_linear.weight")]
                if ".block_sparse_moe." in name:
                    base = base.replace(".block_sparse_moe.", ".mlp.experts.")
                    for e in range(tensor.shape[0]):
                        yield f"{base}{e}.gate_proj.weight", gate[e]
                        yield f"{base}{e}.up_proj.weight", up[e]
                else:
                    yield base + "gate_proj.weight", gate
                    yield base + "up_proj.weight", up
            elif name.endswith(".output_linear.weight"):
                base = name[: -len("output_linear.weight")]
                if ".block_sparse_moe." in name:
                    base = base.replace(".block_sparse_moe.", ".mlp.experts.")
                    for e in range(tensor.shape[0]):
                        yield f"{base}{e}.down_proj.weight", tensor[e]
                else:
                    yield base + "down_proj.weight", tensor
            else:
                yield name, tensor


# ---- how these blocks describe themselves to the CPU's C decode step (layers/c_description.py) ----
@describes(GraniteMoeBlock)
def _c_block(block: GraniteMoeBlock, c: CDescriber) -> CPart:
    """Its router, experts and ungated shared MLP in the one call; the shared MLP alone as a dense MLP."""
    if block.experts is None:
        return describe(block.shared_mlp, c, "its shared MLP")
    return describe_experts_block(block, block.experts, block.gate, block.shared_mlp, None, c)


@describes(GraniteHybridLayer)
def _c_layer(layer: GraniteHybridLayer, c: CDescriber) -> CPart:
    return pre_norm_layer_part(layer, layer.mamba if layer.kind == MAMBA else layer.self_attn, c)


@describes(GraniteMoeHybridForCausalLM)
def _c_model(model: GraniteMoeHybridForCausalLM, c: CDescriber) -> CModel:
    """Its layers, final norm, embedding and head, with Granite's multipliers."""
    inner = model.model
    return CModel(list(inner.layers), inner.norm, inner.embed_tokens, model.lm_head, inner.embedding_multiplier,
                  inner.layers[0].branch_scale, 1.0 / model.logits_scaling)
