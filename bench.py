"""Throughput benchmark: random prompts of random lengths, ignore_eos, one warm-up, tok/s.

Without --model it builds (once, cached) a random-weight checkpoint of the Qwen3-0.6B shape:
throughput does not depend on weight values. --compare-hf runs the same requests through
transformers `generate` in the same process; --efficiency relates the run to limits measured in
the same process (matmul peak, memory-copy bandwidth).
"""
import argparse
import json
import os
import sys
import time
from random import Random

from nanovllm.utils.cli_args import ArgumentParser, positive_int, print_error  # first: nanovllm's thread defaults

import torch  # noqa: E402

QWEN3_0_6B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False)


# A mixture of experts of Qwen3-30B-A3B's kind (64 experts, 8 active per token) at a size that fits
# a small machine in fp32: 1.5B parameters, 0.33B of them read per token (the 8 experts of 24 layers,
# attention, the tied embedding as LM head).
QWEN3_MOE_BENCH = dict(hidden_size=768, intermediate_size=2048, moe_intermediate_size=384, num_hidden_layers=24,
                       num_attention_heads=12, num_key_value_heads=4, head_dim=64, num_experts=64,
                       num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936, max_position_embeddings=40960,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
# Qwen3.5-0.8B's kind (24 layers, every fourth full attention with 8 query / 2 KV heads of 256 and a
# quarter of each head rotated; the others Gated DeltaNet with 16 key and value heads of 128) with
# the Qwen2 vocabulary the llama.cpp converter's tokenizer check knows.
QWEN3_5_BENCH = dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
                     num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                     linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                     vocab_size=151936, max_position_embeddings=65536, rms_norm_eps=1e-6, tie_word_embeddings=True)
# GLM-4.5-Air's kind (a dense first layer, then 64 routed experts of which 8 a token plus one shared,
# the sigmoid router, biased q/k/v, half of each head rotated) at QWEN3_MOE_BENCH's size.
GLM4_MOE_BENCH = dict(hidden_size=768, intermediate_size=2048, moe_intermediate_size=384, num_hidden_layers=24,
                      num_attention_heads=12, num_key_value_heads=4, head_dim=64, n_routed_experts=64,
                      num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                      routed_scaling_factor=1.0, norm_topk_prob=True, attention_bias=True, partial_rotary_factor=0.5,
                      num_nextn_predict_layers=0, vocab_size=151936, max_position_embeddings=40960,
                      rms_norm_eps=1e-5, tie_word_embeddings=False)
# LFM2-700M's shape (16 layers: 10 short convolutions and attention at 2, 5, 8, 10, 12 and 14; the
# MLP at its adjusted width) with the Qwen2 vocabulary the GGUF converter's tokenizer step knows.
LFM2_BENCH = dict(hidden_size=1536, intermediate_size=6912, block_auto_adjust_ff_dim=False, num_hidden_layers=16,
                  num_attention_heads=24, num_key_value_heads=8, conv_L_cache=3, full_attn_idxs=[2, 5, 8, 10, 12, 14],
                  vocab_size=151936, max_position_embeddings=128000, norm_eps=1e-5, tie_word_embeddings=True)
