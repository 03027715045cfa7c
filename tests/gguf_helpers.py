"""Tiny GGUF files written with the gguf package, and the logprob / perplexity comparisons against transformers the GGUF and quantization tests share."""
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import qtype, random_weights
from nanovllm import SamplingParams

gguf = pytest.importorskip("gguf")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import perplexity as ppl  # noqa: E402  (scripts/perplexity.py: llama-perplexity's scoring)


TEXT = (REPO / "tests" / "data" / "english.txt").read_text()


def model_of(llm):
    return llm.llm_engine.model_runner.model


# ---- perplexity as llama-perplexity scores it (scripts/perplexity.py) --------------------------------
def hf_perplexity(model, chunks) -> float:
    nll = []
    for chunk in chunks:
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([chunk])).logits[0].float(), -1)
        nll += ppl.scored([0.0] + [-logp[j - 1, chunk[j]].item() for j in range(1, len(chunk))])
    return ppl.perplexity(nll)


def perplexity_and_answer(llm) -> tuple[list[list[int]], float, str]:
    """The chunks of TEXT llama-perplexity scores, our perplexity over them, and our greedy answer
    to "What is the capital of France?" (the default model and its quantized forms)."""
    chunks = ppl.chunks_of(llm.tokenizer, TEXT)
    ours = ppl.our_perplexity(llm, chunks)
    prompt = llm.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    answer = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]["text"]
    return chunks, ours, answer


def assert_like_transformers(folder: str, chunks: list[list[int]], ours: float, answer: str) -> None:
    """Our perplexity within 2% of transformers' on the same folder, and an answer naming Paris."""
    from transformers import AutoModelForCausalLM
    ref = hf_perplexity(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), chunks)
    assert abs(ours / ref - 1) < 0.02, (ours, ref)
    assert "Paris" in answer, answer


def llama_cpp_row_order(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's order of a llama q / k projection's rows: each head's two halves
    interleaved (its rotary layout)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# The formats gguf.quants cannot quantize into: tiny files hold random blocks of them.
RANDOM_BLOCKS = ("q4_k", "q5_k", "q6_k", "q2_k", "q3_k", "iq4_nl", "iq4_xs", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs",
                 "iq3_s", "iq1_s", "iq1_m")


def write_tiny(path: Path, arch: str, types: dict[str, str], hidden=256, inter=512, layers=2, heads=4,
               kv_heads=2, vocab=320, seed=0, untied=False, metadata: dict | None = None) -> Path:
    """A random model as a GGUF file; types: tensor role (attn_q, ffn_down, token_embd, output,
    ...) -> GGUF type name (default F32); metadata: more keys (float values as float32, int as uint32)."""
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    for key, value in (metadata or {}).items():
        (w.add_uint32 if isinstance(value, int) else w.add_float32)(key, value)

    def add(name: str, role: str, value: np.ndarray) -> None:
        kind = types.get(role, "f32")
        if value.ndim == 1 or kind == "f32":
            w.add_tensor(name, value.astype(np.float32))
        elif kind in RANDOM_BLOCKS:  # gguf.quants has no quantizer for these: random blocks
            w.add_tensor(name, random_weights(kind, *value.shape, rng, std=float(value.std())), raw_dtype=qtype(kind))
        else:
            w.add_tensor(name, gguf.quants.quantize(value.astype(np.float32), qtype(kind)), raw_dtype=qtype(kind))

    def mat(n, k, scale=None):
        return rng.standard_normal((n, k)).astype(np.float32) * (scale or k ** -0.5)

    add("token_embd.weight", "token_embd", mat(vocab, hidden, 0.1))
    if untied:
        add("output.weight", "output", mat(vocab, hidden))
    add("output_norm.weight", "norm", 1 + 0.1 * rng.standard_normal(hidden))
    shapes = {"attn_q": (heads * head_dim, hidden), "attn_k": (kv_heads * head_dim, hidden),
              "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, heads * head_dim),
              "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden), "ffn_down": (hidden, inter)}
    for i in range(layers):
        for role, shape in shapes.items():
            value = mat(*shape)
            if arch == "llama" and role in ("attn_q", "attn_k"):
                value = llama_cpp_row_order(value, heads if role == "attn_q" else kv_heads)
            add(f"blk.{i}.{role}.weight", role, value)
        for role in ("attn_norm", "ffn_norm"):
            add(f"blk.{i}.{role}.weight", role, 1 + 0.1 * rng.standard_normal(hidden))
        if arch == "qwen2":
            for role in ("attn_q", "attn_k", "attn_v"):
                add(f"blk.{i}.{role}.bias", role, 0.1 * rng.standard_normal(shapes[role][0]))
        if arch == "qwen3":
            for role in ("attn_q_norm", "attn_k_norm"):
                add(f"blk.{i}.{role}.weight", role, 1 + 0.1 * rng.standard_normal(head_dim))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def quantized_like_kernels(x: torch.Tensor, group: int, bits: int | str = 14) -> torch.Tensor:
    """x rounded as the C kernels quantize a linear layer's input, per group of `group` values:
    to 14-bit integers, scale max|x| / 127^2 (bits 14), to int8, scale max|x| / 127 (bits 8), or
    (bits "auto") to int8 where its rounding noise, group (max|x| / 127)^2 / 12, is within 1e-4 of
    the group's sum of squares and to 14 bits elsewhere; round half to even."""
    g = x.reshape(*x.shape[:-1], -1, group)
    amax = g.abs().amax(-1, keepdim=True)
    if bits == "auto":
        loud = (amax.double() / 127) ** 2 * group / 12 > 1e-4 * (g.double() ** 2).sum(-1, keepdim=True)
        top = torch.where(loud, 127.0 * 127, 127.0).to(g.dtype)
    else:
        top = torch.tensor(127.0 * 127 if bits == 14 else 127.0, dtype=g.dtype)
    q = torch.where(amax > 0, g * (top / amax.clamp_min(1e-30)), torch.zeros_like(g)).round()
    q = torch.minimum(torch.maximum(q, -top), top)
    return (q * (amax / top)).reshape(x.shape)


def hf_logprobs_of_file(path: Path, prompt: list[int], input_groups: dict[str, int] | None = None,
                        bits: int | str = 14) -> torch.Tensor:
    """transformers' log-probabilities on the file (it dequantizes the tensors itself); with
    input_groups (HF module name suffix -> group), each such linear layer's input quantized as the
    C kernels quantize it, so that the result differs from ours only by the order of float sums."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    for name, module in model.named_modules():
        group = next((g for suffix, g in (input_groups or {}).items() if name.endswith(suffix)), None)
        if group is not None and isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(lambda m, args, g=group: (quantized_like_kernels(args[0], g, bits),))
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)


def our_logprobs(llm, prompt: list[int], vocab: int) -> torch.Tensor:
    """Our log-probabilities of every prompt token given the ones before it [len - 1], and of our
    top-5 at each position (the rest -inf), as rows comparable to HF's."""
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5), use_tqdm=False)[0]
    rows = torch.full((len(prompt) - 1, vocab), -math.inf)
    for j, entry in enumerate(out["prompt_logprobs"][1:]):
        for token, logprob in entry.items():
            rows[j, token] = logprob
    return rows


