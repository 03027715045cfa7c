"""The server's response bodies as pydantic models, so that /openapi.json describes what each route
answers (schemathesis checks every response against them). The generation routes build their
bodies as dicts (serving.py) and are documented by these models; the small routes return them."""
from typing import Literal

from pydantic import BaseModel


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # read from the prefix cache or the tier under it, not computed


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions logprobs: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptTokenLogprob(BaseModel):
    """vLLM's prompt_logprobs entry of one token id."""

    logprob: float
    rank: int | None
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None
    # vLLM's field, with prompt_logprobs asked: per prompt token None (the first) or token id -> entry
    prompt_logprobs: list[dict[str, PromptTokenLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class TokenLogprob(BaseModel):
    token: str
    logprob: float | None
    bytes: list[int]


class TokenLogprobWithTop(TokenLogprob):
    top_logprobs: list[TokenLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobWithTop]
    refusal: str | None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class VersionResponse(BaseModel):
    version: str


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str
