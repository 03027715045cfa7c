"""One HTTP request's generation (its prompts x n choices) and the OpenAI response bodies built from it.

openai_server.py makes a Generation per request, submits it to the AsyncEngine, then streams it as
server-sent events (sse_chunks) or waits for the end and returns one body.
"""
import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from nanovllm.outputs.streaming import StreamDelta
from nanovllm.entrypoints.async_engine import AsyncEngine, EngineStepError
from nanovllm.entrypoints.protocol import error_body


@dataclass
class Choice:
    index: int
    pieces: list[str] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    # With logprobs: (token text, its logprob, [(text, logprob)] of the top ones) per token.
    logprobs: list[tuple[str, float | None, list[tuple[str, float]]]] = field(default_factory=list)
    num_logprob_chars: int = 0  # text_offset of the next token (completions' logprobs format)
    # With prompt_logprobs: one entry per prompt token (None first), and each id's text.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_token_texts: dict[int, str] = field(default_factory=dict)
    num_cached_tokens: int = 0  # of its prompt's tokens, found cached

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def _clamp(logprob: float) -> float:
    return max(logprob, -9999.0)  # JSON has no -Infinity


def token_logprobs(delta: StreamDelta, top_n: int,
                   as_ids: bool = False) -> list[tuple[str, float | None, list[tuple[str, float]]]]:
    """The delta's tokens as (text, logprob, top_n most likely (text, logprob)), best first;
    as_ids (vLLM's return_tokens_as_token_ids): each token's text is "token_id:N"."""
    def text_of(t: int) -> str:
        return f"token_id:{t}" if as_ids else delta.token_texts[t]
    entries = []
    for token_id, d in zip(delta.token_ids, delta.logprobs or []):
        text = text_of(token_id)
        if not d:
            entries.append((text, None, []))
            continue
        top = sorted(d.items(), key=lambda kv: -kv[1])[:top_n]
        entries.append((text, _clamp(d[token_id]), [(text_of(t), _clamp(lp)) for t, lp in top]))
    return entries


def echo_logprobs(choice: Choice, prompt_ids: list[int], top_n: int) -> list:
    """The echoed prompt's tokens as token_logprobs entries; the first has no logprob (top: None)."""
    texts = choice.prompt_token_texts
    entries: list = [(texts.get(prompt_ids[0], ""), None, None)]
    for token_id, d in zip(prompt_ids[1:], (choice.prompt_logprobs or [])[1:]):
        top = sorted(d.items(), key=lambda kv: -kv[1])[:top_n]
        entries.append((texts[token_id], _clamp(d[token_id]), [(texts[t], _clamp(lp)) for t, lp in top]))
    return entries


def vllm_prompt_logprobs(choice: Choice, k: int) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}}; rank counts from 1 among the top k (None for a prompt token outside them)."""
    out: list[dict | None] = []
    texts = choice.prompt_token_texts
    for d in choice.prompt_logprobs or []:
        if d is None:
            out.append(None)
            continue
        prompt_token = next(iter(d))  # the prompt token first, then the top k
        ranks = {t: i + 1 for i, t in enumerate(sorted(d, key=lambda t: -d[t]))}
        if len(d) > k:
            ranks[prompt_token] = None  # not among the top k: its place is not known
        out.append({str(t): {"logprob": _clamp(lp), "rank": ranks[t], "decoded_token": texts.get(t, "")}
                    for t, lp in d.items()})
    return out


def completion_logprobs(choice: Choice, entries: list) -> dict:
    """OpenAI's legacy completions format: parallel lists, top_logprobs keyed by token text."""
    offsets = []
    for text, _, _ in entries:
        offsets.append(choice.num_logprob_chars)
        choice.num_logprob_chars += len(text)
    return {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
            "top_logprobs": [None if e[2] is None else dict(e[2]) for e in entries], "text_offset": offsets}