def logprob_errors(ours: torch.Tensor, reference: torch.Tensor, prompt: list[int]) -> torch.Tensor:
    """|ours - reference| of each position's prompt token and our top 5."""
    out = []
    for j in range(len(prompt) - 1):
        ids = torch.cat([ours[j].topk(5).indices, torch.tensor([prompt[j + 1]])])
        out.append((ours[j, ids] - reference[j, ids]).abs())
    return torch.stack(out)


# One file per case: (arch, tensor types); 'all' covers each format at least once, stacked parts in
# different formats included (Q4_K q / k with Q6_K v, as llama-quantize's Q4_K_M writes them).
CASES = {
    "llama-f32": ("llama", {}),
    "llama-q8_0": ("llama", {r: "q8_0" for r in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                                                  "ffn_down", "token_embd")}),
    "llama-q4_k_m": ("llama", {"attn_q": "q4_k", "attn_k": "q4_k", "attn_v": "q6_k", "attn_output": "q4_k",
                               "ffn_gate": "q4_k", "ffn_up": "q4_k", "ffn_down": "q6_k", "token_embd": "q4_k"}),
    "qwen2-mixed": ("qwen2", {"attn_q": "q4_0", "attn_k": "q4_1", "attn_v": "q5_0", "attn_output": "q5_1",
                              "ffn_gate": "f16", "ffn_up": "bf16", "ffn_down": "q8_0", "token_embd": "q6_k"}),
    "qwen3-q5_k": ("qwen3", {"attn_q": "q5_k", "attn_k": "q5_k", "attn_v": "q6_k", "attn_output": "q5_k",
                             "ffn_gate": "q5_k", "ffn_up": "q5_k", "ffn_down": "q5_k", "token_embd": "q8_0"}),
    # the decoded-block formats (kernels/cpu_quant_decoded.h), stacked parts in different ones
    "llama-k-low": ("llama", {"attn_q": "q3_k", "attn_k": "q2_k", "attn_v": "iq4_xs", "attn_output": "iq4_nl",
                              "ffn_gate": "q3_k", "ffn_up": "iq4_xs", "ffn_down": "q2_k", "token_embd": "q3_k"}),
    "llama-iq": ("llama", {"attn_q": "iq2_xxs", "attn_k": "iq2_xs", "attn_v": "iq2_s", "attn_output": "iq3_xxs",
                           "ffn_gate": "iq3_s", "ffn_up": "iq1_s", "ffn_down": "iq1_m", "token_embd": "iq4_xs"}),
    "qwen3-q4_0": ("qwen3", {r: "q4_0" for r in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                                                 "ffn_down", "token_embd", "output")}),
}

