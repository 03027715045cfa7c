"""Shared blocks of decoder-only transformers (Qwen3, Qwen2, Llama, Mistral; Gemma 3 builds on
them): attention with optional q/k RMSNorm, qkv bias and a sliding window per layer kind
(`layer_types`), gated MLP, pre-norm layers, and the causal-LM wrapper. Every layer
gets its module prefix (the checkpoint's names) and the quantization config, which picks how its
weights are held; each decoder layer asks the model for its MLP (make_mlp), so a model can put
another block (a sparse MoE) in some layers."""
from collections.abc import Callable, Iterable

import torch
from torch import nn

from nanovllm.layers.activation import SiluAndMul, gated_activation
from nanovllm.kernels.cpu_structs import Linear
from nanovllm.layers.attention import Attention
from nanovllm.layers.c_description import CDescriber, CModel, CPart, NotInC, Phases, describe, describes, pointer
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


LAYER_TYPES = ("full_attention", "sliding_attention")


def layer_type_of(config, layer_idx: int) -> str:
    """The attention kind of a layer: config.layer_types' entry (Gemma 3, GPT-OSS, Qwen2 and the
    5.x configs of every family), else a window on every layer where sliding_window is set and
    not switched off (Mistral)."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        if len(types) != config.num_hidden_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {config.num_hidden_layers} layers")
        kind = types[layer_idx]
        if kind not in LAYER_TYPES:
            raise ValueError(f"layer_types[{layer_idx}] is {kind!r}, not a layer type this engine runs {LAYER_TYPES}")
        return kind
    window = getattr(config, "sliding_window", None)
    return "sliding_attention" if window and getattr(config, "use_sliding_window", True) else "full_attention"


def sliding_window_of(config, layer_idx: int) -> int | None:
    """The layer's window in tokens (a query sees the last `window` keys up to itself), or None."""
    if layer_type_of(config, layer_idx) != "sliding_attention":
        return None
    window = getattr(config, "sliding_window", None)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"layer {layer_idx} is a sliding_attention layer, but sliding_window is {window!r} "
                         "(it must be a positive number of tokens)")
    context = getattr(config, "max_position_embeddings", None)
    if isinstance(context, int) and window > context:
        raise ValueError(f"layer {layer_idx} is a sliding_attention layer, but sliding_window {window} is larger than "
                         f"the model's context (max_position_embeddings {context}): such a window never slides; "
                         "give a smaller one, or full_attention layers")
    return window


def build_rope(config, layer_type: str | None = None) -> RotaryEmbedding:
    """The rotary embedding, over the first partial_rotary_factor of each head (1: all of it)."""
    theta, scaling = rope_settings(config, layer_type)
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
    head_dim = head_dim_of(config)
    return get_rope(head_dim, int(head_dim * factor), config.max_position_embeddings, theta, scaling)


class DecoderAttention(nn.Module):
    """q/k/v projections, optional q/k norm (norm: its class), rotary embedding, paged attention
    (scale: head_dim ** -0.5 unless given; sliding_window: None for full attention; logit_softcap:
    Gemma 2's cap on the scores), o projection."""

    def __init__(self, config, qkv_bias: bool, o_bias: bool, use_qk_norm: bool,
                 rotary_emb: RotaryEmbedding | None = None, quant_config: QuantizationConfig | None = None,
                 prefix: str = "", sliding_window: int | None = None, scale: float | None = None,
                 norm: type[RMSNorm] = RMSNorm, logit_softcap: float | None = None):
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
        self.use_rope = True  # False: a NoPE layer (SmolLM3's), whose q and k keep their positions out
        self.attn = Attention(self.num_heads, self.head_dim, scale or self.head_dim ** -0.5, self.num_kv_heads,
                              sliding_window, logit_softcap)
        self.use_qk_norm = use_qk_norm
        if use_qk_norm:
            self.q_norm = norm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = norm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v)
        return self.o_proj(o.flatten(1, -1))


class GatedMLP(nn.Module):
    """down(act(gate x) * up x), of config.intermediate_size unless intermediate_size is given (a
    mixture of experts' shared expert); act: config.hidden_activation (Gemma) or hidden_act."""

    def __init__(self, config, quant_config: QuantizationConfig | None = None, prefix: str = "",
                 intermediate_size: int | None = None):
        super().__init__()
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        bias = getattr(config, "mlp_bias", False)
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size] * 2, bias=bias,
                                                       quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=bias,
                                           quant_config=quant_config, prefix=f"{prefix}.down_proj")
        self.act_fn = gated_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


