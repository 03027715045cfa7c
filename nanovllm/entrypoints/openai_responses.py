"""OpenAI's Responses API: POST /v1/responses (whole, or streamed as the Responses event sequence),
GET and DELETE /v1/responses/{id}, for `client.responses.create` and the OpenAI Agents SDK.

A request is translated into a chat turn (chat_turn.py): `instructions` and `input` (a string, or
message / function_call / function_call_output / reasoning items) become chat messages, function
`tools` and `tool_choice` the chat request's, `text.format` its response_format,
`max_output_tokens` its max_completion_tokens; `reasoning.effort: "none"` turns the template's
thinking off (`enable_thinking: false`, as does vLLM's `chat_template_kwargs`). The reply's blocks
come back as `reasoning`, `message` and `function_call` output items (the bodies and items:
responses_items.py).

Stored responses (`store`, true by default) are kept in memory, least recently used dropped first
past --max-stored-responses or 64 MiB of stored conversation; `previous_response_id` continues
one (its input and output before the new input; its instructions are not carried over, as in
OpenAI's API) and names a response no longer kept with a 404.
"""
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask

from nanovllm.entrypoints.async_engine import EngineStepError
from nanovllm.entrypoints.chat_turn import AssistantTurn, ChatService
from nanovllm.entrypoints.protocol import (ApiError, ChatCompletionRequest, error_body, error_responses,
                                           generation_responses)
from nanovllm.entrypoints.responses_items import (Conversation, FunctionTool, ResponsesRequest, assistant_message,
                                                  bad_field, output_item, text_part)

logger = logging.getLogger(__name__)

MAX_STORED_BYTES = 64 * 2**20


@dataclass
class Stored:
    body: dict             # the response object
    messages: list[dict]   # its conversation, input and output (instructions left out)
    size: int


class ResponseStore:
    """Responses kept for GET and previous_response_id: bounded by count and by stored size, the
    least recently used dropped first."""

    def __init__(self, max_entries: int, max_bytes: int = MAX_STORED_BYTES):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.entries: OrderedDict[str, Stored] = OrderedDict()
        self.size = 0

    def get(self, response_id: str, param: str = "response_id") -> Stored:
        """The stored response; a 404 naming `param` (the path's response_id, or the request's
        previous_response_id) where there is none."""
        stored = self.entries.get(response_id)
        if stored is None:
            raise ApiError(404, f"response {response_id!r} is not stored on this server (never made, not "
                                "stored, deleted, or dropped from its bounded store)", param=param,
                           code="not_found")
        self.entries.move_to_end(response_id)
        return stored

    def put(self, response_id: str, body: dict, messages: list[dict]) -> None:
        size = len(json.dumps(messages)) + len(json.dumps(body))
        if size > self.max_bytes:
            return
        self.entries[response_id] = Stored(body, messages, size)
        self.size += size
        while len(self.entries) > self.max_entries or self.size > self.max_bytes:
            _, dropped = self.entries.popitem(last=False)
            self.size -= dropped.size

    def delete(self, response_id: str) -> None:
        self.size -= self.get(response_id).size
        del self.entries[response_id]


class ResponseRun:
    """One request's response object, as it is built."""

    def __init__(self, body: ResponsesRequest, model: str, tools: list[FunctionTool]):
        self.id = "resp_" + uuid.uuid4().hex[:24]
        self.request, self.model, self.tools = body, model, tools
        self.created_at = int(time.time())

    def body(self, status: str, turn: AssistantTurn | None = None, output: list[dict] | None = None) -> dict:
        r = self.request
        choice = r.tool_choice.model_dump() if isinstance(r.tool_choice, BaseModel) else (r.tool_choice or "auto")
        text_format = r.text.format.model_dump(by_alias=True, exclude_none=True) if r.text and r.text.format \
            else {"type": "text"}
        out = {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
               "model": self.model, "output": output or [], "instructions": r.instructions,
               "tools": [t.model_dump(exclude_none=True) for t in self.tools], "tool_choice": choice,
               "parallel_tool_calls": r.parallel_tool_calls is not False, "temperature": r.temperature,
               "top_p": r.top_p, "max_output_tokens": r.max_output_tokens,
               "previous_response_id": r.previous_response_id, "store": r.store, "metadata": r.metadata or {},
               "text": {"format": text_format}, "truncation": "disabled", "error": None,
               "incomplete_details": None, "usage": None}
        if turn is not None and status in ("completed", "incomplete"):
            if status == "incomplete":
                out["incomplete_details"] = {"reason": "max_output_tokens"}
            out["usage"] = {"input_tokens": turn.num_prompt_tokens,
                            "input_tokens_details": {"cached_tokens": turn.gen.num_cached_tokens,
                                                     "cache_write_tokens": 0},
                            "output_tokens": turn.num_output_tokens,
                            "output_tokens_details": {"reasoning_tokens": turn.reasoning_tokens()},
                            "total_tokens": turn.num_prompt_tokens + turn.num_output_tokens}
        return out


def _status(turn: AssistantTurn) -> str:
    return "incomplete" if turn.finish_reason == "length" else "completed"


