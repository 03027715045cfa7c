"""Decode speed and KV memory held behind a long prompt, the same random model with full attention
and with sliding windows: on every layer (`--family mistral`: Mistral-style, SmolLM2-135M's shape),
or on five layers of six beside full ones (`--family gemma3`: Gemma 3 1B's attention, 26 layers of
4 query / 1 KV head of 256, a full layer every sixth, with a narrower MLP and vocabulary so that an
8k prefill fits the benchmark). fp32 weights, f16 KV.

    python scripts/bench_sliding_window.py --depth 4096 --window 512
    python scripts/bench_sliding_window.py --family gemma3 --depth 8192 --window 512

Per model: the prompt is prefilled once (warming the prefix cache), then the same prompt with 64
new tokens is timed (its prefill a cache hit but the last block), and the blocks held after each
step are read from the block manager, as blocks and as bytes (a Gemma 3 block holds the layers of
one KV group, engine/kv_groups.py). One process, models in turn.
"""
import argparse
import json
import os
import tempfile
import time

import torch

from nanovllm import LLM, SamplingParams


def make(root: str, family: str, window: int | None) -> str:
    import transformers
    path = os.path.join(root, f"{family}-window-{window}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    if family == "mistral":
        config = transformers.MistralConfig(
            vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, head_dim=64, max_position_embeddings=32768, sliding_window=window,
            tie_word_embeddings=True)
        name = "MistralForCausalLM"
    else:  # Gemma 3 1B's layers and attention (sliding_window 512 in its config), a smaller MLP and vocabulary
        kinds = ["full_attention" if window is None or (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)]
        config = transformers.Gemma3TextConfig(
            vocab_size=32768, hidden_size=576, intermediate_size=1536, num_hidden_layers=26, num_attention_heads=4,
            num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, max_position_embeddings=32768,
            sliding_window=window or 512, layer_types=kinds)
        name = "Gemma3ForCausalLM"
    config.architectures = [name]
    torch.manual_seed(0)
    getattr(transformers, name)(config).save_pretrained(path)
    return path


def run(path: str, depth: int, new: int) -> dict:
    with LLM(path, dtype="float32", kv_cache_dtype="float16", max_model_len=depth + new + 16,
             max_num_batched_tokens=2048) as llm:
        top = min(40000, llm.config.hf_config.vocab_size)
        prompt = [int(x) for x in torch.randint(10, top, (depth,), generator=torch.Generator().manual_seed(1))]
        bm = llm.llm_engine.scheduler.kv_cache_manager
        llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
        held = []
        step = llm.llm_engine.step

        def spy():
            out = step()
            held.append(bm.num_blocks - bm.num_free_blocks)
            return out
        llm.llm_engine.step = spy
        t0 = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=new, ignore_eos=True), use_tqdm=False)
        seconds = time.perf_counter() - t0
        block_bytes = llm.llm_engine.model_runner.kv_block_bytes()
        return dict(windows=bm.windows, decode_tok_s=round(new / seconds, 1), blocks_held_max=max(held),
                    block_size=bm.block_size, block_bytes=block_bytes,
                    kv_mib_held_max=round(max(held) * block_bytes / 2**20, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["mistral", "gemma3"], default="mistral")
    parser.add_argument("--depth", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "nanovllm-bench-window"))
    args = parser.parse_args()
    out = {str(w): run(make(args.dir, args.family, w), args.depth, args.new) for w in (None, args.window)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
