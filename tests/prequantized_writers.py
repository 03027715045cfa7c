"""GPTQ, AWQ and FP8 checkpoints laid out from the formats' published definitions (cited at each
writer), with the dense weights each definition gives: the references of tests/models/test_prequantized.py,
written here and not by the engine's code."""
import json
import os
import subprocess

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 words held in int64 as the int32 tensors the formats store."""
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)


def pack_along(values: torch.Tensor, bits: int, dim: int, order: list[int] | None = None) -> torch.Tensor:
    """32 / bits consecutive values along dim per int32 word, value order[j] (or j) in the j-th lowest bits."""
    per = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, per)
    order = order or list(range(per))
    words = sum(v[..., order[j]] << (bits * j) for j in range(per))
    return to_int32(words).movedim(-1, dim).contiguous()


def quantize_groups(w: torch.Tensor, bits: int, g_idx: torch.Tensor, groups: int, sym: bool):
    """Round-to-nearest integers of w [n, k] per (output, group): (q [n, k] in [0, 2^bits), scales
    fp16 [n, groups], zero points [n, groups]), the usual min-max rule (GPTQ's and AWQ's quantizers)."""
    maxq = 2**bits - 1
    scales = torch.empty(w.shape[0], groups)
    zeros = torch.empty(w.shape[0], groups, dtype=torch.int64)
    for g in range(groups):
        part = w[:, g_idx == g]
        lo, hi = part.min(1).values.clamp(max=0), part.max(1).values.clamp(min=0)
        if sym:
            hi = torch.maximum(hi, -lo)
            lo = -hi
        scales[:, g] = ((hi - lo) / maxq).to(torch.float16).float()
        zeros[:, g] = 2 ** (bits - 1) if sym else torch.round(-lo / scales[:, g]).clamp(0, maxq).to(torch.int64)
    q = torch.round(w / scales[:, g_idx]) + zeros[:, g_idx]
    return q.clamp(0, maxq).to(torch.int64), scales.to(torch.float16), zeros


def gptq_tensors(w: torch.Tensor, bits: int, group: int, sym: bool, desc_act: bool, v2: bool, rng):
    """AutoGPTQ's QuantLinear.pack layout (auto_gptq/nn_modules/qlinear): qweight [k * bits / 32, n]
    packed along the inputs, qzeros [groups, n * bits / 32] along the outputs holding zero - 1
    ("gptq" v1; "gptq_v2": the zero point), scales [groups, n] fp16, g_idx [k]; and the dense weight
    the checkpoint stands for: scales[g_idx[i], o] * (q[i, o] - (stored zero + 1 in v1))."""
    n, k = w.shape
    group = k if group == -1 else group
    # desc_act: one order per input (the layer input's activation statistics order it), so q / k / v share it
    order = torch.randperm(k, generator=torch.Generator().manual_seed(k)) if desc_act else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // group  # desc_act: groups made in a scattered input order
    q, scales, zeros = quantize_groups(w, bits, g_idx, k // group, sym)
    stored = (zeros if v2 else zeros - 1) & (2**bits - 1)
    t = {"qweight": pack_along(q.t(), bits, 0), "qzeros": pack_along(stored.t(), bits, 1),
         "scales": scales.t().contiguous(), "g_idx": g_idx.to(torch.int32)}
    meant = stored if v2 else stored + 1
    return t, scales.float()[:, g_idx] * (q - meant[:, g_idx]).float()


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def awq_tensors(w: torch.Tensor, group: int, rng):
    """AutoAWQ's WQLinear_GEMM layout (awq/modules/linear/gemm.py): qweight [k, n / 8] and qzeros
    [groups, n / 8] packed along the outputs in the order [0, 2, 4, 6, 1, 3, 5, 7], scales [groups, n]."""
    n, k = w.shape
    g_idx = torch.arange(k) // group
    q, scales, zeros = quantize_groups(w, 4, g_idx, k // group, sym=False)
    t = {"qweight": pack_along(q.t(), 4, 1, AWQ_ORDER), "qzeros": pack_along(zeros.t(), 4, 1, AWQ_ORDER),
         "scales": scales.t().contiguous()}
    return t, scales.float()[:, g_idx] * (q - zeros[:, g_idx]).float()


def fp8_tensors(w: torch.Tensor, block: list[int] | None, rng):
    """vLLM's fp8 layout: weight float8_e4m3fn [n, k] cast from w / scale, weight_scale (one fp32 per
    tensor) or weight_scale_inv [ceil(n / bo), ceil(k / bi)] (weight_block_size); w = weight * scale."""
    if block is None:
        scale = w.abs().max() / 448
        w8 = (w / scale).to(torch.float8_e4m3fn)
        return {"weight": w8, "weight_scale": scale.reshape(())}, w8.float() * scale
    bo, bi = block
    n, k = w.shape
    scale = w.abs().reshape(n // bo, bo, k // bi, bi).amax((1, 3)) / 448
    full = scale.repeat_interleave(bo, 0).repeat_interleave(bi, 1)
    w8 = (w / full).to(torch.float8_e4m3fn)
    return {"weight": w8, "weight_scale_inv": scale.contiguous()}, w8.float() * full


WRITTEN = {  # case -> (quantization_config, tensors(w, rng) -> (tensors, dense), the block format held)
    "gptq-4bit-g128-sym": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
                           lambda w, rng: gptq_tensors(w, 4, 128, True, False, False, rng), "q4_0"),
    "gptq-4bit-g64-desc_act": ({"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True, "sym": False},
                               lambda w, rng: gptq_tensors(w, 4, 64, False, True, False, rng), "q5_0"),
    "gptq-8bit-channel-sym": ({"quant_method": "gptq", "bits": 8, "group_size": -1, "desc_act": False, "sym": True},
                              lambda w, rng: gptq_tensors(w, 8, -1, True, False, False, rng), "q8_0"),
    "gptq_v2-4bit-g128": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": False,
                           "checkpoint_format": "gptq_v2"},
                          lambda w, rng: gptq_tensors(w, 4, 128, False, False, True, rng), "q5_0"),
    "awq-4bit-g64": ({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"},
                     lambda w, rng: awq_tensors(w, 64, rng), "q5_0"),
    "fp8-tensor": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, lambda w, rng: fp8_tensors(w, None, rng),
                   "e4m3"),
    "fp8-block128": ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
                     lambda w, rng: fp8_tensors(w, [128, 128], rng), "e4m3"),
}


def write_quantized(src: str, dst: str, dense_dst: str, qc: dict, make) -> None:
    """src's linear layers replaced by make's tensors in dst (with qc in config.json), and the
    weights they stand for in dense_dst (a plain checkpoint, for transformers). lm_head stays dense
    unless qc has GPTQ's "lm_head": true (GPTQModel's quantized head); a tied head is then written
    as a head of its own (the tied table's copy), quantized, beside the dense embedding, and the
    dense reference is untied."""
    rng = torch.Generator().manual_seed(0)
    dense = load_file(os.path.join(src, "model.safetensors"))
    config = json.load(open(os.path.join(src, "config.json")))
    untie = {}
    if qc.get("lm_head") and "lm_head.weight" not in dense:
        dense["lm_head.weight"] = dense["model.embed_tokens.weight"].clone()
        untie = {"tie_word_embeddings": False}
    quantized, plain = {}, dict(dense)
    for name, tensor in dense.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and (module.endswith(LINEARS) or module == "lm_head" and qc.get("lm_head")):
            t, meant = make(tensor.float(), rng)
            quantized.update({f"{module}.{key}": value for key, value in t.items()})
            plain[name] = meant.contiguous()
        else:
            quantized[name] = tensor
    for folder, tensors, extra in ((dst, quantized, {"quantization_config": qc}), (dense_dst, plain, untie)):
        os.makedirs(folder, exist_ok=True)
        for file in os.listdir(src):
            if file != "model.safetensors" and not file.endswith(".json") or file.startswith("tokenizer"):
                subprocess.run(["cp", os.path.join(src, file), folder], check=True)
        json.dump({**config, **extra}, open(os.path.join(folder, "config.json"), "w"))
        save_file(tensors, os.path.join(folder, "model.safetensors"))
