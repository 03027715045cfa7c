"""Perplexity scored as llama.cpp's llama-perplexity scores it: the text's tokens (no BOS added
where the vocabulary does not add one) in chunks of n_ctx, each chunk evaluated on its own, and only
the predictions of its second half counted (tokens n_ctx / 2 + 1 .. n_ctx - 1 of each chunk);
perplexity = exp(mean negative log-likelihood). Used by bench_llamacpp.py --perplexity (against
llama-perplexity on the same file) and tests/models/test_gguf.py (against transformers)."""
import math
import re

N_CTX = 128


def chunks_of(tokenizer, text: str, n_ctx: int = N_CTX) -> list[list[int]]:
    """The text's tokens in whole chunks of n_ctx (a partial last chunk is dropped, as llama-perplexity does)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [ids[i:i + n_ctx] for i in range(0, len(ids) - n_ctx + 1, n_ctx)]


def scored(nll_by_position: list[float]) -> list[float]:
    """The counted part of one chunk's negative log-likelihoods (nll_by_position[j]: of token j
    given the tokens before it; position 0 has none)."""
    n_ctx = len(nll_by_position)
    return nll_by_position[n_ctx // 2 + 1:]


def perplexity(nlls: list[float]) -> float:
    return math.exp(sum(nlls) / len(nlls))


def our_perplexity(llm, chunks: list[list[int]]) -> float:
    """nano-vLLM's perplexity over the chunks, from prompt_logprobs."""
    from nanovllm import SamplingParams
    outs = llm.generate(chunks, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    nll = []
    for chunk, out in zip(chunks, outs):
        entries = out["prompt_logprobs"]
        nll += scored([0.0] + [-entries[j][chunk[j]] for j in range(1, len(chunk))])
    return perplexity(nll)


def parse_llama_perplexity(log: str) -> float:
    """The final figure of llama-perplexity's output ("Final estimate: PPL = 12.3456 +/- 0.5")."""
    match = re.search(r"Final estimate: PPL = ([0-9.]+)", log)
    if match is None:
        raise ValueError("no 'Final estimate: PPL = ...' line in llama-perplexity's output")
    return float(match.group(1))


def main() -> None:
    """python scripts/perplexity.py [--model M] [--n-ctx N] [--kv-cache-dtype auto,float32,...] [--text FILE]:
    our perplexity of the text under each KV cache format (one engine each), as llama-perplexity
    scores it."""
    import argparse
    from pathlib import Path

    from nanovllm import LLM
    from nanovllm.layers.backends.kv_formats import NAMES
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--model", help="HF folder or .gguf file (default: the default model)")
    p.add_argument("--n-ctx", type=int, default=N_CTX, help="tokens per chunk (default: %(default)s)")
    p.add_argument("--kv-cache-dtype", default="float32,auto", help="comma-separated kv_cache_dtype values")
    p.add_argument("--text", default=str(Path(__file__).resolve().parent.parent / "tests" / "data" / "english.txt"))
    args = p.parse_args()
    names = args.kv_cache_dtype.split(",")
    bad = [n for n in names if n not in NAMES]
    if bad:
        p.error(f"--kv-cache-dtype: {bad} not in {list(NAMES)}")
    if args.model is None:
        from nanovllm.utils.default_model import default_model
        args.model = default_model()
    model = args.model
    text = Path(args.text).read_text()
    reference = None
    for name in names:
        with LLM(model, kv_cache_dtype=name, max_model_len=args.n_ctx + 1, enable_prefix_caching=False) as llm:
            chunks = chunks_of(llm.tokenizer, text, args.n_ctx)
            if not chunks:
                p.error(f"{args.text} holds fewer than {args.n_ctx} tokens")
            value = our_perplexity(llm, chunks)
        reference = value if reference is None else reference
        print(f"kv_cache_dtype={name:9s} n_ctx={args.n_ctx} chunks={len(chunks)} PPL={value:.4f} "
              f"({100 * (value / reference - 1):+.3f}% vs {names[0]})", flush=True)


if __name__ == "__main__":
    main()
