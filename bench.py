"""Throughput benchmark: random prompts of random lengths, ignore_eos, one warm-up, tok/s.

Without --model it builds (once, cached) a random-weight checkpoint of the Qwen3-0.6B shape:
throughput does not depend on weight values. --compare-hf runs the same requests through
transformers `generate` in the same process; --efficiency relates the run to limits measured in
the same process (matmul peak, memory-copy bandwidth).
"""
import argparse
import json
import os
import time
from random import Random

import torch

QWEN3_0_6B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False)


def random_qwen3_checkpoint() -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cache = os.environ.get("NANOVLLM_CACHE", os.path.expanduser("~/.cache/nanovllm"))
    path = os.path.join(cache, "bench-qwen3-0.6b-bfloat16")
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    print(f"building a random Qwen3-0.6B-shaped checkpoint in {path} (once)")
    config = Qwen3Config(**QWEN3_0_6B)
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    tmp = path + ".tmp"
    model.save_pretrained(tmp, safe_serialization=True)
    os.replace(tmp, path)
    return path


def parse_args() -> argparse.Namespace:
    on_cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF checkpoint folder (default: random Qwen3-0.6B shape)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", help="auto: the checkpoint's (fp32 on CPUs without bf16 units)")
    p.add_argument("--num-seqs", type=int, default=256 if on_cuda else 64)
    p.add_argument("--min-input-len", type=int, default=100 if on_cuda else 32)
    p.add_argument("--max-input-len", type=int, default=1024 if on_cuda else 256)
    p.add_argument("--min-output-len", type=int, default=100 if on_cuda else 32)
    p.add_argument("--max-output-len", type=int, default=1024 if on_cuda else 256)
    p.add_argument("--max-num-seqs", type=int, default=256 if on_cuda else 64)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--compare-hf", action="store_true", help="also run transformers generate on the same requests")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--efficiency", action="store_true",
                   help="measure matmul peak and copy bandwidth; report large-batch and batch-1 decode efficiency")
    p.add_argument("--json", help="write the results to this file")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def make_requests(args, vocab: int):
    rng = Random(args.seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(args.min_input_len, args.max_input_len))]
               for _ in range(args.num_seqs)]
    max_tokens = [rng.randint(args.min_output_len, args.max_output_len) for _ in range(args.num_seqs)]
    return prompts, max_tokens


def run_engine(llm, prompts, max_tokens) -> float:
    from nanovllm import SamplingParams
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


@torch.inference_mode()
def run_hf(path: str, dtype: torch.dtype, device: str, prompts, max_tokens, batch_size: int) -> float:
    """transformers generate as a user would: left-padded batches, sampling, no early stop."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None
    pad = 0
    model.generate(torch.tensor([[1, 2, 3]], device=device), max_new_tokens=2, do_sample=False, pad_token_id=pad)
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch, lens = prompts[i: i + batch_size], max_tokens[i: i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        model.generate(ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens),
                       do_sample=True, temperature=0.6, top_k=0, top_p=1.0, pad_token_id=pad)
    elapsed = time.perf_counter() - start
    del model
    return elapsed


def main() -> None:
    args = parse_args()
    from nanovllm import LLM
    path = args.model or random_qwen3_checkpoint()
    llm = LLM(path, device=args.device, dtype=args.dtype, enforce_eager=args.enforce_eager,
              max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
              tensor_parallel_size=args.tensor_parallel_size)
    cfg = llm.config
    prompts, max_tokens = make_requests(args, llm.vocab_size)
    total = sum(max_tokens)
    results = {"device": cfg.device, "dtype": str(cfg.torch_dtype).split(".")[-1], "num_seqs": args.num_seqs,
               "input_len": [args.min_input_len, args.max_input_len],
               "output_len": [args.min_output_len, args.max_output_len], "output_tokens": total,
               "threads": torch.get_num_threads()}
    elapsed = run_engine(llm, prompts, max_tokens)
    results["nanovllm"] = {"time_s": elapsed, "tok_s": total / elapsed}
    print(f"nano-vLLM     Total: {total}tok, Time: {elapsed:.2f}s, Throughput: {total / elapsed:.2f}tok/s "
          f"({args.num_seqs} requests, {cfg.device}, {results['dtype']})")
    if args.efficiency:
        from nanovllm.utils.efficiency import measure_efficiency
        results["efficiency"] = measure_efficiency(llm)
    device = llm.model_runner.device
    llm.exit()
    del llm
    if args.compare_hf:
        hf_time = run_hf(path, cfg.torch_dtype, str(device), prompts, max_tokens, args.hf_batch_size)
        results["transformers"] = {"time_s": hf_time, "tok_s": total / hf_time, "batch_size": args.hf_batch_size}
        results["speedup_vs_transformers"] = hf_time / elapsed
        print(f"transformers  Total: {total}tok, Time: {hf_time:.2f}s, Throughput: {total / hf_time:.2f}tok/s "
              f"(generate, batches of {args.hf_batch_size})")
        print(f"nano-vLLM / transformers throughput: {hf_time / elapsed:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
