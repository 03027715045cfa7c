"""Tool-call parsers: each model format of tool calls in one file, registered by name here.

`nanovllm serve --tool-call-parser NAME` picks one; entrypoints/tool_calls.py asks it to parse a
reply (whole or streamed) into OpenAI tool calls and for the grammar of a forced call. A new format
is one module with a ToolParser subclass, added to TOOL_PARSERS.
"""
import importlib
from dataclasses import dataclass, field


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON text, as OpenAI sends it


@dataclass
class ParsedReply:
    """A whole reply: its text outside the calls (None when blank) and the calls in order."""
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class ToolCallDelta:
    """A streamed piece of call `index`: its name once (the call's first piece), then argument text."""
    index: int
    name: str | None = None
    arguments: str = ""


class ToolParser:
    """One model's tool-call format. NOTE: one instance per reply (it keeps streaming state)."""

    def parse(self, text: str) -> ParsedReply:
        """The whole reply; a call that does not parse leaves all the text as content."""
        raise NotImplementedError

    def feed(self, text: str, is_final: bool) -> tuple[str, list[ToolCallDelta]]:
        """The next piece of a streamed reply: (content to send, call pieces to send); is_final on
        the last piece flushes whatever was held back."""
        raise NotImplementedError

    @staticmethod
    def forced_call_grammar(call_schemas: list[dict], parallel: bool) -> str:
        """An EBNF grammar (xgrammar's dialect) of a reply that is only calls in this format, each
        call object matching one of call_schemas ({"name": ..., "arguments": ...} JSON schemas);
        one call, or one or more when parallel."""
        raise NotImplementedError


# name -> "module:class", imported when asked for.
TOOL_PARSERS = {"hermes": "nanovllm.entrypoints.tool_parsers.hermes:HermesToolParser"}


def get_tool_parser(name: str) -> type[ToolParser]:
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}, got {name!r}")
    module, cls = TOOL_PARSERS[name].split(":")
    return getattr(importlib.import_module(module), cls)
