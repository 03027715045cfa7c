"""Sampler: one token per row from the final logits, for the whole batch at once.

ModelRunner calls it with a SamplingMetadata (sample/sampling_metadata.py). Order, as in vLLM:
raw logprobs, grammar mask (structured outputs), min_tokens mask, penalties, greedy argmax; then
temperature, min_p, top_k, top_p and one exact draw from the result, with the draw function the
platform names (platform.random_sample, a key of RANDOM_SAMPLES): an exponential race
(Gumbel-max) or inverse-CDF.
"""
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.sample.prompt_logprobs import PromptLogprobs
from nanovllm.sample.sampling_metadata import SamplingMetadata
from nanovllm.sample.structured_outputs import apply_token_bitmask
from nanovllm.sampling_params import MIN_TEMPERATURE

TOP_P_CANDIDATES = 1024  # tokens searched for the top-p cut before falling back to a full sort
# A draw: probs [num_rows, vocab], the generators of seeded rows, the generator of the others -> token ids.
RandomSample = Callable[[torch.Tensor, dict[int, torch.Generator], torch.Generator | None], torch.Tensor]


@dataclass
class SampledTokens:
    """One step's result on the host, per scheduled row (vLLM v1's ModelRunnerOutput): the tokens
    it emits, one, or 1..k+1 where the step verified k proposals (the accepted ones, then the
    target's own: spec_decode/verify.py), each with its logprobs entry (None unless asked);
    is_sampled False on rows that are mid-prompt chunks (their one token means nothing);
    prompt_logprobs: per row, the prompt entries this prefill step computed (None: no row asked)."""

    token_ids: list[list[int]]
    is_sampled: list[bool]
    logprobs: list[list[dict[int, float] | None]]
    prompt_logprobs: "list[PromptLogprobs | None] | None" = None

    @property
    def num_emitted(self) -> int:
        """The tokens the step's sampled rows emit."""
        return sum(len(t) for t, sampled in zip(self.token_ids, self.is_sampled) if sampled)


@dataclass
class SampledRows:
    """The sampler's result on the host: one token per row and its logprobs entry (None unless asked)."""

    token_ids: list[int]
    is_sampled: list[bool]
    logprobs: list[dict[int, float] | None]

    def as_tokens(self) -> SampledTokens:
        """As a step's result: each row's one token."""
        return SampledTokens([[t] for t in self.token_ids], self.is_sampled, [[lp] for lp in self.logprobs])


