"""Tool calling on /v1/chat/completions: which choice a request makes (none, auto, required, a named
tool), the constraint that forces a call, and each reply parsed into OpenAI's tool_calls, whole or
streamed. openai_server.py checks and constrains; serving.py builds the bodies with ToolReply.
"""
import copy
import json
import logging
import uuid
from dataclasses import dataclass, replace

from nanovllm.entrypoints.protocol import ChatCompletionRequest, NamedToolChoice
from nanovllm.entrypoints.tool_parsers import ParsedReply, ToolCall, ToolCallDelta, ToolParser, get_tool_parser
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams


@dataclass(frozen=True)
class ChatSettings:
    """Server-wide chat options (`nanovllm serve` flags, vLLM's names)."""
    tool_call_parser: str | None = None       # --tool-call-parser: the model's tool-call format
    enable_auto_tool_choice: bool = False     # --enable-auto-tool-choice: allow tool_choice "auto"
    trust_request_chat_template: bool = False  # --trust-request-chat-template
    reasoning_parser: str | None = None       # --reasoning-parser: the thinking apart (reasoning.py)

    def __post_init__(self) -> None:
        from nanovllm.entrypoints.reasoning import get_reasoning_parser
        get_reasoning_parser(self.reasoning_parser)  # an unknown name fails at start, not per request
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)  # an unknown name fails at start, not per request
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")

    @property
    def reasoning(self):
        """The reasoning.ReasoningParser of --reasoning-parser (None without one)."""
        from nanovllm.entrypoints.reasoning import get_reasoning_parser
        return get_reasoning_parser(self.reasoning_parser)


def tool_choice_of(body: ChatCompletionRequest, settings: ChatSettings) -> str | None:
    """"none", "auto", "required" or the named tool's name (vLLM's checks); ValueError if refused."""
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if body.tools else "none"
    if choice != "none" and body.tools is None:
        raise ValueError("tool_choice needs tools")
    if choice == "required" and not body.tools:
        return "none"  # OpenAI's answer to required with an empty list
    if isinstance(choice, NamedToolChoice):
        names = [t.function.name for t in body.tools]
        if choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not in tools {names}")
        return choice.function.name
    if choice == "auto" and not (settings.enable_auto_tool_choice and settings.tool_call_parser):
        raise ValueError('tool_choice "auto" (the default when a request brings tools) needs `nanovllm serve '
                         '--enable-auto-tool-choice --tool-call-parser NAME`; "required" or a named tool works without')
    return choice


