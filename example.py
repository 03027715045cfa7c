"""The main job: answer a few chat prompts with a model folder and print prompt and completion."""
import argparse

from nanovllm import LLM, SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "List three prime numbers.",
    "Introduce yourself in one sentence.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="HF checkpoint folder (config.json, *.safetensors, tokenizer)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    args = parser.parse_args()
    llm = LLM(args.model, device=args.device)
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    outputs = llm.chat(conversations, params)
    for prompt, out in zip(PROMPTS, outputs):
        print(f"\nPrompt: {prompt!r}\nCompletion: {out['text']!r}")
    llm.exit()


if __name__ == "__main__":
    main()