# make_mlp(config, layer_idx, prefix, quant_config) -> the layer's MLP module
MakeMLP = Callable[[object, int, str, QuantizationConfig | None], nn.Module]


def gated_mlp(config, layer_idx: int, prefix: str, quant_config: QuantizationConfig | None) -> nn.Module:
    return GatedMLP(config, quant_config, prefix)


def layer_ropes(config) -> list[RotaryEmbedding]:
    """Each layer's rotary embedding: one per layer kind where rope_parameters are given per kind
    (Gemma 3: another theta for sliding layers), else one for all."""
    kinds = [layer_type_of(config, i) for i in range(config.num_hidden_layers)]
    params = getattr(config, "rope_parameters", None) or {}
    per_kind = any(isinstance(params.get(kind), dict) for kind in LAYER_TYPES)
    ropes = {kind: build_rope(config, kind if per_kind else None) for kind in (set(kinds) if per_kind else {None})}
    return [ropes[kind if per_kind else None] for kind in kinds]


class PreNormLayer(nn.Module):
    """A pre-norm layer: input_layernorm, the layer's mixer (mix: attention, or a hybrid's linear
    attention, convolution or Mamba-2 mixer), post_attention_layernorm, mlp; the residual stream
    carried by the fused add-and-norm. branch_scale: each branch's multiplier as it joins the stream
    (Granite's residual_multiplier; 1 elsewhere)."""

    branch_scale = 1.0

    def mix(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            hidden_states, residual = self.input_layernorm(hidden_states), hidden_states
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.mix(positions, hidden_states)
        if self.branch_scale != 1.0:
            hidden_states = hidden_states * self.branch_scale
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return (hidden_states if self.branch_scale == 1.0 else hidden_states * self.branch_scale), residual


class LayerStack(nn.Module):
    """The model body: embed_tokens, the layers (each (positions, hidden, residual) -> (hidden,
    residual)), the final norm. embed: a family's own embedding (a scale) where it has one."""

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self.embed(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class DecoderLayer(PreNormLayer):
    def __init__(self, config, layer_idx: int, qkv_bias: bool, o_bias: bool, use_qk_norm: bool,
                 rotary_emb: RotaryEmbedding | None = None, quant_config: QuantizationConfig | None = None,
                 prefix: str = "", make_mlp: MakeMLP = gated_mlp):
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = DecoderAttention(config, qkv_bias, o_bias, use_qk_norm, rotary_emb, quant_config,
                                          f"{prefix}.self_attn", sliding_window_of(config, layer_idx))
        self.mlp = make_mlp(config, layer_idx, f"{prefix}.mlp", quant_config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def mix(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.self_attn(positions, hidden_states)


class DecoderModel(LayerStack):
    layer_class: type[nn.Module] = DecoderLayer  # a family's own layer (Gemma 3's four norms)
    norm_class: type[RMSNorm] = RMSNorm

    def __init__(self, config, qkv_bias: bool, o_bias: bool, use_qk_norm: bool,
                 quant_config: QuantizationConfig | None = None, prefix: str = "model", make_mlp: MakeMLP = gated_mlp):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, quant_config,
                                                   f"{prefix}.embed_tokens")
        # NOTE: one cos/sin cache shared by all layers of a kind; per-layer copies of a 128k-position
        # cache (Llama 3.1) would cost gigabytes.
        ropes = layer_ropes(config)
        self.layers = nn.ModuleList(self.layer_class(config, i, qkv_bias, o_bias, use_qk_norm, ropes[i],
                                                     quant_config, f"{prefix}.layers.{i}", make_mlp)
                                    for i in range(config.num_hidden_layers))
        self.norm = self.norm_class(config.hidden_size, eps=config.rms_norm_eps)


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
    model_class: type[DecoderModel] = DecoderModel

    def __init__(self, config, quant_config: QuantizationConfig | None = None):
        super().__init__()
        qkv_bias, o_bias = self.attention_biases(config)
        self.model = self.model_class(config, qkv_bias, o_bias, self.use_qk_norm, quant_config, "model",
                                      self.make_mlp)
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


# ---- how these blocks describe themselves to the CPU's C decode step (layers/c_description.py) ----
def attention_part(a: nn.Module, c: CDescriber, gated: bool = False) -> CPart:
    """An attention block's part (this file's DecoderAttention; gated: the hybrids' GatedAttention,
    its output gated, its q and k always normed): projections, q/k norms, heads and rotary cache, over
    its Attention's own part."""
    qkv, o = c.linear(a.qkv_proj, "its qkv_proj"), c.linear(a.o_proj, "its o_proj")
    fields = {"qkv": qkv or Linear(), "o": o or Linear(), "attn_gate": int(gated),
              "no_rope": int(not getattr(a, "use_rope", True))}
    if gated or a.use_qk_norm:
        fields |= {"q_norm": c.norm(a.q_norm, "its q_norm"), "k_norm": c.norm(a.k_norm, "its k_norm")}
    cos_sin = a.rotary_emb.cos_sin_cache
    model = {"num_heads": a.num_heads, "num_kv_heads": a.num_kv_heads, "head_dim": a.head_dim,
             "rotary_dim": a.rotary_emb.rotary_dim, "cos_sin": pointer(cos_sin)}
    own = CPart(fields, in_c=qkv is not None and o is not None, one_call_only=gated, model_fields=model,
                max_position=cos_sin.shape[0],
                phases=Phases(qkv=a.qkv_proj, o=a.o_proj, attention=a.attn, q_size=a.q_size, kv_size=a.kv_size,
                              head_dim=a.head_dim))
    return describe(a.attn, c, "its paged attention").merged(own)


describes(DecoderAttention)(attention_part)


@describes(GatedMLP)
def _c_gated_mlp(mlp: GatedMLP, c: CDescriber) -> CPart:
    if not isinstance(mlp.act_fn, SiluAndMul):
        raise NotInC(f"its activation is {type(mlp.act_fn).__name__}, not SiLU (the C step's)")
    gate_up, down = c.linear(mlp.gate_up_proj, "its gate_up_proj"), c.linear(mlp.down_proj, "its down_proj")
    return CPart({"gate_up": gate_up or Linear(), "down": down or Linear()},
                 in_c=gate_up is not None and down is not None,
                 phases=Phases(gate_up=mlp.gate_up_proj, down=mlp.down_proj, mlp=mlp))


def pre_norm_layer_part(layer: nn.Module, mixer: nn.Module, c: CDescriber) -> CPart:
    """A pre-norm layer's part (input norm, mixer, post-attention norm, MLP: this file's
    DecoderLayer and the hybrids'). An MLP the C step cannot run (no description, another
    activation) runs whole through its module, between the C phases of the layer."""
    norms = CPart({"input_norm": c.norm(layer.input_layernorm, "its input_layernorm"),
                   "post_norm": c.norm(layer.post_attention_layernorm, "its post_attention_layernorm")})
    try:
        mlp = describe(layer.mlp, c, "its MLP")
    except NotInC:
        mlp = CPart(in_c=False, phases=Phases(mlp=layer.mlp))
    return norms.merged(describe(mixer, c, "its attention"), mlp)


@describes(DecoderLayer)
def _c_decoder_layer(layer: DecoderLayer, c: CDescriber) -> CPart:
    return pre_norm_layer_part(layer, layer.self_attn, c)


@describes(DecoderForCausalLM, subclasses=True)
def _c_causal_lm(model: DecoderForCausalLM, c: CDescriber) -> CModel:
    """Its layers, final norm, embedding and head, where the logits are the head's alone and the
    embedding is the table's rows (no family's own scaling)."""
    name = type(model).__name__
    if type(model).compute_logits is not DecoderForCausalLM.compute_logits:
        raise NotInC(f"{name}'s logits are not its head's alone (its own compute_logits: a soft cap, a scale)")
    inner = model.model
    if getattr(type(inner), "embed", LayerStack.embed) is not LayerStack.embed:
        raise NotInC(f"{name}'s embedding is not the table's rows (its own embed: a scale)")
    return CModel(list(inner.layers), inner.norm, inner.embed_tokens, model.lm_head)
