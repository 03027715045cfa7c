"""What each model family's GGUF files name and state their own way (llama.cpp's conventions):
the tensor names under their HuggingFace names, and the settings read from a file's metadata
beyond the common ones (loader/gguf.py's GGUFFile.hf_config builds the common ones and calls
family_config). The hybrid linear-attention families have a module of their own, gguf_hybrid.py."""
import re

import torch

from nanovllm.loader import gguf_hybrid

# The files whose q / k rows llama.cpp's converter permuted for its rotation (its LlamaModel and the
# families built on it): read back in HF order.
PERMUTED_QK = {"llama", "smollm3", "granitehybrid"}
# Gemma files (llama.cpp's conventions): norms stored as 1 + w; the norm before the MLP is ffn_norm,
# the ones after attention and the MLP have their own names; every `pattern`-th layer is full
# attention, the others slide (llama.cpp's set_swa_pattern), with sliding layers' rope base 10000.
GEMMA = {"gemma2": dict(pattern=2, local_theta=None, large_layers=46),
         "gemma3": dict(pattern=6, local_theta=10000.0, large_layers=62)}
_GEMMA_LAYER_NAMES = {"ffn_norm.weight": "pre_feedforward_layernorm.weight",
                      "post_attention_norm.weight": "post_attention_layernorm.weight",
                      "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
# GPT-OSS files (llama.cpp's gpt-oss): the norm before the MLP is post_attention_norm, the router
# ffn_gate_inp with a bias, each head's sink logit attn_sinks, the experts' biases stacked [E, rows];
# every other layer slides (the even ones: swa_layer_types with a pattern of 2); its clamped SwiGLU's
# constants are llama.cpp's (and the model card's), not in the file.
_GPT_OSS_LAYER_NAMES = {"post_attention_norm.weight": "post_attention_layernorm.weight",
                        "attn_sinks.weight": "self_attn.sinks",
                        "ffn_gate_inp.weight": "mlp.router.weight", "ffn_gate_inp.bias": "mlp.router.bias",
                        "ffn_gate_exps.bias": "mlp.experts.gate_proj.bias", "ffn_up_exps.bias": "mlp.experts.up_proj.bias",
                        "ffn_down_exps.bias": "mlp.experts.down_proj.bias"}
GPT_OSS_SWIGLU = dict(swiglu_alpha=1.702, swiglu_limit=7.0)
# GLM-4.5 files (llama.cpp's glm4moe): the norm before the MLP is post_attention_norm, the router's
# correction bias exp_probs_b, the shared experts *_shexp (one MLP), the MTP layers (nextn) last.
_GLM_LAYER_NAMES = {"post_attention_norm.weight": "post_attention_layernorm.weight",
                    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
                    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
                    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
                    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight"}
# LFM2 files (llama.cpp's lfm2 / lfm2moe): the short convolutions shortconv.*, the final norm
# token_embd_norm, the router's bias exp_probs_b; a layer's kind from its head_count_kv entry (0: a
# short convolution); the dense MLP's width as adjusted (feed_forward_length).
LFM2 = {"lfm2": "Lfm2ForCausalLM", "lfm2moe": "Lfm2MoeForCausalLM"}
_LFM2_LAYER_NAMES = {"shortconv.conv.weight": "conv.conv.weight", "shortconv.in_proj.weight": "conv.in_proj.weight",
                     "shortconv.out_proj.weight": "conv.out_proj.weight",
                     "exp_probs_b.bias": "mlp.experts.e_score_correction_bias"}
# Granite 4.0-H files (llama.cpp's granitehybrid): the Mamba-2 mixers ssm_* (A stored as -exp(A_log),
# in_proj whole: cut into its z, x, B, C and dt rows in the file's index), the shared MLP as *_shexp
# beside experts or as the plain ffn_* without; each layer's kind from its head_count_kv entry (0: Mamba-2).
# Falcon-H1 files (falcon-h1): a Mamba-2 mixer and attention in every layer, the muP multipliers
# folded into the weights by the converter; its mixer's norm where ssm_norm is given (after the gate,
# as llama.cpp runs it).
GRANITE_HYBRID, FALCON_H1 = "granitehybrid", "falcon-h1"
MAMBA2_ARCHS = (GRANITE_HYBRID, FALCON_H1)
_MAMBA2_LAYER_NAMES = {"ssm_in.weight": "mamba.in_proj.weight", "ssm_conv1d.weight": "mamba.conv1d.weight",
                       "ssm_conv1d.bias": "mamba.conv1d.bias", "ssm_dt.bias": "mamba.dt_bias", "ssm_a": "mamba.A_log",
                       "ssm_d": "mamba.D", "ssm_norm.weight": "mamba.norm.weight", "ssm_out.weight": "mamba.out_proj.weight"}
_GRANITE_LAYER_NAMES = {**_MAMBA2_LAYER_NAMES, **{f"ffn_{part}{suffix}.weight": f"mlp.shared_mlp.{part}_proj.weight"
                                                  for part in ("gate", "up", "down") for suffix in ("", "_shexp")}}
# The architectures whose files end in an MTP head's layers that the model itself does not run
# (nextn_predict_layers; the hybrids' are read as their MTP head, gguf_hybrid.py).
MTP_LAST = {"glm4moe"}
# llama.cpp renormalizes the chosen experts' weights for qwen3moe and not for qwen2moe (its
# build_moe_ffn's norm_w); the files carry no key for it.
NORM_TOPK = {"qwen2moe": False, "qwen3moe": True, "qwen35moe": True, "qwen3next": True}
MIXTRAL = "MixtralForCausalLM"
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight", "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # mixture of experts: the router, the experts stacked in 3-D tensors [experts, rows, columns]
    # (yielded expert by expert), Qwen2-MoE's shared expert and its gate
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight", "ffn_up_exps.weight": "mlp.experts.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
# The layer names of the architectures whose files name some tensors their own way.
_ARCH_LAYER_NAMES = {**{a: {**_LAYER_NAMES, **_GEMMA_LAYER_NAMES} for a in GEMMA},
                     "gpt-oss": {**_LAYER_NAMES, **_GPT_OSS_LAYER_NAMES},
                     "glm4moe": {**_LAYER_NAMES, **_GLM_LAYER_NAMES},
                     **{a: {**_LAYER_NAMES, **_LFM2_LAYER_NAMES} for a in LFM2},
                     GRANITE_HYBRID: {**_LAYER_NAMES, **_GRANITE_LAYER_NAMES},
                     FALCON_H1: {**_LAYER_NAMES, **_MAMBA2_LAYER_NAMES,
                                 "ffn_norm": "post_attention_layernorm.weight"},  # (no .weight in its files)
                     **{a: {**_LAYER_NAMES, **gguf_hybrid.LAYER_NAMES} for a in gguf_hybrid.ARCHITECTURES}}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_ARCH_GLOBAL_NAMES = {a: {**_GLOBAL_NAMES, "token_embd_norm.weight": "model.norm.weight"} for a in LFM2}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "smollm3": "SmolLM3ForCausalLM", "glm4moe": "Glm4MoeForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "gpt-oss": "GptOssForCausalLM",
                 GRANITE_HYBRID: "GraniteMoeHybridForCausalLM", FALCON_H1: "FalconH1ForCausalLM", **LFM2,
                 **gguf_hybrid.ARCHITECTURES}
LAYER = re.compile(r"blk\.(\d+)\.(.+)")


def swa_layer_types(window: int | None, layers: int, pattern: int) -> list[str]:
    """llama.cpp's set_swa_pattern: every `pattern`-th layer full attention, the others sliding
    (all full without a window)."""
    return ["full_attention" if not window or (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]


def hf_name(name: str, arch: str = "llama") -> str | None:
    """The HuggingFace parameter name of a GGUF tensor name, or None for one the model lacks."""
    globals_ = _ARCH_GLOBAL_NAMES.get(arch, _GLOBAL_NAMES)
    if name in globals_:
        return globals_[name]
    match = LAYER.fullmatch(name)
    names = _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES)
    if match and match.group(2) in names:
        return f"model.layers.{match.group(1)}.{names[match.group(2)]}"
    return None


def gemma_config(file, a: str, kwargs: dict) -> dict:
    """A Gemma file's settings as llama.cpp reads them (its gemma2 / gemma3 graphs)."""
    rules, layers = GEMMA[a], kwargs["num_hidden_layers"]
    window = file.field(f"{a}.attention.sliding_window", None)
    kinds = swa_layer_types(window, layers, rules["pattern"])
    # llama.cpp scales queries by 1/sqrt(head_dim), by 1/sqrt(hidden / heads) for the 27B models
    scalar = (kwargs["hidden_size"] // kwargs["num_attention_heads"] if layers == rules["large_layers"]
              else kwargs["head_dim"])
    out = dict(hidden_activation="gelu_pytorch_tanh", layer_types=kinds, sliding_window=window,
               query_pre_attn_scalar=scalar, tie_word_embeddings=True,
               final_logit_softcapping=file.field(f"{a}.final_logit_softcapping", None),
               attn_logit_softcapping=file.field(f"{a}.attn_logit_softcapping", None))
    if rules["local_theta"] is not None:
        theta = kwargs.pop("rope_theta")
        out["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": theta},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": rules["local_theta"]}}
    return out


def gpt_oss_config(file, a: str, kwargs: dict) -> dict:
    """A gpt-oss file's settings: experts, alternating windows, YaRN as the HF config states it."""
    window = file.field(f"{a}.attention.sliding_window", None)
    out = dict(num_local_experts=int(file.field(f"{a}.expert_count")),
               num_experts_per_tok=int(file.field(f"{a}.expert_used_count")),
               sliding_window=window, attention_bias=True, **GPT_OSS_SWIGLU,
               layer_types=swa_layer_types(window, kwargs["num_hidden_layers"], 2))
    if file.field(f"{a}.rope.scaling.type", None) == "yarn":
        out["rope_parameters"] = {
            "rope_type": "yarn", "rope_theta": kwargs.pop("rope_theta"),
            "factor": float(file.field(f"{a}.rope.scaling.factor")),
            "original_max_position_embeddings": int(file.field(f"{a}.rope.scaling.original_context_length")),
            "beta_fast": float(file.field(f"{a}.rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(file.field(f"{a}.rope.scaling.yarn_beta_slow", 1.0)), "truncate": False}
    return out


def moe_config(file, a: str, layers: int) -> dict:
    """A MoE file's expert settings; the layers without expert tensors are dense (mlp_only_layers)."""
    sparse = [i for i in range(layers) if f"model.layers.{i}.mlp.experts.gate_proj.weight" in file.tensors]
    if not sparse:
        raise ValueError(f"{file.path!r}: a {a} file without expert tensors (blk.N.ffn_gate_exps)")
    experts = file.tensors[f"model.layers.{sparse[0]}.mlp.experts.gate_proj.weight"].shape
    out = dict(num_experts=int(file.field(f"{a}.expert_count")),
               num_experts_per_tok=int(file.field(f"{a}.expert_used_count")),
               moe_intermediate_size=int(file.field(f"{a}.expert_feed_forward_length", experts[1])),
               norm_topk_prob=NORM_TOPK.get(a, True), decoder_sparse_step=1,
               mlp_only_layers=[i for i in range(layers) if i not in sparse])
    if experts[0] != out["num_experts"]:
        raise ValueError(f"{file.path!r}: expert tensors hold {experts[0]} experts, {a}.expert_count says "
                         f"{out['num_experts']}")
    gating = file.field(f"{a}.expert_gating_func", None)
    if gating not in (None, 1):  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise ValueError(f"{file.path!r}: MoE router option {a}.expert_gating_func={gating} is not supported "
                         "(only 1, softmax)")
    if a in ("qwen2moe", "qwen35moe", "qwen3next"):
        shared = file.tensors.get(f"model.layers.{sparse[0]}.mlp.shared_expert.gate_proj.weight")
        out["shared_expert_intermediate_size"] = int(file.field(
            f"{a}.expert_shared_feed_forward_length", shared.shape[0] if shared is not None else 0))
    return out


def glm4moe_config(file, a: str, kwargs: dict) -> dict:
    """A GLM-4.5 file's settings: DeepSeek-V3's router (sigmoid gating, groups, scale), the shared
    experts, the leading dense layers, q/k norms where the file holds them, the rotary share."""
    gating = file.field(f"{a}.expert_gating_func", 2)
    if gating != 2:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
        raise ValueError(f"{file.path!r}: {a}.expert_gating_func={gating} is not supported (GLM-4.5's is 2, sigmoid)")
    rotary = int(file.field(f"{a}.rope.dimension_count", kwargs["head_dim"]))
    return dict(n_routed_experts=int(file.field(f"{a}.expert_count")),
                num_experts_per_tok=int(file.field(f"{a}.expert_used_count")),
                moe_intermediate_size=int(file.field(f"{a}.expert_feed_forward_length")),
                n_shared_experts=int(file.field(f"{a}.expert_shared_count", 0)),
                first_k_dense_replace=int(file.field(f"{a}.leading_dense_block_count", 0)),
                n_group=int(file.field(f"{a}.expert_group_count", 1) or 1),
                topk_group=int(file.field(f"{a}.expert_group_used_count", 1) or 1),
                routed_scaling_factor=float(file.field(f"{a}.expert_weights_scale", 1.0)),
                norm_topk_prob=bool(file.field(f"{a}.expert_weights_norm", True)),
                use_qk_norm="model.layers.0.self_attn.q_norm.weight" in file.tensors,
                partial_rotary_factor=rotary / kwargs["head_dim"])


def layer_kinds(file, a: str, layers: int, stateful: str, attention: str) -> list[str]:
    """Each layer's kind where a file gives its KV heads per layer (LFM2's, Granite 4.0-H's): a 0 entry
    is a layer without attention (stateful), any other an attention layer."""
    kv = file.field(f"{a}.attention.head_count_kv")
    return [stateful if n == 0 else attention for n in (kv if isinstance(kv, list) else [kv] * layers)][:layers]


def lfm2_config(file, a: str, kwargs: dict) -> dict:
    """An LFM2 file's settings: each layer's kind, the convolution's taps, LFM2-MoE's experts (a
    sigmoid router with the bias in its choice, renormalized; expert_weights_scale where given)."""
    if file.field(f"{a}.attention.sliding_window", 0):
        raise ValueError(f"{file.path!r}: an {a} file with sliding-window attention layers is not supported")
    kinds = layer_kinds(file, a, kwargs["num_hidden_layers"], "conv", "full_attention")
    out = dict(layer_types=kinds, conv_L_cache=int(file.field(f"{a}.shortconv.l_cache")),
               block_auto_adjust_ff_dim=False, norm_eps=kwargs["rms_norm_eps"])
    if a == "lfm2moe":
        gating = file.field(f"{a}.expert_gating_func", 2)
        if gating != 2:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
            raise ValueError(f"{file.path!r}: {a}.expert_gating_func={gating} is not supported (LFM2-MoE's is 2, sigmoid)")
        out.update(num_experts=int(file.field(f"{a}.expert_count")),
                   num_experts_per_tok=int(file.field(f"{a}.expert_used_count")),
                   moe_intermediate_size=int(file.field(f"{a}.expert_feed_forward_length")),
                   num_dense_layers=int(file.field(f"{a}.leading_dense_block_count", 0)),
                   routed_scaling_factor=float(file.field(f"{a}.expert_weights_scale", 0.0)) or 1.0,
                   norm_topk_prob=True)
    return out


def mamba2_config(file, a: str, first: int | None) -> dict:
    """A file's Mamba-2 shapes (ssm.*; first: a Mamba-2 layer's index, for its optional tensors)."""
    heads, inner = int(file.field(f"{a}.ssm.time_step_rank")), int(file.field(f"{a}.ssm.inner_size"))
    layer = f"model.layers.{first}.mamba"
    return dict(mamba_n_heads=heads, mamba_d_head=inner // heads, mamba_d_ssm=inner,
                mamba_n_groups=int(file.field(f"{a}.ssm.group_count")), mamba_d_state=int(file.field(f"{a}.ssm.state_size")),
                mamba_d_conv=int(file.field(f"{a}.ssm.conv_kernel")), mamba_conv_bias=f"{layer}.conv1d.bias" in file.tensors,
                mamba_proj_bias=False, projectors_bias=f"{layer}.out_proj.bias" in file.tensors,
                mamba_rms_norm=f"{layer}.norm.weight" in file.tensors, mamba_norm_before_gate=False)


def granite_hybrid_config(file, a: str, kwargs: dict) -> dict:
    """A Granite 4.0-H file's settings: each layer's mixer, the Mamba-2 shapes, Granite's multipliers,
    rotary only where the file asks for it (llama.cpp's rope.scaling.finetuned), the experts."""
    kinds = layer_kinds(file, a, kwargs["num_hidden_layers"], "mamba", "attention")
    experts = int(file.field(f"{a}.expert_count", 0) or 0)
    first = next((i for i, kind in enumerate(kinds) if kind == "mamba"), None)
    out = dict(layer_types=kinds, **mamba2_config(file, a, first), num_local_experts=experts,
               attention_multiplier=float(file.field(f"{a}.attention.scale", 0.0) or 0.0) or None,
               embedding_multiplier=float(file.field(f"{a}.embedding_scale", 1.0)),
               residual_multiplier=float(file.field(f"{a}.residual_scale", 1.0)),
               logits_scaling=float(file.field(f"{a}.logit_scale", 1.0)),
               position_embedding_type="rope" if file.field(f"{a}.rope.scaling.finetuned", False) else None)
    # (the experts' width is feed_forward_length, read as intermediate_size; the shared MLP's its own)
    out["shared_intermediate_size"] = int(file.field(f"{a}.expert_shared_feed_forward_length", kwargs["intermediate_size"]))
    if experts:
        out["num_experts_per_tok"] = int(file.field(f"{a}.expert_used_count"))
    return out


def is_mixtral(file) -> bool:
    """A llama file with experts (llama.cpp writes Mixtral as llama with ffn_*_exps tensors)."""
    return file.arch == "llama" and bool(file.field("llama.expert_count", 0))


def architecture(file) -> str:
    """The transformers architecture name of an opened file."""
    return MIXTRAL if is_mixtral(file) else ARCHITECTURES[file.arch]


def family_config(file, a: str, kwargs: dict) -> dict:
    """kwargs (the settings every family's file states alike) with architecture a's own added."""
    if a not in ("qwen2", "qwen2moe"):
        kwargs["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in file.tensors
    if a == "qwen2moe":
        kwargs["qkv_bias"] = "model.layers.0.self_attn.q_proj.bias" in file.tensors
    if a in NORM_TOPK or is_mixtral(file):
        kwargs.update(moe_config(file, a, kwargs["num_hidden_layers"]))
    if a in GEMMA:
        kwargs.update(gemma_config(file, a, kwargs))
    if a == "gpt-oss":
        kwargs.update(gpt_oss_config(file, a, kwargs))
    if a == "glm4moe":
        kwargs.update(glm4moe_config(file, a, kwargs))
    if a in LFM2:
        kwargs.update(lfm2_config(file, a, kwargs))
    if a == GRANITE_HYBRID:
        kwargs.update(granite_hybrid_config(file, a, kwargs))
    if a == FALCON_H1:
        kwargs.update(mamba2_config(file, a, 0))
    if a == "smollm3":  # the file states no NoPE layers: llama.cpp takes every 4th (n_no_rope_layer_step)
        kwargs["no_rope_layer_interval"] = 4
    if a in gguf_hybrid.ARCHITECTURES:
        kwargs.update(gguf_hybrid.hybrid_config(file, a, kwargs))
    if is_mixtral(file):  # llama.cpp's Mixtral: a llama file whose layers all hold experts
        kwargs["num_local_experts"] = kwargs.pop("num_experts")
        kwargs["intermediate_size"] = kwargs.pop("moe_intermediate_size")
        if kwargs.pop("mlp_only_layers"):
            raise ValueError(f"{file.path!r}: a llama MoE file whose layers do not all hold expert tensors")
        for key in ("norm_topk_prob", "decoder_sparse_step"):
            kwargs.pop(key)
    return kwargs


def split_rows(file, name: str, info) -> list:
    """(HF name, info) pairs of one file tensor: the parts of a tensor the model splits over ranks
    apart (the hybrids' attn_qkv, gguf_hybrid.split_rows; LFM2's in_proj as its B, C and x rows),
    any other as itself."""
    if file.arch in gguf_hybrid.ARCHITECTURES:
        return gguf_hybrid.split_rows(file, name, info)
    if file.arch in MAMBA2_ARCHS and name.endswith(".mamba.in_proj.weight"):
        a = file.arch
        heads, inner = int(file.field(f"{a}.ssm.time_step_rank")), int(file.field(f"{a}.ssm.inner_size"))
        bc = int(file.field(f"{a}.ssm.group_count")) * int(file.field(f"{a}.ssm.state_size"))
        return gguf_hybrid.row_parts(name.removesuffix("in_proj.weight") + "in_proj_", info,
                                     {"z": inner, "x": inner, "B": bc, "C": bc, "dt": heads})
    if file.arch in LFM2 and name.endswith(".conv.in_proj.weight"):
        third = info.shape[0] // 3
        return gguf_hybrid.row_parts(name.removesuffix("in_proj.weight") + "in_proj_", info,
                                     {"b": third, "c": third, "x": third})
    return [(name, info)]


def stored_as_hf(arch: str, name: str, tensor):
    """An F32 vector as the HF checkpoint holds it (llama.cpp stores Gemma's and the hybrids' norms
    as 1 + w, and a few of the hybrids' values otherwise)."""
    if arch in GEMMA and name.endswith("norm.weight"):
        tensor = tensor - 1.0
    if arch in gguf_hybrid.ARCHITECTURES:
        tensor = gguf_hybrid.stored_as_hf(name, tensor)
    if arch in MAMBA2_ARCHS and name.endswith("mamba.A_log"):
        tensor = torch.log(-tensor)  # stored as A = -exp(A_log)
    return tensor
