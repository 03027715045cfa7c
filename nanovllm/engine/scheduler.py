"""Scheduler: picks the sequences of each step (prefill first, then decode) and applies results.

LLMEngine calls schedule() before a step and postprocess() after it, with each row's token (or
tokens, where the step verified proposals). Decode rows may hold KV slots past their token (lookahead):
what proposes tokens into them (spec_decode/) travels beside the step, not in it.
"""
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from nanovllm.config import Config
from nanovllm.engine.kv_cache_manager import KVCacheManager, needs_prompt_logits
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.lora.slots import LoRASlots


@dataclass
class SchedulerOutput:
    """One step's work: seqs[i] computes num_new_tokens[i] tokens from seq.num_computed_tokens."""

    seqs: list[Sequence]
    num_new_tokens: list[int]
    is_prefill: bool
    # Prefill rows whose every new position needs logits (prompt logprobs); None: no row does.
    needs_prompt_logits: list[bool] | None = None
    # Decode steps: the KV slots each row holds past its token, which tokens proposed beside the
    # step may fill (within the tokens it may still emit); None: no lookahead this step.
    lookahead: list[int] | None = None
    # LoRA (lora/slots.py): the adapter each slot holds, and each row's slot (-1: the base model);
    # None when the engine serves no adapters.
    lora_slots: tuple | None = None
    lora_rows: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, config: Config, num_kvcache_blocks: int, kv_windows: list[int | None] | None = None,
                 num_state_slots: int = 0, num_lookahead_tokens: int = 0, lookahead_below: int = 0, tier=None):
        """kv_windows: each KV group's sliding window, None for full attention (engine/kv_groups.py);
        a sliding group's blocks behind its window are freed. Default: one full-attention group.
        num_state_slots: the state layers' slots (0: the model has no such layer); prefix
        caching is off with them (a hit would need the state at the hit's end).
        num_lookahead_tokens: KV slots held past each decoding sequence's token where the cache has
        room, while fewer than lookahead_below sequences decode (the speculator's proposals).
        tier: a KVTier under the prefix cache (kv_offload/): a sequence whose prefix it holds waits in
        `loading` while its blocks are read, and the others go on."""
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.eos_token_ids = config.eos_token_ids
        self.kv_cache_manager = KVCacheManager(num_kvcache_blocks, config.kvcache_block_size,
                                          config.enable_prefix_caching and not num_state_slots, kv_windows,
                                          num_state_slots, tier=tier)
        self.waiting: deque[Sequence] = deque()
        self.loading: dict[int, Sequence] = {}  # seq_id -> a sequence holding blocks the tier is filling
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.num_lookahead_tokens, self.lookahead_below = num_lookahead_tokens, lookahead_below
        self.loras = LoRASlots(config.max_loras) if config.enable_lora else None

    def is_finished(self) -> bool:
        return not self.waiting and not self.running and not self.loading

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = self._schedule_prefill()
        if not out.seqs:
            out = self._schedule_decode()
        if self.loras is not None and out.seqs:
            out.lora_slots, out.lora_rows = tuple(self.loras.table), self.loras.row_slots(out.seqs)
        return out

    def _schedule_prefill(self) -> SchedulerOutput:
        seqs, num_new = [], []
        budget = self.max_num_batched_tokens
        # Sequences holding blocks: running ones, those being loaded, and those at the queue's head that
        # a prefill chunk or a finished load left there.
        num_active = len(self.running) + len(self.loading) + sum(1 for seq in self.waiting if seq.block_table)
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if not seq.block_table:  # not started yet (new, or preempted)
                if num_active >= self.max_num_seqs or not self.kv_cache_manager.can_allocate(seq):
                    break
                if self.loras is not None:  # its adapter needs a slot; without one it (and the queue) waits
                    if not self.loras.can_admit(seq):
                        break
                    self.loras.acquire(seq)
                num_active += 1
                if self.kv_cache_manager.allocate(seq):  # its prefix is being read: it waits aside
                    self.loading[seq.seq_id] = self.waiting.popleft()
                    continue
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
        lookahead = self.num_lookahead_tokens if len(self.running) < self.lookahead_below else 0
        rooms = []
        while self.running:
            seq = self.running.popleft()
            # Lookahead where the cache has room now; a sequence is never preempted for it.
            room = min(lookahead, self._tokens_left(seq) - 1)
            if room > 0 and self.kv_cache_manager.can_append(seq, room):
                self.kv_cache_manager.may_append(seq, room)
                seqs.append(seq)
                rooms.append(room)
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
                rooms.append(0)
        self.running.extendleft(reversed(seqs))
        return SchedulerOutput(seqs, [1] * len(seqs), is_prefill=False, lookahead=rooms if any(rooms) else None)

    def _tokens_left(self, seq: Sequence) -> int:
        """Tokens seq may still emit (max_tokens, max_model_len): a step's lookahead stays below it,
        so a verification never overshoots."""
        return min(seq.max_tokens - seq.num_completion_tokens, self.max_model_len - len(seq))

    def loaded(self, seq_id: int, num_keys: int) -> Sequence | None:
        """The tier's read for a loading sequence is done (its first num_keys keys are in its blocks):
        it goes back to the queue's head to prefill the rest. Returns it, or None for a sequence no
        longer loading (aborted)."""
        seq = self.loading.pop(seq_id, None)
        if seq is None:
            return None
        self.kv_cache_manager.finish_load(seq, num_keys)
        self.waiting.appendleft(seq)
        return seq

    def preempt(self, seq: Sequence) -> None:
        """Free seq's blocks and put it at the queue's head: it is prefilled again, generated tokens
        included (deallocate resets its cache state)."""
        self.kv_cache_manager.deallocate(seq)
        self._release_lora(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(self, out: SchedulerOutput, token_ids: list[int] | list[list[int]],
                    after_token: Callable[[int, Sequence, int], bool] | None = None) -> list[Sequence]:
        """Apply one step's tokens: each row's token, or its list of tokens (a verification's
        accepted proposals and the target's own), one at a time as decode steps would.
        after_token(row, seq, j), after each token: whether something else ended seq there (its
        grammar, a stop string; it finishes seq itself). A row's later tokens are dropped once it
        ends. Returns the sequences that finished."""
        finished = []
        for row, (seq, n, tokens) in enumerate(zip(out.seqs, out.num_new_tokens, token_ids)):
            for j, token_id in enumerate(tokens if isinstance(tokens, list) else [tokens]):
                ended = self.apply_token(seq, n if j == 0 else 1, token_id)
                if after_token is not None and after_token(row, seq, j):
                    ended = True
                if ended:
                    finished.append(seq)
                    break
        return finished

    def apply_token(self, seq: Sequence, num_computed: int, token_id: int) -> bool:
        """seq's K/V now holds num_computed more positions, and token_id comes after them (unless
        the prompt is not done: a mid-prompt chunk's token means nothing). A row that emits several
        tokens (a verification) applies each in turn: the first with its scheduled count, the others
        with 1 (each accepted proposal's K/V was computed by the step). Returns whether seq finished
        (EOS, a stop token, a length)."""
        seq.num_computed_tokens += num_computed
        self.kv_cache_manager.register_computed_blocks(seq)
        self.kv_cache_manager.release_behind_window(seq)
        if seq.num_computed_tokens < len(seq):
            return False
        seq.append_token(token_id)
        reason = self._finish_reason(seq, token_id)
        if reason is not None:
            self.finish(seq, reason)
        return reason is not None

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
        self._release_lora(seq)
        self.running.remove(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop a request wherever it is and free its blocks at once."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif self.loading.pop(seq.seq_id, None) is not None:
            pass
        elif seq in self.running:
            self.running.remove(seq)
        else:
            return
        self.kv_cache_manager.deallocate(seq)
        self._release_lora(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "abort"

    def _release_lora(self, seq: Sequence) -> None:
        if self.loras is not None:
            self.loras.release(seq)