@dataclass
class SamplerOutput:
    """token_ids [num_rows]; with logprobs: chosen token's logprob [num_rows] and the top-N
    token ids / logprobs [num_rows, N] of each row (N = the most any row asked for)."""

    token_ids: torch.Tensor
    chosen_logprobs: torch.Tensor | None = None
    top_token_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None

    def to_host(self, metadata: SamplingMetadata) -> SampledRows:
        token_ids = self.token_ids.tolist()
        return SampledRows(token_ids, metadata.is_sampled, self.logprobs_per_row(token_ids, metadata))

    def logprobs_per_row(self, token_ids: list[int], metadata: SamplingMetadata) -> list[dict[int, float] | None]:
        """{token_id: logprob} per row, the chosen token first, then the row's top-N."""
        if self.chosen_logprobs is None:
            return [None] * len(metadata.num_logprobs)
        chosen = self.chosen_logprobs.tolist()
        top_ids, top_lps = self.top_token_ids.tolist(), self.top_logprobs.tolist()
        rows: list[dict[int, float] | None] = []
        for i, n in enumerate(metadata.num_logprobs):
            if n is None:
                rows.append(None)
                continue
            entry = {token_ids[i]: chosen[i]}
            for t, lp in zip(top_ids[i][:n], top_lps[i][:n]):
                entry.setdefault(t, lp)
            rows.append(entry)
        return rows


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """vLLM/HF penalties. repetition: over prompt + output tokens; presence/frequency: output only."""
    num_rows, vocab = logits.shape
    # [num_rows, vocab + 1]: the extra column swallows the padding id (vocab_size).
    output_counts = torch.zeros(num_rows, vocab + 1, dtype=logits.dtype, device=logits.device)
    output_counts.scatter_add_(1, md.output_token_ids, torch.ones_like(md.output_token_ids, dtype=logits.dtype))
    output_counts = output_counts[:, :vocab]
    seen = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=logits.device)
    seen.scatter_(1, md.prompt_token_ids, True)
    seen = seen[:, :vocab] | (output_counts > 0)
    rep = md.repetition_penalties.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    # NOTE: a tiny (or huge) repetition penalty makes logits infinite, and softmax of an inf is NaN,
    # which samples an id outside the vocabulary and fails the whole step. Bounded so that even the
    # smallest temperature cannot overflow them (a quarter: headroom for rounding).
    bound = torch.finfo(logits.dtype).max * MIN_TEMPERATURE / 4
    penalized = penalized.clamp(-bound, bound)
    logits = torch.where(seen, penalized, logits)
    logits = logits - md.frequency_penalties.unsqueeze(1) * output_counts
    return logits - md.presence_penalties.unsqueeze(1) * (output_counts > 0).to(logits.dtype)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability."""
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, k_max: int | None = None) -> torch.Tensor:
    """Mask all but each row's top_k [num_rows] tokens (top_k >= vocab_size: off). k_max: the
    largest top_k below vocab_size, when the caller knows it on the host (saves a device sync)."""
    is_off = top_k >= logits.shape[1]
    if k_max is None:
        k_max = int(top_k.masked_fill(is_off, 0).max())
    if k_max == 0:
        return logits
    # A partial top-k (not a full sort): below the k-th largest value goes.
    kth = logits.topk(k_max, dim=-1).values.gather(1, (top_k.clamp(max=k_max) - 1).unsqueeze(1))
    kth = kth.masked_fill(is_off.unsqueeze(1), float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p [num_rows]
    (inf: off), the token that crosses it included; the top token always stays.

    NOTE: sorting the whole vocabulary is slow on CPU, so the cut is first looked for among the
    TOP_P_CANDIDATES most likely tokens; only rows whose candidates hold less than p are sorted.
    """
    vocab = logits.shape[1]
    values, order = logits.topk(min(vocab, TOP_P_CANDIDATES), dim=-1)  # [num_rows, K], descending
    probs = (values - torch.logsumexp(logits, dim=-1, keepdim=True)).exp()
    cumulative = probs.cumsum(dim=-1)
    drop = cumulative - probs >= top_p.unsqueeze(1)  # the mass of the more likely tokens reached p
    drop[:, 0] = False
    out = torch.full_like(logits, float("-inf")).scatter_(1, order, values.masked_fill(drop, float("-inf")))
    is_off = torch.isinf(top_p)
    out = torch.where(is_off.unsqueeze(1), logits, out)
    unresolved = (cumulative[:, -1] < top_p) & ~is_off
    if values.shape[1] < vocab and bool(unresolved.any()):
        rows = unresolved.nonzero().squeeze(1)
        sorted_logits, full_order = logits[rows].sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        full_drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p[rows].unsqueeze(1)
        full_drop[:, 0] = False
        out[rows] = torch.empty_like(sorted_logits).scatter_(
            1, full_order, sorted_logits.masked_fill(full_drop, float("-inf")))
    return out


