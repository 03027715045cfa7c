"""Anthropic's Messages API: POST /v1/messages (whole, or streamed as Anthropic's events) and
/v1/messages/count_tokens, for the official `anthropic` client and the agents built on it.

A request is translated into a chat turn (chat_turn.py): `system` (a string or text blocks) and the
messages (strings or text / tool_use / tool_result / thinking blocks) become chat messages, custom
`tools` (name, description, input_schema) the chat request's tools, `tool_choice` auto / any / tool /
none its tool choice ("any" is "required"; disable_parallel_tool_use its parallel_tool_calls), and
`thinking: {"type": "disabled"}` turns the template's thinking off (enable_thinking false). The
reply's blocks come back as thinking, text and tool_use content blocks. Errors have Anthropic's
shape (anthropic_errors.py) on every path under /v1/messages.
"""
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.background import BackgroundTask

from nanovllm.entrypoints.anthropic_errors import ERRORS, PATH, error_response
from nanovllm.entrypoints.async_engine import EngineStepError
from nanovllm.entrypoints.chat_turn import AssistantTurn, Block, ChatService
from nanovllm.entrypoints.protocol import ApiError, ChatCompletionRequest, generation_responses
from nanovllm.entrypoints.tokenization import chat_prompt_ids
from nanovllm.entrypoints.validation_errors import first_error

MAX_MESSAGES = 1024
MAX_BLOCKS = 1024
MAX_TOOLS = 128

Blocks = Annotated[list[dict[str, Any]], Field(max_length=MAX_BLOCKS)]


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    role: Literal["user", "assistant"]
    content: str | Blocks


class ThinkingConfig(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=0)  # accepted; the thinking is bounded by max_tokens only
    display: str | None = None


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | Blocks | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: dict[str, Any] | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(None, max_length=16)
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None


