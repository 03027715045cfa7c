"""Scheduler: picks the sequences of each step (prefill first, then decode) and applies results.

LLMEngine calls schedule() before a step and postprocess() after it.
"""
from collections import deque
from dataclasses import dataclass

from nanovllm.config import Config
from nanovllm.engine.kv_cache_manager import KVCacheManager, needs_prompt_logits
from nanovllm.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """One step's work: seqs[i] computes num_new_tokens[i] tokens from seq.num_computed_tokens."""

    seqs: list[Sequence]
    num_new_tokens: list[int]
    is_prefill: bool
    # Prefill rows whose every new position needs logits (prompt logprobs); None: no row does.
    needs_prompt_logits: list[bool] | None = None
    # Speculation (decode steps): how many proposals each row has KV slots and tokens left for
    # (None: speculation off this step), and the proposals the step verifies (spec_decode/).
    max_drafts: list[int] | None = None
    draft_token_ids: list[list[int]] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, config: Config, num_kvcache_blocks: int, kv_windows: list[int | None] | None = None,
                 num_state_slots: int = 0):
        """kv_windows: each KV group's sliding window, None for full attention (engine/kv_groups.py);
        a sliding group's blocks behind its window are freed. Default: one full-attention group.
        num_state_slots: the linear-attention state slots (0: the model has no such layer); prefix
        caching is off with them (a hit would need the state at the hit's end)."""
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.eos_token_ids = config.eos_token_ids
        self.kv_cache_manager = KVCacheManager(num_kvcache_blocks, config.kvcache_block_size,
                                          config.enable_prefix_caching and not num_state_slots, kv_windows,
                                          num_state_slots)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        spec = config.speculative_config
        # KV slots held past each decoding sequence's end for its proposals (0: no speculation).
        self.num_lookahead_tokens = spec.num_speculative_tokens if spec is not None else 0
        self.disable_by_batch_size = spec.disable_by_batch_size if spec is not None else 0

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = self._schedule_prefill()
        if out.seqs:
            return out
        return self._schedule_decode()

    def _schedule_prefill(self) -> SchedulerOutput:
        seqs, num_new = [], []
        budget = self.max_num_batched_tokens
        # Sequences holding blocks: running ones plus a partly prefilled one at the queue's head.
        num_active = len(self.running) + int(bool(self.waiting and self.waiting[0].block_table))
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if not seq.block_table:  # not started yet (new, or preempted)
                if num_active >= self.max_num_seqs or not self.kv_cache_manager.can_allocate(seq):
                    break
                self.kv_cache_manager.allocate(seq)
                num_active += 1
            n = min(len(seq) - seq.num_computed_tokens, budget)
            seqs.append(seq)
            num_new.append(n)
            budget -= n
            if seq.num_computed_tokens + n < len(seq):
                break  # chunked: this prompt continues next step, at the queue's head
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        needs = [needs_prompt_logits(seq) for seq in seqs]
        return SchedulerOutput(seqs, num_new, is_prefill=True, needs_prompt_logits=needs if any(needs) else None)

    def _schedule_decode(self) -> SchedulerOutput:
        seqs: list[Sequence] = []
        lookahead = self.num_lookahead_tokens if len(self.running) < self.disable_by_batch_size else 0
        max_drafts = []
        while self.running:
            seq = self.running.popleft()
            # Room for proposals where the cache has it now; a sequence is never preempted for them.
            room = min(lookahead, self._tokens_left(seq) - 1)
            if room > 0 and self.kv_cache_manager.can_append(seq, room):
                self.kv_cache_manager.may_append(seq, room)
                seqs.append(seq)
                max_drafts.append(room)
                continue
            while not self.kv_cache_manager.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())  # the most recently added one
                else:
                    self.preempt(seq)
                    break
            else:
                self.kv_cache_manager.may_append(seq)
                seqs.append(seq)
                max_drafts.append(0)
        self.running.extendleft(reversed(seqs))
        return SchedulerOutput(seqs, [1] * len(seqs), is_prefill=False,
                               max_drafts=max_drafts if any(max_drafts) else None)

    def _tokens_left(self, seq: Sequence) -> int:
        """Tokens seq may still emit (max_tokens, max_model_len): a step's proposals stay below it,
        so a verification never overshoots."""
        return min(seq.max_tokens - seq.num_completion_tokens, self.max_model_len - len(seq))

    def preempt(self, seq: Sequence) -> None:
        """Free seq's blocks and put it at the queue's head: it is prefilled again, generated tokens
        included (deallocate resets its cache state)."""
        self.kv_cache_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(self, out: SchedulerOutput, token_ids: list[int]) -> list[Sequence]:
        """Apply one step's sampled tokens; returns the sequences that finished."""
        finished = []
        for seq, n, token_id in zip(out.seqs, out.num_new_tokens, token_ids):
            seq.num_computed_tokens += n
            self.kv_cache_manager.register_computed_blocks(seq)
            self.kv_cache_manager.release_behind_window(seq)
            if seq.num_computed_tokens < len(seq):
                continue  # mid-prompt chunk: its sampled token means nothing
            seq.append_token(token_id)
            reason = self._finish_reason(seq, token_id)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        sp = seq.sampling_params
        if seq.num_completion_tokens >= sp.min_tokens:
            if not seq.ignore_eos and token_id in self.eos_token_ids:
                return "stop"
            if token_id in sp.stop_token_ids:
                seq.stop_reason = token_id
                return "stop"
        if seq.num_completion_tokens >= seq.max_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.kv_cache_manager.deallocate(seq)
        self.running.remove(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop a request wherever it is and free its blocks at once."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
        else:
            return
        self.kv_cache_manager.deallocate(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "abort"