def chat_logprobs(entries: list) -> dict:
    def item(text: str, logprob: float | None) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
    return {"content": [dict(item(text, lp), top_logprobs=[item(t, l) for t, l in top])
                        for text, lp, top in entries], "refusal": None}


class Generation:
    """The engine requests of one HTTP request: prompt i's completion j is choice i * n + j."""

    def __init__(self, engine: AsyncEngine, request_id: str, model: str, n: int, top_logprobs: int | None, *,
                 num_prompt_logprobs: int | None = None, echo_texts: list[str] | None = None,
                 echo_prefix: str = "", tokens_as_ids: bool = False, new_tool_reply=None, reasoning=None,
                 lora_request=None):
        """num_prompt_logprobs: SamplingParams.prompt_logprobs; echo_texts: completions' echo, each
        prompt's text; echo_prefix: chat's echo, the last (assistant) message's content opening the
        reply; tokens_as_ids: return_tokens_as_token_ids; new_tool_reply: chat with tools, () ->
        tool_calls.ToolReply for one choice; reasoning: chat's reasoning.ReasoningParser (the
        thinking returned apart; tool calls are read from the answer after it)."""
        self.engine = engine
        self.id = request_id
        self.model = model
        self.n = n
        self.top_logprobs = top_logprobs  # None: no logprobs asked
        self.created = int(time.time())
        self.out: asyncio.Queue = asyncio.Queue()
        self.prompt_index: dict[str, int] = {}  # engine request id -> prompt position
        self.prompt_lens: list[int] = []
        self.prompt_ids: list[list[int]] = []
        self.echo_texts = echo_texts
        self.num_prompt_logprobs = num_prompt_logprobs
        self.choices: list[Choice] = []
        self.num_unfinished = 0
        self.tokens_as_ids = tokens_as_ids
        self.echo_prefix = echo_prefix
        self.new_tool_reply = new_tool_reply
        self.reasoning = reasoning
        self.lora_request = lora_request  # the adapter every prompt runs with (None: the base model)

    async def submit(self, prompts: list, sampling_params) -> None:
        """Queue every prompt at once (they can share a step); if one is refused, abort the others
        and raise its error (ValueError/TypeError: a bad request)."""
        for i in range(len(prompts)):
            self.prompt_index[f"{self.id}-{i}"] = i
        try:
            accepted = await asyncio.gather(*(self.engine.submit(rid, prompt, sampling_params, self.out,
                                                                 self.lora_request)
                                              for rid, prompt in zip(self.prompt_index, prompts)),
                                            return_exceptions=True)
            errors = [r for r in accepted if isinstance(r, BaseException)]
            if errors:
                raise errors[0]
        except BaseException:
            self.abort()
            raise
        self.prompt_ids = list(accepted)
        self.prompt_lens = [len(prompt_ids) for prompt_ids in accepted]
        self.choices = [Choice(i) for i in range(len(prompts) * self.n)]
        self.num_unfinished = len(self.choices)

    def abort(self) -> None:
        for rid in self.prompt_index:
            self.engine.abort(rid)

    def abort_unfinished(self) -> None:
        if self.num_unfinished:
            self.abort()

    async def deltas(self) -> AsyncIterator[tuple[Choice, StreamDelta, list]]:
        """Each choice's deltas as the engine makes them (with their logprob entries), recorded
        into self.choices on the way. Leaving early (client gone, cancelled) aborts the requests."""
        try:
            while self.num_unfinished:
                for delta in await self._next_deltas():
                    choice = self.choices[self.prompt_index[delta.request_id] * self.n + delta.index]
                    if delta.text:
                        choice.pieces.append(delta.text)
                    if delta.prompt_logprobs is not None:
                        choice.prompt_logprobs = delta.prompt_logprobs
                        choice.prompt_token_texts = delta.prompt_token_texts or {}
                    entries = (token_logprobs(delta, self.top_logprobs, self.tokens_as_ids)
                               if self.top_logprobs is not None else [])
                    choice.logprobs += entries
                    choice.num_tokens = delta.num_output_tokens
                    choice.num_cached_tokens = delta.num_cached_tokens
                    if delta.is_finished:
                        choice.finish_reason = delta.finish_reason
                        self.num_unfinished -= 1
                    yield choice, delta, entries
        finally:
            self.abort_unfinished()

    async def _next_deltas(self) -> list[StreamDelta]:
        """The next delta, merged with every one already waiting behind it: when the client
        reads slower than the engine steps, it gets fewer, larger chunks instead of a backlog."""
        items = [await self.out.get()]
        while not self.out.empty():
            items.append(self.out.get_nowait())
        merged: dict[tuple, StreamDelta] = {}
        for item in items:
            if isinstance(item, EngineStepError):
                raise item
            key = (item.request_id, item.index)
            merged[key] = merged[key].merge(item) if key in merged else item
        return list(merged.values())

    async def run_to_end(self) -> None:
        async for _ in self.deltas():
            pass

    async def run_unless_disconnected(self, request) -> bool:
        """run_to_end; False (and the requests aborted) if the HTTP client left first."""
        return await unless_disconnected(self.run_to_end(), request)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens found cached, each prompt counted once (its completions share it)."""
        return sum(max((c.num_cached_tokens for c in self.choices[i * self.n:(i + 1) * self.n]), default=0)
                   for i in range(len(self.prompt_lens)))

    def usage(self) -> dict:
        prompt_tokens = sum(self.prompt_lens)
        completion_tokens = sum(c.num_tokens for c in self.choices)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens}}

    def header(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


async def unless_disconnected(work, request) -> bool:
    """Await the coroutine work; False (and work cancelled) if the HTTP client left first; work's
    error (an EngineStepError) is raised.

    NOTE: the request's body is already read, so its next ASGI message can only be http.disconnect."""
    task, hang_up = asyncio.ensure_future(work), asyncio.ensure_future(request.receive())
    try:
        await asyncio.wait({task, hang_up}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, hang_up):
            t.cancel()  # cancelling Generation.deltas runs its abort
    if task.cancelled() or not task.done():
        return False
    task.result()
    return True