# LFM2-8B-A1B's kind (its layer pattern: 6 attention layers among 16 here, the first 2 dense, then 32
# experts of which 4 a token under the biased sigmoid router) at a size this bench's machines hold.
LFM2_MOE_BENCH = dict(hidden_size=768, intermediate_size=2048, moe_intermediate_size=512, num_experts=32,
                      num_experts_per_tok=4, num_dense_layers=2, num_hidden_layers=16, num_attention_heads=12,
                      num_key_value_heads=4, conv_L_cache=3,
                      layer_types=["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)],
                      vocab_size=151936, max_position_embeddings=128000, norm_eps=1e-5, tie_word_embeddings=True)
# Granite-4.0-H-350M's kind (Mamba-2 layers with attention at every 8th, no experts, no rotary,
# Granite's multipliers) with the Qwen2 vocabulary the GGUF converter's tokenizer step knows.
GRANITE_HYBRID_BENCH = dict(hidden_size=768, shared_intermediate_size=2048, intermediate_size=2048, num_local_experts=0,
                            num_experts_per_tok=0, num_hidden_layers=32, num_attention_heads=12, num_key_value_heads=4,
                            layer_types=["attention" if (i + 1) % 8 == 0 else "mamba" for i in range(32)],
                            mamba_n_heads=48, mamba_d_head=32, mamba_expand=2, mamba_d_state=128, mamba_n_groups=1,
                            mamba_d_conv=4, position_embedding_type=None, embedding_multiplier=12.0,
                            attention_multiplier=0.0078125, residual_multiplier=0.246, logits_scaling=3.0,
                            vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-5, tie_word_embeddings=True)
# Falcon-H1-0.5B's shape (36 layers, each a Mamba-2 mixer of 24 heads x 64 x 128 beside attention
# of 8 heads; no mixer norm) with the Qwen2 vocabulary; the multipliers at 1 (a converter folds them).
FALCON_H1_BENCH = dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=36, num_attention_heads=8,
                       num_key_value_heads=2, head_dim=64, mamba_d_ssm=1536, mamba_n_heads=24, mamba_d_head=64,
                       mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4, mamba_rms_norm=False,
                       vocab_size=151936, max_position_embeddings=16384, rms_norm_eps=1e-5, tie_word_embeddings=False)
RANDOM_MODELS = {"qwen3-moe": "a random Qwen3-MoE (24 layers, 64 experts, 8 active; 1.5B parameters, bf16)"}

# GPT-OSS-20B's kind (24 layers of 32 experts, 4 active; sinks; windows of 128 on every other layer;
# YaRN) at hidden 1024: 2.6B parameters, the experts (2.4B) in MXFP4 as OpenAI ships them (1.3 GB),
# 0.36B parameters read per token.
GPT_OSS_BENCH = dict(hidden_size=1024, intermediate_size=1024, num_hidden_layers=24, num_attention_heads=16,
                     num_key_value_heads=4, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
                     sliding_window=128, vocab_size=151936, max_position_embeddings=131072,
                     tie_word_embeddings=False)


