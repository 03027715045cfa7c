"""GGUF files as models, against independent references (online quantization:
test_online_quantization.py):
- the default model's shipped Q4_1 file (from PyPI) against transformers on the same file
  (transformers dequantizes it itself): perplexity scored as llama-perplexity scores, greedy answer;
- tiny random llama / qwen2 / qwen3 files written with the `gguf` package's GGUFWriter in every
  block format (blocks from gguf.quants, llama.cpp's q/k row order for llama), against
  transformers' reading of the same file;
- malformed and unsupported files, and misuse of quantization=, refused with clear errors."""
import logging
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest


from helpers import make_qwen3  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.layers.quantization.block_formats import block_shape  # noqa: E402
from nanovllm.config import CPU_INPUT_BITS  # noqa: E402
from nanovllm.kernels import cpu_kernels  # noqa: E402
from nanovllm.layers.quantization import linear_layers  # noqa: E402
from nanovllm.utils import default_model as dm  # noqa: E402
from nanovllm.executor.cpu_decode import FusedDecode  # noqa: E402

from gguf_helpers import CASES, REPO, assert_like_transformers, gguf, hf_logprobs_of_file, logprob_errors, model_of, our_logprobs, perplexity_and_answer, write_tiny  # noqa: E402
import perplexity as ppl  # noqa: E402  (scripts/, on the path through gguf_helpers)


@pytest.fixture(scope="module")
def shipped():
    """(the shipped Q4_1 GGUF, the fp32 folder transformers dequantized from it)."""
    cache = Path(os.environ.get(dm.CACHE_ENV) or REPO / ".cache" / "nanovllm")
    folder = dm.default_model_path(cache)
    return str(cache / "downloads" / dm.GGUF_NAME), folder


def test_shipped_q4_1_file(shipped):
    path, folder = shipped
    with LLM(path, max_num_seqs=8, max_model_len=512, kv_cache_dtype="float32") as llm:
        held = {layer.quant_method.name for layer in linear_layers(model_of(llm))}
        assert held == {"q4_1 (C kernel)", "q8_0 (C kernel)"}  # the file's own formats: no fp32 copy
        chunks, ours, answer = perplexity_and_answer(llm)
    assert len(chunks) >= 6 and {len(c) for c in chunks} == {ppl.N_CTX}
    assert_like_transformers(folder, chunks, ours, answer)


def test_shipped_file_tokenizer_is_the_one_autotokenizer_builds(shipped):
    """Checkpoint.load_tokenizer() builds a GGUF file's tokenizer without the model config AutoTokenizer loads
    to pick its class: the same vocabulary, special tokens, encodings and chat template."""
    from transformers import AutoTokenizer

    from nanovllm.loader.checkpoint import Checkpoint
    path = shipped[0]
    ours = Checkpoint(path).load_tokenizer()
    theirs = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    texts = ["The capital of France is", " a leading space\n\nand   runs\tof whitespace",
             "<|im_start|>user\nhi<|im_end|>", "digits 1234567 and émigré 🙂"]
    assert [ours(t).input_ids for t in texts] == [theirs(t).input_ids for t in texts]
    assert ours.get_vocab() == theirs.get_vocab() and ours.all_special_tokens == theirs.all_special_tokens
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert (ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) ==
            theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))


# ---- tiny files in every block format ----------------------------------------------------------
ARCH_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
LAYER_TENSORS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                 "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


HF_MODULES = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
              "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj", "output": "lm_head"}


def kernel_input_groups(types: dict[str, str], tied: bool) -> dict[str, int]:
    """The input quantization of each HF linear layer the C kernels multiply in integers."""
    groups = {}
    roles = {**types, **({"output": types["token_embd"]} if tied and "token_embd" in types else {})}
    for role, kind in roles.items():
        if role in HF_MODULES and kind not in ("f32", "f16", "bf16"):
            groups[HF_MODULES[role]] = block_shape(kind)[0]  # the input groups are the blocks
    return groups


# Mean |logprob error| against plain transformers: our inputs are quantized to 14-bit integers per
# group, which moves these random models' log-probabilities by about 1e-3 (F32 weights multiply in
# fp32: no such error).
TOLERANCE = {"llama-f32": 1e-4}


