"""Sequence: one request's tokens and scheduling state. Owned by the Scheduler, read by ModelRunner;
its pickled form is what a tensor-parallel worker receives each step."""
import sys
from enum import Enum, auto
from itertools import count

from nanovllm.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """Token ids (prompt + completion) and KV bookkeeping of one request.

    num_computed_tokens counts the tokens whose K/V are already in the paged cache (prefix-cache
    hits and earlier prefill chunks included); num_cached_tokens counts the prefix-cache hits.
    The KVCacheManager owns block_tables and both counts (allocate sets them, deallocate clears them)
    and all block arithmetic: a Sequence knows nothing of block sizes, so engines with different
    block sizes can share a process.
    """

    _counter = count()

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams | None = None):
        sp = sampling_params or SamplingParams()
        self.seq_id = next(Sequence._counter)
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.last_token = self.token_ids[-1]
        self.num_tokens = len(self.token_ids)
        self.num_prompt_tokens = self.num_tokens
        self.num_cached_tokens = 0
        self.num_computed_tokens = 0
        # The prompt tokens its first prefill found cached (the engine's cache or its tier), kept
        # after it finishes: the usage's cached_tokens.
        self.num_cached_prompt_tokens = 0
        # One block table per KV group (engine/kv_groups.py; one group unless the model's layers
        # attend in several ways): [[]] until the KVCacheManager allocates.
        self.block_tables: list[list[int]] = [[]]
        # Leading entries of each sliding-window group's table handed back because the window has
        # passed them (KVCacheManager.release_behind_window); their ids stay, never read again.
        self.num_released_blocks = 0
        # The linear-attention state slot the KVCacheManager gives it while it holds blocks (None: none).
        self.state_slot: int | None = None
        self.sampling_params = sp
        # max_tokens None: bounded by max_model_len only (the scheduler checks that).
        self.max_tokens = sp.max_tokens if sp.max_tokens is not None else sys.maxsize
        self.ignore_eos = sp.ignore_eos
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        # Set by the engine's OutputProcessor once the sequence finishes.
        self.output_text: str | None = None
        self.output_logprobs: list[dict[int, float]] | None = None
        # structured_outputs: this sequence's xgrammar GrammarMatcher, set by the engine (rank 0 only,
        # never pickled); its state follows completion_token_ids, so preemption keeps it.
        self.grammar = None
        self.output_prompt_logprobs: list[dict[int, float] | None] | None = None
        # LoRA (lora/): the request's adapter, the scheduler's slot for it while it holds KV blocks,
        # and the seed of its prefix-cache keys (the adapter's digest: its blocks never meet another's).
        self.lora_request = None
        self.lora_slot: int | None = None
        self.cache_salt: int | None = None

    @property
    def block_table(self) -> list[int]:
        """The first KV group's block table (a full-attention group wherever the model has one)."""
        return self.block_tables[0]

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.block_tables = [table]

    def __len__(self) -> int:
        return self.num_tokens

    def __getitem__(self, key):
        return self.token_ids[key]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def uncomputed_token_ids(self, num_new_tokens: int) -> list[int]:
        """The token ids a step computes: num_new_tokens of them from num_computed_tokens on."""
        start = self.num_computed_tokens
        if self.token_ids is None:  # a worker's copy carries only the last token
            assert start == self.num_tokens - 1 and num_new_tokens == 1
            return [self.last_token]
        return self.token_ids[start: start + num_new_tokens]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.last_token = token_id
        self.num_tokens += 1

    # ---- tensor-parallel wire format --------------------------------------------------------
    # NOTE: exactly what a worker's ModelRunner.prepare_prefill / prepare_decode read; sampling
    # (SamplingMetadata) and outputs run on rank 0 only, so sampling params, text and logprobs stay
    # home. A worker's copy has no other attribute: reading one there fails loudly. copy.copy() goes
    # through these too, so copy a Sequence by building a new one.
    def __getstate__(self) -> tuple:
        # Once only the last token is left to compute (every decode step), the worker's cache holds
        # the K/V of all the others: the last token alone keeps the message size flat.
        if self.num_computed_tokens == self.num_tokens - 1:
            tokens: int | list[int] = self.last_token
        else:  # prefill, chunked prefill, or recompute after preemption: the worker slices token_ids
            tokens = self.token_ids
        return (self.num_tokens, self.num_computed_tokens, self.block_tables, self.state_slot, tokens)

    def __setstate__(self, state: tuple) -> None:
        self.num_tokens, self.num_computed_tokens, self.block_tables, self.state_slot, tokens = state
        if isinstance(tokens, int):
            self.token_ids, self.last_token = None, tokens
        else:
            self.token_ids, self.last_token = tokens, tokens[-1]
