"""Pydantic models of the OpenAI API requests the server accepts, and their SamplingParams mapping;
vLLM's /tokenize and /detokenize bodies; OpenAI's error body.

openai_server.py validates each request body with these models. Unknown fields are an error (400).
"""
from contextlib import contextmanager
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from nanovllm.entrypoints.chat_protocol import ChatTemplateOptions, ChatTool, NamedToolChoice, template_tool_call
from nanovllm.entrypoints.sglang_compat import SGLangChatFields, SGLangSamplingFields
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams

# Request fields handed to SamplingParams under the same (vLLM) name when the client sets them.
# SamplingParams itself validates their values; one it does not know raises TypeError -> 400.
SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "min_tokens",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
    "skip_special_tokens", "include_stop_str_in_output", "n", "spaces_between_special_tokens",
)


def resolve_max_tokens(asked: int | None, defaults: dict | None, ceiling: int | None) -> int | None:
    """A request's max_tokens: what it asked for, else the server's default (the generation config's
    max_new_tokens; None: as many as fit in max_model_len, OpenAI's and vLLM's default), never more
    than the ceiling (--override-generation-config's max_new_tokens, as vLLM caps it)."""
    value = asked if asked is not None else (defaults or {}).get("max_tokens")
    if ceiling is not None and (value is None or value > ceiling):
        return ceiling
    return value


# OpenAI's and vLLM's cap on logprobs / top_logprobs.
MAX_LOGPROBS = 20

