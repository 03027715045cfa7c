"""Gemma 2 / Gemma 3 GGUF files (llama.cpp's conventions: norms stored as 1 + w, ffn_norm before the
MLP, post_attention_norm / post_ffw_norm after, every 6th (gemma3) or 2nd (gemma2) layer full, the
rest sliding) written with the gguf package's GGUFWriter, against transformers reading the same
file: the log-probabilities of a prompt longer than the window."""
from pathlib import Path

import numpy as np
import pytest
import torch

from nanovllm import LLM, SamplingParams

gguf = pytest.importorskip("gguf")

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB, WINDOW = 64, 128, 2, 1, 256, 128, 8


def write_gemma(path: Path, arch: str, layers: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(100000.0)
    w.add_sliding_window(WINDOW)
    w.add_vocab_size(VOCAB)
    if arch == "gemma2":  # transformers' Gemma2Config defaults, which its GGUF reader keeps
        w.add_attn_logit_softcapping(50.0)
        w.add_final_logit_softcapping(30.0)

    def mat(n, k, scale=None):
        return (rng.standard_normal((n, k)) * (scale or k ** -0.5)).astype(np.float32)

    def norm(n):  # as llama.cpp's converter writes Gemma's norms: 1 + w
        return (1 + 0.2 * rng.standard_normal(n)).astype(np.float32)
    w.add_tensor("token_embd.weight", mat(VOCAB, HIDDEN, 0.3))
    w.add_tensor("output_norm.weight", norm(HIDDEN))
    for i in range(layers):
        for role, shape in {"attn_q": (HEADS * HEAD_DIM, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
                            "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HEADS * HEAD_DIM),
                            "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN), "ffn_down": (HIDDEN, INTER)}.items():
            w.add_tensor(f"blk.{i}.{role}.weight", mat(*shape, 3 * shape[1] ** -0.5))
        for role in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            w.add_tensor(f"blk.{i}.{role}.weight", norm(HIDDEN))
        if arch == "gemma3":
            for role in ("attn_q_norm", "attn_k_norm"):
                w.add_tensor(f"blk.{i}.{role}.weight", norm(HEAD_DIM))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch, layers", [("gemma3", 7), ("gemma2", 3)])
def test_gemma_files_match_transformers(tmp_path, arch, layers):
    from transformers import AutoModelForCausalLM

    path = write_gemma(tmp_path / f"{arch}.gguf", arch, layers)
    prompt = [int(t) for t in np.random.default_rng(1).integers(2, VOCAB, 3 * WINDOW)]
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    with LLM(str(path), dtype="float32", kv_cache_dtype="float32", max_model_len=128) as llm:
        kinds = [layer.self_attn.attn.sliding_window for layer in llm.llm_engine.model_runner.model.model.layers]
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5, logprobs=5),
                           use_tqdm=False)[0]
    pattern = 6 if arch == "gemma3" else 2
    assert kinds == [None if (i + 1) % pattern == 0 else WINDOW for i in range(layers)]
    # every prompt position past the first, and the next token: our top-5 log-probabilities are transformers'
    rows = out["prompt_logprobs"][1:] + out["logprobs"]
    assert len(rows) == len(prompt)
    for i, row in enumerate(rows):
        for token, logprob in row.items():
            assert abs(logprob - want[i, token].item()) < 2e-3, (i, token, logprob, want[i, token].item())
    assert out["token_ids"][0] == int(want[-1].argmax())
