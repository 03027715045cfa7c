"""SamplingMetadata: one step's per-row sampling tensors, built from the scheduled sequences.

ModelRunner calls SamplingMetadata.build() (the "prepare" half); Sampler consumes it ("sample").
"""
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
import xxhash

from nanovllm.sample.structured_outputs import fill_bitmask
from nanovllm.sampling_params import SAMPLING_EPS

if TYPE_CHECKING:  # NOTE: annotations only: the sampler sits below the engine and never imports it
    from nanovllm.engine.sequence import Sequence


def rows_to_sample(seqs: "list[Sequence]", num_new_tokens: list[int]) -> list[bool]:
    """Which rows of a step produce a token: all but mid-prompt chunks. Call before postprocess."""
    return [seq.num_computed_tokens + n >= len(seq) for seq, n in zip(seqs, num_new_tokens)]


def step_seed(seed: int, step: int) -> int:
    """The seed of one draw of a seeded request: a hash of (request seed, completion position).

    NOTE: deriving it from the position, not from a generator advanced in place, makes a draw
    independent of batch companions, of skipped (mid-prompt) steps and of preemption.
    """
    return xxhash.xxh64(f"{seed}:{step}".encode()).intdigest() >> 1  # manual_seed wants < 2**63


@dataclass
class SamplingMetadata:
    """Per-row tensors for one step ([num_rows] unless noted). None means "no row uses it"."""

    is_sampled: list[bool]
    all_greedy: bool
    any_greedy: bool = True                      # False: no row needs the argmax
    is_greedy: torch.Tensor | None = None        # bool
    temperatures: torch.Tensor | None = None     # fp32, 1.0 on greedy rows
    top_k: torch.Tensor | None = None            # int64, vocab_size when off
    max_top_k: int = 0                           # largest top_k in use, on the host: no device sync
    top_p: torch.Tensor | None = None            # fp32, inf when off
    min_p: torch.Tensor | None = None            # fp32, 0 when off
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> this step's draw
    repetition_penalties: torch.Tensor | None = None
    presence_penalties: torch.Tensor | None = None
    frequency_penalties: torch.Tensor | None = None
    prompt_token_ids: torch.Tensor | None = None   # [num_rows, max_prompt_len], padded with vocab_size
    output_token_ids: torch.Tensor | None = None   # [num_rows, max_output_len], padded with vocab_size
    banned_rows: torch.Tensor | None = None        # min_tokens: (row, token) pairs masked to -inf
    banned_token_ids: torch.Tensor | None = None
    num_logprobs: list[int | None] = field(default_factory=list)
    max_num_logprobs: int | None = None
    grammar_rows: torch.Tensor | None = None       # int64 [num_grammar_rows]: rows under a grammar
    grammar_bitmask: torch.Tensor | None = None    # int32 [num_grammar_rows, ceil(vocab / 32)]

    @classmethod
    def from_temperatures(cls, temperatures: torch.Tensor) -> "SamplingMetadata":
        """Plain temperature sampling per row (0 = greedy), no other option: for benchmarks and
        for tests that feed the Sampler without sequences."""
        is_greedy = temperatures < SAMPLING_EPS
        md = cls(is_sampled=[True] * len(temperatures), all_greedy=bool(is_greedy.all()),
                 any_greedy=bool(is_greedy.any()))
        md.num_logprobs = [None] * len(temperatures)
        if not md.all_greedy:
            md.is_greedy = is_greedy
            md.temperatures = torch.where(is_greedy, torch.ones_like(temperatures), temperatures).float()
        return md

    @classmethod
    def build(cls, seqs: "list[Sequence]", num_new_tokens: list[int], vocab_size: int,
              eos_token_ids: frozenset | set, device: torch.device,
              to_device: Callable[[torch.Tensor], torch.Tensor] | None = None) -> "SamplingMetadata":
        """device: where the step's logits are (seeded rows' generators live there); to_device: the
        runner's host->device copy (None: the tensors stay on the host)."""
        sampled = rows_to_sample(seqs, num_new_tokens)
        # Mid-prompt chunk rows are treated as greedy with no options: their token is thrown away,
        # and they must not consume a seeded request's randomness.
        params = [seq.sampling_params if s else None for seq, s in zip(seqs, sampled)]
        greedy = [p is None or p.is_greedy for p in params]
        md = cls(is_sampled=sampled, all_greedy=all(greedy), any_greedy=any(greedy))
        md.num_logprobs = [p.logprobs if p is not None else None for p in params]
        asked = [n for n in md.num_logprobs if n is not None]
        md.max_num_logprobs = max(asked) if asked else None

        def put(values, dtype) -> torch.Tensor:
            t = torch.tensor(values, dtype=dtype)
            return t if to_device is None else to_device(t)

        if not md.all_greedy:
            md.is_greedy = put(greedy, torch.bool)
            md.temperatures = put([1.0 if g else p.temperature for g, p in zip(greedy, params)], torch.float32)
            live = [p for p in params if p is not None and not p.is_greedy]
            if any(0 < p.top_k < vocab_size for p in live):
                top_k = [p.top_k if p is not None and 0 < p.top_k < vocab_size else vocab_size for p in params]
                md.top_k, md.max_top_k = put(top_k, torch.int64), max(k for k in top_k if k < vocab_size)
            if any(p.top_p < 1.0 for p in live):
                md.top_p = put([p.top_p if p is not None and p.top_p < 1.0 else float("inf") for p in params],
                               torch.float32)
            if any(p.min_p > 0.0 for p in live):
                md.min_p = put([p.min_p if p is not None else 0.0 for p in params], torch.float32)
            for row, (seq, p) in enumerate(zip(seqs, params)):
                if p is not None and not p.is_greedy and p.seed is not None:
                    g = torch.Generator(device=device)
                    g.manual_seed(step_seed(p.seed, seq.num_completion_tokens))
                    md.generators[row] = g
        if any(p is not None and p.has_penalties for p in params):
            md._add_penalties(seqs, params, vocab_size, put)
        md._add_min_tokens(seqs, params, vocab_size, eos_token_ids, put)
        grammars = fill_bitmask(seqs, sampled, vocab_size)
        if grammars is not None:
            md.grammar_rows = put(grammars[0], torch.int64)
            md.grammar_bitmask = grammars[1] if to_device is None else to_device(grammars[1])
        return md

    def _add_penalties(self, seqs, params, vocab_size: int, put) -> None:
        def pad(rows: list[list[int]]) -> np.ndarray:
            out = np.full((len(rows), max(1, max(len(r) for r in rows))), vocab_size, dtype=np.int64)
            for i, r in enumerate(rows):
                out[i, : len(r)] = r
            return out

        active = [p is not None and p.has_penalties for p in params]
        self.repetition_penalties = put([p.repetition_penalty if a else 1.0 for p, a in zip(params, active)],
                                        torch.float32)
        self.presence_penalties = put([p.presence_penalty if a else 0.0 for p, a in zip(params, active)],
                                      torch.float32)
        self.frequency_penalties = put([p.frequency_penalty if a else 0.0 for p, a in zip(params, active)],
                                       torch.float32)
        prompts = pad([seq.prompt_token_ids if a else [] for seq, a in zip(seqs, active)])
        outputs = pad([seq.completion_token_ids if a else [] for seq, a in zip(seqs, active)])
        self.prompt_token_ids = put(prompts, torch.int64)
        self.output_token_ids = put(outputs, torch.int64)

    def _add_min_tokens(self, seqs, params, vocab_size: int, eos_token_ids, put) -> None:
        rows, ids = [], []
        for row, (seq, p) in enumerate(zip(seqs, params)):
            # A grammar decides alone where its output may end (banning its only way out would
            # leave the row no token at all).
            if p is None or seq.num_completion_tokens >= p.min_tokens or seq.grammar is not None:
                continue
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            banned = sorted(t for t in banned if t < vocab_size)
            rows.extend([row] * len(banned))
            ids.extend(banned)
        if rows:
            self.banned_rows = put(rows, torch.int64)
            self.banned_token_ids = put(ids, torch.int64)
