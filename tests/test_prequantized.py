"""Pre-quantized checkpoints as vLLM loads them, against references independent of the engine:
- compressed-tensors folders written by llm-compressor itself (oneshot, data-free, in its own venv:
  scripts/llmcompressor_env.sh) over a tiny random Qwen3 and over the default model, against
  transformers running the same folder with the compressed-tensors version that wrote it;
- GPTQ, AWQ and FP8 folders laid out here from their published format definitions (cited at each
  writer), against transformers on the dense weights those definitions give;
- the engine's held weights, read back from its kernels' blocks, equal to each format's definition
  computed here in plain torch, exactly;
- TP=2 equal to TP=1; bad configs and missing tensors refused before the model is built."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import check_tokens_close, make_qwen3
from nanovllm import LLM, SamplingParams
from nanovllm.kernels import cpu_kernels
from nanovllm.layers.quantization import linear_layers
from nanovllm.utils.cache import cache_root

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import llmcompressor_quantize as lq  # noqa: E402  (its reference() runs here too, on dense folders)

PROMPTS = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [9, 8, 7, 100, 22, 5, 77, 31]]
NEW_TOKENS = 10
# llm-compressor scheme -> the block format that holds it exactly ("f32": none does; dense fp32)
SCHEMES = {"W4A16": "q4_0", "W4A16_ASYM": "q5_0", "W8A16": "q8_0", "int4-asym-channel": "q5_0",
           "int8-asym-channel": "f32", "fp8-channel": "e4m3", "fp8-block128": "e4m3", "fp8-tensor": "e4m3"}
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


@pytest.fixture(scope="session")
def llmcompressor() -> str:
    """llm-compressor's python (its venv made on first use)."""
    out = subprocess.run(["bash", str(REPO / "scripts" / "llmcompressor_env.sh")], capture_output=True, text=True,
                         env={**os.environ, "PYTHON": sys.executable}, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def run_llmcompressor(python: str, *args: str) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    out = subprocess.run([python, str(REPO / "scripts" / "llmcompressor_quantize.py"), *args], capture_output=True,
                         text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.fixture(scope="session")
def ct_folders(llmcompressor, tmp_path_factory) -> dict[str, str]:
    """scheme -> a compressed-tensors folder of a tiny random Qwen3 (bf16, every input a multiple
    of 128 per rank of two) written by llm-compressor, with transformers' reference beside it."""
    root = tmp_path_factory.mktemp("compressed_tensors")
    src = make_qwen3(str(root / "dense"), shape="groups")
    run_llmcompressor(llmcompressor, "quantize", src, str(root), *SCHEMES)
    folders = {s: str(root / s) for s in SCHEMES}
    run_llmcompressor(llmcompressor, "reference", json.dumps(PROMPTS), str(NEW_TOKENS), *folders.values())
    return folders


def model_of(llm):
    return llm.model_runner.model


def layer_at(llm, name: str):
    return dict(model_of(llm).named_modules())[name]


def held_weight(layer) -> torch.Tensor:
    """The weight a layer multiplies from, read back as fp32 [outputs, inputs] in the checkpoint's
    input order: the C kernels' own reading of their blocks (rows_to_f32), or the dense weight."""
    method = layer.quant_method
    inner = method.inner
    if getattr(inner, "c_linear", None) is not None and inner.name.endswith("(C kernel)"):
        rows = cpu_kernels.rows_to_f32(inner.c_kernels, inner.c_linear, torch.arange(cpu_kernels.linear_outputs(
            inner.c_linear)))
        if method.perm is not None:
            out = torch.empty_like(rows)
            out[:, method.perm] = rows
            rows = out
        return rows
    return layer.weight.float()


def stacked_names(name: str) -> list[str]:
    """The checkpoint modules of one of our layers (q/k/v in qkv_proj, gate/up in gate_up_proj)."""
    if name.endswith("qkv_proj"):
        return [name.replace("qkv_proj", p) for p in ("q_proj", "k_proj", "v_proj")]
    if name.endswith("gate_up_proj"):
        return [name.replace("gate_up_proj", p) for p in ("gate_proj", "up_proj")]
    return [name]


def our_outputs(llm, prompts, vocab: int):
    """Greedy tokens and, per prompt, our log-probabilities of the prompt tokens and our top 5 (rest -inf)."""
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    rows = []
    for prompt in prompts:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5), use_tqdm=False)[0]
        r = torch.full((len(prompt) - 1, vocab), -float("inf"))
        for j, entry in enumerate(out["prompt_logprobs"][1:]):
            for token, logprob in entry.items():
                r[j, token] = logprob
        rows.append(r)
    return [o["token_ids"] for o in outs], rows


