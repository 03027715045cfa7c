"""Pieces of the agent-API tests: Qwen3's own chat template (llama.cpp's copy, from the
llama-cpp-python sdist, kept in tests/data), a tiny Qwen3 whose greedy reply is known by construction (a bigram
model: each token's successor is written into its weights), and `nanovllm serve` as a subprocess."""
import hashlib
import os
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

# Qwen3-0.6B's chat template as llama.cpp ships it, kept in tests/data (its provenance in
# tests/data/README.md) so that nothing is downloaded at test time.
TEMPLATE = Path(__file__).parent / "data" / "Qwen-Qwen3-0.6B.jinja"
TEMPLATE_SHA256 = "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5"
# Qwen3's added tokens (its tokenizer has them; the template writes them as text).
SPECIAL = ["<|im_start|>", "<|im_end|>"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]


def qwen3_chat_template() -> str:
    """Qwen3-0.6B's chat template, checked against the sdist member's sha256."""
    data = TEMPLATE.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    assert digest == TEMPLATE_SHA256, f"{TEMPLATE} is not the file tests/data/README.md names (sha256 {digest})"
    return data.decode()


def make_scripted_qwen3(path: str, script: list[str], template: str):
    """A tiny Qwen3 with a byte-level tokenizer plus Qwen3's added tokens and `template`, whose
    greedy next token after script[i] is script[i + 1] (each entry one token, none repeated):
    attention and MLP outputs are zero, so each position's logits depend on its own token only,
    and the head maps each script token's normalised embedding to its successor."""
    from helpers import make_byte_tokenizer, make_qwen3
    from transformers import AutoModelForCausalLM

    make_qwen3(path, vocab_size=272, seed=5, max_position_embeddings=4096)
    tokenizer = make_byte_tokenizer(path)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    tokenizer.add_tokens(ADDED)
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = template
    tokenizer.save_pretrained(path)
    ids = []
    for piece in script:
        (token,) = tokenizer.encode(piece, add_special_tokens=False)
        ids.append(token)
    assert len(set(ids)) == len(ids), "a script token may appear once"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        normed = model.model.norm(model.model.embed_tokens.weight)
        head = torch.zeros_like(model.lm_head.weight)
        for src, dst in zip(ids, ids[1:]):
            head[dst] += 4.0 * normed[src] / normed[src].norm()
        model.lm_head.weight.copy_(head)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path, safe_serialization=True)
    return tokenizer


@contextmanager
def serve(model: str, *flags: str):
    """`nanovllm serve model flags...` on a free port; yields its URL once /health answers."""
    from process_helpers import stop
    from server_fixtures import wait_for_health

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "nanovllm.cli", "serve", model, "--port", str(port), "--log-level", "warning",
           "--kvcache-block-size", "16", *flags]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_health(proc, url)
        yield url
    finally:
        stop(proc)
