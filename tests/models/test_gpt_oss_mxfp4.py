"""GPT-OSS as OpenAI ships it: experts in MXFP4 (`*_blocks` / `*_scales`, config.json quant_method
"mxfp4"), the rest dense. The checkpoint's codes and exponents are made by the `gguf` package's MXFP4
quantizer from a tiny random GPT-OSS and written in the OCP layout; transformers reads it back
(dequantizing the experts itself) as the reference. The engine holds the experts as MXFP4 block
rows and multiplies them with the C kernel: greedy tokens equal transformers', through whole and
chunked prefills, prefix-cache hits, preemption and TP=2; a scale tensor that does not match its
blocks is named."""
import os

import numpy as np
import pytest
import torch

from helpers import gguf_writer
from nanovllm import LLM, SamplingParams
from mxfp4_checkpoints import MAX_NEW, gguf, make_mxfp4_checkpoint, safetensors_torch  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_mxfp4_checkpoint(str(tmp_path_factory.mktemp("gpt_oss_mxfp4")))


def test_experts_held_as_mxfp4(checkpoint):
    from nanovllm.executor.cpu_decode import FusedDecode
    with LLM(checkpoint, dtype="float32", cpu_kvcache_bytes=8 << 20) as llm:
        # every layer in the C decode step's one call (sinks, windows, biases, experts kernel): the
        # greedy tests below run it
        assert llm.llm_engine.model_runner.step_runner(FusedDecode).one_call_layers == 3
        experts = llm.llm_engine.model_runner.model.model.layers[0].mlp.experts
        assert experts.quant_method.name == "experts mxfp4 (C kernel)"
        # 17 bytes per 32 weights, the rows interleaved by 8 in place: the checkpoint's bytes, once
        assert experts.w13_weight.dtype == torch.uint8 and tuple(experts.w13_weight.shape) == (4, 128, 2 * 17)
        assert tuple(experts.w2_weight.shape) == (4, 64, 2 * 17)


@pytest.mark.parametrize("engine", [dict(), dict(max_num_batched_tokens=16, max_num_seqs=4)],
                         ids=["whole", "chunked"])
def test_greedy_matches_transformers(checkpoint, engine):
    from transformers import Mxfp4Config

    from sliding_checkpoints import check_greedy_against_transformers
    # (dequantized by transformers' own reading of the blocks; its hub kernels are not for CPUs)
    check_greedy_against_transformers(checkpoint, engine, MAX_NEW, quantization_config=Mxfp4Config(dequantize=True))


def test_tp2_matches_tp1_with_preemption(checkpoint):
    from sliding_checkpoints import check_tp2_equals_tp1
    check_tp2_equals_tp1(checkpoint)


def test_scales_that_do_not_pair_are_named(checkpoint, tmp_path):
    import shutil
    bad = str(tmp_path / "bad")
    shutil.copytree(checkpoint, bad)
    file = os.path.join(bad, "model.safetensors")
    tensors = safetensors_torch.load_file(file)
    name = "model.layers.1.mlp.experts.down_proj_scales"
    tensors[name] = tensors[name][..., :1].contiguous()  # one exponent per row where two are due
    safetensors_torch.save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.down_proj_blocks .* do not pair as MXFP4"):
        LLM(bad, dtype="float32", cpu_kvcache_bytes=8 << 20)


