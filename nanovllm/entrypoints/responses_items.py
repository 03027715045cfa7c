"""OpenAI's Responses API's bodies (openai_responses.py serves them): the create-response request
as pydantic models, its input items as chat messages (Conversation), and the reply's blocks as
output items."""
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nanovllm.entrypoints.chat_turn import Block
from nanovllm.entrypoints.protocol import ApiError
from nanovllm.entrypoints.validation_errors import first_error

MAX_INPUT_ITEMS = 1024
MAX_TOOLS = 128


class FunctionTool(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """text.format: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "name", "schema"}."""
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    def response_format(self) -> dict | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        if self.schema_ is None:
            raise ApiError(400, "text.format of type json_schema needs a schema", param="text.format.schema")
        return {"type": "json_schema", "json_schema": {"name": self.name or "output", "schema": self.schema_}}


class TextConfig(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted; the model decides its length


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # accepted; the thinking comes whole
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(BaseModel):
    """The fields of OpenAI's create-response body this server acts on, and those it accepts without
    effect (include, truncation "disabled", metadata echoed back, user and cache hints); any other is a 400."""
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    input: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_INPUT_ITEMS)]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # vLLM's extra
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extra
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    include: list[str] | None = Field(None, max_length=16)
    truncation: Literal["disabled"] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None

    def function_tools(self) -> list[FunctionTool]:
        tools = []
        for i, tool in enumerate(self.tools or []):
            if tool.get("type") != "function":  # web_search, file_search, mcp, ...
                raise ApiError(400, f"tools[{i}]: tools of type {tool.get('type')!r} are not supported "
                                    "(function tools only)", param=f"tools[{i}].type")
            try:
                tools.append(FunctionTool.model_validate(tool))
            except ValidationError as e:
                raise bad_field(e, f"tools[{i}]") from None
        return tools


def bad_field(e: ValidationError, where: str = "") -> ApiError:
    path, message = first_error(e, where)
    return ApiError(400, f"{path}: {message}", param=path or None)


# ---- input items -> chat messages -----------------------------------------------------------------
def _text_of(content, where: str, kinds: tuple[str, ...]) -> str:
    """A message's content as text: a string, or a list of text parts of the given types."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}: content must be a string or a list of parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise ApiError(400, f"{where}[{j}]: content parts of type {kind!r} are not supported "
                                f"(expected one of {list(kinds)} with a text)", param=f"{where}[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ApiError(400, f"{where}.{key} must be a string", param=f"{where}.{key}")
    return value


class Conversation:
    """Chat messages built item by item; function calls (and the thinking before them) join the
    assistant message they follow; a function_call_output must answer a call made earlier."""

    def __init__(self, messages: list[dict] | None = None):
        self.messages = list(messages or [])
        self.call_ids = {c["id"] for m in self.messages for c in m.get("tool_calls") or []}
        self.reasoning: str | None = None  # a reasoning item's text, for the next assistant message

    def _assistant(self) -> dict:
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant" or self.reasoning is not None:
            last = {"role": "assistant", "content": ""}
            if self.reasoning is not None:
                last["reasoning_content"], self.reasoning = self.reasoning, None
            self.messages.append(last)
        return last

    def add(self, item: dict, where: str) -> None:
        if not isinstance(item, dict):
            raise ApiError(400, f"{where} must be an object", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role == "assistant":
                self._assistant()["content"] += _text_of(item.get("content"), f"{where}.content",
                                                         ("output_text", "input_text", "refusal"))
                return
            if role not in ("user", "system", "developer"):
                raise ApiError(400, f"{where}.role must be user, assistant, system or developer, got {role!r}",
                               param=f"{where}.role")
            text = _text_of(item.get("content"), f"{where}.content", ("input_text", "output_text"))
            self.messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call_id, name = _string(item, "call_id", where), _string(item, "name", where)
            arguments = _string(item, "arguments", where)
            try:
                json.loads(arguments)
            except json.JSONDecodeError as e:
                raise ApiError(400, f"{where}.arguments is not JSON: {e}", param=f"{where}.arguments") from None
            self._assistant().setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
            self.call_ids.add(call_id)
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            if call_id not in self.call_ids:
                raise ApiError(400, f"{where}: call_id {call_id!r} answers no earlier function_call",
                               param=f"{where}.call_id")
            output = _text_of(item.get("output"), f"{where}.output", ("input_text", "output_text"))
            self.messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            self.reasoning = _text_of(parts, f"{where}.content", ("reasoning_text", "summary_text"))
        else:
            raise ApiError(400, f"{where}: input items of type {kind!r} are not supported (message, "
                                "function_call, function_call_output and reasoning are)", param=f"{where}.type")


# ---- output ----------------------------------------------------------------------------------------
def output_item(block: Block, status: str = "completed") -> dict:
    """A block as a Responses output item (its text so far)."""
    if block.kind == "reasoning":
        content = [{"type": "reasoning_text", "text": block.text}] if status == "completed" else []
        return {"type": "reasoning", "id": block.id, "summary": [], "content": content, "status": status}
    if block.kind == "text":
        content = [text_part(block.text)] if status == "completed" else []
        return {"type": "message", "id": block.id, "role": "assistant", "status": status, "content": content}
    return {"type": "function_call", "id": block.id, "call_id": block.call_id, "name": block.name,
            "arguments": block.text if status == "completed" else "", "status": status}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def assistant_message(blocks: list[Block]) -> dict:
    """The reply as the chat message a continuation (previous_response_id) renders."""
    message: dict = {"role": "assistant", "content": "".join(b.text for b in blocks if b.kind == "text")}
    thinking = "".join(b.text for b in blocks if b.kind == "reasoning")
    if thinking:
        message["reasoning_content"] = thinking
    calls = [{"id": b.call_id, "type": "function", "function": {"name": b.name, "arguments": b.text}}
             for b in blocks if b.kind == "call"]
    if calls:
        message["tool_calls"] = calls
    return message
