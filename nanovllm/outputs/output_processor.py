"""OutputProcessor: what a request returns to its caller (text, logprobs, stop strings).

LLMEngine calls add() per request, process() after each Scheduler.postprocess(), and output_of().
Per-request state lives here, not on Sequence, so TP workers never receive it.
"""
from dataclasses import dataclass

from nanovllm.outputs.detokenizer import StopStringMatcher
from nanovllm.engine.sequence import Sequence


@dataclass
class RequestState:
    matcher: StopStringMatcher | None        # only requests with stop strings detokenize per step
    logprobs: list[dict[int, float]] | None  # one {token_id: logprob} per output token, if asked


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[int, RequestState] = {}

    def add(self, seq: Sequence) -> None:
        sp = seq.sampling_params
        matcher = None
        if sp.stop:
            matcher = StopStringMatcher(self.tokenizer, sp.stop, sp.skip_special_tokens,
                                        sp.include_stop_str_in_output, sp.min_tokens)
        self.states[seq.seq_id] = RequestState(matcher, [] if sp.logprobs is not None else None)

    def drop(self, seq: Sequence) -> None:
        self.states.pop(seq.seq_id, None)

    def process(self, seqs: list[Sequence], is_sampled: list[bool],
                logprobs: list[dict[int, float] | None]) -> list[Sequence]:
        """Record one step's new tokens. Returns the running sequences a stop string ends; the
        caller finishes them. Sequences that finished otherwise get their final output here."""
        to_stop = []
        for seq, sampled, token_logprobs in zip(seqs, is_sampled, logprobs):
            state = self.states.get(seq.seq_id)
            if not sampled or state is None:
                continue
            if state.logprobs is not None:
                state.logprobs.append(token_logprobs)
            if state.matcher is not None and self._match_stop(seq, state.matcher) and not seq.is_finished:
                to_stop.append(seq)
            if seq.is_finished:
                self.finalize(seq)
        return to_stop

    def _match_stop(self, seq: Sequence, matcher: StopStringMatcher) -> bool:
        sp = seq.sampling_params
        if seq.is_finished and seq.finish_reason == "stop" and not sp.include_stop_str_in_output:
            return False  # ended by EOS / a stop token, whose text is left out
        stop = matcher.add_token(seq.last_token, seq.num_completion_tokens)
        if stop is None:
            return False
        seq.stop_reason = stop
        if seq.is_finished:
            seq.finish_reason = "stop"  # a stop string outranks "length" on the same token
        return True

    def logprobs_so_far(self, seq: Sequence) -> list[dict[int, float]] | None:
        """A running request's logprobs, one dict per output token so far (streaming reads them)."""
        state = self.states.get(seq.seq_id)
        return state.logprobs if state is not None else None

    def finalize(self, seq: Sequence) -> None:
        """Freeze a finished sequence's text and logprobs onto it and forget its state."""
        state = self.states.pop(seq.seq_id, None)
        if state is None:
            return
        seq.output_text = self._text(seq, state.matcher)
        seq.output_logprobs = state.logprobs

    def _text(self, seq: Sequence, matcher: StopStringMatcher | None) -> str | None:
        if self.tokenizer is None:
            return None  # a weights-only folder: token ids only
        if matcher is not None:
            return matcher.text
        sp = seq.sampling_params
        token_ids = seq.completion_token_ids
        if seq.finish_reason == "stop" and (seq.stop_reason is None or isinstance(seq.stop_reason, int)):
            # Ended by EOS or a stop token: vLLM leaves its text out unless asked.
            if not sp.include_stop_str_in_output:
                token_ids = token_ids[:-1]
        return self.tokenizer.decode(token_ids, skip_special_tokens=sp.skip_special_tokens)

    def output_of(self, seq: Sequence) -> dict:
        """One completion: text, token ids, finish/stop reason, and logprobs when asked.

        logprobs is a list with one dict per generated token, {token_id: logprob}, the chosen
        token first, then the `logprobs` most likely ones (N or N + 1 entries); logprobs are of
        the raw model distribution. cumulative_logprob sums the chosen tokens' logprobs.
        """
        state = self.states.get(seq.seq_id)
        if state is not None:  # still running: a snapshot
            text, logprobs = self._text(seq, state.matcher), state.logprobs
        elif seq.output_text is not None:
            text, logprobs = seq.output_text, seq.output_logprobs
        else:  # queued straight into the Scheduler, bypassing the engine's bookkeeping
            text, logprobs = self._text(seq, None), None
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
        return out
