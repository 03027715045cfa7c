"""One HTTP request's generation (its prompts x n choices) and the OpenAI response bodies built from it.

openai_server.py makes a Generation per request, submits it to the AsyncEngine, then streams it as
server-sent events (sse_chunks) or waits for the end and returns one body.
"""
import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from nanovllm.engine.streaming import StreamDelta
from nanovllm.entrypoints.async_engine import AsyncEngine, EngineStepError
from nanovllm.entrypoints.protocol import error_body


@dataclass
class Choice:
    index: int
    pieces: list[str] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)


class Generation:
    """The engine requests of one HTTP request: prompt i's completion j is choice i * n + j."""

    def __init__(self, engine: AsyncEngine, request_id: str, model: str, n: int):
        self.engine = engine
        self.id = request_id
        self.model = model
        self.n = n
        self.created = int(time.time())
        self.out: asyncio.Queue = asyncio.Queue()
        self.prompt_index: dict[str, int] = {}  # engine request id -> prompt position
        self.prompt_lens: list[int] = []
        self.choices: list[Choice] = []
        self.num_unfinished = 0

    async def submit(self, prompts: list, sampling_params) -> None:
        """Queue every prompt; on a bad one (ValueError/TypeError) abort the others and re-raise."""
        try:
            for i, prompt in enumerate(prompts):
                rid = f"{self.id}-{i}"
                self.prompt_index[rid] = i
                prompt_ids = await self.engine.submit(rid, prompt, sampling_params, self.out)
                self.prompt_lens.append(len(prompt_ids))
        except BaseException:
            self.abort()
            raise
        self.choices = [Choice(i) for i in range(len(prompts) * self.n)]
        self.num_unfinished = len(self.choices)

    def abort(self) -> None:
        for rid in self.prompt_index:
            self.engine.abort(rid)

    async def deltas(self) -> AsyncIterator[tuple[Choice, StreamDelta]]:
        """Each choice's deltas as the engine makes them, recorded into self.choices on the way.
        Leaving early (client gone, task cancelled) aborts the engine requests."""
        try:
            while self.num_unfinished:
                item = await self.out.get()
                if isinstance(item, EngineStepError):
                    raise item
                choice = self.choices[self.prompt_index[item.request_id] * self.n + item.index]
                if item.text:
                    choice.pieces.append(item.text)
                choice.num_tokens = item.num_output_tokens
                if item.is_finished:
                    choice.finish_reason = item.finish_reason
                    self.num_unfinished -= 1
                yield choice, item
        finally:
            if self.num_unfinished:
                self.abort()

    async def run_to_end(self) -> None:
        async for _ in self.deltas():
            pass

    def usage(self) -> dict:
        prompt_tokens = sum(self.prompt_lens)
        completion_tokens = sum(c.num_tokens for c in self.choices)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def header(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def completion_response(gen: Generation) -> dict:
    choices = [{"index": c.index, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
               for c in gen.choices]
    return {**gen.header("text_completion"), "choices": choices, "usage": gen.usage()}


def chat_response(gen: Generation) -> dict:
    choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": None, "finish_reason": c.finish_reason} for c in gen.choices]
    return {**gen.header("chat.completion"), "choices": choices, "usage": gen.usage()}


def _sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


async def sse_chunks(gen: Generation, kind: str, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: one chunk per new piece of text (and per finish), then `[DONE]`."""
    is_chat = kind == "chat"
    obj = "chat.completion.chunk" if is_chat else "text_completion"
    try:
        if is_chat:  # OpenAI opens each choice with the assistant role
            for c in gen.choices:
                yield _sse({**gen.header(obj), "choices": [
                    {"index": c.index, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None}]})
        async for choice, delta in gen.deltas():
            for entry in _chunk_choices(choice, delta, is_chat):
                yield _sse({**gen.header(obj), "choices": [entry]})
        if include_usage:
            yield _sse({**gen.header(obj), "choices": [], "usage": gen.usage()})
    except EngineStepError as e:
        yield _sse(error_body(str(e), "server_error"))
    yield _sse("[DONE]")


def _chunk_choices(choice: Choice, delta: StreamDelta, is_chat: bool) -> list[dict]:
    finish = delta.finish_reason
    text = delta.text or ""
    if not is_chat:
        if not text and finish is None:
            return []
        return [{"index": choice.index, "text": text, "logprobs": None, "finish_reason": finish}]
    entries = []
    if text:
        entries.append({"index": choice.index, "delta": {"content": text}, "logprobs": None,
                        "finish_reason": None})
    if finish is not None:
        entries.append({"index": choice.index, "delta": {}, "logprobs": None, "finish_reason": finish})
    return entries
