"""Pydantic models of the OpenAI API requests the server accepts, and their SamplingParams mapping;
vLLM's /tokenize and /detokenize bodies; OpenAI's error body.

openai_server.py validates each request body with these models. Unknown fields are an error (400).
"""
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from nanovllm.sampling_params import SamplingParams

# Request fields handed to SamplingParams under the same (vLLM) name when the client sets them.
# SamplingParams itself validates their values; one it does not know raises TypeError -> 400.
SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "min_tokens",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
    "skip_special_tokens", "include_stop_str_in_output", "n", "spaces_between_special_tokens",
)


# NOTE: token ids are StrictInt: a lax int would take `true` or `1.0` as a token id.
TokenIds = list[StrictInt]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    # vLLM's: usage (so far) in every chunk too, not only in the last one (needs include_usage).
    continuous_usage_stats: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's plus vLLM's extras)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling fields (the openai client sends them through `extra_body`).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    spaces_between_special_tokens: bool | None = None
    # vLLM's: logprob tokens as "token_id:N" (every token is then identifiable, even a partial character).
    return_tokens_as_token_ids: bool | None = None

    def check_supported(self) -> None:
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")

    def sampling_kwargs(self) -> dict:
        """The fields the client set, by SamplingParams' names (unset ones keep its defaults)."""
        return {name: getattr(self, name) for name in SAMPLING_FIELDS
                if name in self.model_fields_set and getattr(self, name) is not None}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingRequest):
    prompt: str | TokenIds | list[str] | list[TokenIds]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of must equal n ({self.n}) or be unset, got {self.best_of}")

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (a string, token ids, or a list of either)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ValueError("prompt is empty")
        return list(p)

    def sampling_params(self) -> SamplingParams:
        kwargs = self.sampling_kwargs()
        if self.max_tokens is not None:
            kwargs["max_tokens"] = self.max_tokens
        if self.logprobs is not None:
            kwargs["logprobs"] = self.logprobs
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
            message["tool_calls"] = [_template_tool_call(c) for c in message["tool_calls"]]
        return message


def _template_tool_call(call) -> dict:
    """An assistant message's tool call with its arguments as a dict, as chat templates (Qwen's
    `arguments | tojson`) expect; OpenAI sends them as a JSON string (vLLM decodes them too)."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    arguments = call["function"].get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise ValueError(f"messages: a tool call's function.arguments is not JSON: {e}") from None
        call = {**call, "function": {**call["function"], "arguments": arguments}}
    return call


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    """tool_choice {"type": "function", "function": {"name": ...}}: the model must call that tool."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: NamedFunction


# Names the chat template receives from the request's own fields (or from the HF call itself):
# chat_template_kwargs may not set them (it would bypass their checks).
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


class ChatTemplateOptions(BaseModel):
    """vLLM's chat-template fields, shared by /v1/chat/completions and /tokenize (tokenization.py renders)."""

    model_config = ConfigDict(extra="forbid")
    add_generation_prompt: bool = True
    # Leave the last message open (no end-of-turn): the model continues it (a "prefill").
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables, e.g. enable_thinking
    documents: list[dict[str, str]] | None = None  # for templates that render RAG documents
    chat_template: str | None = None  # needs `nanovllm serve --trust-request-chat-template`

    def check_template_options(self) -> None:
        if self.continue_final_message and self.add_generation_prompt and \
                "add_generation_prompt" in self.model_fields_set:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS & set(self.chat_template_kwargs or {}))
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {reserved}; use the request fields")

    @property
    def adds_generation_prompt(self) -> bool:
        """continue_final_message alone turns the generation prompt off (vLLM wants both set)."""
        return self.add_generation_prompt and not self.continue_final_message


class ChatCompletionRequest(ChatTemplateOptions, _SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
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

    def conversation(self) -> list[dict]:
        return [m.to_template_dict() for m in self.messages]

    def sampling_params(self) -> SamplingParams:
        kwargs = self.sampling_kwargs()
        # Unset: as many as fit in max_model_len (OpenAI's chat default).
        kwargs["max_tokens"] = self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens
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
