"""StreamDelta: what one streamed completion produced in a step.

OutputProcessor.finish_step (outputs/output_processor.py) makes them; LLMEngine.step() returns
them to LLMEngine.generate_stream and to the async server (entrypoints/async_engine.py).
"""
from dataclasses import dataclass, field


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
    # With SamplingParams.prompt_logprobs, on the completion's first delta only: one entry per
    # prompt token (None for the first), and the text of each id in them (prompt tokens included).
    prompt_logprobs: list[dict[int, float] | None] | None = field(default=None, repr=False)
    prompt_token_texts: dict[int, str] | None = field(default=None, repr=False)
    # Prompt tokens its prefill found cached (the engine's cache or the tier under it): usage's cached_tokens.
    num_cached_tokens: int = 0

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
        first = self if self.prompt_logprobs is not None else later
        return StreamDelta(self.request_id, self.index, self.token_ids + later.token_ids, text,
                           later.finish_reason, later.num_prompt_tokens, later.num_output_tokens,
                           later.stop_reason, logprobs, token_texts, first.prompt_logprobs,
                           first.prompt_token_texts, later.num_cached_tokens)


def token_texts(tokenizer, token_ids: list[int], logprobs: list[dict[int, float] | None]) -> dict[int, str]:
    """Each token's own text (the chosen ones and every logprobs candidate), decoded on the engine's
    thread (tokenizers are not shared across threads)."""
    ids = set(token_ids).union(*(d for d in logprobs if d))
    if tokenizer is None:
        return {i: "" for i in ids}
    return {i: tokenizer.decode([i]) for i in ids}