def add_responses_routes(app: FastAPI, service: ChatService, max_stored: int = 1024) -> None:
    store = ResponseStore(max_stored)
    app.state.response_store = store

    def chat_request(body: ResponsesRequest, tools: list[FunctionTool], conversation: Conversation) -> ChatCompletionRequest:
        if body.input == [] and body.previous_response_id is None:
            raise ApiError(400, "input is empty", param="input")
        if isinstance(body.input, str):
            conversation.messages.append({"role": "user", "content": body.input})
        else:
            for i, item in enumerate(body.input):
                conversation.add(item, f"input[{i}]")
        messages = conversation.messages
        if body.instructions:
            messages = [{"role": "system", "content": body.instructions}] + messages
        if not messages:
            raise ApiError(400, "input is empty", param="input")
        fields: dict[str, Any] = {"model": body.model, "messages": messages,
                                  "max_completion_tokens": body.max_output_tokens}
        for name in ("temperature", "top_p", "top_k", "parallel_tool_calls", "chat_template_kwargs"):
            if getattr(body, name) is not None:
                fields[name] = getattr(body, name)
        if body.reasoning is not None and body.reasoning.effort == "none":
            fields["chat_template_kwargs"] = {"enable_thinking": False, **(body.chat_template_kwargs or {})}
        if tools:
            fields["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                               for t in tools]
        if body.tool_choice is not None:
            fields["tool_choice"] = (body.tool_choice if isinstance(body.tool_choice, str) else
                                     {"type": "function", "function": {"name": body.tool_choice.name}})
        if body.text is not None and body.text.format is not None:
            response_format = body.text.format.response_format()
            if response_format is not None:
                fields["response_format"] = response_format
        try:
            return ChatCompletionRequest.model_validate(fields)
        except ValidationError as e:
            raise bad_field(e) from None

    @app.post("/v1/responses", responses=generation_responses(None))
    async def create_response(body: ResponsesRequest, request: Request):
        service.check_model(body.model)
        tools = body.function_tools()
        previous = (store.get(body.previous_response_id, "previous_response_id").messages
                    if body.previous_response_id else [])
        conversation = Conversation(previous)
        chat = chat_request(body, tools, conversation)
        turn = await service.start_turn(chat, "resp", "max_output_tokens")
        run = ResponseRun(body, turn.gen.model, tools)

        def keep(response: dict) -> None:
            if body.store:
                store.put(run.id, response, conversation.messages + [assistant_message(turn.blocks)])
        if body.stream:
            return StreamingResponse(_events(run, turn, keep), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"},
                                     background=BackgroundTask(turn.gen.abort_unfinished))
        try:
            if await turn.run(request) is None:
                return JSONResponse(error_body("client disconnected"), status_code=499)
        except EngineStepError as e:
            raise ApiError(500, str(e), "server_error") from e
        response = run.body(_status(turn), turn, [output_item(b) for b in turn.blocks])
        keep(response)
        return response

    # NOTE: one route for both methods, so a 405 on the path names both in Allow.
    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"], responses=error_responses(401, 404))
    async def stored_response(response_id: str, request: Request) -> dict:
        if request.method == "GET":
            return store.get(response_id).body
        store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}


async def _events(run: ResponseRun, turn: AssistantTurn, keep) -> AsyncIterator[str]:
    """The Responses event sequence: response.created and .in_progress; per output item its
    .added, content part and deltas, .done events; then response.completed (or .incomplete)."""
    sequence = 0

    def event(kind: str, **data) -> str:
        nonlocal sequence
        payload = {"type": kind, "sequence_number": sequence, **data}
        sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    yield event("response.created", response=run.body("in_progress"))
    yield event("response.in_progress", response=run.body("in_progress"))
    done: list[dict] = []
    try:
        async for what, block, piece in turn.events():
            at = {"item_id": block.id, "output_index": len(done)}
            if what == "open":
                yield event("response.output_item.added", output_index=len(done), item=output_item(block, "in_progress"))
                if block.kind == "text":
                    yield event("response.content_part.added", **at, content_index=0, part=text_part(""))
                elif block.kind == "reasoning":
                    yield event("response.content_part.added", **at, content_index=0,
                                part={"type": "reasoning_text", "text": ""})
            elif what == "delta":
                if block.kind == "text":
                    yield event("response.output_text.delta", **at, content_index=0, delta=piece, logprobs=[])
                elif block.kind == "reasoning":
                    yield event("response.reasoning_text.delta", **at, content_index=0, delta=piece)
                else:
                    yield event("response.function_call_arguments.delta", **at, delta=piece)
            else:
                if block.kind == "text":
                    yield event("response.output_text.done", **at, content_index=0, text=block.text, logprobs=[])
                    yield event("response.content_part.done", **at, content_index=0, part=text_part(block.text))
                elif block.kind == "reasoning":
                    yield event("response.reasoning_text.done", **at, content_index=0, text=block.text)
                    yield event("response.content_part.done", **at, content_index=0,
                                part={"type": "reasoning_text", "text": block.text})
                else:
                    yield event("response.function_call_arguments.done", **at, arguments=block.text)
                item = output_item(block)
                yield event("response.output_item.done", output_index=len(done), item=item)
                done.append(item)
    except EngineStepError as e:
        yield event("error", code="server_error", message=str(e), param=None)
        failed = run.body("failed", turn, done)
        failed["error"] = {"code": "server_error", "message": str(e)}
        yield event("response.failed", response=failed)
        return
    status = _status(turn)
    response = run.body(status, turn, done)
    keep(response)
    yield event(f"response.{status}", response=response)
