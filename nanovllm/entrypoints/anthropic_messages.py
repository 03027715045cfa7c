"""Anthropic's Messages API: POST /v1/messages (whole or streamed with Anthropic's events) and
/v1/messages/count_tokens, for the official `anthropic` client and the tools built on it. Text
content only so far: `system` (a string or text blocks), messages whose content is a string or
text blocks, `max_tokens`, `stop_sequences`, `temperature`, `top_p`, `top_k`, `stream`, `metadata`;
errors in Anthropic's shape ({"type": "error", "error": {"type", "message"}}). Other content blocks
(tool_use, tool_result, image) and `tools` are refused with a 400 naming them."""
import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.background import BackgroundTask

from nanovllm.entrypoints.async_engine import AsyncEngine, EngineStepError, EngineStoppedError
from nanovllm.entrypoints.limits import check_context_length
from nanovllm.entrypoints.protocol import ApiError
from nanovllm.entrypoints.serving import Generation
from nanovllm.entrypoints.tokenization import prepared
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.chat_template import render_chat

# Anthropic's error types by HTTP status.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "request_too_large", 500: "api_error", 503: "overloaded_error"}
MAX_MESSAGES = 1024


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="allow")  # cache_control, citations: accepted, not used
    type: str
    text: str | None = None

    def checked_text(self, where: str) -> str:
        if self.type != "text" or self.text is None:
            raise ValueError(f"{where}: content blocks of type {self.type!r} are not supported (text only)")
        return self.text


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: str | list[TextBlock]

    def text(self, i: int) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(b.checked_text(f"messages[{i}].content[{j}]") for j, b in enumerate(self.content))


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | list[TextBlock] | None = None
    tools: list[dict] | None = None

    def conversation(self) -> list[dict]:
        if self.tools:
            raise ValueError("tools are not supported on /v1/messages yet")
        out = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "".join(
                b.checked_text(f"system[{j}]") for j, b in enumerate(self.system))
            out.append({"role": "system", "content": system})
        out += [{"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages)]
        return out


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(None, max_length=16)
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: dict | None = None
    tool_choice: dict | None = None

    def sampling_params(self, defaults: dict) -> SamplingParams:
        kwargs = dict(defaults)
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        if self.stop_sequences:
            kwargs["stop"] = self.stop_sequences
        return SamplingParams(max_tokens=self.max_tokens, **kwargs)


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse({"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"),
                                                     "message": message}}, status_code=status)


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def stop_reason(finish_reason: str | None, stop) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence from ours."""
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def add_messages_routes(app: FastAPI, engine: AsyncEngine, served_model_name: str,
                        check_model: Callable[[str | None], None]) -> None:
    max_model_len = engine.llm.config.max_model_len
    sampling_defaults = engine.llm.config.sampling_defaults

    async def parse(request: Request, kind: type[BaseModel]):
        try:
            body = kind.model_validate(await request.json())
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ApiError(400, f"{where}: {first['msg']}") from None
        except ValueError as e:  # not JSON
            raise ApiError(400, f"the body is not JSON: {e}") from None
        check_model(body.model)
        return body

    async def prompt_of(body: CountTokensRequest) -> list[int]:
        try:
            conversation = body.conversation()
        except ValueError as e:
            raise ApiError(400, str(e)) from e
        return await prepared(engine, lambda llm: render_chat(llm.tokenizer, conversation))

    @app.post("/v1/messages/count_tokens", include_in_schema=False)
    async def count_tokens(request: Request):
        try:
            body = await parse(request, CountTokensRequest)
            return {"input_tokens": len(await prompt_of(body))}
        except ApiError as e:
            return error_response(e.status, e.body["error"]["message"])

    @app.post("/v1/messages", include_in_schema=False)
    async def messages(request: Request):
        try:
            body = await parse(request, MessagesRequest)
            try:
                params = body.sampling_params(sampling_defaults)
            except (ValueError, TypeError) as e:
                raise ApiError(400, str(e)) from e
            prompt = await prompt_of(body)
            check_context_length([len(prompt)], params.max_tokens, max_model_len, "messages", "max_tokens")
            gen = Generation(engine, engine.new_request_id("msg"), served_model_name, 1, None)
            try:
                await gen.submit([prompt], params)
            except (ValueError, TypeError) as e:
                raise ApiError(400, str(e)) from e
            except EngineStoppedError as e:
                raise ApiError(503, str(e), "server_error") from e
        except ApiError as e:
            return error_response(e.status, e.body["error"]["message"])
        message_id = "msg_" + uuid.uuid4().hex[:24]
        head = {"id": message_id, "type": "message", "role": "assistant", "model": served_model_name}
        if body.stream:
            return StreamingResponse(_stream(gen, head, len(prompt)), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"},
                                     background=BackgroundTask(gen.abort_unfinished))
        text, finish, stop, num_tokens = "", None, None, 0
        try:
            async for _, delta, _ in gen.deltas():
                text += delta.text or ""
                finish, stop, num_tokens = delta.finish_reason, delta.stop_reason, delta.num_output_tokens
        except EngineStepError as e:
            return error_response(500, str(e))
        reason, sequence = stop_reason(finish, stop)
        return {**head, "content": [{"type": "text", "text": text}], "stop_reason": reason,
                "stop_sequence": sequence, "usage": {"input_tokens": len(prompt), "output_tokens": num_tokens}}


async def _stream(gen: Generation, head: dict, num_prompt_tokens: int) -> AsyncIterator[str]:
    """Anthropic's event sequence: message_start, one text block (start, deltas, stop),
    message_delta with the stop reason and usage, message_stop."""
    yield _event("message_start", {"type": "message_start", "message": {
        **head, "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": num_prompt_tokens, "output_tokens": 0}}})
    yield _event("content_block_start", {"type": "content_block_start", "index": 0,
                                         "content_block": {"type": "text", "text": ""}})
    finish, stop, num_tokens = None, None, 0
    try:
        async for _, delta, _ in gen.deltas():
            if delta.text:
                yield _event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                     "delta": {"type": "text_delta", "text": delta.text}})
            finish, stop, num_tokens = delta.finish_reason, delta.stop_reason, delta.num_output_tokens
    except EngineStepError as e:
        yield _event("error", {"type": "error", "error": {"type": "api_error", "message": str(e)}})
        return
    yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
    reason, sequence = stop_reason(finish, stop)
    yield _event("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                   "usage": {"output_tokens": num_tokens}})
    yield _event("message_stop", {"type": "message_stop"})