@pytest.mark.parametrize("case", sorted(CASES))
def test_tiny_files_match_transformers(tmp_path, case, caplog):
    caplog.set_level(logging.INFO, logger="nanovllm")
    arch, types = CASES[case]
    # NOTE: transformers reads no head_dim from a qwen3 GGUF (it takes 128): two heads of 128 here.
    shape = dict(heads=2, kv_heads=1, untied=True) if arch == "qwen3" else {}
    path = write_tiny(tmp_path / f"{case}.gguf", arch, types, **shape)
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, 320, 40)]
    ref = hf_logprobs_of_file(path, prompt)
    same_inputs = hf_logprobs_of_file(path, prompt, kernel_input_groups(types, tied=arch != "qwen3"))
    with LLM(str(path), kv_cache_dtype="float32", max_num_seqs=4, max_model_len=256, cpu_input_bits=14) as llm:
        assert llm.tokenizer is None  # no vocabulary in the file: token-id prompts
        assert llm.config.hf_config.architectures == [ARCH_CLASSES[arch]]
        ours = our_logprobs(llm, prompt, 320)
    tol = TOLERANCE.get(case, 5e-3)
    plain, same = logprob_errors(ours, ref, prompt), logprob_errors(ours, same_inputs, prompt)
    if "q5_k" in types.values():  # converted at load, and said so
        assert "Q5_K tensors (e.g. blk.0.attn_q.weight) converted at load to Q5_1" in caplog.text
    print(case, "|logprob error| max / mean", plain.max().item(), plain.mean().item(),
          "with the kernels' input rounding", same.max().item(), same.mean().item())
    # With the same input rounding only the order of float sums differs (which can move a value
    # across a rounding boundary of the next layer's input now and then).
    assert same.mean() < 2e-3 and same.max() < 0.05, case
    assert plain.mean() < tol, case


@pytest.mark.parametrize("bits", [8, "auto"])
@pytest.mark.parametrize("case", ["llama-q4_k_m", "qwen2-mixed", "qwen3-q4_0"])
def test_input_rounding_is_the_named_one(tmp_path, case, bits):
    """cpu_input_bits=8: every block-format layer's input rounded to int8 per group (llama.cpp's Q8
    inputs); "auto" (the default): to int8 or 14 bits per group, as the group needs. The result is
    transformers' with its inputs rounded the same way, and not with the others' rounding."""
    arch, types = CASES[case]
    shape = dict(heads=2, kv_heads=1, untied=True) if arch == "qwen3" else {}
    path = write_tiny(tmp_path / f"{case}.gguf", arch, types, **shape)
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, 320, 40)]
    groups = kernel_input_groups(types, tied=arch != "qwen3")
    refs = {b: hf_logprobs_of_file(path, prompt, groups, b) for b in (8, 14, "auto")}
    with LLM(str(path), kv_cache_dtype="float32", max_num_seqs=4, max_model_len=256, **({"cpu_input_bits": bits} if bits != "auto" else {})) as llm:
        assert {layer.quant_method.input_planes for layer in linear_layers(model_of(llm))
                if hasattr(layer.quant_method, "input_planes")} == {CPU_INPUT_BITS[bits]}
        ours = our_logprobs(llm, prompt, 320)
    errors = {b: logprob_errors(ours, ref, prompt).mean().item() for b, ref in refs.items()}
    print(case, bits, "inputs: mean |logprob error| against transformers with each rounding", errors)
    same, others = errors.pop(bits), errors.values()
    # (int8 steps are 128x coarser than the two planes': a float-sum-order difference that moves a
    # value across one moves the next layers more than in test_tiny_files_match_transformers)
    assert same < 1e-2, case
    assert min(others) > 2 * same, case