def completion_response(gen: Generation) -> dict:
    return {**gen.header("text_completion"), "choices": [completion_choice(gen, c) for c in gen.choices],
            "usage": gen.usage()}


def completion_choice(gen: Generation, c: Choice) -> dict:
    """One choice; with echo, the prompt's text (and its tokens' logprobs) come first."""
    prompt = c.index // gen.n
    text, entries = c.text, c.logprobs
    if gen.echo_texts is not None:
        text = gen.echo_texts[prompt] + text
        if gen.top_logprobs is not None:
            entries = echo_logprobs(c, gen.prompt_ids[prompt], gen.top_logprobs) + entries
    out = {"index": c.index, "text": text, "finish_reason": c.finish_reason,
           "logprobs": completion_logprobs(c, entries) if gen.top_logprobs is not None else None}
    if c.prompt_logprobs is not None:
        out["prompt_logprobs"] = vllm_prompt_logprobs(c, gen.num_prompt_logprobs or 0)
    return out


def chat_response(gen: Generation) -> dict:
    has_logprobs = gen.top_logprobs is not None
    choices = []
    for c in gen.choices:
        text, message = c.text, {"role": "assistant"}
        if gen.reasoning is not None:
            message["reasoning_content"], text = gen.reasoning.split(text)
        message["content"], finish = gen.echo_prefix + text, c.finish_reason
        if gen.new_tool_reply is not None:
            reply = gen.new_tool_reply()
            content, calls = reply.whole(text)
            message["content"] = gen.echo_prefix + content if content or gen.echo_prefix else None
            message["tool_calls"] = calls
            finish = reply.finish_reason(finish)
        choices.append({"index": c.index, "message": message, "finish_reason": finish,
                        "logprobs": chat_logprobs(c.logprobs) if has_logprobs else None})
    return {**gen.header("chat.completion"), "choices": choices, "usage": gen.usage()}


