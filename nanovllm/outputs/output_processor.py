"""OutputProcessor: what each request returns to its caller: text, logprobs, stop strings, stream deltas.

LLMEngine calls add() per request; after each Scheduler.postprocess(), process() then finish_step();
output_of() for a result. Per-request state lives here, not on Sequence, so TP workers never get it.
"""
from dataclasses import dataclass

from nanovllm.engine.sequence import Sequence
from nanovllm.outputs.detokenizer import RequestText, added_token_texts, decode_text
from nanovllm.outputs.streaming import StreamDelta, token_texts
from nanovllm.sample.prompt_logprobs import PromptLogprobs


@dataclass
class RequestState:
    """One completion's output so far; request_id and index are its caller's key (StreamDelta)."""

    request_id: object
    index: int
    # NOTE: the request's only detokenizer, made when text is needed every step (a stream or stop
    # strings, given a tokenizer); other requests decode once, when they finish.
    text: RequestText | None
    logprobs: list[dict[int, float]] | None  # one {token_id: logprob} per output token, if asked
    is_streamed: bool
    # One per prompt token, if asked: None for the first, then {token_id: logprob} (see output_of).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_sent_tokens: int = 0  # a stream's tokens and characters already handed out
    is_prompt_sent: bool = False  # a stream's prompt_logprobs handed out (on its first delta)
    num_sent_chars: int = 0


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[int, RequestState] = {}

    def add(self, seq: Sequence, request_id: object, index: int = 0, stream: bool = False) -> None:
        sp = seq.sampling_params
        text = None
        if self.tokenizer is not None and (stream or sp.stop):
            text = RequestText(self.tokenizer, sp.stop, sp.skip_special_tokens,
                               sp.include_stop_str_in_output, sp.min_tokens, sp.spaces_between_special_tokens)
        logprobs = [] if sp.logprobs is not None else None
        prompt_logprobs = [None] if sp.prompt_logprobs is not None else None
        self.states[seq.seq_id] = RequestState(request_id, index, text, logprobs, stream, prompt_logprobs)

    def request_ids(self, seqs: list[Sequence]) -> set:
        """The request ids of seqs (of those added here)."""
        states = (self.states.get(seq.seq_id) for seq in seqs)
        return {state.request_id for state in states if state is not None}

    def add_prompt_logprobs(self, seqs: list[Sequence], prompt_logprobs: "list[PromptLogprobs | None] | None") -> None:
        """Record one prefill step's prompt entries (before process(), which may finish seqs)."""
        if prompt_logprobs is None:
            return
        for seq, part in zip(seqs, prompt_logprobs):
            state = self.states.get(seq.seq_id)
            if part is None or state is None or state.prompt_logprobs is None:
                continue
            have = len(state.prompt_logprobs)
            # NOTE: chunks arrive in order; an entry already held (a recomputed chunk) is not added twice.
            assert part.first_index <= have, "a prompt chunk's logprobs arrived before the one before it"
            state.prompt_logprobs.extend(part.entries[have - part.first_index:])

    def process(self, seqs: list[Sequence], is_sampled: list[bool],
                logprobs: list[dict[int, float] | None]) -> list[Sequence]:
        """Record one step's new tokens. Returns the running sequences a stop string ends; the
        caller finishes them, then calls finish_step()."""
        return [seq for seq, sampled, token_logprobs in zip(seqs, is_sampled, logprobs)
                if sampled and self.process_one(seq, token_logprobs)]

    def process_one(self, seq: Sequence, token_logprobs: dict[int, float] | None) -> bool:
        """Record seq's new token (its last) and its logprobs entry; whether seq is running and a
        stop string now ends it (the caller finishes it)."""
        state = self.states.get(seq.seq_id)
        if state is None:
            return False
        if state.logprobs is not None:
            state.logprobs.append(token_logprobs)
        return state.text is not None and self._add_text(seq, state.text) and not seq.is_finished

    def _add_text(self, seq: Sequence, text: RequestText) -> bool:
        """Detokenize seq's new token; True when it completes a stop string."""
        sp = seq.sampling_params
        if seq.is_finished and seq.finish_reason == "stop" and not sp.include_stop_str_in_output:
            return False  # ended by EOS / a stop token, whose text is left out
        stop = text.add_token(seq.last_token, seq.num_completion_tokens)
        if stop is None:
            return False
        seq.stop_reason = stop
        if seq.is_finished:
            seq.finish_reason = "stop"  # a stop string outranks "length" on the same token
        return True

    def finish_step(self, seqs: list[Sequence]) -> list[StreamDelta]:
        """Close a step over seqs: a delta for each streamed one that grew or finished; finished
        ones get their final output frozen onto them and their state forgotten."""
        deltas = []
        for seq in seqs:
            state = self.states.get(seq.seq_id)
            if state is None:
                continue
            if seq.is_finished:
                self.finalize(seq)
            if state.is_streamed:
                delta = self._delta(seq, state)
                if delta is not None:
                    deltas.append(delta)
        return deltas

    def _delta(self, seq: Sequence, state: RequestState) -> StreamDelta | None:
        # NOTE: a sequence's completion tokens only ever grow (preemption keeps them), so the new
        # ones of a step are completion_token_ids[num_sent_tokens:].
        completion = seq.completion_token_ids
        new_ids = completion[state.num_sent_tokens:]
        if not new_ids and not seq.is_finished:
            return None
        if seq.is_finished:
            text, logprobs = seq.output_text, seq.output_logprobs
        else:
            text = state.text.streamable_text() if state.text is not None else None
            logprobs = state.logprobs
        piece = None
        if text is not None:
            piece = text[state.num_sent_chars:]
            state.num_sent_chars = max(len(text), state.num_sent_chars)
        new_logprobs = texts = None
        if logprobs is not None:
            new_logprobs = logprobs[state.num_sent_tokens:]
            texts = token_texts(self.tokenizer, new_ids, new_logprobs)
        state.num_sent_tokens = len(completion)
        delta = StreamDelta(state.request_id, state.index, new_ids, piece, seq.finish_reason,
                            seq.num_prompt_tokens, len(completion), seq.stop_reason, new_logprobs, texts,
                            num_cached_tokens=seq.num_cached_prompt_tokens)
        if state.prompt_logprobs is not None and not state.is_prompt_sent:
            # NOTE: a first delta comes once the prompt is computed (entries complete) or aborted.
            state.is_prompt_sent = True
            delta.prompt_logprobs = list(state.prompt_logprobs)
            delta.prompt_token_texts = token_texts(self.tokenizer, seq.prompt_token_ids, delta.prompt_logprobs)
        return delta

    def finalize(self, seq: Sequence) -> None:
        """Freeze a finished sequence's text and logprobs onto it and forget its state."""
        state = self.states.pop(seq.seq_id, None)
        if state is None:
            return
        seq.output_text = self._text(seq, state.text)
        seq.output_logprobs = state.logprobs
        seq.output_prompt_logprobs = state.prompt_logprobs

    def _text(self, seq: Sequence, text: RequestText | None) -> str | None:
        if self.tokenizer is None:
            return None  # a weights-only folder: token ids only
        if text is not None:  # EOS / stop-token text was never fed to it unless kept
            return text.text
        sp = seq.sampling_params
        token_ids = seq.completion_token_ids
        if seq.finish_reason == "stop" and (seq.stop_reason is None or isinstance(seq.stop_reason, int)):
            # Ended by EOS or a stop token: vLLM leaves its text out unless asked.
            if not sp.include_stop_str_in_output:
                token_ids = token_ids[:-1]
        added = None if sp.spaces_between_special_tokens else added_token_texts(self.tokenizer)
        return decode_text(self.tokenizer, token_ids, sp.skip_special_tokens, added)

    def output_of(self, seq: Sequence) -> dict:
        """One completion: text, token ids, finish/stop reason, and logprobs when asked.

        logprobs is a list with one dict per generated token, {token_id: logprob}, the chosen
        token first, then the `logprobs` most likely ones (N or N + 1 entries); logprobs are of
        the raw model distribution. cumulative_logprob sums the chosen tokens' logprobs.
        prompt_logprobs (when asked) has one entry per prompt token: None for the first, then
        {token_id: logprob}, the prompt token first, then the `prompt_logprobs` most likely ones.
        """
        state = self.states.get(seq.seq_id)
        if state is not None:  # still running: a snapshot
            text, logprobs = self._text(seq, state.text), state.logprobs
            prompt_logprobs = state.prompt_logprobs
        else:  # finished (or queued straight into the Scheduler, bypassing the engine's bookkeeping)
            text = seq.output_text if seq.output_text is not None else self._text(seq, None)
            logprobs = seq.output_logprobs
            prompt_logprobs = seq.output_prompt_logprobs
        token_ids = seq.completion_token_ids
        out = {
            "text": text,
            "token_ids": token_ids,
            "finish_reason": seq.finish_reason,
            "stop_reason": seq.stop_reason,
            "prompt_token_ids": seq.prompt_token_ids,
        }
        if seq.sampling_params.logprobs is not None:
            out["logprobs"] = list(logprobs or [])
            out["cumulative_logprob"] = sum(d[t] for d, t in zip(out["logprobs"], token_ids) if d)
        if seq.sampling_params.prompt_logprobs is not None:
            out["prompt_logprobs"] = list(prompt_logprobs or [])
        return out
