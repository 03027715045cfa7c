"""Speculator: what LLMEngine holds when speculation is on. Each decode step it asks the proposer
for tokens (within the lookahead the scheduler left room for, and what each sequence has earned),
checks them against a grammar, and returns them: they go to the executor beside the step; after
the step it counts what was accepted (each row's emitted tokens less one) and adapts.

Paying its way:
- no proposals while disable_by_batch_size or more sequences decode (the scheduler leaves no room);
- a sequence's proposal length grows by one when all its proposals were accepted and falls to
  one past what was accepted when not; after repeated misses at length one it is paused for
  2, 4, ... 32 steps, so a request speculation does not help costs almost nothing;
- each step's length is the one with the most expected tokens per second, from the step times
  measured at start-up and each sequence's acceptance rate (cost.py): none at all when the rows
  cost more than they earn (large batches, low acceptance).
"""
from nanovllm.engine.scheduler import SchedulerOutput
from nanovllm.engine.sequence import Sequence
from nanovllm.sample.sampler import SampledTokens
from nanovllm.spec_decode.config import SpeculativeConfig
from nanovllm.spec_decode.cost import AcceptanceRates, StepTimes, best_length
from nanovllm.spec_decode.metrics import SpecDecodeMetrics
from nanovllm.spec_decode.proposer import Proposer

MAX_PAUSE_STEPS = 32


def grammar_prefix(seq: Sequence, tokens: list[int]) -> list[int]:
    """The leading proposals seq's grammar accepts (all of them without a grammar); the matcher is
    left as it was."""
    matcher = seq.grammar
    if matcher is None or not tokens:
        return tokens
    accepted = 0
    for t in tokens:
        if matcher.is_terminated() or not matcher.accept_token(t):
            break
        accepted += 1
    if accepted:
        matcher.rollback(accepted)
    return tokens[:accepted]


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, target_times: StepTimes | None = None,
                 draft_times: StepTimes | None = None):
        self.config = config
        self.proposer = proposer
        # Step times by rows (None: not measured, e.g. tensor parallelism: lengths by the rules above only).
        self.target_times, self.draft_times = target_times, draft_times
        self.rates = AcceptanceRates(proposer.prior_acceptance)
        self.metrics = SpecDecodeMetrics(config.num_speculative_tokens)
        self.length: dict[int, int] = {}            # seq_id -> proposals it gets next
        self.misses: dict[int, int] = {}            # seq_id -> verifications in a row with nothing accepted
        self.paused_until: dict[int, int] = {}      # seq_id -> step at which it gets proposals again
        self.steps = 0

    def propose(self, out: SchedulerOutput, num_decoding: int) -> list[list[int]] | None:
        """Prefill: let the proposer see it (a draft model: only while proposals could pay with
        num_decoding sequences decoding together). Decode: each row's proposals (None: none this
        step), for the executor to verify beside the step."""
        if out.is_prefill:
            n = num_decoding
            if self.proposer.runs_a_model and self.target_times is not None and n > 0 and best_length(
                    [self.config.num_speculative_tokens] * n, [self.proposer.prior_acceptance] * n,
                    self.target_times, self.draft_times) == 0:
                self.proposer.skip(out)
            else:
                self.proposer.observe(out)
            return None
        self.steps += 1
        if out.lookahead is None:
            return None
        k = self.config.num_speculative_tokens
        wants = []
        for seq, room in zip(out.seqs, out.lookahead):
            if self.paused_until.get(seq.seq_id, 0) > self.steps:
                wants.append(0)
            else:
                wants.append(min(room, self.length.get(seq.seq_id, k)))
        if not any(wants):
            self._record_idle(out.seqs)
            return None
        free = not self.proposer.runs_a_model  # proposals cost nothing to make (ngram): look, then choose
        rates = self.rates_of(out.seqs)
        if self.target_times is not None:
            # The length that pays if every sequence got all it asks for: an upper bound for ngram
            # (its lookups are then skipped when nothing can pay), the length itself for a draft.
            length = best_length(wants, rates, self.target_times, self.draft_times,
                                 self.proposer.pending(out.seqs))
            wants = [min(w, length) for w in wants]
            if not any(wants):
                self._record_idle(out.seqs)
                return None
        drafts = self.proposer.propose(out.seqs, wants)
        drafts = [grammar_prefix(seq, d[:w]) for seq, d, w in zip(out.seqs, drafts, wants)]
        if self.target_times is not None and free and any(drafts):
            length = best_length([len(d) for d in drafts], rates, self.target_times, None)
            drafts = [d[:length] for d in drafts]
        if any(drafts):
            return drafts
        self._record_idle(out.seqs)
        return None

    def _record_idle(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.rates.record(seq.seq_id, 0, 0)

    def rates_of(self, seqs: list[Sequence]) -> list[float]:
        return [self.rates.rate(seq.seq_id) for seq in seqs]

    def record(self, seqs: list[Sequence], drafts: list[list[int]], sampled: SampledTokens) -> None:
        """Count one verification step (each row emitted its accepted proposals and one token of the
        target's) and adapt each sequence's proposal length."""
        k = self.config.num_speculative_tokens
        for seq, proposed, emitted in zip(seqs, drafts, sampled.token_ids):
            drafted, accepted = len(proposed), len(emitted) - 1
            self.metrics.record(drafted, accepted)
            self.rates.record(seq.seq_id, drafted, accepted)
            if drafted == 0:
                continue
            sid = seq.seq_id
            length = self.length.get(sid, k)
            if accepted == drafted:
                self.length[sid] = min(k, length + 1)
                self.misses.pop(sid, None)
            else:
                self.length[sid] = max(1, accepted + 1)
                if accepted == 0 and length == 1:
                    misses = self.misses[sid] = self.misses.get(sid, 0) + 1
                    self.paused_until[sid] = self.steps + 1 + min(2 ** misses, MAX_PAUSE_STEPS)
                elif accepted:
                    self.misses.pop(sid, None)

    def forget(self, seq: Sequence) -> None:
        for table in (self.length, self.misses, self.paused_until):
            table.pop(seq.seq_id, None)
        self.rates.forget(seq.seq_id)
        self.proposer.forget(seq)

    def exit(self) -> None:
        self.proposer.exit()
