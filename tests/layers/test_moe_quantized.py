"""Quantized experts (layers/quantization/gguf_moe.py): MoE GGUF files (qwen3moe, qwen2moe, and
Mixtral as llama.cpp writes it: a llama file, q/k rows in its rotary order; experts
in 3-D ffn_*_exps tensors, written here by the `gguf` package's writer and quantizers from a tiny
transformers checkpoint) give transformers' tokens on that checkpoint at F32, and at Q8_0 the same
tokens as quantization="q8_0" at load (the same blocks); the C experts kernel over quantized experts
equals the dense layers' kernel run expert by expert, and is close to the dequantized weights."""
import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from helpers import check_tokens_close, gguf_writer, hf_greedy
from nanovllm import LLM, SamplingParams
from nanovllm.kernels import cpu_kernels
from nanovllm.layers.quantization.moe_ops import select_experts
from nanovllm.executor.cpu_decode import FusedDecode
from gguf_helpers import llama_cpp_row_order
from moe_checkpoints import make_moe

gguf = pytest.importorskip("gguf")
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
               "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
               "mlp.shared_expert_gate": "ffn_gate_inp_shexp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
               "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp"}


def write_moe_gguf(hf_dir: str, path: str, arch: str, kind: str) -> str:
    """hf_dir's tensors as a llama.cpp-style GGUF file: experts stacked into [E, rows, columns], the
    matrices other than the router and the shared expert's gate in `kind` (f32 or q8_0)."""
    import transformers
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    tensors = {n: t.numpy() for n, t in load_file(f"{hf_dir}/model.safetensors").items()}
    mixtral = arch == "llama"  # llama.cpp writes Mixtral as a llama file with expert tensors
    if mixtral:
        parts = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
        tensors = {n.replace(".block_sparse_moe.", ".mlp."): t for n, t in tensors.items()}
        tensors = {(n if ".experts." not in n else ".".join(parts.get(p, p) for p in n.split("."))): t
                   for n, t in tensors.items()}
        for n in [n for n in tensors if n.endswith(("q_proj.weight", "k_proj.weight"))]:
            heads = config.num_attention_heads if "q_proj" in n else config.num_key_value_heads
            tensors[n] = llama_cpp_row_order(tensors[n], heads)
        experts, inter = config.num_local_experts, config.intermediate_size
    else:
        experts, inter = config.num_experts, config.moe_intermediate_size
    w = gguf_writer(path, arch, config)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_expert_count(experts)
    w.add_expert_used_count(config.num_experts_per_tok)
    w.add_expert_feed_forward_length(inter)
    if arch == "qwen3moe":
        w.add_key_length(config.head_dim)
        w.add_value_length(config.head_dim)
    elif arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)

    def add(name: str, value: np.ndarray, quantize: bool = True) -> None:
        value = value.astype(np.float32)
        if value.ndim == 1 or kind == "f32" or not quantize:
            w.add_tensor(name, value)
        else:
            qtype = gguf.GGMLQuantizationType[kind.upper()]
            w.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    add("token_embd.weight", tensors.pop("model.embed_tokens.weight"))
    add("output_norm.weight", tensors.pop("model.norm.weight"))
    add("output.weight", tensors.pop("lm_head.weight"))
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        mine = {n[len(prefix):]: tensors.pop(n) for n in list(tensors) if n.startswith(prefix)}
        num_experts = sum(n.endswith("gate_proj.weight") and ".experts." in n for n in mine)
        for part, role in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
            if num_experts:
                add(f"blk.{i}.{role}.weight", np.stack([mine.pop(f"mlp.experts.{e}.{part}.weight")
                                                        for e in range(num_experts)]))
        for name, value in mine.items():
            module, _, kind_of = name.rpartition(".")
            router = module in ("mlp.gate", "mlp.shared_expert_gate")  # llama.cpp keeps them F32
            add(f"blk.{i}.{LAYER_NAMES[module]}.{kind_of}", value[0] if module == "mlp.shared_expert_gate" else value,
                quantize=not router)
    assert not tensors, sorted(tensors)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


CASES = {"qwen3moe": "qwen3_moe_norm", "qwen2moe": "qwen2_moe_shared", "llama": "mixtral"}
CLASSES = {"qwen3moe": "Qwen3MoeForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM", "llama": "MixtralForCausalLM"}


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in (1, 9, 30)]


