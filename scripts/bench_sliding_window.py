"""Decode speed and KV blocks held behind a long prompt, the same random model with full attention
and with a sliding window on every layer (Mistral-style; SmolLM2-135M's shape, fp32 weights, f16 KV).

    python scripts/bench_sliding_window.py --depth 4096 --window 512

Per model: the prompt is prefilled once (warming the prefix cache), then the same prompt with 64
new tokens is timed (its prefill a cache hit but the last block), and the blocks held at the end of
the prefill and after the decode are read from the block manager. One process, models in turn.
"""
import argparse
import json
import os
import tempfile
import time

import torch

from nanovllm import LLM, SamplingParams


def make(root: str, window: int | None) -> str:
    from transformers import MistralConfig, MistralForCausalLM
    path = os.path.join(root, f"window-{window}")
    if not os.path.exists(os.path.join(path, "config.json")):
        config = MistralConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                               num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=32768,
                               sliding_window=window, tie_word_embeddings=True)
        config.architectures = ["MistralForCausalLM"]
        torch.manual_seed(0)
        MistralForCausalLM(config).save_pretrained(path)
    return path


def run(path: str, depth: int, new: int) -> dict:
    with LLM(path, dtype="float32", kv_cache_dtype="float16", max_model_len=depth + new + 16,
             max_num_batched_tokens=2048) as llm:
        prompt = [int(x) for x in torch.randint(10, 40000, (depth,), generator=torch.Generator().manual_seed(1))]
        bm = llm.scheduler.block_manager
        llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
        held = []
        step = llm.step

        def spy():
            out = step()
            held.append(bm.num_blocks - bm.num_free_blocks)
            return out
        llm.step = spy
        t0 = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=new, ignore_eos=True), use_tqdm=False)
        seconds = time.perf_counter() - t0
        return dict(window=bm.window, decode_tok_s=round(new / seconds, 1), blocks_held_max=max(held),
                    blocks_held_last=held[-1], block_size=bm.block_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "nanovllm-bench-window"))
    args = parser.parse_args()
    out = {str(w): run(make(args.dir, w), args.depth, args.new) for w in (None, args.window)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
