"""Throughput benchmark: random prompts of random lengths, ignore_eos, one warm-up, tok/s.

Without --model it builds (once, cached) a random-weight checkpoint of the Qwen3-0.6B shape:
throughput does not depend on weight values.
"""
import argparse
import os
import time
from random import Random

import torch

QWEN3_0_6B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False)


def random_qwen3_checkpoint(dtype: torch.dtype) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cache = os.environ.get("NANOVLLM_CACHE", os.path.expanduser("~/.cache/nanovllm"))
    path = os.path.join(cache, f"bench-qwen3-0.6b-{str(dtype).split('.')[-1]}")
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    print(f"building a random Qwen3-0.6B-shaped checkpoint in {path} (once)")
    config = Qwen3Config(**QWEN3_0_6B)
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = Qwen3ForCausalLM(config).to(dtype)
    tmp = path + ".tmp"
    model.save_pretrained(tmp, safe_serialization=True)
    os.replace(tmp, path)
    return path


def parse_args() -> argparse.Namespace:
    on_cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", help="HF checkpoint folder (default: random Qwen3-0.6B shape)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-seqs", type=int, default=256 if on_cuda else 64)
    p.add_argument("--min-input-len", type=int, default=100 if on_cuda else 32)
    p.add_argument("--max-input-len", type=int, default=1024 if on_cuda else 256)
    p.add_argument("--min-output-len", type=int, default=100 if on_cuda else 32)
    p.add_argument("--max-output-len", type=int, default=1024 if on_cuda else 256)
    p.add_argument("--max-num-seqs", type=int, default=256 if on_cuda else 64)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    from nanovllm import LLM, SamplingParams
    from nanovllm.config import _DTYPES
    path = args.model or random_qwen3_checkpoint(_DTYPES[args.dtype])
    llm = LLM(path, device=args.device, dtype=args.dtype, enforce_eager=args.enforce_eager,
              max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len)
    rng = Random(args.seed)
    vocab = llm.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(args.min_input_len, args.max_input_len))]
               for _ in range(args.num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True,
                             max_tokens=rng.randint(args.min_output_len, args.max_output_len))
              for _ in range(args.num_seqs)]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    total = sum(sp.max_tokens for sp in params)
    print(f"Total: {total}tok, Time: {elapsed:.2f}s, Throughput: {total / elapsed:.2f}tok/s "
          f"({args.num_seqs} requests, device {llm.config.device}, dtype {llm.config.torch_dtype})")
    llm.exit()


if __name__ == "__main__":
    main()
