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

from helpers import make_qwen3
from prequantized_writers import WRITTEN, write_quantized
from nanovllm import LLM, SamplingParams
from nanovllm.kernels import cpu_kernels
from nanovllm.layers.quantization import linear_layers

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import llmcompressor_quantize as lq  # noqa: E402  (its reference() runs here too, on dense folders)
from prequantized_checks import NEW_TOKENS, check_against_reference, llm_names, model_of  # noqa: E402

PROMPTS = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [9, 8, 7, 100, 22, 5, 77, 31]]
# llm-compressor scheme -> the block format that holds it exactly ("f32": none does; dense fp32)
# ("+head": lm_head quantized too, which llm-compressor unties from the embedding; "+head8": lm_head
# int8 per channel in a config group of its own, named exactly, listed after the "Linear" group)
SCHEMES = {"W4A16": "q4_0", "W4A16_ASYM": "q5_0", "W8A16": "q8_0", "int4-asym-channel": "q5_0",
           "int8-asym-channel": "f32", "fp8-channel": "e4m3", "fp8-block128": "e4m3", "fp8-tensor": "e4m3",
           "W4A16_ASYM+head": "q5_0", "W4A16+head8": "q4_0"}
HEADS = {"W4A16_ASYM+head": "q5_0", "W4A16+head8": "q8_0"}  # how a quantized head is held


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
    of 128 per rank of two, tied embeddings) written by llm-compressor, with transformers'
    reference beside it."""
    root = tmp_path_factory.mktemp("compressed_tensors")
    src = make_qwen3(str(root / "dense"), shape="groups", tie_word_embeddings=True)
    run_llmcompressor(llmcompressor, "quantize", src, str(root), *SCHEMES)
    folders = {s: str(root / s) for s in SCHEMES}
    run_llmcompressor(llmcompressor, "reference", json.dumps(PROMPTS), str(NEW_TOKENS), *folders.values())
    return folders


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
    # compressed-tensors' precedence (utils/match.py): a group naming the module, else the "Linear" one
    groups = list(qc["config_groups"].values())
    w = next((g for g in groups if module in g["targets"]), None) or next(g for g in groups if "Linear" in g["targets"])
    w = w["weights"]
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
    with LLM(folder, kv_cache_dtype="float32", max_num_seqs=4, max_model_len=256, cpu_input_bits=14) as llm:
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
        check_head(llm, folder, HEADS.get(scheme), lambda: ct_dense(folder, "lm_head"))
        worst = check_against_reference(llm, folder)
    # integer schemes: our inputs are rounded to 14-bit integers per block (about 1e-3 here); fp8 multiplies fp32
    assert worst < (1e-4 if held == "e4m3" or held == "f32" else 5e-3), worst


@pytest.mark.parametrize("bits", ["auto", 14, 8])
def test_input_rounding_of_a16_formats(ct_folders, bits):
    """W8A16's inputs are rounded as cpu_input_bits says, as the GGUF formats' are: "auto" per group
    (int8 or 14 bits as the group needs), 14 everywhere (as vLLM keeps A16 activations in 16 bits),
    8 everywhere. The layers carry the named rounding; the outputs stay close to transformers' on
    the folder (the tokens by vLLM's closeness rule, the prompt log-probabilities within the bound)."""
    from nanovllm.config import CPU_INPUT_BITS
    folder = ct_folders["W8A16"]
    with LLM(folder, kv_cache_dtype="float32", max_num_seqs=4, max_model_len=256, cpu_input_bits=bits) as llm:
        planes = {layer.quant_method.input_planes for layer in linear_layers(model_of(llm)) if layer.prefix != "lm_head"}
        assert planes == {CPU_INPUT_BITS[bits]}, planes
        worst = check_against_reference(llm, folder)
    # int8 steps are 128x the two planes' (this random model's inputs hold few loud groups: "auto"
    # rounds almost all of them to int8)
    assert worst < {"auto": 0.2, 14: 5e-3, 8: 0.2}[bits], worst


def check_head(llm, folder: str, held: str | None, dense_head) -> None:
    """lm_head dense and tied to the embedding (held None: as the checkpoint's tied table), or held
    as block format held, equal to dense_head(), beside the checkpoint's dense embedding."""
    head, embedding = layer_at(llm, "lm_head"), layer_at(llm, "model.embed_tokens")
    table = load_file(os.path.join(folder, "model.safetensors"))["model.embed_tokens.weight"].float()
    assert torch.equal(embedding.weight.float(), table)
    if held is None:
        assert head.weight is embedding.weight
        return
    assert f" as {held} (C kernel)" in head.quant_method.name, head.quant_method.name
    assert torch.equal(held_weight(head), dense_head())


# ---- GPTQ, AWQ and FP8 folders written from the formats' definitions (prequantized_writers.py) -----
@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """case -> (the quantized folder, the dense folder of the weights it stands for, with transformers' reference)."""
    root = tmp_path_factory.mktemp("written")
    src = make_qwen3(str(root / "src"), shape="groups")
    out = {}
    for case, (qc, make, _) in WRITTEN.items():
        folder, dense = str(root / case), str(root / f"{case}-dense")
        write_quantized(src, folder, dense, qc, make)
        lq.reference(dense, PROMPTS, NEW_TOKENS)
        out[case] = (folder, dense)
    return out


@pytest.mark.parametrize("case", sorted(WRITTEN))
def test_written_formats(written, case):
    folder, dense = written[case]
    held = WRITTEN[case][2]
    plain = load_file(os.path.join(dense, "model.safetensors"))
    with LLM(folder, kv_cache_dtype="float32", max_num_seqs=4, max_model_len=256, cpu_input_bits=14) as llm:
        names = {layer.quant_method.name for layer in linear_layers(model_of(llm)) if layer.prefix != "lm_head"}
        assert all(f" as {held} (C kernel)" in n for n in names), names
        if "desc_act" in case:
            assert all(n.endswith("inputs permuted") for n in names), names
        for layer in ("model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.gate_up_proj",
                      "model.layers.1.mlp.down_proj", "model.layers.0.self_attn.o_proj"):
            ref = torch.cat([plain[f"{m}.weight"] for m in stacked_names(layer)])
            assert torch.equal(held_weight(layer_at(llm, layer)), ref), (case, layer)
        worst = check_against_reference(llm, dense)
    assert worst < (1e-4 if held == "e4m3" else 5e-3), worst


def test_gptq_quantized_head_of_a_tied_model(tmp_path):
    """GPTQ's lm_head: true (GPTQModel's quantized head) over a model with tied embeddings: the head
    multiplies from its own 4-bit tensors, the embedding stays the checkpoint's dense table."""
    qc, make, held = WRITTEN["gptq-4bit-g128-sym"]
    src = make_qwen3(str(tmp_path / "src"), shape="groups", tie_word_embeddings=True, seed=1)
    folder, dense = str(tmp_path / "gptq"), str(tmp_path / "dense")
    write_quantized(src, folder, dense, {**qc, "lm_head": True}, make)
    lq.reference(dense, PROMPTS, NEW_TOKENS)
    plain = load_file(os.path.join(dense, "model.safetensors"))
    with LLM(folder, kv_cache_dtype="float32", max_num_seqs=4, max_model_len=256, cpu_input_bits=14) as llm:
        check_head(llm, folder, held, lambda: plain["lm_head.weight"])
        assert check_against_reference(llm, dense) < 5e-3


# ---- tensor parallelism ----------------------------------------------------------------------------
def greedy(llm) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    return [o["token_ids"] for o in outs]


def test_tensor_parallel_equals_one_rank(ct_folders, written):
    """TP=2 shards the packed tensors (zero points packed along the outputs, scales by groups,
    g_idx with every rank loading all groups' scales; a quantized head by its vocabulary) and gives
    TP=1's tokens."""
    for folder in (ct_folders["W4A16_ASYM+head"], written["gptq-4bit-g64-desc_act"][0], written["fp8-tensor"][0]):
        # 14-bit inputs: per-group int8 rounding would turn the ranks' different order of sums
        # into different roundings
        with LLM(folder, kv_cache_dtype="float32", max_num_seqs=4, max_model_len=256, cpu_input_bits=14) as llm:
            one = greedy(llm)
        with LLM(folder, kv_cache_dtype="float32", max_num_seqs=4, max_model_len=256, cpu_input_bits=14, tensor_parallel_size=2) as llm:
            assert greedy(llm) == one, folder


def test_a_split_that_cuts_a_group_is_refused(written, tmp_path):
    """Refused before any rank starts, naming the layer: AWQ groups of 64 over down_proj's 256
    inputs are 4 groups, which 8 ranks would cut; fp8 blocks of 128 outputs over k_proj's 128
    outputs are one block, which 2 ranks would cut."""
    with pytest.raises(ValueError, match=r"tensor_parallel_size=8 would split the inputs of "
                                         r"model.layers.0.mlp.down_proj \(4 quantization groups\)"):
        LLM(written["awq-4bit-g64"][0], tensor_parallel_size=8)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 would split the outputs of "
                                         r"model.layers.0.self_attn.k_proj \(1 quantization blocks\)"):
        LLM(written["fp8-block128"][0], tensor_parallel_size=2)


