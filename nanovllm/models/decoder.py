"""Shared blocks of decoder-only transformers (Qwen3, Qwen2, Llama): attention with optional
q/k RMSNorm and qkv bias, SiLU-gated MLP, pre-norm layers, and the causal-LM wrapper. Every layer
gets its module prefix (the checkpoint's names) and the quantization config, which picks how its
weights are held; each decoder layer asks the model for its MLP (make_mlp), so a model can put
another block (a sparse MoE) in some layers."""
from collections.abc import Callable, Iterable

import torch
from torch import nn

from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import Attention
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.quantization.base import QuantizationConfig
from nanovllm.layers.rotary_embedding import RotaryEmbedding, get_rope, rope_settings
from nanovllm.loader.weights import StackedParam, load_weights


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def row_parallel_inputs(config) -> dict[str, int]:
    """The inputs of each kind of row-parallel layer (split over the tensor-parallel ranks), for the
    formats' checks that a split keeps their blocks whole."""
    sizes = {"o_proj": config.num_attention_heads * head_dim_of(config), "down_proj": config.intermediate_size,
             "experts' down_proj": getattr(config, "moe_intermediate_size", None),
             "shared_expert.down_proj": getattr(config, "shared_expert_intermediate_size", None)}
    return {name: k for name, k in sizes.items() if k}


def build_rope(config) -> RotaryEmbedding:
    theta, scaling = rope_settings(config)
    head_dim = head_dim_of(config)
    return get_rope(head_dim, head_dim, config.max_position_embeddings, theta, scaling)


class DecoderAttention(nn.Module):
    def __init__(self, config, qkv_bias: bool, o_bias: bool, use_qk_norm: bool,
                 rotary_emb: RotaryEmbedding | None = None, quant_config: QuantizationConfig | None = None,
                 prefix: str = ""):
        super().__init__()
        hidden_size = config.hidden_size
        self.total_num_heads = config.num_attention_heads
        self.total_num_kv_heads = getattr(config, "num_key_value_heads", None) or self.total_num_heads
        self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(hidden_size, self.head_dim, self.total_num_heads,
                                          self.total_num_kv_heads, bias=qkv_bias, quant_config=quant_config,
                                          prefix=f"{prefix}.qkv_proj")
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(self.total_num_heads * self.head_dim, hidden_size, bias=o_bias,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.rotary_emb = rotary_emb if rotary_emb is not None else build_rope(config)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5, self.num_kv_heads)
        self.use_qk_norm = use_qk_norm
        if use_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v)
        return self.o_proj(o.flatten(1, -1))


class GatedMLP(nn.Module):
    """down(silu(gate x) * up x), of config.intermediate_size unless intermediate_size is given (a
    mixture of experts' shared expert)."""

    def __init__(self, config, quant_config: QuantizationConfig | None = None, prefix: str = "",
                 intermediate_size: int | None = None):
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
        bias = getattr(config, "mlp_bias", False)
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size] * 2, bias=bias,
                                                       quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=bias,
                                           quant_config=quant_config, prefix=f"{prefix}.down_proj")
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


# make_mlp(config, layer_idx, prefix, quant_config) -> the layer's MLP module
MakeMLP = Callable[[object, int, str, QuantizationConfig | None], nn.Module]


def gated_mlp(config, layer_idx: int, prefix: str, quant_config: QuantizationConfig | None) -> nn.Module:
    return GatedMLP(config, quant_config, prefix)


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, qkv_bias: bool, o_bias: bool, use_qk_norm: bool,
                 rotary_emb: RotaryEmbedding | None = None, quant_config: QuantizationConfig | None = None,
                 prefix: str = "", make_mlp: MakeMLP = gated_mlp):
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = DecoderAttention(config, qkv_bias, o_bias, use_qk_norm, rotary_emb, quant_config,
                                          f"{prefix}.self_attn")
        self.mlp = make_mlp(config, layer_idx, f"{prefix}.mlp", quant_config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            hidden_states, residual = self.input_layernorm(hidden_states), hidden_states
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class DecoderModel(nn.Module):
    def __init__(self, config, qkv_bias: bool, o_bias: bool, use_qk_norm: bool,
                 quant_config: QuantizationConfig | None = None, prefix: str = "model", make_mlp: MakeMLP = gated_mlp):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, quant_config,
                                                   f"{prefix}.embed_tokens")
        # NOTE: one cos/sin cache shared by all layers; per-layer copies of a 128k-position cache
        # (Llama 3.1) would cost gigabytes.
        rotary_emb = build_rope(config)
        self.layers = nn.ModuleList(DecoderLayer(config, i, qkv_bias, o_bias, use_qk_norm, rotary_emb, quant_config,
                                                 f"{prefix}.layers.{i}", make_mlp)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class DecoderForCausalLM(nn.Module):
    """forward() gives hidden states; compute_logits() maps the selected rows to vocab logits."""

    # HF checkpoint name -> (our parameter name, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    use_qk_norm = False

    def __init__(self, config, quant_config: QuantizationConfig | None = None):
        super().__init__()
        qkv_bias, o_bias = self.attention_biases(config)
        self.model = DecoderModel(config, qkv_bias, o_bias, self.use_qk_norm, quant_config, "model", self.make_mlp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=quant_config,
                                      prefix="lm_head")
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.tie_weights(self.model.embed_tokens)

    def make_mlp(self, config, layer_idx: int, prefix: str, quant_config: QuantizationConfig | None) -> nn.Module:
        """The MLP of layer layer_idx: the gated MLP; a subclass may give some layers another block."""
        return gated_mlp(config, layer_idx, prefix, quant_config)

    def stacked_params(self) -> list[StackedParam]:
        """The checkpoint parts loaded into parts of stacked parameters (first match wins)."""
        return [StackedParam(param_part, part, shard_id)
                for part, (param_part, shard_id) in self.packed_modules_mapping.items()]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Checkpoint (name, tensor) pairs into the parameters (loader/weights.py)."""
        load_weights(self, weights, self.stacked_params())

    def attention_biases(self, config) -> tuple[bool, bool]:
        """(qkv_proj has bias, o_proj has bias): `attention_bias` covers all four by default."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden_states)