def check_against_reference(llm, folder: str, vocab: int = 256) -> float:
    """Our greedy tokens and prompt log-probabilities against the reference written beside folder
    (vLLM's check_logprobs_close rule for the tokens); returns the largest |logprob error|."""
    ref = json.load(open(f"{folder}.ref.json"))
    tensors = load_file(f"{folder}.ref.safetensors")
    tokens, logprobs = our_outputs(llm, ref["prompts"], vocab)
    check_tokens_close(tokens, [(t, tensors[f"logits.{i}"]) for i, t in enumerate(ref["tokens"])])
    worst = 0.0
    for i, (prompt, ours) in enumerate(zip(ref["prompts"], logprobs)):
        theirs = tensors[f"prompt_logprobs.{i}"]
        for j in range(len(prompt) - 1):
            ids = torch.cat([ours[j].topk(5).indices, torch.tensor([prompt[j + 1]])])
            worst = max(worst, (ours[j, ids] - theirs[j, ids]).abs().max().item())
    return worst


# ---- compressed-tensors: the format's definition, written here from compressors/pack_quantized ----
def ct_unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """compressed-tensors' pack_to_int32 read back: element j of a row at bits [j * bits, (j + 1) * bits)
    of the row's words (word j * bits // 32), stored as value + 2^(bits - 1)."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    out = torch.empty(packed.shape[0], count, dtype=torch.int64)
    for j in range(count):
        out[:, j] = (words[:, j * bits // 32] >> (j * bits % 32)) & ((1 << bits) - 1)
    return out - (1 << (bits - 1))


def ct_dense(folder: str, module: str) -> torch.Tensor:
    """The fp32 weight a compressed-tensors module stands for: scale * (value - zero_point)."""
    t = load_file(os.path.join(folder, "model.safetensors"))
    qc = json.load(open(os.path.join(folder, "config.json")))["quantization_config"]
    w = qc["config_groups"]["group_0"]["weights"]
    scale = t[f"{module}.weight_scale"].float()
    if w["type"] == "float":
        values = t[f"{module}.weight"].float()
        n, k = values.shape
        if w["strategy"] == "block":
            bo, bi = w["block_structure"]
            scale = scale.repeat_interleave(bo, 0)[:n].repeat_interleave(bi, 1)[:, :k]
        return values * scale.expand(n, k) if scale.numel() > 1 else values * scale.reshape(())
    n, k = t[f"{module}.weight_shape"].tolist()
    values = ct_unpack(t[f"{module}.weight_packed"], w["num_bits"], k)
    group = w["group_size"] or k
    if f"{module}.weight_zero_point" in t:
        zeros = ct_unpack(t[f"{module}.weight_zero_point"].t().contiguous(), w["num_bits"], n).t()
        values = values - zeros.repeat_interleave(group, 1)
    return values.double().mul(scale.double().repeat_interleave(group, 1)).float()


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_llmcompressor_folders(ct_folders, scheme):
    folder = ct_folders[scheme]
    with LLM(folder, max_num_seqs=4, max_model_len=256) as llm:
        names = {layer.quant_method.name for layer in linear_layers(model_of(llm)) if layer.prefix != "lm_head"}
        held = SCHEMES[scheme]
        if held == "f32":  # dense: the layers multiply as a dense checkpoint's do
            assert all(n.startswith("compressed-tensors W8A16 as ") and "(C kernel)" not in n for n in names), names
        else:
            assert all(f" as {held} (C kernel)" in n for n in names), names
        for layer in ("model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.gate_up_proj",
                      "model.layers.1.mlp.down_proj", "model.layers.0.self_attn.o_proj"):
            ref = torch.cat([ct_dense(folder, m) for m in stacked_names(layer)])
            assert torch.equal(held_weight(layer_at(llm, layer)), ref), (scheme, layer)
        worst = check_against_reference(llm, folder)
    # integer schemes: our inputs are rounded to 14-bit integers per block (about 1e-3 here); fp8 multiplies fp32
    assert worst < (1e-4 if held == "e4m3" or held == "f32" else 5e-3), worst
