"""The Hermes tool-call format of the Qwen2.5 / Qwen3 chat templates: each call is
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, the reply's other text is content."""
import json
import re

from nanovllm.entrypoints.tool_parsers import ParsedReply, ToolCall, ToolCallDelta, ToolParser

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')
_ARGUMENTS_KEY = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_WS = " \t\n\r"
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")  # xgrammar's "[time] file.cc:line: "
_DECODER = json.JSONDecoder()


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _top_level_spans(text: str) -> dict[str, tuple[int, int]] | None:
    """Where each top-level value of the JSON object `text` lies, by key; None if not one object."""
    spans, i = {}, _skip_ws(text, 0)
    if not text.startswith("{", i):
        return None
    i = _skip_ws(text, i + 1)
    try:
        while not text.startswith("}", i):
            key, i = _DECODER.raw_decode(text, i)
            i = _skip_ws(text, i)
            if not isinstance(key, str) or not text.startswith(":", i):
                return None
            start = _skip_ws(text, i + 1)
            _, i = _DECODER.raw_decode(text, start)
            spans[key] = (start, i)
            i = _skip_ws(text, i)
            if text.startswith(",", i):
                i = _skip_ws(text, i + 1)
            elif not text.startswith("}", i):
                return None
    except json.JSONDecodeError:
        return None
    return spans if _skip_ws(text, i + 1) == len(text) else None


def parse_call(body: str) -> ToolCall | None:
    """One call's JSON; its arguments are the model's own object text (what a stream sends piece by
    piece), so a streamed call and a whole one carry the same string."""
    spans = _top_level_spans(body)
    if spans is None or "name" not in spans:
        return None
    name = json.loads(body[slice(*spans["name"])])
    key = "arguments" if "arguments" in spans else "parameters" if "parameters" in spans else None
    if not isinstance(name, str) or not name:
        return None
    if key is None:
        return ToolCall(name, "{}")
    raw = body[slice(*spans[key])]
    value = json.loads(raw)
    if isinstance(value, dict):
        return ToolCall(name, raw)
    if isinstance(value, str):  # arguments sent as a JSON string: its text is the JSON
        return ToolCall(name, value)
    return None


