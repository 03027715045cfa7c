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