def random_checkpoint(name: str, family: str, shape: dict, config_class: str | None = None) -> str:
    """A random-weight bf16 checkpoint of transformers' {family}ForCausalLM, built once in the cache."""
    import transformers
    cache = os.environ.get("NANOVLLM_CACHE", os.path.expanduser("~/.cache/nanovllm"))
    path = os.path.join(cache, f"bench-{name}-bfloat16")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    print(f"building a random {name}-shaped checkpoint in {path} (once)")
    config = getattr(transformers, config_class or f"{family}Config")(**shape)
    config.architectures = [f"{family}ForCausalLM"]
    torch.manual_seed(0)
    with torch.device("meta"):  # allocated directly in bf16 below, never in fp32
        model = getattr(transformers, f"{family}ForCausalLM")(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    model.tie_weights()
    with torch.no_grad():
        for p in model.parameters():  # transformers' initializer_range, norms at one
            p.normal_(0, config.initializer_range) if p.dim() > 1 else p.fill_(1.0)
    tmp = path + ".tmp"
    model.save_pretrained(tmp, safe_serialization=True)
    os.replace(tmp, path)
    return path


def random_gpt_oss_mxfp4_checkpoint() -> str:
    """A random GPT-OSS-shaped checkpoint (GPT_OSS_BENCH) in OpenAI's layout: experts as MXFP4
    _blocks / _scales (random codes, exponents giving weights of about transformers' init size),
    everything else bf16; built once in the cache, written tensor by tensor."""
    import json

    import transformers
    from safetensors.torch import save_file
    cache = os.environ.get("NANOVLLM_CACHE", os.path.expanduser("~/.cache/nanovllm"))
    path = os.path.join(cache, "bench-gpt-oss-mxfp4")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    print(f"building a random GPT-OSS-shaped MXFP4 checkpoint in {path} (once)")
    config = transformers.GptOssConfig(**GPT_OSS_BENCH)
    config.architectures = ["GptOssForCausalLM"]
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in transformers.GptOssForCausalLM(config).state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith("gate_up_proj") or name.endswith("down_proj"):  # [E, inputs, outputs]
            e, k, n = shape
            tensors[f"{name}_blocks"] = torch.randint(0, 256, (e, n, k // 32, 16), dtype=torch.uint8, generator=gen)
            # codes of std ~3.3 (E2M1 doubled) at 2^(e - 128): e = 121 gives weights of std ~0.026
            tensors[f"{name}_scales"] = torch.randint(120, 123, (e, n, k // 32), dtype=torch.uint8, generator=gen)
        elif len(shape) > 1 or name.endswith("bias") or name.endswith("sinks"):
            tensors[name] = (torch.randn(shape, generator=gen) * config.initializer_range).to(torch.bfloat16)
        else:
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
    tmp = path + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    config_dict = config.to_dict()
    config_dict["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config_dict, f, indent=2)
    os.replace(tmp, path)
    return path


def random_qwen3_checkpoint() -> str:
    return random_checkpoint("qwen3-0.6b", "Qwen3", QWEN3_0_6B)


# SmolLM3's blocks (NoPE every 4th layer) at Qwen3-0.6B's size and vocabulary (the GGUF converter's
# vendored Qwen2 vocabulary fits it): the 3B model's layers at a size this bench's machines hold.
SMOLLM3_BENCH = {k: v for k, v in QWEN3_0_6B.items() if k != "head_dim"}


def random_smollm3_checkpoint() -> str:
    return random_checkpoint("smollm3-0.6b", "SmolLM3", SMOLLM3_BENCH)


def random_glm4_moe_checkpoint() -> str:
    return random_checkpoint("glm4.5-moe", "Glm4Moe", GLM4_MOE_BENCH)


def random_lfm2_checkpoint() -> str:
    return random_checkpoint("lfm2-700m", "Lfm2", LFM2_BENCH)


def random_lfm2_moe_checkpoint() -> str:
    return random_checkpoint("lfm2-moe", "Lfm2Moe", LFM2_MOE_BENCH)


def random_granite_hybrid_checkpoint() -> str:
    """GRANITE_HYBRID_BENCH's checkpoint, its config's layer types in the hub's names (mamba /
    attention: llama.cpp's converter looks for them)."""
    import json
    path = random_checkpoint("granite-4.0-h-350m", "GraniteMoeHybrid", GRANITE_HYBRID_BENCH)
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    if config["layer_types"] != GRANITE_HYBRID_BENCH["layer_types"]:
        config["layer_types"] = GRANITE_HYBRID_BENCH["layer_types"]
        with open(config_path, "w") as f:
            json.dump(config, f, indent=2)
    return path


def random_falcon_h1_checkpoint() -> str:
    return random_checkpoint("falcon-h1-0.5b", "FalconH1", FALCON_H1_BENCH)


def random_qwen3_moe_checkpoint() -> str:
    return random_checkpoint("qwen3-moe", "Qwen3Moe", QWEN3_MOE_BENCH)


def random_qwen3_5_checkpoint() -> str:
    return random_checkpoint("qwen3.5-0.8b", "Qwen3_5", QWEN3_5_BENCH, config_class="Qwen3_5TextConfig")


def build_parser() -> ArgumentParser:
    on_cuda = torch.cuda.is_available()
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF checkpoint folder or .gguf file (default: a random-weight Qwen3-0.6B-shaped bf16 "
                   "checkpoint, built once in $NANOVLLM_CACHE or ~/.cache/nanovllm); qwen3-moe: "
                   + RANDOM_MODELS["qwen3-moe"] + ", built the same way")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto (default): CUDA if available, else CPU")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto (default): float32 on CPUs, the checkpoint's on GPUs")
    from nanovllm.layers.backends.kv_formats import NAMES as KV_NAMES
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_NAMES),
                   help="how the KV cache stores K and V (default: auto: 16-bit on CPUs, the model's dtype on GPUs)")
    from nanovllm.cli import add_kv_offloading_args
    add_kv_offloading_args(p)  # a tier under the prefix cache (docs/serving.md)
    from nanovllm.layers.quantization.block_formats import ONLINE_FORMATS
    p.add_argument("--quantization", default=None, choices=list(ONLINE_FORMATS),
                   help="quantize the weights at load into this GGUF block format (CPU; default: none)")
    # Workload defaults depend on the device: the original's on CUDA, a few minutes' worth on CPU.
    for flag, cuda, cpu, help_ in [
        ("--num-seqs", 256, 64, "requests to generate"),
        ("--min-input-len", 100, 32, "shortest random prompt, in tokens"),
        ("--max-input-len", 1024, 256, "longest random prompt, in tokens"),
        ("--min-output-len", 100, 32, "fewest new tokens of a request (ignore_eos)"),
        ("--max-output-len", 1024, 256, "most new tokens of a request"),
        ("--max-num-seqs", 256, 64, "engine: most sequences in one step"),
    ]:
        p.add_argument(flag, type=positive_int, default=cuda if on_cuda else cpu,
                       help=f"{help_} (default: {cuda} on CUDA, {cpu} on CPU)")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                   help="engine: most tokens in one step, the prefill chunk (default: the platform's, 8192 on CPU)")
    p.add_argument("--max-model-len", type=positive_int, default=4096,
                   help="engine: longest prompt + output (default: %(default)s)")
    p.add_argument("--enforce-eager", action="store_true", help="engine: no CUDA graphs")
    from nanovllm.cli import json_object
    p.add_argument("--speculative-config", type=json_object, default=None,
                   help='engine: speculative decoding, vLLM\'s JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                   "(docs/speculative.md; default: none). Random prompts give the n-gram lookup little to find: "
                   "scripts/bench_speculative.py measures it on real text")
    p.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1,
                   help="engine: devices (GPUs, or CPU processes) to shard the model over (default: %(default)s)")
    p.add_argument("--compare-hf", action="store_true", help="also run transformers generate on the same requests")
    p.add_argument("--hf-batch-size", type=positive_int, default=16,
                   help="with --compare-hf: requests per left-padded transformers batch (default: %(default)s)")
    p.add_argument("--efficiency", action="store_true",
                   help="measure matmul peak and copy bandwidth; report large-batch and batch-1 decode efficiency")
    p.add_argument("--json", metavar="FILE", help="also write the results to FILE")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random prompts and lengths (default: %(default)s)")
    return p


def parse_args() -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args()
    check_lengths(parser, args)
    return args


def check_lengths(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Length flags that are fine alone but not together: reported before any checkpoint is built."""
    for kind in ("input", "output"):
        low, high = getattr(args, f"min_{kind}_len"), getattr(args, f"max_{kind}_len")
        if low > high:
            parser.error(f"--min-{kind}-len ({low}) must be <= --max-{kind}-len ({high})")
    if args.max_input_len + args.max_output_len > args.max_model_len:
        parser.error(f"--max-input-len + --max-output-len ({args.max_input_len} + {args.max_output_len}) "
                     f"must be <= --max-model-len ({args.max_model_len})")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        parser.error(f"--json {args.json!r}: its folder does not exist")


def make_requests(args, vocab: int):
    rng = Random(args.seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(args.min_input_len, args.max_input_len))]
               for _ in range(args.num_seqs)]
    max_tokens = [rng.randint(args.min_output_len, args.max_output_len) for _ in range(args.num_seqs)]
    return prompts, max_tokens


def run_engine(llm, prompts, max_tokens) -> float:
    """Seconds to generate every request. The progress bar (requests, tokens, elapsed time) redraws
    at most twice a second: no measurable share of a run."""
    from nanovllm import SamplingParams
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=True)
    return time.perf_counter() - start


def peak_rss_gib() -> float:
    """The largest resident set of this process or of any of its finished children (TP workers), GiB."""
    import resource
    kib = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    return kib / 2**20


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


def main() -> int:
    args = parse_args()
    from nanovllm import LLM
    from nanovllm.engine_args import EngineArgs
    options = dict(device=args.device, dtype=args.dtype, quantization=args.quantization,
                   kv_cache_dtype=args.kv_cache_dtype, enforce_eager=args.enforce_eager,
                   max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                   max_num_batched_tokens=args.max_num_batched_tokens,
                   tensor_parallel_size=args.tensor_parallel_size, speculative_config=args.speculative_config)
    from nanovllm.cli import kv_offloading_kwargs
    options.update(kv_offloading_kwargs(args))
    try:
        EngineArgs(args.model, **options)  # every flag's value, before a random checkpoint is written
    except (ValueError, TypeError) as e:
        return print_error("bench.py", e)
    path = random_qwen3_moe_checkpoint() if args.model == "qwen3-moe" else args.model or random_qwen3_checkpoint()
    print(f"bench.py: loading {path}", flush=True)
    try:
        llm = LLM(path, **options)
    except (ValueError, TypeError) as e:  # our validation of the model folder or an engine flag
        return print_error("bench.py", e)
    cfg = llm.config
    longest = args.max_input_len + args.max_output_len
    if longest > cfg.max_model_len:  # max_model_len is capped to the model's positions
        llm.exit()
        return print_error("bench.py", f"--max-input-len + --max-output-len ({longest}) exceeds this model's "
                           f"max_model_len ({cfg.max_model_len})")
    prompts, max_tokens = make_requests(args, llm.llm_engine.vocab_size)
    total = sum(max_tokens)
    results = {"device": cfg.device, "dtype": str(cfg.torch_dtype).split(".")[-1],
               "weight_dtype": str(cfg.weight_dtype).split(".")[-1], "kv_cache_dtype": cfg.kv_format.name,
               "num_seqs": args.num_seqs,
               "input_len": [args.min_input_len, args.max_input_len],
               "output_len": [args.min_output_len, args.max_output_len], "output_tokens": total,
               "threads": torch.get_num_threads()}
    print(f"bench.py: {args.num_seqs} requests, {sum(map(len, prompts))} prompt tokens in, {total} tokens out "
          f"(ignore_eos), on {cfg.device} with {results['threads']} threads; peak RSS so far "
          f"{peak_rss_gib():.2f} GiB. The default CPU run takes 2-4 minutes on 2 cores "
          "(docs/benchmarks.md)", flush=True)
    elapsed = run_engine(llm, prompts, max_tokens)
    results["nanovllm"] = {"time_s": elapsed, "tok_s": total / elapsed}
    print(f"nano-vLLM     Total: {total}tok, Time: {elapsed:.2f}s, Throughput: {total / elapsed:.2f}tok/s "
          f"({args.num_seqs} requests, {cfg.device}, {results['dtype']}"
          + ("" if results["weight_dtype"] == results["dtype"] else f", {results['weight_dtype']} weights")
          + f", {results['kv_cache_dtype']} KV cache)")
    if llm.llm_engine.speculator is not None:
        results["speculation"] = llm.llm_engine.speculator.metrics.as_dict()
        print(llm.llm_engine.speculator.metrics.summary())
    if args.efficiency:
        from nanovllm.utils.efficiency import measure_efficiency
        results["efficiency"] = measure_efficiency(llm)
    device = llm.llm_engine.model_runner.device
    llm.exit()  # (its tensor-parallel workers end here, and count in the peak below)
    del llm
    results["peak_rss_gib"] = peak_rss_gib()
    print(f"peak RSS {results['peak_rss_gib']:.2f} GiB (this process, or its largest tensor-parallel worker)")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