_PROBE_TOOL = {"type": "function", "function": {"name": "nanovllm_probe_tool", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}


def template_renders_tools(tokenizer) -> bool | None:
    """Whether the tokenizer's chat template shows a request's tools to the model: the same
    conversation rendered with and without one tool differs. None without a chat template; False
    also when rendering with tools fails."""
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        return None
    conversation = [{"role": "user", "content": "hi"}]
    try:
        plain = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        with_tools = tokenizer.apply_chat_template(conversation, tools=[_PROBE_TOOL], add_generation_prompt=True,
                                                   tokenize=False)
    except Exception:  # a template's own error (raise_exception) or an undefined field: tools not usable
        return False
    return with_tools != plain


def tools_note(tokenizer, settings: ChatSettings) -> str | None:
    """What the model's chat template does with tools, for the start-up log (INFO): nobody asked for
    tools yet, so a template that ignores them is no warning until a request brings some
    (ToolsWarning)."""
    renders = template_renders_tools(tokenizer)
    if renders is None:
        return None
    if renders:
        return "the chat template renders tools: requests' tools are shown to the model"
    return "the chat template ignores tools: " + _ignored_tools_consequence(settings)


def _ignored_tools_consequence(settings: ChatSettings) -> str:
    auto = ("; tool_choice \"auto\" will never call one" if settings.enable_auto_tool_choice else "")
    return ("the model is not shown a request's tools" + auto
            + "; tool_choice \"required\" or a named tool still force a call by grammar")


class ToolsWarning:
    """Warns once, at the first chat request that brings tools, where the chat template ignores them."""

    def __init__(self, tokenizer, settings: ChatSettings):
        self.ignores_tools = template_renders_tools(tokenizer) is False
        self.settings = settings
        self.warned = False

    def request_brings_tools(self) -> None:
        if self.ignores_tools and not self.warned:
            self.warned = True
            logging.getLogger(__name__).warning("a request brings tools, but the chat template ignores them: %s",
                                                _ignored_tools_consequence(self.settings))


def template_tools(body: ChatCompletionRequest) -> list[dict] | None:
    """The tools as the chat template gets them (OpenAI's dicts)."""
    return [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None


def _parameters(tool) -> dict:
    return copy.deepcopy(tool.function.parameters) or {"type": "object", "properties": {}}


def forced_call_constraint(body: ChatCompletionRequest, choice: str | None,
                           settings: ChatSettings) -> StructuredOutputsParams | None:
    """The grammar that makes the reply a valid call (required: of any tool; named: of that one)."""
    if choice in (None, "none", "auto"):
        return None
    tools = [t for t in body.tools if choice == "required" or t.function.name == choice]
    # One forced call unless the request allows more: a model forced by the grammar otherwise tends
    # to repeat its call until max_tokens.
    parallel = choice == "required" and body.parallel_tool_calls is True
    if settings.tool_call_parser is not None:  # the model's own format, e.g. <tool_call>...</tool_call>
        schemas = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                    "properties": {"name": {"enum": [t.function.name]}, "arguments": _parameters(t)}}
                   for t in tools]
        parser = get_tool_parser(settings.tool_call_parser)
        return StructuredOutputsParams(grammar=parser.forced_call_grammar(schemas, parallel))
    if choice != "required":  # vLLM's way without a parser: the reply is the arguments object
        return StructuredOutputsParams(json=_parameters(tools[0]))
    items = [{"type": "object", "required": ["name", "parameters"],
              "properties": {"name": {"enum": [t.function.name]}, "parameters": _parameters(t)}} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


def with_forced_call(params: SamplingParams, body: ChatCompletionRequest, choice: str | None,
                     settings: ChatSettings) -> SamplingParams:
    """params with the grammar of a forced tool call, when tool_choice is required or named."""
    constraint = forced_call_constraint(body, choice, settings)
    if constraint is None:
        return params
    if params.structured_outputs is not None:
        raise ValueError("tool_choice required or a named tool cannot be combined with structured outputs")
    return replace(params, structured_outputs=constraint)


class _JsonReply(ToolParser):
    """A reply forced without a parser: the named tool's arguments, or (required) vLLM's JSON array
    of {"name", "parameters"}; the arguments stream as they come, a required array at its end."""

    def __init__(self, named: str | None):
        self.named, self.text, self.started = named, "", False

    def parse(self, text: str) -> ParsedReply:
        if self.named is not None:
            return ParsedReply(None, [ToolCall(self.named, text)])
        try:
            calls = [ToolCall(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False))
                     for c in json.loads(text)]
        except (json.JSONDecodeError, TypeError, KeyError):
            return ParsedReply(text.strip() or None)
        return ParsedReply(None, calls)

    def feed(self, text: str, is_final: bool) -> tuple[str, list[ToolCallDelta]]:
        self.text += text
        if self.named is not None:
            first, self.started = not self.started, True
            return "", [ToolCallDelta(0, name=self.named if first else None, arguments=text)]
        if not is_final:
            return "", []
        whole = self.parse(self.text)
        return whole.content or "", [ToolCallDelta(i, c.name, c.arguments) for i, c in enumerate(whole.tool_calls)]


class ToolReply:
    """One choice's reply read for tool calls: whole() for a body, feed() for a stream's chunks."""

    def __init__(self, choice: str, settings: ChatSettings):
        named = choice if choice not in ("auto", "required") else None
        if settings.tool_call_parser is not None:
            self.parser = get_tool_parser(settings.tool_call_parser)()
        else:
            self.parser = _JsonReply(named)
        self.ids: dict[int, str] = {}  # streamed call index -> its id
        self.has_calls = False

    def whole(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, OpenAI tool_calls) of a finished reply."""
        reply = self.parser.parse(text)
        self.has_calls = bool(reply.tool_calls)
        return reply.content, [{"id": _call_id(), "type": "function",
                                "function": {"name": c.name, "arguments": c.arguments}} for c in reply.tool_calls]

    def feed(self, text: str, is_final: bool) -> tuple[str, list[dict]]:
        """(content, OpenAI delta.tool_calls) of the next piece: a call's first delta carries its
        index, id, type and name; later ones its index and a piece of arguments."""
        content, deltas = self.parser.feed(text, is_final)
        out = []
        for d in deltas:
            entry = {"index": d.index, "function": {"arguments": d.arguments}}
            if d.index not in self.ids:
                self.ids[d.index] = _call_id()
                entry.update(id=self.ids[d.index], type="function")
                entry["function"]["name"] = d.name
            out.append(entry)
        self.has_calls = self.has_calls or bool(out)
        return content, out

    def finish_reason(self, finish_reason: str | None) -> str | None:
        return "tool_calls" if finish_reason == "stop" and self.has_calls else finish_reason


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