def test_decode_step_with_chained_parts(tmp_path):
    """The one-call C decode over layers whose q/k/v parts are chained matrices of different
    formats: the chained structures outlive the description (a dangling part crashed the step); with
    every matmul on the C kernels it runs at any batch size, and its greedy tokens are those of the
    per-layer path."""
    import ctypes
    import gc
    arch, types = CASES["llama-q4_k_m"]
    path = write_tiny(tmp_path / "chain.gguf", arch, types)
    prompts = [[int(t) for t in np.random.default_rng(s).integers(0, 320, 12)] for s in range(5)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(str(path), max_num_seqs=8, max_model_len=128, kv_cache_dtype="float32") as llm:
        fused = llm.llm_engine.model_runner.step_runner(FusedDecode)
        assert fused.max_rows == cpu_kernels.ALL_ROWS
        gc.collect()
        kept = {ctypes.addressof(part) for lin in fused.linears for part in getattr(lin, "chain", [])}
        chained = [fused.layers[i].qkv.next for i in range(len(fused.modules))]
        assert all(chained) and set(chained) <= kept  # every layer's v part (Q6_K) chained after q / k (Q4_K)
        one_call = [o["token_ids"] for o in llm.generate(prompts, sp, use_tqdm=False)]
        fused.max_rows = 0  # the per-layer path: the layers' own modules between the C phases
        per_layer = [o["token_ids"] for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert one_call == per_layer


def test_tensor_parallel_gguf(tmp_path):
    """Two CPU ranks on a mixed-format file give the one-rank output; a split that would cut a
    block is refused before any rank starts, naming the tensor and the sizes."""
    arch, types = CASES["llama-q4_k_m"]
    path = write_tiny(tmp_path / "tp.gguf", arch, types, hidden=512, inter=1024, heads=8, kv_heads=2)
    prompts = [[int(t) for t in np.random.default_rng(s).integers(0, 320, 20)] for s in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(str(path), kv_cache_dtype="float32", max_num_seqs=4, max_model_len=128) as llm:
        one = [o["token_ids"] for o in llm.generate(prompts, sp, use_tqdm=False)]
    with LLM(str(path), kv_cache_dtype="float32", max_num_seqs=4, max_model_len=128, tensor_parallel_size=2) as llm:
        two = [o["token_ids"] for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert one == two
    small = write_tiny(tmp_path / "small.gguf", arch, types)  # o_proj: 256 inputs, one Q4_K block
    with pytest.raises(ValueError, match=r"split model.layers.0.self_attn.o_proj.weight \(q4_k, 256 inputs\) into "
                                         r"parts of 128 inputs, not whole q4_k blocks of 256"):
        LLM(str(small), max_num_seqs=4, max_model_len=128, tensor_parallel_size=2)


# ---- bad input ---------------------------------------------------------------------------------------
def test_bad_files_and_options(tmp_path):
    good = write_tiny(tmp_path / "good.gguf", "qwen3", {"attn_q": "q8_0"})
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "missing.gguf"))
    bad_magic = tmp_path / "magic.gguf"
    bad_magic.write_bytes(b"GGUX" + good.read_bytes()[4:])
    with pytest.raises(ValueError, match="not a readable GGUF"):
        LLM(str(bad_magic))
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(ValueError, match="GGUF"):
        LLM(str(truncated))
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="GGUF"):
        LLM(str(empty))
    gpt2 = write_tiny(tmp_path / "gpt2.gguf", "gpt2", {})
    with pytest.raises(ValueError, match=r"architecture 'gpt2' is not supported; supported: \['falcon-h1', 'gemma2', 'gemma3', 'glm4moe', 'gpt-oss', 'granitehybrid', 'lfm2', 'lfm2moe', 'llama', 'qwen2', 'qwen2moe', 'qwen3', 'qwen35', 'qwen35moe', 'qwen3moe', 'qwen3next', 'smollm3'\]"):
        LLM(str(gpt2))
    with pytest.raises(ValueError, match="quantization='q8_0' cannot apply to a GGUF file"):
        LLM(str(good), quantization="q8_0")
    folder = make_qwen3(str(tmp_path / "qwen3"))
    with pytest.raises(ValueError, match=r"quantization 'int3' is not supported; choose one of \['q8_0'"):
        LLM(folder, quantization="int3")
    for bits in (4, 16, True, 14.0, "8", "int8", None):
        with pytest.raises(ValueError, match=f"cpu_input_bits must be 'auto', 8 or 14, got {re.escape(repr(bits))}"):
            LLM(str(good), cpu_input_bits=bits)


def test_unsupported_tensor_type(tmp_path):
    """A tensor type the kernels do not multiply (here TQ1_0, written as raw blocks) is refused
    before anything is allocated, naming it and the supported list."""
    path = tmp_path / "tq1.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("add_block_count", 1), ("add_context_length", 64), ("add_embedding_length", 32),
                       ("add_feed_forward_length", 64), ("add_head_count", 2), ("add_layer_norm_rms_eps", 1e-6)):
        getattr(w, key)(value)
    w.add_tensor("token_embd.weight", np.zeros((64, 32), np.float32))
    w.add_tensor("blk.0.ffn_down.weight", np.zeros((32, 54), np.uint8), raw_dtype=gguf.GGMLQuantizationType.TQ1_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"tensor types tq1_0 \(e.g. blk.0.ffn_down.weight\).*supported: f32, f16"):
        LLM(str(path))
