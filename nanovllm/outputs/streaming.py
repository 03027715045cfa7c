"""Streaming: turns the growth of live sequences into per-request deltas after each engine step.

LLM.generate_stream and the async server front (entrypoints/async_engine.py) call track() for each
new sequence and collect() after each LLMEngine.step().
"""
from dataclasses import dataclass, field

from nanovllm.outputs.detokenizer import IncrementalDetokenizer
from nanovllm.engine.sequence import Sequence


@dataclass
class StreamDelta:
    """What one completion produced since its previous delta.

    request_id is the caller's key; index tells the completions of one request apart (n > 1).
    Concatenating a completion's `text` pieces gives the offline output's text, its `token_ids`
    pieces the offline token ids. finish_reason is None until the completion's last delta.
    """

    request_id: object
    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    stop_reason: int | str | None = None
    # With SamplingParams.logprobs: one {token_id: logprob} per new token, and each such id's text.
    logprobs: list[dict[int, float]] | None = field(default=None, repr=False)
    token_texts: dict[int, str] | None = field(default=None, repr=False)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def merge(self, later: "StreamDelta") -> "StreamDelta":
        """This delta followed by a later one of the same completion, as one delta."""
        assert (later.request_id, later.index) == (self.request_id, self.index) and not self.is_finished
        text = None if self.text is None else self.text + later.text
        logprobs = token_texts = None
        if self.logprobs is not None:
            logprobs = self.logprobs + later.logprobs
            token_texts = {**self.token_texts, **later.token_texts}
        return StreamDelta(self.request_id, self.index, self.token_ids + later.token_ids, text,
                           later.finish_reason, later.num_prompt_tokens, later.num_output_tokens,
                           later.stop_reason, logprobs, token_texts)


class _Tracked:
    def __init__(self, seq: Sequence, request_id: object, index: int, tokenizer):
        self.seq = seq
        self.request_id = request_id
        self.index = index
        sp = seq.sampling_params
        has_text = tokenizer is not None
        self.detokenizer = IncrementalDetokenizer(tokenizer, sp.skip_special_tokens) if has_text else None
        # A stop string kept in the output needs no holding back: nothing after it is ever sent.
        stops = [] if sp.include_stop_str_in_output else sp.stop
        # NOTE: text that may be the start of a stop string is held back until it cannot be one,
        # so a stream never sends text that the final output cuts off.
        self.holdback = max((len(s) for s in stops), default=1) - 1
        self.num_sent_tokens = 0
        self.num_sent_chars = 0


class OutputStreamer:
    """Per-sequence stream state: how many tokens and characters were already handed out.

    NOTE: a sequence's completion tokens only ever grow (preemption keeps them), so the new ones
    of a step are completion_token_ids[num_sent_tokens:].
    """

    def __init__(self, engine):
        self.engine = engine
        self.tracked: dict[int, _Tracked] = {}

    def __len__(self) -> int:
        return len(self.tracked)

    def track(self, seq: Sequence, request_id: object, index: int = 0) -> None:
        self.tracked[seq.seq_id] = _Tracked(seq, request_id, index, self.engine.tokenizer)

    def untrack(self, seq: Sequence) -> None:
        self.tracked.pop(seq.seq_id, None)

    def collect(self) -> list[StreamDelta]:
        """Deltas of every tracked sequence that grew or finished since the last call; finished
        sequences are untracked after their last delta."""
        deltas = []
        for seq_id, t in list(self.tracked.items()):
            delta = self._delta(t)
            if delta is None:
                continue
            deltas.append(delta)
            if delta.is_finished:
                del self.tracked[seq_id]
        return deltas

    def _delta(self, t: _Tracked) -> StreamDelta | None:
        seq = t.seq
        completion = seq.completion_token_ids
        new_ids = completion[t.num_sent_tokens:]
        if not new_ids and not seq.is_finished:
            return None
        if seq.is_finished:
            output = self.engine.output_of(seq)
            text = output["text"]
            logprobs = output.get("logprobs")
        else:
            text = self._running_text(t, new_ids)
            logprobs = self.engine.output_processor.logprobs_so_far(seq)
        piece = None
        if text is not None:
            piece = text[t.num_sent_chars:]
            t.num_sent_chars = len(text)
        new_logprobs = token_texts = None
        if logprobs is not None:
            new_logprobs = logprobs[t.num_sent_tokens:]
            token_texts = self._token_texts(new_ids, new_logprobs)
        t.num_sent_tokens = len(completion)
        return StreamDelta(t.request_id, t.index, new_ids, piece, seq.finish_reason, seq.num_prompt_tokens,
                           len(completion), seq.stop_reason, new_logprobs, token_texts)

    def _token_texts(self, token_ids: list[int], logprobs: list[dict[int, float] | None]) -> dict[int, str]:
        """Each token's own text, decoded here on the engine's thread (tokenizers are not shared)."""
        tokenizer = self.engine.tokenizer
        ids = set(token_ids).union(*(d for d in logprobs if d))
        if tokenizer is None:
            return {i: "" for i in ids}
        return {i: tokenizer.decode([i]) for i in ids}

    @staticmethod
    def _running_text(t: _Tracked, new_ids: list[int]) -> str | None:
        if t.detokenizer is None:
            return None
        for token_id in new_ids:
            t.detokenizer.add_token(token_id)
        text = t.detokenizer.text
        visible = len(text) - t.holdback
        return text[:max(visible, t.num_sent_chars)]
