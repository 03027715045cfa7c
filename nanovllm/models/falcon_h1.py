"""Falcon-H1 (FalconH1ForCausalLM): every layer runs a Mamba-2 mixer (layers/mamba2.py; its inner
size mamba_d_ssm, its output norm optional: mamba_rms_norm, mamba_norm_before_gate) and attention
side by side on the same normed input, their outputs summed into the residual stream, then a SwiGLU
MLP (pre_ff_layernorm before it).

Falcon-H1's muP multipliers are linear in the weights they follow, so they are folded into them at
load, as llama.cpp's converter folds them into its files: the embedding table (embedding_multiplier),
the LM head (lm_head_multiplier), in_proj's z, x, B, C and dt rows (ssm_multipliers, times
ssm_in_multiplier), out_proj (ssm_out_multiplier), q, k and v (attention_in_multiplier; k also
key_multiplier), o_proj (attention_out_multiplier), gate_proj and down_proj (mlp_multipliers). The
model then runs as a plain parallel hybrid (a GGUF file's weights hold them already: its config
states none). Its decode steps run in the C one call, which sums a layer's mixer and attention
outputs (DecoderLayer.mamba2 beside the layer's attention matrices)."""
from collections.abc import Iterable

import torch
from torch import nn

from nanovllm.layers.c_description import CDescriber, CPart, describe, describes
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.mamba2 import Mamba2Mixer, in_proj_parts, is_in_proj, mamba2_inner
from nanovllm.layers.quantization.base import QuantizationConfig
from nanovllm.models.decoder import (DecoderAttention, DecoderForCausalLM, GatedMLP, LayerStack, PreNormLayer, build_rope,
                                     pre_norm_layer_part)
from nanovllm.models.granite_hybrid import GraniteMoeHybridForCausalLM


class FalconH1Layer(PreNormLayer):
    def __init__(self, config, rope, quant_config, prefix: str):
        super().__init__()
        self.mamba = Mamba2Mixer(config, quant_config, f"{prefix}.mamba")
        bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = DecoderAttention(config, bias, bias, False, rope, quant_config, f"{prefix}.self_attn")
        self.mlp = GatedMLP(config, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def mix(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.mamba(hidden_states) + self.self_attn(positions, hidden_states)


@describes(FalconH1Layer)
def _c_layer(layer: FalconH1Layer, c: CDescriber) -> CPart:
    """Its attention in the layer's seats, the Mamba-2 mixer beside it (its own matrices): the C one
    call sums their outputs."""
    return pre_norm_layer_part(layer, layer.self_attn, c).merged(describe(layer.mamba, c, "its Mamba-2 mixer"))


class FalconH1Model(LayerStack):
    def __init__(self, config, quant_config: QuantizationConfig | None, prefix: str = "model"):
        super().__init__()
        rope = build_rope(config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, quant_config,
                                                   f"{prefix}.embed_tokens")
        self.layers = nn.ModuleList(FalconH1Layer(config, rope, quant_config, f"{prefix}.layers.{i}")
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


MULTIPLIERS = ("embedding_multiplier", "lm_head_multiplier", "attention_in_multiplier", "attention_out_multiplier",
               "key_multiplier", "ssm_in_multiplier", "ssm_out_multiplier")


def falcon_scales(config, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A checkpoint tensor with the multiplier of its weight folded in (the tensor itself where none)."""
    get = lambda key, default=1.0: getattr(config, key, default)  # noqa: E731
    attn_in = get("attention_in_multiplier")
    if is_in_proj(name):
        inner = mamba2_inner(config)
        bc = int(config.mamba_n_groups) * int(config.mamba_d_state)
        sizes = [inner, inner, bc, bc, tensor.shape[0] - 2 * inner - 2 * bc]
        rows = torch.tensor(get("ssm_multipliers", [1.0] * 5)).repeat_interleave(torch.tensor(sizes))
        return tensor * (rows.view(-1, *[1] * (tensor.dim() - 1)) * get("ssm_in_multiplier")).to(tensor.dtype)
    scale = {".mamba.out_proj.": get("ssm_out_multiplier"), ".self_attn.q_proj.": attn_in,
             ".self_attn.k_proj.": attn_in * get("key_multiplier"), ".self_attn.v_proj.": attn_in,
             ".self_attn.o_proj.": get("attention_out_multiplier"),
             ".feed_forward.gate_proj.": get("mlp_multipliers", [1.0, 1.0])[0],
             ".feed_forward.down_proj.": get("mlp_multipliers", [1.0, 1.0])[1],
             "model.embed_tokens.": get("embedding_multiplier"), "lm_head.": get("lm_head_multiplier")}
    factor = next((v for k, v in scale.items() if k in name), 1.0)
    return tensor if factor == 1.0 else tensor * factor


class FalconH1ForCausalLM(DecoderForCausalLM):
    packed_modules_mapping = GraniteMoeHybridForCausalLM.packed_modules_mapping

    def __init__(self, config, quant_config: QuantizationConfig | None = None):
        nn.Module.__init__(self)
        if getattr(config, "tie_word_embeddings", False) and \
                getattr(config, "embedding_multiplier", 1.0) != getattr(config, "lm_head_multiplier", 1.0):
            raise ValueError("a Falcon-H1 checkpoint with tied embeddings and embedding_multiplier != "
                             "lm_head_multiplier is not supported (the one table cannot hold both scales)")
        self.config = config
        self.model = FalconH1Model(config, quant_config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=quant_config, prefix="lm_head")
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.tie_weights(self.model.embed_tokens)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self.renamed(weights))

    def renamed(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """The multipliers folded into a float checkpoint's weights (falcon_scales); names as ours,
        in_proj cut into its z, x, B, C and dt rows."""
        config = self.config
        inner = mamba2_inner(config)
        bc = int(config.mamba_n_groups) * int(config.mamba_d_state)
        folds = any(getattr(config, key, 1.0) not in (1.0, None) for key in MULTIPLIERS) or any(
            m != 1.0 for key in ("ssm_multipliers", "mlp_multipliers") for m in getattr(config, key, None) or [])
        for name, tensor in weights:
            if folds and tensor.is_floating_point():
                tensor = falcon_scales(config, name, tensor)
            elif folds and any(name.endswith(s) for s in (".weight", ".bias")):
                raise ValueError(f"{name}: a Falcon-H1 checkpoint's multipliers fold into float weights only, got "
                                 f"{tensor.dtype}")
            name = name.replace(".feed_forward.", ".mlp.").replace(".pre_ff_layernorm.", ".post_attention_layernorm.")
            name = name.replace("model.final_layernorm.", "model.norm.")
            if is_in_proj(name):
                yield from in_proj_parts(name, tensor, inner, bc)
            else:
                yield name, tensor
