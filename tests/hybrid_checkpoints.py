"""Tiny hybrid linear-attention checkpoints (Qwen3.5 / Qwen3-Next) and their GGUF files, shared by the hybrid, MTP and Triton DeltaNet tests."""
import random
import torch
from helpers import save_decisive
from nanovllm import LLM, SamplingParams


VOCAB, MAX_NEW = 256, 12


SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=16, linear_value_head_dim=32, linear_conv_kernel_dim=4,
             max_position_embeddings=512, rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=2, pad_token_id=0,
             tie_word_embeddings=False)


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64)


def make_checkpoint(name: str, path: str) -> str:
    import transformers
    if name == "qwen3_5":
        config, family = transformers.Qwen3_5TextConfig(**SHAPE), "Qwen3_5"
    elif name == "qwen3_5_moe":
        config, family = transformers.Qwen3_5MoeTextConfig(**SHAPE, **MOE), "Qwen3_5Moe"
    else:
        config, family = transformers.Qwen3NextConfig(**SHAPE, **MOE, decoder_sparse_step=1), "Qwen3Next"
    config.architectures = [f"{family}ForCausalLM"]
    torch.manual_seed(3)
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    return save_decisive(model, path, VOCAB)


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 9, 70, 150)]  # past one and two chunks


def generate(path: str, batch, **engine) -> tuple[list[list[int]], int]:
    engine = dict(dict(dtype="float32", kvcache_block_size=16, cpu_kvcache_bytes=8 << 20), **engine)
    with LLM(path, **engine) as llm:
        outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
        return [o["token_ids"] for o in outs], llm.llm_engine.scheduler.num_preemptions


def tiled(t: torch.Tensor, dim: int, k_heads: int, per_k: int, size: int) -> torch.Tensor:
    """Value heads along dim from grouped by key head ([k][j]) to tiled ([j][k]), as llama.cpp's
    converter stores them where a key head serves several value heads."""
    shape = list(t.shape)
    split = shape[:dim] + [k_heads, per_k, size] + shape[dim + 1:]
    return t.reshape(split).transpose(dim, dim + 1).reshape(shape)


def write_gguf(folder: str, path: str, arch: str, quantized: bool = False) -> str:
    """The checkpoint as llama.cpp's converter writes a qwen35 / qwen35moe file: its names, norms as
    1 + w, A = -exp(A_log), the conv kernel squeezed, the value heads tiled; matrices F32, or Q8_0
    (gguf.quants) where quantized; an MTP head (mtp.*) as one more layer, its fc and norms blk.N.nextn.*."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from helpers import gguf_writer
    config = AutoConfig.from_pretrained(folder)
    t = load_file(f"{folder}/model.safetensors")
    nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv, r = config.linear_key_head_dim, config.linear_value_head_dim, nv // nk
    mtp = "mtp.fc.weight" in t
    w = gguf_writer(path, arch, config, config.num_hidden_layers + mtp)
    if mtp:
        w.add_nextn_predict_layers(1)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_rope_dimension_count(int(config.head_dim * config.rope_parameters["partial_rotary_factor"]))
    w.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
    w.add_ssm_state_size(dk)
    w.add_ssm_group_count(nk)
    w.add_ssm_time_step_rank(nv)
    w.add_ssm_inner_size(dv * nv)
    w.add_full_attention_interval(4)
    w.add_array(f"{arch}.attention.recurrent_layers", [kind == "linear_attention" for kind in config.layer_types])
    if arch == "qwen35moe":
        w.add_expert_count(config.num_experts)
        w.add_expert_used_count(config.num_experts_per_tok)
        w.add_expert_feed_forward_length(config.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)

    def add(name: str, x: torch.Tensor, matrix: bool = False):
        x = x.float().contiguous()
        if quantized and matrix and x.shape[-1] % 32 == 0:
            w.add_tensor(name, gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, np.ascontiguousarray(x.numpy()))
    add("token_embd.weight", t["model.embed_tokens.weight"], True)
    add("output_norm.weight", t["model.norm.weight"] + 1)
    add("output.weight", t["lm_head.weight"], True)

    def add_layer(p: str, b: str, kind: str):
        add(f"{b}.attn_norm.weight", t[f"{p}.input_layernorm.weight"] + 1)
        add(f"{b}.post_attention_norm.weight", t[f"{p}.post_attention_layernorm.weight"] + 1)
        if kind == "full_attention":
            for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")):
                add(f"{b}.{ours}.weight", t[f"{p}.self_attn.{theirs}.weight"], True)
            add(f"{b}.attn_q_norm.weight", t[f"{p}.self_attn.q_norm.weight"] + 1)
            add(f"{b}.attn_k_norm.weight", t[f"{p}.self_attn.k_norm.weight"] + 1)
        else:
            la = f"{p}.linear_attn"
            qkv = t[f"{la}.in_proj_qkv.weight"]
            add(f"{b}.attn_qkv.weight", torch.cat([qkv[:2 * nk * dk], tiled(qkv[2 * nk * dk:], 0, nk, r, dv)]), True)
            add(f"{b}.attn_gate.weight", tiled(t[f"{la}.in_proj_z.weight"], 0, nk, r, dv), True)
            add(f"{b}.ssm_beta.weight", tiled(t[f"{la}.in_proj_b.weight"], 0, nk, r, 1))
            add(f"{b}.ssm_alpha.weight", tiled(t[f"{la}.in_proj_a.weight"], 0, nk, r, 1))
            conv = t[f"{la}.conv1d.weight"].squeeze(1)
            add(f"{b}.ssm_conv1d.weight", torch.cat([conv[:2 * nk * dk], tiled(conv[2 * nk * dk:], 0, nk, r, dv)]))
            add(f"{b}.ssm_a", tiled(-t[f"{la}.A_log"].exp(), 0, nk, r, 1))
            add(f"{b}.ssm_dt.bias", tiled(t[f"{la}.dt_bias"], 0, nk, r, 1))
            add(f"{b}.ssm_norm.weight", t[f"{la}.norm.weight"])
            add(f"{b}.ssm_out.weight", tiled(t[f"{la}.out_proj.weight"], 1, nk, r, dv), True)
        if arch == "qwen35":
            for ours, theirs in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj")):
                add(f"{b}.{ours}.weight", t[f"{p}.mlp.{theirs}.weight"], True)
            return
        add(f"{b}.ffn_gate_inp.weight", t[f"{p}.mlp.gate.weight"])
        for ours, theirs in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj")):
            add(f"{b}.{ours}_exps.weight", torch.stack([t[f"{p}.mlp.experts.{e}.{theirs}.weight"]
                                                        for e in range(config.num_experts)]), True)
            add(f"{b}.{ours}_shexp.weight", t[f"{p}.mlp.shared_expert.{theirs}.weight"], True)
        add(f"{b}.ffn_gate_inp_shexp.weight", t[f"{p}.mlp.shared_expert_gate.weight"][0])

    for i, kind in enumerate(config.layer_types):
        add_layer(f"model.layers.{i}", f"blk.{i}", kind)
    if mtp:
        b = f"blk.{config.num_hidden_layers}"
        add_layer("mtp.layers.0", b, "full_attention")
        add(f"{b}.nextn.eh_proj.weight", t["mtp.fc.weight"], True)
        for ours, theirs in (("enorm", "pre_fc_norm_embedding"), ("hnorm", "pre_fc_norm_hidden"),
                             ("shared_head_norm", "norm")):
            add(f"{b}.nextn.{ours}.weight", t[f"mtp.{theirs}.weight"] + 1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path