def run(path: str, **kwargs) -> list[list[int]]:
    with LLM(path, kvcache_block_size=16, dtype="float32", cpu_kvcache_bytes=16 << 20, **kwargs) as llm:
        return [o["token_ids"] for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("arch", sorted(CASES))
def test_f32_file_gives_transformers_tokens(arch, tmp_path):
    hf_dir = make_moe(str(tmp_path / "hf"), CASES[arch])
    path = write_moe_gguf(hf_dir, str(tmp_path / f"{arch}.gguf"), arch, "f32")
    with LLM(path, dtype="float32", cpu_kvcache_bytes=1 << 20) as llm:
        hf = llm.config.hf_config
        assert hf.architectures == [CLASSES[arch]]
        if arch != "llama":
            assert hf.mlp_only_layers == ([1] if arch == "qwen3moe" else [])
            assert hf.norm_topk_prob == (arch == "qwen3moe")  # what llama.cpp computes for each
    ours = run(path)
    exact = check_tokens_close(ours, hf_greedy(hf_dir, prompts(), 16))
    assert exact >= len(ours) - 1


@pytest.mark.parametrize("arch", sorted(CASES))
def test_q8_0_file_equals_quantization_at_load(arch, tmp_path):
    if cpu_kernels.load() is None:
        pytest.skip("quantized weights need the C kernels")
    hf_dir = make_moe(str(tmp_path / "hf"), CASES[arch])
    path = write_moe_gguf(hf_dir, str(tmp_path / f"{arch}.gguf"), arch, "q8_0")
    with LLM(path, dtype="float32", cpu_kvcache_bytes=1 << 20) as llm:
        methods = {type(m.quant_method).__name__ for m in llm.llm_engine.model_runner.model.modules() if hasattr(m, "w13_weight")}
        assert methods == {"GGUFFusedMoEMethod"}
        assert llm.llm_engine.model_runner.step_runner(FusedDecode).one_call_layers == llm.config.hf_config.num_hidden_layers
    assert run(path) == run(hf_dir, quantization="q8_0")


# ---- the kernel over quantized experts ----------------------------------------------------------
@pytest.mark.parametrize("fmt,hidden,inter", [("q8_0", 64, 96), ("q4_0", 64, 64), ("q4_k", 256, 256)])
def test_quantized_experts_equal_the_dense_kernel_per_expert(fmt, hidden, inter):
    """The grouped kernel against cpu_kernels.linear (the dense layers' kernel, whose integer part
    test_cpu_quant checks) run expert by expert on the same blocks; and against the dequantized
    weights within the inputs' 8-bit rounding."""
    from nanovllm.layers.moe import FusedMoE
    from nanovllm.layers.quantization.moe_ops import experts_reference
    from nanovllm.layers.quantization import LinearKernels, OnlineQuantConfig

    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("no C kernels on this machine")
    torch.manual_seed(0)
    layer = FusedMoE(6, 2, hidden, inter, True, OnlineQuantConfig(fmt), "mlp.experts")
    dense13, dense2 = torch.randn(6, 2 * inter, hidden) * 0.1, torch.randn(6, hidden, inter) * 0.1
    layer.w13_weight.data.copy_(dense13)
    layer.w2_weight.data.copy_(dense2)
    layer.quant_method.process_weights_after_loading(layer, LinearKernels(c_kernels=kernels), False)
    assert layer.w13_weight.dtype == torch.uint8  # one copy: the blocks
    x, logits = torch.randn(5, hidden), torch.randn(5, 6)
    logits[:, 4] -= 50.0  # expert 4 receives no row
    ours = layer(x, logits)
    weights, ids = select_experts(logits, 2, True)
    up_views, down_views = layer.quant_method.c_moe.keep[0], layer.quant_method.c_moe.keep[1]
    expected = torch.zeros(5, hidden)
    for t in range(5):
        for j in range(2):
            e = int(ids[t, j])
            gu = cpu_kernels.linear(kernels, up_views[e], x[t:t + 1], None)
            act = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
            expected[t] += weights[t, j] * cpu_kernels.linear(kernels, down_views[e], act, None)[0]
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    qtype = gguf.GGMLQuantizationType[fmt.upper()]
    deq = [torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), qtype), qtype)) if fmt != "q4_k"
           else None for w in (dense13, dense2)]
    if deq[0] is not None:  # gguf.quants has no Q4_K quantizer; ours is checked against llama-quantize's
        reference = experts_reference(x, deq[0], deq[1], weights, ids)
        assert (ours - reference).abs().max() < 0.02 * reference.abs().max()
