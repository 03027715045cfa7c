"""Checks of an engine over a pre-quantized checkpoint against its dense reference."""
import json
import torch
from safetensors.torch import load_file
from helpers import check_tokens_close
from nanovllm import SamplingParams
from nanovllm.layers.quantization import linear_layers


NEW_TOKENS = 10


def model_of(llm):
    return llm.llm_engine.model_runner.model


def our_outputs(llm, prompts, vocab: int):
    """Greedy tokens and, per prompt, our log-probabilities of the prompt tokens and our top 5 (rest -inf)."""
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    rows = []
    for prompt in prompts:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5), use_tqdm=False)[0]
        r = torch.full((len(prompt) - 1, vocab), -float("inf"))
        for j, entry in enumerate(out["prompt_logprobs"][1:]):
            for token, logprob in entry.items():
                r[j, token] = logprob
        rows.append(r)
    return [o["token_ids"] for o in outs], rows


def check_against_reference(llm, folder: str, vocab: int = 256) -> float:
    """Our greedy tokens and prompt log-probabilities against the reference written beside folder
    (vLLM's check_logprobs_close rule for the tokens); returns the largest |logprob error|."""
    ref = json.load(open(f"{folder}.ref.json"))
    tensors = load_file(f"{folder}.ref.safetensors")
    tokens, logprobs = our_outputs(llm, ref["prompts"], vocab)
    check_tokens_close(tokens, [(t, tensors[f"logits.{i}"]) for i, t in enumerate(ref["tokens"])])
    worst = 0.0
    for i, (prompt, ours) in enumerate(zip(ref["prompts"], logprobs)):
        theirs = tensors[f"prompt_logprobs.{i}"]
        for j in range(len(prompt) - 1):
            ids = torch.cat([ours[j].topk(5).indices, torch.tensor([prompt[j + 1]])])
            worst = max(worst, (ours[j, ids] - theirs[j, ids]).abs().max().item())
    return worst


def llm_names(llm) -> str:
    return ", ".join(sorted({layer.quant_method.name for layer in linear_layers(model_of(llm))}))

