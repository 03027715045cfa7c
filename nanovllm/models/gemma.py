"""Gemma 2 and Gemma 3 (text; Gemma2ForCausalLM, Gemma3ForCausalLM): sliding-window and full layers
(`layer_types`), attention scaled by query_pre_attn_scalar ** -0.5, Gemma's (1 + w) RMSNorm, four
norms per layer (before and after attention and the MLP), a GELU-tanh gated MLP, embeddings scaled
by sqrt(hidden_size), the head tied to them. Gemma 2: logit soft-capping of the attention scores
(attn_logit_softcapping) and of the final logits (final_logit_softcapping). Gemma 3: q/k norms and
a rope theta per layer kind (`rope_parameters` per layer type), no soft-capping."""
import torch
from torch import nn

from nanovllm.layers.layernorm import GemmaRMSNorm
from nanovllm.layers.quantization.base import QuantizationConfig
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.models.decoder import (DecoderAttention, DecoderForCausalLM, DecoderModel, gated_mlp,
                                     sliding_window_of)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, qkv_bias: bool, o_bias: bool, use_qk_norm: bool,
                 rotary_emb: RotaryEmbedding | None = None, quant_config: QuantizationConfig | None = None,
                 prefix: str = "", make_mlp=gated_mlp):
        super().__init__()
        self.self_attn = DecoderAttention(config, qkv_bias, o_bias, use_qk_norm, rotary_emb, quant_config,
                                          f"{prefix}.self_attn", sliding_window_of(config, layer_idx),
                                          scale=config.query_pre_attn_scalar ** -0.5, norm=GemmaRMSNorm,
                                          logit_softcap=getattr(config, "attn_logit_softcapping", None))
        self.mlp = make_mlp(config, layer_idx, f"{prefix}.mlp", quant_config)
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the model adds the two, as the
        shared layers' (output, residual) pairs are added."""
        stream = hidden_states if residual is None else hidden_states + residual
        h = self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(stream)))
        stream = stream + h
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(stream))), stream


class GemmaModel(DecoderModel):
    layer_class = GemmaDecoderLayer
    norm_class = GemmaRMSNorm

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.embed_scale = config.hidden_size ** 0.5

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Scaled by sqrt(hidden_size) rounded to the weights' dtype, as transformers does.
        embeds = self.embed_tokens(input_ids)
        return embeds * torch.tensor(self.embed_scale, dtype=embeds.dtype)


class Gemma2ForCausalLM(DecoderForCausalLM):
    model_class = GemmaModel
    fused_decode = False  # the C decode step knows the shared layer only

    def __init__(self, config, quant_config=None):
        super().__init__(config, quant_config)
        self.final_softcap = getattr(config, "final_logit_softcapping", None)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden_states)
        if logits is not None and self.final_softcap is not None:
            logits = self.final_softcap * torch.tanh(logits / self.final_softcap)
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    use_qk_norm = True
