"""Proposer: the seat every way of guessing the next tokens plugs into (ngram.py, draft_model.py;
EAGLE / MTP heads later). The Speculator calls it on rank 0 once per step."""
from nanovllm.engine.scheduler import SchedulerOutput
from nanovllm.engine.sequence import Sequence


class Proposer:
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        """Up to num_tokens[i] proposed next tokens of seqs[i] (fewer, or none, where it has no
        good guess). Called on decode steps, before the target runs."""
        raise NotImplementedError

    def observe(self, out: SchedulerOutput) -> None:
        """A prefill step the target is about to run (a proposer with a KV cache of its own
        computes the same positions)."""

    def forget(self, seq: Sequence) -> None:
        """seq finished or was aborted: drop what is kept for it."""

    def exit(self) -> None:
        """Release what it holds (a draft model's weights and cache)."""
