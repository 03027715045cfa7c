"""keep_freed_memory(): large CPU tensors come from glibc's heap and stay there once freed, so the
next step reuses warm pages instead of faulting in a fresh mmap (checked with mallinfo2)."""
import ctypes
import ctypes.util

import pytest
import torch

from nanovllm.utils.cpu_memory import keep_freed_memory


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                 "fordblks", "keepcost")]


def glibc():
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallinfo2"):
        pytest.skip("not glibc >= 2.33")
    libc.mallinfo2.restype = MallInfo2
    return libc


def test_large_tensors_come_from_the_heap_and_stay():
    libc = glibc()
    assert keep_freed_memory()
    size = 200 << 20
    mmapped_before = libc.mallinfo2().hblkhd
    t = torch.empty(size, dtype=torch.uint8)
    t.fill_(1)
    assert libc.mallinfo2().hblkhd - mmapped_before < size  # not its own mmap
    arena_in_use = libc.mallinfo2().arena
    assert arena_in_use >= size
    del t
    assert libc.mallinfo2().arena >= size  # freed, but not trimmed back to the OS
    assert libc.mallinfo2().arena >= arena_in_use - (1 << 20)


# A Qwen3 body of 47.2M parameters (189 MB in fp32): a second copy of its weights, or an fp32 one
# beside quantized blocks, would pass the margin below.
BODY = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8,
            num_key_value_heads=4, head_dim=64)
VOCAB = 256
MARGIN_MIB = 100  # the engine's own memory after load: the sampler, caches, the C library, heap slack

MEASURE = """
import json, re, sys
import torch, transformers
from transformers import AutoConfig, AutoTokenizer
from nanovllm import LLM
def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
path, quantization, dtype = sys.argv[1], sys.argv[2] or None, sys.argv[3]
AutoConfig.from_pretrained(path), AutoTokenizer.from_pretrained(path)  # transformers' own imports and caches
base = rss()
llm = LLM(path, max_num_seqs=4, max_model_len=256, cpu_kvcache_bytes=32 << 20, quantization=quantization,
          dtype=dtype)
print(json.dumps({"grew": rss() - base, "kv": llm.config.cpu_kvcache_bytes}))
"""


def hand_count_bytes(quantization, dtype="float32"):
    """The bytes the weights take as held, from the shapes: linear matrices (and the untied
    embedding and LM head) in fp32, bf16 or in Q8_0 blocks of 34 bytes per 32, norms in fp32."""
    h, i, layers = BODY["hidden_size"], BODY["intermediate_size"], BODY["num_hidden_layers"]
    q, kv = BODY["num_attention_heads"] * BODY["head_dim"], BODY["num_key_value_heads"] * BODY["head_dim"]
    matrices = layers * (h * (q + 2 * kv) + q * h + 3 * h * i) + 2 * VOCAB * h
    norms = layers * (2 * h + 2 * BODY["head_dim"]) + h
    per_weight = 34 / 32 if quantization is not None else 2 if dtype == "bfloat16" else 4
    return matrices * per_weight + 4 * norms


@pytest.mark.parametrize("quantization,dtype", [(None, "float32"), (None, "bfloat16"), ("q8_0", "float32")])
def test_rss_after_load_is_the_weights_held_once(tmp_path, quantization, dtype):
    """A fresh process's RSS grows by the weights as held (a hand count from the shapes), the KV
    cache and at most MARGIN_MIB when the engine loads: fp32 and bf16 weights are held once (no
    packed fp32 copy beside the dense one), quantized ones only as their blocks (no fp32 copy left
    from the load)."""
    import json
    import os
    import subprocess
    import sys

    from helpers import make_qwen3
    path = make_qwen3(str(tmp_path / "body"), vocab_size=VOCAB, tie_word_embeddings=False, **BODY)
    out = subprocess.run([sys.executable, "-c", MEASURE, path, quantization or "", dtype], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    held = hand_count_bytes(quantization, dtype)
    assert got["grew"] <= held + got["kv"] + (MARGIN_MIB << 20), (got, held)
    # and the weights are there: not a test that an unloaded model would pass
    assert got["grew"] >= 0.9 * held, (got, held)


DEFAULT_GGUF = """
import json, re, sys
def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
import torch, transformers, tokenizers  # what any engine on transformers' tokenizers imports
base = rss()
from nanovllm import LLM
llm = LLM(sys.argv[1], max_num_seqs=4, max_model_len=512, cpu_kvcache_bytes=64 << 20)
print(json.dumps({"grew": rss() - base,
                  "imported": sorted(m for m in ("sympy", "torch.distributed.tensor", "accelerate") if m in sys.modules)}))
"""


def test_default_model_holds_its_file_once():
    """A fresh process running the default model from its shipped Q4_1 file grows, past torch and
    transformers' import, by at most the file's size (the weights as their blocks, the vocabulary),
    the 64 MiB KV cache and the engine's margin: no dequantized copy of any matrix (the embedding
    table alone would be 113 MB in fp32). transformers' architecture config classes are not imported
    for a GGUF file: their import chain (torch.distributed.tensor, sympy, accelerate) alone is ~60 MiB."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import nanovllm.utils.default_model as dm
    cache = Path(os.environ.get(dm.CACHE_ENV) or Path(__file__).resolve().parents[2] / ".cache" / "nanovllm")
    dm.default_model_path(cache)  # fetches the shipped file on first use, as LLM.default() does
    gguf = cache / "downloads" / dm.GGUF_NAME
    out = subprocess.run([sys.executable, "-c", DEFAULT_GGUF, str(gguf)], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["grew"] <= gguf.stat().st_size + (64 << 20) + (MARGIN_MIB << 20), (got, gguf.stat().st_size)
    assert got["imported"] == [], got
