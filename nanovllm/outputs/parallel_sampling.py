"""Parallel sampling (SamplingParams.n > 1): n completions of one prompt sharing its KV blocks.

LLMEngine builds the group's parameters with child_params(). The first sequence prefills alone;
PendingSiblings holds the others back until that prefill has put the prompt's full blocks in the
prefix cache, so their own prefill hits those blocks and computes only the last partial one.
"""
from dataclasses import replace

from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams


def child_params(sp: SamplingParams) -> list[SamplingParams]:
    """One SamplingParams (n=1) per completion; a seeded request gives completion i seed + i,
    so the completions differ yet each one is reproducible (vLLM's rule)."""
    if sp.n == 1:
        return [sp]
    return [replace(sp, n=1, seed=None if sp.seed is None else sp.seed + i) for i in range(sp.n)]


class PendingSiblings:
    """Siblings waiting for their first sequence's prompt to be computed, keyed by its seq_id."""

    def __init__(self):
        self.waiting: dict[int, list[Sequence]] = {}

    def __len__(self) -> int:
        return sum(len(sibs) for sibs in self.waiting.values())

    def hold(self, first: Sequence, siblings: list[Sequence]) -> None:
        if siblings:
            self.waiting[first.seq_id] = list(siblings)

    def release(self, seqs: list[Sequence]) -> list[Sequence]:
        """The siblings of every sequence in seqs whose prompt is now computed (or that ended)."""
        ready: list[Sequence] = []
        for seq in seqs:
            if seq.seq_id in self.waiting and (seq.num_completion_tokens > 0 or seq.is_finished):
                ready.extend(self.waiting.pop(seq.seq_id))
        return ready

    def forget(self, seq: Sequence) -> tuple[bool, list[Sequence]]:
        """For an aborted seq: (whether it was a held sibling, the siblings it was holding)."""
        for siblings in self.waiting.values():
            if seq in siblings:
                siblings.remove(seq)
                return True, []
        return False, self.waiting.pop(seq.seq_id, [])
