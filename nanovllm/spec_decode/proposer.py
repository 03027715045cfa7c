"""Proposer: the seat every way of guessing the next tokens plugs into (ngram.py, draft_model.py;
EAGLE / MTP heads later). The Speculator calls it on rank 0 once per step."""
from nanovllm.engine.scheduler import SchedulerOutput
from nanovllm.engine.sequence import Sequence


class Proposer:
    # A sequence's acceptance rate before it has one (spec_decode/cost.py plans with it).
    prior_acceptance = 0.5
    # Whether proposing runs a forward of its own (then the Speculator sizes the proposals before
    # asking; else it asks for all, then keeps what pays).
    runs_a_model = False

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        """Up to num_tokens[i] proposed next tokens of seqs[i] (fewer, or none, where it has no
        good guess). Called on decode steps, before the target runs."""
        raise NotImplementedError

    def pending(self, seqs: list[Sequence]) -> list[int] | None:
        """Rows a proposer running a model computes for each sequence before its first proposal
        (None: nothing of the kind)."""
        return None

    def observe(self, out: SchedulerOutput) -> None:
        """A prefill step the target is about to run (a proposer with a KV cache of its own
        computes the same positions)."""

    def skip(self, out: SchedulerOutput) -> None:
        """A prefill step the proposer is not asked to observe (it would not be used at this
        load): what it keeps of these sequences is no longer valid."""

    def forget(self, seq: Sequence) -> None:
        """seq finished or was aborted: drop what is kept for it."""

    def exit(self) -> None:
        """Release what it holds (a draft model's weights and cache)."""
