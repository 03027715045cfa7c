"""Prompt logprobs (SamplingParams.prompt_logprobs): the log-probability of every prompt token given
the tokens before it, from the logits of every prompt position of the rows that ask.

ModelRunner selects those positions (logits_positions) on every rank, then, on rank 0, splits the
logits (split_prompt_logits): each row's last position goes to the Sampler, the rest become entries.
"""
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

LOGPROB_ROWS = 1024  # prompt positions turned into fp32 logprobs at once

if TYPE_CHECKING:  # NOTE: annotations only: the sampler sits below the engine and never imports it
    from nanovllm.engine.sequence import Sequence


@dataclass
class PromptLogprobs:
    """One row's entries of one step: entries[i] is prompt token first_index + i's
    {token_id: logprob}, the actual token first, then the top-k of its position."""

    first_index: int
    entries: list[dict[int, float]]


def logits_positions(num_new_tokens: list[int], needs_prompt_logits: list[bool] | None) -> list[int]:
    """Indices into a prefill step's flat tokens whose logits are computed: every new token of the
    rows that need prompt logits, the last new token of the others.

    NOTE: computed from the scheduler's output alone, so every tensor-parallel rank selects the
    same rows (the LM head gathers them to rank 0)."""
    indices: list[int] = []
    start = 0
    for i, n in enumerate(num_new_tokens):
        if needs_prompt_logits is not None and needs_prompt_logits[i]:
            indices.extend(range(start, start + n))
        else:
            indices.append(start + n - 1)
        start += n
    return indices


def split_prompt_logits(logits: torch.Tensor, seqs: "list[Sequence]", num_new_tokens: list[int],
                        needs_prompt_logits: list[bool]) -> tuple[torch.Tensor, list[PromptLogprobs | None]]:
    """logits [len(logits_positions(...)), vocab] -> (the sampler's logits [num_rows, vocab], the
    prompt logprobs of each row or None).

    A chunk computing positions [s, s + n) of a prompt of P tokens gives the entries of tokens
    s + 1 .. min(s + n, P - 1): position p's logits predict token p + 1, and every prompt token is
    known up front, so the chunk's last position already yields the next chunk's first entry.
    Position P - 1 predicts the first completion token: the sampler's, not an entry.
    """
    last_rows, rows, targets, spans = [], [], [], []
    offset = 0
    for seq, n, needs in zip(seqs, num_new_tokens, needs_prompt_logits):
        if not needs:
            last_rows.append(offset)
            offset += 1
            spans.append(None)
            continue
        start = seq.num_computed_tokens
        end = min(start + n, seq.num_prompt_tokens - 1)  # the last token whose entry this chunk gives
        count = max(end - start, 0)
        spans.append((start + 1, len(targets), count, seq.sampling_params.prompt_logprobs))
        rows.extend(range(offset, offset + count))
        targets.extend(seq.token_ids[start + 1: start + 1 + count])
        last_rows.append(offset + n - 1)
        offset += n
    assert offset == logits.shape[0], "logits rows do not match the step's selected positions"
    device = logits.device
    sample_logits = logits[torch.tensor(last_rows, device=device)]
    if not targets:
        return sample_logits, [None if s is None else PromptLogprobs(s[0], []) for s in spans]
    k = max(s[3] for s in spans if s is not None)
    chosen, top_ids, top_lps = prompt_token_logprobs(logits[torch.tensor(rows, device=device)],
                                                     torch.tensor(targets, device=device), k)
    out: list[PromptLogprobs | None] = []
    for span in spans:
        if span is None:
            out.append(None)
            continue
        first, at, count, row_k = span
        entries = []
        for j in range(at, at + count):
            entry = {targets[j]: chosen[j]}
            for t, lp in zip(top_ids[j][:row_k], top_lps[j][:row_k]):
                entry.setdefault(t, lp)
            entries.append(entry)
        out.append(PromptLogprobs(first, entries))
    return sample_logits, out


def prompt_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int) -> tuple[list, list, list]:
    """log_softmax (fp32) of logits [M, vocab]: the targets' [M] logprobs and the top-k ids and
    logprobs [M, k], as host lists. NOTE: in slices of LOGPROB_ROWS rows, so the fp32 copies stay
    small next to the [M, vocab] logits themselves (M <= max_num_batched_tokens)."""
    chosen, top_ids, top_lps = [], [], []
    for start in range(0, logits.shape[0], LOGPROB_ROWS):
        logprobs = torch.log_softmax(logits[start: start + LOGPROB_ROWS].float(), dim=-1)
        rows = targets[start: start + LOGPROB_ROWS]
        chosen += logprobs.gather(1, rows.unsqueeze(1)).squeeze(1).tolist()
        if k == 0:
            top_ids += [[] for _ in range(len(rows))]
            top_lps += [[] for _ in range(len(rows))]
            continue
        values, ids = logprobs.topk(min(k, logprobs.shape[1]), dim=-1)
        top_ids += ids.tolist()
        top_lps += values.tolist()
    return chosen, top_ids, top_lps