def write_gguf(folder: str, path: str) -> str:
    """The MXFP4 checkpoint as llama.cpp's converter lays out a gpt-oss file (conversion/gpt_oss.py:
    experts gate / up apart, MXFP4 rows of GGUF's nibble order, biases split alike, sinks and the
    router under its names), written with the gguf package's GGUFWriter."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(folder)
    rope = config.rope_parameters
    tensors = safetensors_torch.load_file(os.path.join(folder, "model.safetensors"))
    w = gguf_writer(path, "gpt-oss", config)
    w.add_expert_feed_forward_length(config.intermediate_size)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_expert_count(config.num_local_experts)
    w.add_expert_used_count(config.num_experts_per_tok)
    w.add_sliding_window(config.sliding_window)

    def f32(name):
        return tensors[name].float().numpy()
    w.add_tensor("token_embd.weight", f32("model.embed_tokens.weight"))
    w.add_tensor("output_norm.weight", f32("model.norm.weight"))
    w.add_tensor("output.weight", f32("lm_head.weight"))
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        for ours, theirs in (("attn_norm", "input_layernorm"), ("post_attention_norm", "post_attention_layernorm")):
            w.add_tensor(f"blk.{i}.{ours}.weight", f32(f"{p}.{theirs}.weight"))
        for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")):
            for kind in ("weight", "bias"):
                w.add_tensor(f"blk.{i}.{ours}.{kind}", f32(f"{p}.self_attn.{theirs}.{kind}"))
        w.add_tensor(f"blk.{i}.attn_sinks.weight", f32(f"{p}.self_attn.sinks"))
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", f32(f"{p}.mlp.router.weight"))
        w.add_tensor(f"blk.{i}.ffn_gate_inp.bias", f32(f"{p}.mlp.router.bias"))
        e = f"{p}.mlp.experts"
        from nanovllm.layers.quantization.mxfp4 import gguf_rows
        gate_up = gguf_rows(tensors[f"{e}.gate_up_proj_blocks"], tensors[f"{e}.gate_up_proj_scales"], e).numpy()
        down = gguf_rows(tensors[f"{e}.down_proj_blocks"], tensors[f"{e}.down_proj_scales"], e).numpy()
        for name, rows in (("ffn_gate_exps", gate_up[:, 0::2]), ("ffn_up_exps", gate_up[:, 1::2]), ("ffn_down_exps", down)):
            w.add_tensor(f"blk.{i}.{name}.weight", np.ascontiguousarray(rows), raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        bias = f32(f"{e}.gate_up_proj_bias")
        w.add_tensor(f"blk.{i}.ffn_gate_exps.bias", np.ascontiguousarray(bias[:, 0::2]))
        w.add_tensor(f"blk.{i}.ffn_up_exps.bias", np.ascontiguousarray(bias[:, 1::2]))
        w.add_tensor(f"blk.{i}.ffn_down_exps.bias", f32(f"{e}.down_proj_bias"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_file_runs_as_the_checkpoint(checkpoint, tmp_path):
    """The same weights as a gpt-oss GGUF file: experts held MXFP4 as the file stores them, the
    config (experts, alternating windows, YaRN) read from its metadata; the checkpoint's tokens and
    log-probabilities (the checkpoint's run is transformers' above)."""
    path = write_gguf(checkpoint, str(tmp_path / "gpt-oss.gguf"))
    prompts = [[5, 17, 99, 3, 42, 8, 8, 130, 77, 19, 4], [200, 3]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    runs = []
    for model in (checkpoint, path):
        with LLM(model, dtype="float32", cpu_kvcache_bytes=8 << 20) as llm:
            layers = llm.llm_engine.model_runner.model.model.layers
            assert [layer.self_attn.attn.sliding_window for layer in layers] == [8, None, 8]
            assert layers[2].mlp.experts.quant_method.name == "experts mxfp4 (C kernel)"
            runs.append(llm.generate(prompts, params, use_tqdm=False))
    for hf, ours in zip(*runs):
        assert ours["token_ids"] == hf["token_ids"]
        for a, b in zip(hf["logprobs"], ours["logprobs"]):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)


def test_tensor_parallel_cutting_a_block_is_named():
    from nanovllm.layers.quantization.mxfp4 import Mxfp4Config
    header = {"model.layers.0.mlp.experts.down_proj_blocks": ("U8", (4, 64, 3, 16)),
              "model.layers.0.mlp.experts.down_proj_scales": ("U8", (4, 64, 3))}
    config = Mxfp4Config(header, {})
    config.check_checkpoint()
    config.check_tensor_parallel(3, {})  # one block of 32 inputs a rank
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 would split model\.layers\.0\.mlp\.experts\.down_proj_blocks "
                                         r"\(3 MXFP4 blocks"):
        config.check_tensor_parallel(2, {})