# ---- without the C kernels (as on a GPU): dequantized once into the model dtype --------------------
def test_without_c_kernels_the_weights_are_dequantized(written, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)  # as where the C kernels cannot be built
    folder, dense = written["gptq-4bit-g128-sym"]
    with LLM(folder, kv_cache_dtype="float32", max_num_seqs=4, max_model_len=256) as llm:
        names = llm_names(llm)
        assert "GPTQ 4-bit as oneDNN-packed" in names and "C kernel" not in names, names
        # the dense weights the definition gives, multiplied in fp32 as transformers multiplies them
        assert check_against_reference(llm, dense) < 1e-4


# ---- bad input: refused before the model is built ---------------------------------------------------
def edited(folder: str, dst: Path, qc_edit=None, drop: str | None = None) -> str:
    """A copy of folder with its quantization_config edited and / or one tensor dropped."""
    subprocess.run(["cp", "-r", folder, str(dst)], check=True)
    config = json.load(open(dst / "config.json"))
    if qc_edit:
        qc_edit(config["quantization_config"])
    json.dump(config, open(dst / "config.json", "w"))
    if drop:
        tensors = load_file(str(dst / "model.safetensors"))
        del tensors[drop]
        save_file(tensors, str(dst / "model.safetensors"))
    return str(dst)


