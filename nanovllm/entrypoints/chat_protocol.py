"""Pydantic models of the chat requests' tool and chat-template fields (OpenAI's tools and
tool_choice, vLLM's template options); protocol.py's ChatCompletionRequest and TokenizeRequest use them."""
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


def template_tool_call(call) -> dict:
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