# NOTE: token ids are StrictInt: a lax int would take `true` or `1.0` as a token id. The upper
# bound, the model's vocabulary, is checked where the model is known.
TokenIds = list[Annotated[StrictInt, Field(ge=0)]]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    # vLLM's: usage (so far) in every chunk too, not only in the last one (needs include_usage).
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    """OpenAI's response_format.json_schema. strict is accepted; the schema is always enforced."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def to_params(self) -> StructuredOutputsParams | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return StructuredOutputsParams(json=self.json_schema.schema_)


class StructuredOutputsRequest(BaseModel):
    """vLLM's structured_outputs field: exactly one of these (StructuredOutputsParams checks)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _SamplingRequest(SGLangSamplingFields):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's plus vLLM's extras, plus
    the SGLang fields sglang-router adds, from sglang_compat.py)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # left out: the one model served (vLLM's rule)
    # NOTE: the bounds below are SamplingParams' own, stated here too so /openapi.json documents them
    # (clients and fuzzers see them); SamplingParams still checks every value it is given.
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1)  # the upper bound is the server's --max-n (limits.py)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling fields (the openai client sends them through `extra_body`).
    top_k: int | None = Field(None, ge=-1)  # 0 or -1: off
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    spaces_between_special_tokens: bool | None = None
    # vLLM's: logprob tokens as "token_id:N" (every token is then identifiable, even a partial character).
    return_tokens_as_token_ids: bool | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs, vLLM's older guided_*.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def check_supported(self) -> None:
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        self.check_sglang_fields()

    def sampling_kwargs(self, defaults: dict | None = None) -> dict:
        """The fields the client set, by SamplingParams' names, over defaults (the model's,
        Config.sampling_defaults); fields in neither keep SamplingParams' own defaults."""
        kwargs = dict(defaults or {})
        kwargs.update({name: getattr(self, name) for name in SAMPLING_FIELDS
                       if name in self.model_fields_set and getattr(self, name) is not None})
        structured = self.structured_outputs_params()
        if structured is not None:
            kwargs["structured_outputs"] = structured
        return {**kwargs, **self.sglang_sampling_kwargs()}

    def asked_max_tokens(self, defaults: dict | None = None) -> int | None:
        """The completion length the client asked for (each request kind says where it asks)."""
        raise NotImplementedError

    def checked_max_tokens(self, defaults: dict | None, ceiling: int | None) -> int | None:
        """The completion length a prompt must leave room for (limits.check_context_length): the
        client's own ask, within the ceiling. A server default is not held against the prompt: the
        engine stops a completion at max_model_len."""
        asked = self.asked_max_tokens(defaults)
        return asked if asked is None or ceiling is None else min(asked, ceiling)

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The output constraint from whichever of the three ways the client used (one at most)."""
        given: dict[str, StructuredOutputsParams] = {}
        if self.response_format is not None and self.response_format.type != "text":
            given["response_format"] = self.response_format.to_params()
        if self.structured_outputs is not None:
            fields = self.structured_outputs.model_dump(by_alias=True, exclude_none=True)
            given["structured_outputs"] = StructuredOutputsParams(**fields)
        guided = {kind: getattr(self, f"guided_{kind}") for kind in ("json", "regex", "choice", "grammar")
                  if getattr(self, f"guided_{kind}") is not None}
        if guided:
            if len(guided) > 1:
                raise ValueError(f"give one guided_* field at most, got {sorted('guided_' + k for k in guided)}")
            given["guided_" + next(iter(guided))] = StructuredOutputsParams(**guided)
        if len(given) > 1:
            raise ValueError(f"give one of response_format, structured_outputs and guided_* at most, got {sorted(given)}")
        return next(iter(given.values()), None)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingRequest):
    prompt: str | TokenIds | list[str] | list[TokenIds]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # the prompt's text (and, with logprobs, its tokens' logprobs) before the completion
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
    prompt_logprobs: int | None = None  # vLLM's: a top-level prompt_logprobs list in each choice

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo and self.stream:
            raise ValueError("echo is not supported with stream")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of must equal n ({self.n}) or be unset, got {self.best_of}")

    def asked_max_tokens(self, defaults: dict | None = None) -> int | None:
        """The completion length the client asked for: max_tokens; unset, OpenAI's 16 where the
        server has no default of its own (None: the server's; null: as many as fit)."""
        if "max_tokens" in self.model_fields_set or "max_tokens" in (defaults or {}):
            return self.max_tokens if "max_tokens" in self.model_fields_set else None
        return 16

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (a string, token ids, or a list of either)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ValueError("prompt is empty")
        return list(p)

    def sampling_params(self, defaults: dict | None = None, max_tokens_ceiling: int | None = None) -> SamplingParams:
        kwargs = self.sampling_kwargs(defaults)
        kwargs["max_tokens"] = resolve_max_tokens(self.asked_max_tokens(defaults), defaults, max_tokens_ceiling)
        if self.logprobs is not None:
            kwargs["logprobs"] = self.logprobs
        if self.prompt_logprobs is not None:
            kwargs["prompt_logprobs"] = self.prompt_logprobs
        elif self.echo and self.logprobs is not None:
            kwargs["prompt_logprobs"] = self.logprobs  # echoed prompt tokens carry logprobs too
        return SamplingParams(**kwargs)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. name, tool_calls: passed on to the template
    role: str
    content: str | list[TextPart] | None = None

    def to_template_dict(self) -> dict:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        if isinstance(message.get("tool_calls"), list):
            message["tool_calls"] = [template_tool_call(c) for c in message["tool_calls"]]
        return message


class ChatCompletionRequest(ChatTemplateOptions, _SamplingRequest, SGLangChatFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # Tool calling (tool_calls.py): default choice "auto" when tools are given, else "none".
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: the reply starts with the last message's content when that message is the assistant's.
    echo: bool = False
    add_special_tokens: bool = False  # vLLM's: BOS etc. on top of what the template writes

    def check_supported(self) -> None:
        super().check_supported()
        self.check_template_options()

    def asked_max_tokens(self, defaults: dict | None = None) -> int | None:
        """The completion length the client asked for (None: the server's default, else as many as fit)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def conversation(self) -> list[dict]:
        return [m.to_template_dict() for m in self.messages]

    def sampling_params(self, defaults: dict | None = None, max_tokens_ceiling: int | None = None) -> SamplingParams:
        kwargs = self.sampling_kwargs(defaults)
        kwargs["max_tokens"] = resolve_max_tokens(self.asked_max_tokens(), defaults, max_tokens_ceiling)
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        if self.logprobs:
            kwargs["logprobs"] = self.top_logprobs or 0
        return SamplingParams(**kwargs)


class TokenizeRequest(ChatTemplateOptions):
    """vLLM's /tokenize body: a prompt, or chat messages put through the chat template."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (vLLM's)
    return_token_strs: bool = False
    tools: list[ChatTool] | None = None

    def check_supported(self) -> None:
        self.check_template_options()
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: TokenIds


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body; every 4xx/5xx the server sends has this shape."""
    error: ErrorInfo


def error_responses(*statuses: int) -> dict:
    """The `responses=` of a route: OpenAI's error body under each status it may answer."""
    descriptions = {400: "invalid request (the message names the field and the limit)",
                    401: "missing or wrong API key", 404: "unknown model",
                    413: "request body too large", 500: "engine step failed", 503: "engine stopped"}
    return {s: {"model": ErrorResponse, "description": descriptions[s]} for s in statuses}


# `stream: true` answers server-sent events: documented beside the JSON body. Before OpenAPI 3.2
# (itemSchema), an event stream's `schema` describes one event: its `data` is a JSON chunk, `[DONE]` last.
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}}}


def generation_responses(body: type | None, errors: dict | None = None) -> dict:
    """What a generation route answers, in /openapi.json: its JSON body (a pydantic model, None for
    any object) or its events as server-sent events, and every error status (OpenAI's body unless
    errors gives the route's own)."""
    ok = {"description": "the result (JSON), or its events as server-sent events with stream",
          "content": {"text/event-stream": {"schema": SSE_EVENT}}}
    if body is not None:
        ok["model"] = body
    else:
        ok["content"]["application/json"] = {"schema": {"type": "object"}}
    return {**(errors or error_responses(400, 401, 404, 413, 500, 503)), 200: ok}


class ApiError(Exception):
    """An error answered with OpenAI's error body and this HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.body = status, error_body(message, type_, param, code)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@contextmanager
def as_bad_request():
    """Turns the ValueError/TypeError of request validation into a 400."""
    try:
        yield
    except (ValueError, TypeError) as e:
        raise ApiError(400, str(e)) from e