def test_bad_checkpoints_are_refused_before_anything_is_allocated(ct_folders, written, tmp_path, monkeypatch):
    from nanovllm.models.qwen3 import Qwen3ForCausalLM

    def built(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(Qwen3ForCausalLM, "__init__", built)
    gptq, awq, ct = written["gptq-4bit-g128-sym"][0], written["awq-4bit-g64"][0], ct_folders["W4A16_ASYM"]
    cases = [
        (gptq, dict(qc_edit=lambda qc: qc.update(quant_method="bitsandbytes")),
         r"quantization method 'bitsandbytes' \(config.json quantization_config.quant_method\) is not supported"),
        (gptq, dict(qc_edit=lambda qc: qc.update(bits=3)), r"GPTQ with 3-bit weights is not supported \(4 or 8\)"),
        (awq, dict(qc_edit=lambda qc: qc.update(version="gemv")), r"AWQ version 'gemv' is not supported"),
        (ct, dict(qc_edit=lambda qc: qc["config_groups"]["group_0"]["weights"].update(strategy="tensor")),
         r"scheme 'group_0': strategy 'tensor' is not supported for int weights \(channel, group\)"),
        (ct, dict(qc_edit=lambda qc: qc["config_groups"]["group_0"]["weights"].update(num_bits=2)),
         r"scheme 'group_0': 2-bit int weights are not supported"),
        (ct, dict(drop="model.layers.1.mlp.up_proj.weight_scale"),
         r"model.layers.1.mlp.up_proj: compressed-tensors 4-bit int pack-quantized weights need tensors "
         r"\['weight_packed', 'weight_scale', 'weight_shape', 'weight_zero_point'\]; the checkpoint has no "
         r"\['model.layers.1.mlp.up_proj.weight_scale'\]"),
        (gptq, dict(drop="model.layers.0.self_attn.k_proj.qzeros"),
         r"model.layers.0.self_attn.k_proj: GPTQ 4-bit weights need tensors \['qweight', 'qzeros', 'scales'\]"),
    ]
    for i, (folder, edit, message) in enumerate(cases):
        with pytest.raises(ValueError, match=message):
            LLM(edited(folder, tmp_path / f"case{i}", **edit))


def test_quantization_argument_names_the_checkpoints_own_format(written, tmp_path):
    folder, dense = written["awq-4bit-g64"]
    with LLM(folder, quantization="awq", kv_cache_dtype="float32", max_num_seqs=4, max_model_len=256) as llm:
        assert "AWQ 4-bit as q5_0" in llm_names(llm)
    with pytest.raises(ValueError, match=r"quantization='gptq' names a pre-quantized format, but config.json's "
                                         r"quantization_config names 'awq'"):
        LLM(folder, quantization="gptq")
    with pytest.raises(ValueError, match=r"quantization='fp8' names a pre-quantized format, but the checkpoint has "
                                         r"no quantization_config"):
        LLM(dense, quantization="fp8")


# ---- the default model, quantized by llm-compressor --------------------------------------------------
# SmolLM2-135M's 576 inputs are not whole groups of 128 (the presets' W4A16 / W8A16): the same
# schemes with groups of 64.
DEFAULT_SCHEMES = {"int4-sym-group64": "q4_0", "int8-sym-group64": "q8_0"}


@pytest.fixture(scope="module")
def default_quantized(llmcompressor, tmp_path_factory) -> dict[str, str]:
    from nanovllm.utils import default_model as dm
    cache = Path(os.environ.get(dm.CACHE_ENV) or REPO / ".cache" / "nanovllm")
    src = dm.default_model_path(cache)
    root = tmp_path_factory.mktemp("default_quantized")
    run_llmcompressor(llmcompressor, "quantize", src, str(root), *DEFAULT_SCHEMES)
    return {s: str(root / s) for s in DEFAULT_SCHEMES}


@pytest.mark.parametrize("scheme", sorted(DEFAULT_SCHEMES))
def test_default_model_quantized_by_llmcompressor(default_quantized, scheme):
    from gguf_helpers import assert_like_transformers, perplexity_and_answer
    folder = default_quantized[scheme]
    with LLM(folder, max_num_seqs=8, max_model_len=512) as llm:
        names = {layer.quant_method.name for layer in linear_layers(model_of(llm)) if layer.prefix != "lm_head"}
        assert all(f" as {DEFAULT_SCHEMES[scheme]} (C kernel)" in n for n in names), names
        chunks, ours, answer = perplexity_and_answer(llm)
    assert_like_transformers(folder, chunks, ours, answer)


# ---- the Triton kernels (CUDA), here under the Triton interpreter ------------------------------------
TRITON_RUN = """
import json, sys
sys.path[:0] = [{tests!r}]
from nanovllm import LLM
from prequantized_checks import check_against_reference, llm_names
with LLM({folder!r}, kv_cache_dtype="float32", max_num_seqs=4, max_model_len=256, enforce_eager=True) as llm:
    names = llm_names(llm)
    worst = check_against_reference(llm, {reference!r})
print(json.dumps({{"names": names, "worst": worst}}))
"""


@pytest.mark.parametrize("case", ["gptq-4bit-g64-desc_act", "fp8-block128", "ct-W8A16"])
def test_triton_kernels_through_the_engine(written, ct_folders, case):
    """The layers a GPU runs: the Triton weight-only kernel behind each linear (forced on this CPU,
    under TRITON_INTERPRET=1), against the same references as the C kernels."""
    pytest.importorskip("triton")
    folder, reference = (ct_folders["W8A16"],) * 2 if case.startswith("ct-") else written[case]
    code = TRITON_RUN.format(tests=str(REPO / "tests"), folder=folder, reference=reference)
    env = {**os.environ, "TRITON_INTERPRET": "1", "NANOVLLM_TRITON_WEIGHT_ONLY": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    kind = {"gptq-4bit-g64-desc_act": "int4 (Triton kernel, inputs by g_idx)", "fp8-block128": "fp8 (Triton kernel)",
            "ct-W8A16": "int8 (Triton kernel)"}[case]
    assert kind in result["names"], result["names"]
    assert result["worst"] < 1e-3, result  # fp32 inputs, fp32 products: only the order of sums differs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh runs it)")
@pytest.mark.parametrize("case", ["gptq-4bit-g64-desc_act", "awq-4bit-g64", "fp8-tensor"])
def test_on_a_gpu_the_triton_kernels_run_the_checkpoints(written, case):
    folder, dense = written[case]
    with LLM(folder, device="cuda", dtype="float32", max_num_seqs=4, max_model_len=256) as llm:
        assert "(Triton kernel" in llm_names(llm), llm_names(llm)
        # tl.dot's fp32 inputs round to tf32 on the GPU
        assert check_against_reference(llm, dense) < 0.05
