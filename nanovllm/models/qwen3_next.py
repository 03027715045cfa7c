"""Qwen3-Next and Qwen3.5 (text: Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM): hybrids of Gated
DeltaNet linear attention (layers/gated_deltanet.py; its state in a slot per sequence) and full
attention (`layer_types`: three linear layers of every four by default), the full layers with an
output gate (q_proj gives each head's query and gate), q/k norms and a partial rotary embedding (a
quarter of each head); (1 + w) RMSNorms throughout; Qwen3-Next and Qwen3.5-MoE with the sparse MoE
block and its shared expert. Qwen3-Next's checkpoints interleave q/k/v/z and b/a per key head
(in_proj_qkvz, in_proj_ba): re-cut at load into Qwen3.5's separate projections."""
from collections.abc import Iterable

import torch
from torch import nn

from nanovllm.distributed.parallel import get_tp_size
from nanovllm.layers.attention import Attention
from nanovllm.layers.gated_deltanet import GatedDeltaNet
from nanovllm.layers.layernorm import GemmaRMSNorm
from nanovllm.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from nanovllm.layers.quantization.base import QuantizationConfig
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.loader.weights import load_weights
from nanovllm.layers.c_description import CDescriber, CPart, describes
from nanovllm.models.decoder import (DecoderForCausalLM, LayerStack, PreNormLayer, attention_part, build_rope,
                                     gated_mlp, head_dim_of, pre_norm_layer_part)
from nanovllm.models.qwen_moe import MoeMixin

LINEAR, FULL = "linear_attention", "full_attention"


def hybrid_layer_types(config) -> list[str]:
    """Each layer's kind from layer_types (or every full_attention_interval-th layer full, else 4)."""
    types = getattr(config, "layer_types", None)
    if types is None:
        interval = int(getattr(config, "full_attention_interval", 4) or 4)
        types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(config.num_hidden_layers)]
    types = list(types)
    if len(types) != config.num_hidden_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {config.num_hidden_layers} layers")
    for i, kind in enumerate(types):
        if kind not in (LINEAR, FULL):
            raise ValueError(f"layer_types[{i}] is {kind!r}, not a layer type this model runs ({LINEAR!r}, {FULL!r})")
    return types


class GatedAttention(nn.Module):
    """Full attention whose output is gated per channel by sigmoid(gate), the gate coming from
    q_proj beside each head's query ([q_h | gate_h] per head: 2 x heads "heads" to the stacked
    projection, so tensor parallelism keeps each pair on one rank)."""

    def __init__(self, config, rotary_emb, quant_config: QuantizationConfig | None, prefix: str):
        super().__init__()
        self.head_dim = head_dim_of(config)
        total_heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, 2 * total_heads, kv_heads, bias=bias,
                                          quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.num_heads = self.qkv_proj.num_heads // 2
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, config.hidden_size, bias=bias,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.rotary_emb = rotary_emb
        self.q_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5, self.num_kv_heads)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qg, k, v = self.qkv_proj(hidden_states).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        qg = qg.view(-1, self.num_heads, 2, self.head_dim)
        q, gate = qg[:, :, 0], qg[:, :, 1]
        q = self.q_norm(q.contiguous())
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim))
        q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v.reshape(-1, self.num_kv_heads, self.head_dim)).flatten(1, -1)
        return self.o_proj(o * torch.sigmoid(gate.flatten(1, -1)))


