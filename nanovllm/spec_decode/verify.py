"""Verification: which proposals the target accepts, from one forward over every proposed position.

A sequence with proposals d_0..d_{k-1} runs k+1 rows in the step: row j holds the token at position
len(seq) - 1 + j (its last token, then d_0, ...), so row j's logits are the target's next-token
distribution p_j given the sequence with d_0..d_{j-1} appended. Each row is processed as a plain
decode row of that extended sequence would be (penalties over its tokens, min_tokens, the grammar
state after the earlier proposals, a seeded request's draw of that position), then:

- greedy rows accept d_j while it is the argmax of p_j, and emit the argmax of the first row that
  differs (or of row k): exactly the tokens decoding without proposals gives;
- random rows accept d_j with probability min(1, p_j(d_j) / q_j(d_j)) (q_j: the proposer's
  distribution; a point mass where it proposes deterministically, as both proposers here do), and
  at the first rejection draw from norm(max(0, p_j - q_j)); with all k accepted, the bonus token
  is drawn from p_k. The emitted tokens are then distributed as the target's own samples
  (speculative sampling: Leviathan et al. 2023; Chen et al. 2023).
"""
import torch

from nanovllm.sample.sampler import SampledTokens, Sampler, SamplerOutput
from nanovllm.sample.sampling_metadata import SamplingMetadata


class DraftedMatcher:
    """A sequence's grammar matcher as it stands after `tokens` more (the proposals before a row):
    fills that row's bitmask, then rolls back. Only what fill_bitmask reads."""

    def __init__(self, matcher, tokens: list[int]):
        self.matcher, self.tokens = matcher, tokens

    @property
    def stop_token_ids(self):
        return self.matcher.stop_token_ids

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        accepted = 0
        for t in self.tokens:  # proposals were checked against the grammar when made (speculator)
            if not self.matcher.accept_token(t):
                break
            accepted += 1
        self.matcher.fill_next_token_bitmask(bitmask, index)
        if accepted:
            self.matcher.rollback(accepted)


class DraftedRow:
    """Sequence seq read as if its first j proposals were appended: the state row j of its
    verification conditions on (what SamplingMetadata.build reads of a sequence)."""

    def __init__(self, seq, drafts: list[int], j: int):
        self.seq, self.extra = seq, drafts[:j]
        self.sampling_params = seq.sampling_params
        self.num_tokens = len(seq) + j
        self.num_computed_tokens = self.num_tokens - 1  # one new token: a sampled row
        self.num_prompt_tokens = seq.num_prompt_tokens
        self.grammar = None if seq.grammar is None else DraftedMatcher(seq.grammar, self.extra)

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seq.prompt_token_ids

    @property
    def completion_token_ids(self) -> list[int]:
        return self.seq.completion_token_ids + self.extra


def verification_rows(seqs, drafts: list[list[int]]) -> list[DraftedRow]:
    return [DraftedRow(seq, d, j) for seq, d in zip(seqs, drafts) for j in range(len(d) + 1)]


def accept(target: torch.Tensor, probs: torch.Tensor | None, replacement: torch.Tensor | None,
           is_greedy: list[bool], drafts: list[list[int]], uniform: torch.Tensor | None,
           draft_probs: list[torch.Tensor | None] | None = None) -> list[list[int]]:
    """The tokens each sequence emits (accepted proposals, then one of the target's).

    target [rows]: each row's argmax (greedy rows); probs [rows, vocab]: each row's distribution
    (random rows; None when every row is greedy); replacement [rows]: a draw per row from the
    residual norm(max(0, p_j - q_j)) (row k of a sequence: from p_k); uniform [rows]: the acceptance
    draws; draft_probs: per sequence, q [k, vocab] of its proposals, None for a point mass."""
    target = target.tolist()
    out: list[list[int]] = []
    row = 0
    for i, d in enumerate(drafts):
        emitted: list[int] = []
        if is_greedy[i]:
            for j, token in enumerate(d):
                if target[row + j] != token:
                    break
                emitted.append(token)
            emitted.append(target[row + len(emitted)])
        else:
            q = None if draft_probs is None else draft_probs[i]
            for j, token in enumerate(d):
                p = float(probs[row + j, token])
                ratio = p if q is None else p / max(float(q[j, token]), 1e-30)
                if float(uniform[row + j]) >= ratio:
                    break
                emitted.append(token)
            emitted.append(int(replacement[row + len(emitted)]))
        out.append(emitted)
        row += len(d) + 1
    return out


def residual(probs: torch.Tensor, drafts: list[list[int]],
             draft_probs: list[torch.Tensor | None] | None = None) -> torch.Tensor:
    """Per row, what a rejection at it draws from: norm(max(0, p_j - q_j)) for proposal rows,
    p_k itself for a sequence's last row. Rows whose residual is empty (p_j == q_j) keep p_j:
    a rejection there has probability 0."""
    out = probs.clone()
    row = 0
    for i, d in enumerate(drafts):
        q = None if draft_probs is None else draft_probs[i]
        for j, token in enumerate(d):
            if q is None:
                out[row + j, token] = 0.0
            else:
                out[row + j] = (probs[row + j] - q[j]).clamp_(min=0.0)
            if float(out[row + j].sum()) <= 0.0:
                out[row + j] = probs[row + j]
        row += len(d) + 1
    return out / out.sum(dim=-1, keepdim=True)


def verify(sampler: Sampler, logits: torch.Tensor, seqs, drafts: list[list[int]], vocab_size: int,
           eos_token_ids, device: torch.device, to_device) -> SampledTokens:
    """The tokens each sequence emits from one verification step's logits [sum(len(d) + 1), vocab],
    with their logprobs entries (raw, as without proposals)."""
    rows = verification_rows(seqs, drafts)
    md = SamplingMetadata.build(rows, [1] * len(rows), vocab_size, eos_token_ids, device, to_device)
    constrained, raw_logprobs = sampler.constrain(logits, md)
    is_greedy = [seq.sampling_params.is_greedy for seq in seqs]
    target = constrained.argmax(dim=-1)
    probs = replacement = uniform = None
    if not all(is_greedy):
        probs = sampler.probs(constrained, md)
        # The acceptance draws first, then the replacement draws: a seeded row's generator gives
        # both, in that order, so a seeded request repeats exactly.
        uniform = torch.rand(len(rows), generator=sampler.generator, device=logits.device)
        for r, g in md.generators.items():
            uniform[r] = torch.rand(1, generator=g, device=logits.device)
        replacement = sampler.random_sample(residual(probs, drafts), md.generators, sampler.generator)
    emitted = accept(target, probs, replacement, is_greedy, drafts, uniform)
    # Each row's chosen token, for its logprobs entry: the emitted one (rows past them: unused).
    chosen = [t for d, e in zip(drafts, emitted) for t in e + [0] * (len(d) + 1 - len(e))]
    out = sampler.with_logprobs(SamplerOutput(torch.tensor(chosen, device=logits.device)), raw_logprobs, md)
    per_row = out.logprobs_per_row(chosen, md)
    logprobs, row = [], 0
    for d, e in zip(drafts, emitted):
        logprobs.append(per_row[row: row + len(e)])
        row += len(d) + 1
    return SampledTokens(emitted, [True] * len(seqs), logprobs)