def _sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


async def sse_chunks(gen: Generation, kind: str, include_usage: bool,
                     continuous_usage: bool = False) -> AsyncIterator[str]:
    """Server-sent events: one chunk per new piece of text (and per finish), then `[DONE]`.
    continuous_usage (vLLM's continuous_usage_stats): every chunk also carries the usage so far."""
    is_chat = kind == "chat"
    obj = "chat.completion.chunk" if is_chat else "text_completion"

    def usage() -> dict:
        return {"usage": gen.usage()} if continuous_usage else {}
    replies = {c.index: gen.new_tool_reply() for c in gen.choices} if gen.new_tool_reply else {}
    thinking = {c.index: gen.reasoning.stream() for c in gen.choices} if is_chat and gen.reasoning else {}
    try:
        if is_chat:  # OpenAI opens each choice with the assistant role
            for c in gen.choices:
                yield _sse({**gen.header(obj), "choices": [
                    {"index": c.index, "delta": {"role": "assistant", "content": gen.echo_prefix},
                     "logprobs": None, "finish_reason": None}], **usage()})
        async for choice, delta, entries in gen.deltas():
            logprobs = None
            if gen.top_logprobs is not None and entries:
                logprobs = chat_logprobs(entries) if is_chat else completion_logprobs(choice, entries)
            if choice.index in thinking:  # the thinking as reasoning_content; the answer goes on
                reasoning, answer = thinking[choice.index].feed(delta.text or "", delta.is_finished)
                if reasoning:
                    yield _sse({**gen.header(obj), "choices": [
                        {"index": choice.index, "delta": {"reasoning_content": reasoning}, "logprobs": None,
                         "finish_reason": None}], **usage()})
                delta = replace(delta, text=answer)
            chunk_choices = (_chunk_choices(choice, delta, is_chat, logprobs) if choice.index not in replies
                             else _tool_chunk_choices(choice, delta, logprobs, replies[choice.index]))
            for entry in chunk_choices:
                yield _sse({**gen.header(obj), "choices": [entry], **usage()})
        if include_usage:
            yield _sse({**gen.header(obj), "choices": [], "usage": gen.usage()})
    except EngineStepError as e:
        yield _sse(error_body(str(e), "server_error"))
    yield _sse("[DONE]")


def _chunk_choices(choice: Choice, delta: StreamDelta, is_chat: bool, logprobs: dict | None) -> list[dict]:
    """The chunk entries of one delta; a delta with neither text, logprobs nor finish has none."""
    finish = delta.finish_reason
    text = delta.text or ""
    if not is_chat:
        if not text and finish is None and logprobs is None:
            return []
        return [{"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": finish}]
    entries = []
    if text or logprobs is not None:
        entries.append({"index": choice.index, "delta": {"content": text}, "logprobs": logprobs,
                        "finish_reason": None})
    if finish is not None:
        entries.append({"index": choice.index, "delta": {}, "logprobs": None, "finish_reason": finish})
    return entries


def _tool_chunk_choices(choice: Choice, delta: StreamDelta, logprobs: dict | None, reply) -> list[dict]:
    """A chat delta read for tool calls: content outside the calls, then delta.tool_calls pieces."""
    content, calls = reply.feed(delta.text or "", delta.is_finished)
    entries = []
    if content or logprobs is not None:
        entries.append({"index": choice.index, "delta": {"content": content}, "logprobs": logprobs,
                        "finish_reason": None})
    if calls:
        entries.append({"index": choice.index, "delta": {"tool_calls": calls}, "logprobs": None,
                        "finish_reason": None})
    if delta.finish_reason is not None:
        entries.append({"index": choice.index, "delta": {}, "logprobs": None,
                        "finish_reason": reply.finish_reason(delta.finish_reason)})
    return entries