def _holdback(text: str, tag: str) -> int:
    """How many chars at the end of text may be the start of tag."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class HermesToolParser(ToolParser):
    def __init__(self):
        self.buffer = ""          # text not yet handled (content mode) or the open call's body
        self.in_call = False
        self.index = -1           # the open (or last) call's index
        self.name_sent = False
        self.args_start: int | None = None  # where the arguments object starts in the body
        self.args_sent = 0        # arguments chars sent so far
        self.depth, self.in_string, self.escaped = 0, False, False
        self.content_started, self.pending_ws = False, ""

    def parse(self, text: str) -> ParsedReply:
        """Every complete call is a call, whatever follows it. A closed block that is not a valid
        call stays in the content as written; an unclosed one that does not parse is a reply cut
        off (max_tokens) in its last call: dropped, and the finish reason says "length"."""
        outside, calls, pos = [], [], 0
        while (start := text.find(OPEN, pos)) != -1:
            outside.append(text[pos:start])
            end = text.find(CLOSE, start)
            body = text[start + len(OPEN): end if end != -1 else len(text)]
            call = parse_call(body)
            if call is not None:
                calls.append(call)
            elif end != -1:
                outside.append(text[start:end + len(CLOSE)])
            pos = len(text) if end == -1 else end + len(CLOSE)
        outside.append(text[pos:])
        return ParsedReply("".join(outside).strip() or None, calls)

    # ---- streaming ------------------------------------------------------------------------
    def feed(self, text: str, is_final: bool) -> tuple[str, list[ToolCallDelta]]:
        self.buffer += text
        content, deltas = [], []
        while True:
            if not self.in_call:
                start = self.buffer.find(OPEN)
                if start == -1:
                    keep = 0 if is_final else _holdback(self.buffer, OPEN)
                    content.append(self._content(self.buffer[:len(self.buffer) - keep]))
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                content.append(self._content(self.buffer[:start]))
                self.buffer = self.buffer[start + len(OPEN):]
                self._open_call()
                continue
            end = self.buffer.find(CLOSE)
            if end == -1 and not is_final:
                deltas += self._progress()
                break
            body = self.buffer if end == -1 else self.buffer[:end]
            self.buffer = "" if end == -1 else self.buffer[end + len(CLOSE):]
            more, text_back = self._close_call(body, closed=end != -1)
            deltas += more
            content.append(self._content(text_back))
            if end == -1:
                break
        if is_final:
            self.pending_ws = ""
        return "".join(content), deltas

    def _content(self, text: str) -> str:
        """Content as the whole parse gives it: blanks at the start, at the end, and left alone
        between calls are dropped (held back until non-blank text follows them)."""
        if not self.content_started:
            text = text.lstrip(_WS)
            if not text:
                return ""
            self.content_started = True
        text = self.pending_ws + text
        body = text.rstrip(_WS)
        self.pending_ws = text[len(body):]
        return body

    def _open_call(self) -> None:
        self.in_call, self.name_sent, self.args_start, self.args_sent = True, False, None, 0
        self.depth, self.in_string, self.escaped = 0, False, False

    def _progress(self) -> list[ToolCallDelta]:
        """The open call's name once it is complete, then its arguments object as it grows."""
        deltas = []
        if not self.name_sent:
            match = _NAME.match(self.buffer)
            if match is None:
                return []
            self.index += 1
            self.name_sent = True
            deltas.append(ToolCallDelta(self.index, name=json.loads(match.group(1))))
            key = _ARGUMENTS_KEY.match(self.buffer, match.end())
            if key is None:
                return deltas
            self.args_start = key.end()
        if self.args_start is None or not self.buffer.startswith("{", self.args_start):
            return deltas  # arguments not an object (or not there yet): sent when the call closes
        piece = self._scan_arguments()
        if piece:
            deltas.append(ToolCallDelta(self.index, arguments=piece))
        return deltas

    def _scan_arguments(self) -> str:
        """The arguments text after what was sent, up to the end of the object (a tiny JSON lexer)."""
        start = self.args_start + self.args_sent
        i = start
        while i < len(self.buffer) and not (self.depth == 0 and self.args_sent + (i - start) > 0):
            c = self.buffer[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
            i += 1
        self.args_sent += i - start
        return self.buffer[start:i]

    def _close_call(self, body: str, closed: bool) -> tuple[list[ToolCallDelta], str]:
        """The rest of a finished call; if nothing was sent yet and it does not parse: its text as
        content when the block was closed, nothing when the reply ended inside it (as parse())."""
        self.in_call = False
        call = parse_call(body)
        if not self.name_sent:
            if call is None:
                return [], OPEN + body + CLOSE if closed else ""
            self.index += 1
            return [ToolCallDelta(self.index, name=call.name, arguments=call.arguments)], ""
        if call is None or len(call.arguments) <= self.args_sent:
            return [], ""
        return [ToolCallDelta(self.index, arguments=call.arguments[self.args_sent:])], ""

    @staticmethod
    def forced_call_grammar(call_schemas: list[dict], parallel: bool) -> str:
        from nanovllm.sample.structured_outputs import import_xgrammar

        schema = call_schemas[0] if len(call_schemas) == 1 else {"anyOf": call_schemas}
        defs = {}
        for s in call_schemas:
            defs.update(s.pop("$defs", {}))
        if defs:
            schema = {**schema, "$defs": defs}
        xgr = import_xgrammar()
        try:
            call = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
        except (RuntimeError, TypeError) as e:  # xgrammar's answer to a schema it cannot use
            message = _SOURCE_PREFIX.sub("", str(e).strip()).splitlines()[0]
            raise ValueError(f"tools: a function's parameters is not a usable JSON schema: {message}") from None
        repeat = ' ("\\n" call_block)*' if parallel else ""
        return (f'root ::= call_block{repeat}\n'
                f'call_block ::= {json.dumps(OPEN + chr(10))} call_root {json.dumps(chr(10) + CLOSE)}\n'
                + rename_rules(str(call), "root", "call_root"))


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def rename_rules(ebnf: str, old_prefix: str, new_prefix: str) -> str:
    """xgrammar EBNF with every rule name starting with old_prefix renamed (string literals and
    character classes left alone), so one grammar can be embedded in another."""
    out, i = [], 0
    while i < len(ebnf):
        c = ebnf[i]
        if c in "\"[":  # a literal or a class: copy it through its closing quote / bracket
            close = '"' if c == '"' else "]"
            j = i + 1
            while j < len(ebnf) and ebnf[j] != close:
                j += 2 if ebnf[j] == "\\" else 1
            out.append(ebnf[i:j + 1])
            i = j + 1
            continue
        match = _IDENT.match(ebnf, i)
        if match:
            name = match.group()
            out.append(new_prefix + name[len(old_prefix):] if name.startswith(old_prefix) else name)
            i = match.end()
            continue
        out.append(c)
        i += 1
    return "".join(out)