class HybridLayer(PreNormLayer):
    def __init__(self, config, layer_idx: int, kind: str, rotary_emb, quant_config, prefix: str, make_mlp):
        super().__init__()
        self.kind = kind
        if kind == LINEAR:
            self.linear_attn = GatedDeltaNet(config, quant_config, f"{prefix}.linear_attn")
        else:
            self.self_attn = GatedAttention(config, rotary_emb, quant_config, f"{prefix}.self_attn")
        self.mlp = make_mlp(config, layer_idx, f"{prefix}.mlp", quant_config)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def mix(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.linear_attn(hidden_states) if self.kind == LINEAR else self.self_attn(positions, hidden_states)


@describes(GatedAttention)
def _c_gated_attention(a: GatedAttention, c: CDescriber) -> CPart:
    return attention_part(a, c, gated=True)


@describes(HybridLayer)
def _c_hybrid_layer(layer: HybridLayer, c: CDescriber) -> CPart:
    return pre_norm_layer_part(layer, layer.linear_attn if layer.kind == LINEAR else layer.self_attn, c)


class HybridModel(LayerStack):
    def __init__(self, config, quant_config: QuantizationConfig | None, make_mlp, prefix: str = "model"):
        super().__init__()
        kinds = hybrid_layer_types(config)
        rope = build_rope(config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, quant_config,
                                                   f"{prefix}.embed_tokens")
        self.layers = nn.ModuleList(HybridLayer(config, i, kind, rope, quant_config, f"{prefix}.layers.{i}", make_mlp)
                                    for i, kind in enumerate(kinds))
        self.norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class Qwen3_5ForCausalLM(DecoderForCausalLM):
    """Qwen3.5 (text), dense MLPs."""

    packed_modules_mapping = {
        **DecoderForCausalLM.packed_modules_mapping,
        "in_proj_q": ("in_proj", 0), "in_proj_k": ("in_proj", 1), "in_proj_v": ("in_proj", 2),
        "in_proj_z": ("in_proj", 3), "in_proj_b": ("in_proj", 4), "in_proj_a": ("in_proj", 5),
    }

    def __init__(self, config, quant_config: QuantizationConfig | None = None):
        nn.Module.__init__(self)
        self.model = HybridModel(config, quant_config, self.make_mlp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=quant_config, prefix="lm_head")
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.tie_weights(self.model.embed_tokens)

    def make_mlp(self, config, layer_idx, prefix, quant_config):
        return gated_mlp(config, layer_idx, prefix, quant_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self.renamed(weights))

    def renamed(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """Checkpoint names as this model's: the multimodal checkpoints' text under model.language_model;
        the vision tower and the MTP head (its own model: MtpHeadMixin) skipped; in_proj_qkv cut
        into its q, k and v rows (each split over the ranks on its own)."""
        attn = next(m for m in self.modules() if isinstance(m, GatedDeltaNet))
        key_total = attn.key_dim * get_tp_size()
        for name, tensor in self.checkpoint_names(weights):
            if name.endswith(".in_proj_qkv.weight"):
                base = name[: -len("qkv.weight")]
                for part, rows in zip("qkv", tensor.split([key_total, key_total, tensor.shape[0] - 2 * key_total])):
                    yield f"{base}{part}.weight", rows
            else:
                yield name, tensor

    def checkpoint_names(self, weights: Iterable[tuple[str, torch.Tensor]]):
        for name, tensor in weights:
            if name.startswith(("model.visual.", "mtp.", "model.mtp.")):
                continue
            yield name.replace("model.language_model.", "model.", 1), tensor


class Qwen3_5MoeForCausalLM(MoeMixin, Qwen3_5ForCausalLM):
    """Qwen3.5-MoE (text): the sparse block with a shared expert in every sparse layer; its router
    always renormalizes the top-k (the config has no norm_topk_prob)."""

    def shared_expert_size(self, config) -> int:
        return int(getattr(config, "shared_expert_intermediate_size", 0) or 0)

    def renormalize(self, config) -> bool:
        return bool(getattr(config, "norm_topk_prob", True))


class Qwen3NextForCausalLM(Qwen3_5MoeForCausalLM):
    """Qwen3-Next: Qwen3.5-MoE's layers with the linear projections interleaved per key head."""

    def checkpoint_names(self, weights: Iterable[tuple[str, torch.Tensor]]):
        attn = next(m for m in self.modules() if isinstance(m, GatedDeltaNet))
        nk, dk, dv = attn.num_k_heads * get_tp_size(), attn.dk, attn.dv
        r = attn.num_v_heads // attn.num_k_heads
        for name, tensor in super().checkpoint_names(weights):
            if name.endswith(".in_proj_qkvz.weight"):
                q, k, v, z = tensor.unflatten(0, (nk, -1)).split([dk, dk, r * dv, r * dv], dim=1)
                base = name[: -len("in_proj_qkvz.weight")]
                yield base + "in_proj_qkv.weight", torch.cat([x.flatten(0, 1) for x in (q, k, v)])
                yield base + "in_proj_z.weight", z.flatten(0, 1)
            elif name.endswith(".in_proj_ba.weight"):
                b, a = tensor.unflatten(0, (nk, -1)).split([r, r], dim=1)
                base = name[: -len("in_proj_ba.weight")]
                yield base + "in_proj_b.weight", b.flatten(0, 1)
                yield base + "in_proj_a.weight", a.flatten(0, 1)
            else:
                yield name, tensor


def mtp_layer_count(config) -> int:
    """Layers of a checkpoint's multi-token-prediction head (Qwen3.5's mtp_num_hidden_layers, or
    num_nextn_predict_layers as vLLM names it); 0 where it has none."""
    for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        n = getattr(config, key, None)
        if n is not None:
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"{key} must be an int >= 0, got {n!r}")
            return n
    return 0


class MultiTokenPredictor(nn.Module):
    """The MTP head: from the target's final (normed) hidden state at position i and the token at
    i + 1, the hidden state that predicts the token at i + 2: fc([norm_e(embed(t)) | norm_h(h)]), then
    full-attention layers of the family's kind (gated attention; the MLP or MoE block of its layer
    index, counted after the target's layers), then a final norm; the target's head gives the logits."""

    def __init__(self, config, quant_config: QuantizationConfig | None, make_mlp, prefix: str = "model"):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        rope = build_rope(config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, quant_config, f"{prefix}.embed_tokens")
        self.pre_fc_norm_embedding = GemmaRMSNorm(hidden, eps=eps)
        self.pre_fc_norm_hidden = GemmaRMSNorm(hidden, eps=eps)
        self.fc = ReplicatedLinear(2 * hidden, hidden, quant_config=quant_config, prefix=f"{prefix}.fc")
        first = config.num_hidden_layers
        self.layers = nn.ModuleList(HybridLayer(config, first + i, FULL, rope, quant_config, f"{prefix}.layers.{i}",
                                                make_mlp) for i in range(mtp_layer_count(config)))
        self.norm = GemmaRMSNorm(hidden, eps=eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor,
                step: int = 0) -> torch.Tensor:
        """input_ids [n] (the tokens after those hidden_states [n, hidden] came from), positions [n]
        (theirs); step: which of the head's layers (one per proposed token, cycling)."""
        x = torch.cat([self.pre_fc_norm_embedding(self.embed_tokens(input_ids)),
                       self.pre_fc_norm_hidden(hidden_states)], dim=-1)
        x, residual = self.layers[step % len(self.layers)](positions, self.fc(x), None)
        x, _ = self.norm(x, residual)
        return x


class MtpHeadMixin:
    """A hybrid family's MTP head as a model of its own, for a speculative proposer to build beside
    the target (spec_decode/proposer.py; vLLM's Qwen3NextMTP): it loads the checkpoint's `mtp.*`
    tensors with the token embedding and the head, and skips the rest. The target skips `mtp.*`, so
    its weights are held only where a proposer asks for them."""

    def __init__(self, config, quant_config: QuantizationConfig | None = None):
        nn.Module.__init__(self)
        if mtp_layer_count(config) == 0:
            raise ValueError("this checkpoint has no MTP head (mtp_num_hidden_layers is 0 or missing)")
        self.model = MultiTokenPredictor(config, quant_config, self.make_mlp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=quant_config, prefix="lm_head")
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.tie_weights(self.model.embed_tokens)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_weights(self, self.head_names(weights), self.stacked_params())

    @staticmethod
    def head_names(weights: Iterable[tuple[str, torch.Tensor]]):
        embed = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")
        for name, tensor in weights:
            for prefix in ("mtp.", "model.mtp."):
                if name.startswith(prefix):
                    yield "model." + name[len(prefix):], tensor
                    break
            else:
                if name in embed:
                    yield "model.embed_tokens.weight", tensor
                elif name == "lm_head.weight":
                    yield name, tensor

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor,
                step: int = 0) -> torch.Tensor:
        return self.model(input_ids, positions, hidden_states, step)


class Qwen3_5MTP(MtpHeadMixin, Qwen3_5ForCausalLM):
    """Qwen3.5's MTP head (dense MLP)."""


class Qwen3_5MoeMTP(MtpHeadMixin, Qwen3_5MoeForCausalLM):
    """Qwen3.5-MoE's MTP head (its layer the sparse block with the shared expert)."""


class Qwen3NextMTP(MtpHeadMixin, Qwen3NextForCausalLM):
    """Qwen3-Next's MTP head: its attention projections are separate q/k/v as in its full layers."""