def exponential_race_sample(probs: torch.Tensor, generators: dict[int, torch.Generator],
                            generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row from probs [num_rows, vocab] as argmax(p / E), E ~ Exp(1) per token (the
    Gumbel-max trick): no host sync and fully parallel, the CUDA path. Seeded rows use their own
    generator, the others `generator` (None: torch's default one)."""
    # Exp(1) noise as -log(U): cheaper than exponential_().
    uniform = torch.rand(probs.shape, generator=generator, dtype=probs.dtype, device=probs.device)
    for row, g in generators.items():  # few rows: per-request reproducibility needs their own stream
        uniform[row] = torch.rand(probs.shape[1], generator=g, device=probs.device)
    noise = uniform.log_().neg_()  # U in [0, 1): noise in (0, inf]
    return (probs / noise).argmax(dim=-1)


CDF_CHUNK = 1024  # vocabulary entries per chunk of the two-level inverse CDF


def inverse_cdf_sample(probs: torch.Tensor, generators: dict[int, torch.Generator],
                       generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row by inverting the cumulative distribution with one uniform per row: the CPU
    path, where drawing a random number per vocabulary entry is the sampler's main cost
    (docs/performance.md, "The sampler's draw"). Seeded rows use their own generator, the others
    `generator` (None: torch's default one).

    Two levels, so no cumsum runs over the whole vocabulary (slow at large vocabularies): chunk
    sums pick the chunk, then a cumsum of that chunk alone picks the token in it.
    """
    num_rows, vocab = probs.shape
    uniform = torch.rand(num_rows, 1, generator=generator, device=probs.device)
    for row, g in generators.items():
        uniform[row] = torch.rand(1, generator=g, device=probs.device)
    probs = probs.contiguous()
    full = vocab // CDF_CHUNK * CDF_CHUNK
    sums = probs[:, :full].view(num_rows, -1, CDF_CHUNK).sum(dim=-1)
    if full < vocab:
        sums = torch.cat([sums, probs[:, full:].sum(dim=-1, keepdim=True)], dim=1)
    chunk_cdf = sums.cumsum(dim=-1)  # [num_rows, num_chunks]
    # Scaling by the row total absorbs rounding; searchsorted (right) never picks an empty chunk
    # or a zero-probability token, since the target is always below the total it searches.
    targets = uniform * chunk_cdf[:, -1:]
    chunk = torch.searchsorted(chunk_cdf, targets, right=True).clamp_(max=sums.shape[1] - 1)  # [num_rows, 1]
    chunk_mass = sums.gather(1, chunk)
    cols = chunk * CDF_CHUNK + torch.arange(CDF_CHUNK, device=probs.device)
    local = probs.gather(1, cols.clamp(max=vocab - 1)).masked_fill_(cols >= vocab, 0.0)
    local_cdf = local.cumsum(dim=-1)  # [num_rows, CDF_CHUNK]
    # Where the target falls inside the chunk, as a fraction, mapped onto the chunk's own cumsum.
    fraction = ((targets - (chunk_cdf.gather(1, chunk) - chunk_mass)) / chunk_mass).clamp_(0.0, 1.0)
    local_total = local_cdf[:, -1:]
    local_target = torch.minimum(fraction * local_total, torch.nextafter(local_total, torch.zeros_like(local_total)))
    return (chunk * CDF_CHUNK + torch.searchsorted(local_cdf, local_target, right=True)).squeeze(1)



# The draws by the names platforms give them (Platform.random_sample).
RANDOM_SAMPLES: dict[str, RandomSample] = {"exponential_race": exponential_race_sample,
                                           "inverse_cdf": inverse_cdf_sample}

class Sampler(nn.Module):
    """random_sample: the draw function (the platform's, see platforms/); generator: the engine's
    seeded generator for rows without a seed of their own (None: torch's default one)."""

    def __init__(self, random_sample: RandomSample = inverse_cdf_sample, generator: torch.Generator | None = None):
        super().__init__()
        self.random_sample = random_sample
        self.generator = generator

    def forward(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """logits [num_rows, vocab] -> SamplerOutput with token_ids [num_rows]."""
        logits, raw_logprobs = self.constrain(logits, md)
        if md.all_greedy:
            token_ids = logits.argmax(dim=-1)
        elif not md.any_greedy:
            token_ids = self.sample(logits, md)
        else:
            token_ids = torch.where(md.is_greedy, logits.argmax(dim=-1), self.sample(logits, md))
        return self.with_logprobs(SamplerOutput(token_ids), raw_logprobs, md)

    @staticmethod
    def constrain(logits: torch.Tensor, md: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the logits a row's token is chosen from: grammar, min_tokens and penalties applied; the
        raw logprobs, when some row asked for logprobs, else None)."""
        logits = logits.float()
        # Raw logprobs: of the model's distribution, before penalties and temperature (vLLM's default).
        raw_logprobs = torch.log_softmax(logits, dim=-1) if md.max_num_logprobs is not None else None
        if md.grammar_rows is not None:  # first: every option below then sees only allowed tokens
            logits = apply_token_bitmask(logits, md.grammar_rows, md.grammar_bitmask)
        if md.banned_rows is not None:
            logits = logits.index_put((md.banned_rows, md.banned_token_ids),
                                      torch.tensor(float("-inf"), device=logits.device))
        if md.repetition_penalties is not None:
            logits = apply_penalties(logits, md)
        return logits, raw_logprobs

    @staticmethod
    def with_logprobs(out: SamplerOutput, raw_logprobs: torch.Tensor | None, md: SamplingMetadata) -> SamplerOutput:
        """out with each row's chosen token's logprob and its top-N filled in (when asked)."""
        if raw_logprobs is not None:
            out.chosen_logprobs = raw_logprobs.gather(1, out.token_ids.unsqueeze(1)).squeeze(1)
            k = min(md.max_num_logprobs, raw_logprobs.shape[1])
            out.top_logprobs, out.top_token_ids = raw_logprobs.topk(k, dim=-1)
        return out

    def probs(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """The distribution a random row draws from: constrained logits after temperature, min_p,
        top_k and top_p (rows marked greedy get temperature 1)."""
        logits = logits / md.temperatures.unsqueeze(1)
        if md.min_p is not None:
            logits = apply_min_p(logits, md.min_p)
        if md.top_k is not None:
            logits = apply_top_k(logits, md.top_k, md.max_top_k)
        if md.top_p is not None:
            logits = apply_top_p(logits, md.top_p)
        return torch.softmax(logits, dim=-1)

    def sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        return self.random_sample(self.probs(logits, md), md.generators, self.generator)