def _block_type(block, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise ValueError(f"{where}: a content block must be an object with a type")
    return block["type"]


def _text(block: dict, where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise ValueError(f"{where}.text must be a string")
    return block["text"]


def _tool_result_text(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string or a list of text blocks")
    texts = []
    for j, block in enumerate(content):
        kind = _block_type(block, f"{where}.content[{j}]")
        if kind != "text":
            raise ValueError(f"{where}.content[{j}]: content blocks of type {kind!r} are not supported in a "
                             "tool_result (text only)")
        texts.append(_text(block, f"{where}.content[{j}]"))
    return "".join(texts)


def conversation_of(body: CountTokensRequest) -> list[dict]:
    """The request's system prompt and messages as chat messages; ValueError naming a bad block."""
    out = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "".join(
            _text(b, f"system[{j}]") if _block_type(b, f"system[{j}]") == "text" else _unsupported(b, f"system[{j}]")
            for j, b in enumerate(body.system))
        out.append({"role": "system", "content": system})
    call_ids: set[str] = set()
    for i, m in enumerate(body.messages):
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        message: dict = {"role": m.role, "content": ""}
        results = []
        for j, block in enumerate(blocks):
            where = f"messages[{i}].content[{j}]"
            kind = _block_type(block, where)
            if kind == "text":
                message["content"] += _text(block, where)
            elif kind == "tool_use" and m.role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
                        or not isinstance(block.get("input"), dict):
                    raise ValueError(f"{where}: a tool_use block needs a string id and name and an object input")
                call_ids.add(block["id"])
                message.setdefault("tool_calls", []).append(
                    {"id": block["id"], "type": "function",
                     "function": {"name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}})
            elif kind == "tool_result" and m.role == "user":
                if block.get("tool_use_id") not in call_ids:
                    raise ValueError(f"{where}: tool_use_id {block.get('tool_use_id')!r} names no earlier tool_use block")
                results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                                "content": _tool_result_text(block.get("content"), where)})
            elif kind == "thinking" and m.role == "assistant":
                if not isinstance(block.get("thinking"), str):
                    raise ValueError(f"{where}.thinking must be a string")
                message["reasoning_content"] = message.get("reasoning_content", "") + block["thinking"]
            elif kind == "redacted_thinking" and m.role == "assistant":
                continue  # another model's encrypted thinking: nothing this one can read
            else:
                _unsupported(block, where, m.role)
        out += results
        if message["content"] or m.role == "assistant" or not results:
            out.append(message)
    return out


def _unsupported(block: dict, where: str, role: str | None = None):
    whose = f" in a {role} message" if role else ""
    raise ValueError(f"{where}: content blocks of type {block.get('type')!r} are not supported{whose} (text, "
                     "tool_use and thinking from the assistant, text and tool_result from the user)")


def _chat_tools(body: CountTokensRequest) -> list[dict] | None:
    if not body.tools:
        return None
    tools = []
    for i, tool in enumerate(body.tools):
        if tool.get("type") not in (None, "custom"):
            raise ValueError(f"tools[{i}]: tools of type {tool.get('type')!r} are not supported (custom tools only)")
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
            raise ValueError(f"tools[{i}]: a tool needs a string name and an input_schema object")
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(choice: dict | None) -> tuple[Any, bool | None]:
    """(chat tool_choice, parallel_tool_calls) of Anthropic's tool_choice."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = None if "disable_parallel_tool_use" not in choice else not choice["disable_parallel_tool_use"]
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise ValueError("tool_choice of type tool needs the tool's name")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if mapped is None:
        raise ValueError(f"tool_choice.type must be auto, any, tool or none, got {kind!r}")
    return mapped, parallel


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    fields: dict[str, Any] = {"model": body.model, "messages": conversation_of(body)}
    tools = _chat_tools(body)
    if tools:
        fields["tools"] = tools
    choice, parallel = _tool_choice(body.tool_choice)
    if choice is not None:
        fields["tool_choice"] = choice
    if parallel is not None:
        fields["parallel_tool_calls"] = parallel
    if body.thinking is not None and body.thinking.type == "disabled":
        fields["chat_template_kwargs"] = {"enable_thinking": False}
    if isinstance(body, MessagesRequest):
        fields["max_completion_tokens"] = body.max_tokens
        for name in ("temperature", "top_p", "top_k"):
            if getattr(body, name) is not None:
                fields[name] = getattr(body, name)
        if body.stop_sequences:
            fields["stop"] = body.stop_sequences
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        path, message = first_error(e)
        raise ValueError(f"{path}: {message}") from None


def content_block(block: Block, whole: bool = True) -> dict:
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": block.text if whole else "", "signature": ""}
    if block.kind == "text":
        return {"type": "text", "text": block.text if whole else ""}
    try:
        arguments = json.loads(block.text) if whole else {}
    except json.JSONDecodeError:
        arguments = {}
    return {"type": "tool_use", "id": block.call_id, "name": block.name,
            "input": arguments if isinstance(arguments, dict) else {}}


def stop_reason(turn: AssistantTurn) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence of a finished turn."""
    if turn.finish_reason == "tool_calls":
        return "tool_use", None
    if turn.finish_reason == "length":
        return "max_tokens", None
    if isinstance(turn.stop_reason, str):
        return "stop_sequence", turn.stop_reason
    return "end_turn", None


def add_messages_routes(app: FastAPI, service: ChatService) -> None:
    engine = service.engine

    def translated(body: CountTokensRequest) -> ChatCompletionRequest:
        try:
            return chat_request(body)
        except ValueError as e:
            raise ApiError(400, str(e)) from e

    @app.post(PATH + "/count_tokens", responses={**ERRORS, 200: {"description": "{\"input_tokens\": N}"}})
    async def count_tokens(body: CountTokensRequest) -> dict:
        service.check_model(body.model)
        chat = translated(body)
        tools = [t.model_dump(exclude_none=True) for t in chat.tools] if chat.tools else None
        prompt = await chat_prompt_ids(engine, chat.conversation(), chat, tools, False, False)
        return {"input_tokens": len(prompt)}

    @app.post(PATH, responses=generation_responses(None, ERRORS))
    async def messages(body: MessagesRequest, request: Request):
        turn = await service.start_turn(translated(body), "msg", "max_tokens")
        head = {"id": "msg_" + turn.gen.id.split("-", 1)[-1], "type": "message", "role": "assistant",
                "model": turn.gen.model}
        if body.stream:
            return StreamingResponse(_stream(turn, head), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"},
                                     background=BackgroundTask(turn.gen.abort_unfinished))
        try:
            if await turn.run(request) is None:
                return error_response(499, "client disconnected")
        except EngineStepError as e:
            return error_response(500, str(e))
        reason, sequence = stop_reason(turn)
        return {**head, "content": [content_block(b) for b in turn.blocks], "stop_reason": reason,
                "stop_sequence": sequence,
                "usage": {**input_usage(turn), "output_tokens": turn.num_output_tokens}}


def input_usage(turn: AssistantTurn) -> dict:
    """Anthropic's split of the prompt: input_tokens computed, cache_read_input_tokens read from the
    prefix cache or the tier under it (their sum is the prompt)."""
    cached = turn.gen.num_cached_tokens
    return {"input_tokens": turn.num_prompt_tokens - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached}


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


async def _stream(turn: AssistantTurn, head: dict) -> AsyncIterator[str]:
    """Anthropic's event sequence: message_start; per content block its start, deltas and stop;
    message_delta with the stop reason and usage; message_stop."""
    yield _event("message_start", {"message": {**head, "content": [], "stop_reason": None, "stop_sequence": None,
                                               "usage": {"input_tokens": turn.num_prompt_tokens, "output_tokens": 0}}})
    index = 0
    delta_of = {"text": lambda p: {"type": "text_delta", "text": p},
                "reasoning": lambda p: {"type": "thinking_delta", "thinking": p},
                "call": lambda p: {"type": "input_json_delta", "partial_json": p}}
    try:
        async for what, block, piece in turn.events():
            if what == "open":
                yield _event("content_block_start", {"index": index, "content_block": content_block(block, whole=False)})
            elif what == "delta":
                yield _event("content_block_delta", {"index": index, "delta": delta_of[block.kind](piece)})
            else:
                if block.kind == "reasoning":
                    yield _event("content_block_delta", {"index": index,
                                                         "delta": {"type": "signature_delta", "signature": ""}})
                yield _event("content_block_stop", {"index": index})
                index += 1
    except EngineStepError as e:
        yield _event("error", {"error": {"type": "api_error", "message": str(e)}})
        return
    reason, sequence = stop_reason(turn)
    yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                   "usage": {**input_usage(turn), "output_tokens": turn.num_output_tokens}})
    yield _event("message_stop", {})
