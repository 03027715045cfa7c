"""The Hermes tool-call parser on text: whole replies, streamed pieces at every split (they must
reassemble to the whole parse), the forced-call grammar (checked with xgrammar's matcher), and
the request-level tool choice and reply reading of entrypoints/tool_calls.py."""
import json

import pytest

from nanovllm.entrypoints.protocol import ChatCompletionRequest
from nanovllm.entrypoints.tool_calls import ChatSettings, ToolReply, forced_call_constraint, tool_choice_of
from nanovllm.entrypoints.tool_parsers import ParsedReply, ToolCall, get_tool_parser
from nanovllm.entrypoints.tool_parsers.hermes import HermesToolParser, rename_rules

CALL_A = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>'
CALL_B = '<tool_call>\n{"name": "noop", "arguments": {"note": "a } \\" { <tool_call>"}}\n</tool_call>'
REPLIES = {
    "only a call": (CALL_A, ParsedReply(None, [ToolCall("get_weather", '{"city": "Paris", "days": [1, 2]}')])),
    "text then two calls": ("Let me check.\n" + CALL_A + "\n" + CALL_B + "\n",
                            ParsedReply("Let me check.", [ToolCall("get_weather", '{"city": "Paris", "days": [1, 2]}'),
                                                          ToolCall("noop", '{"note": "a } \\" { <tool_call>"}')])),
    "no call": ("just < text <tool_ and more", ParsedReply("just < text <tool_ and more")),
    "unclosed last call": ('ok <tool_call>{"name": "f", "arguments": {}}',
                           ParsedReply("ok", [ToolCall("f", "{}")])),
    "arguments as a string": ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',
                              ParsedReply(None, [ToolCall("f", '{"x": 1}')])),
    # max_tokens ended the reply inside a second call: the complete first one is still a call
    "a call, then one cut off": (CALL_A + '\n<tool_call>\n{"na',
                                 ParsedReply(None, [ToolCall("get_weather", '{"city": "Paris", "days": [1, 2]}')])),
    "a call, then a closed block that is no call": (
        CALL_A + ' <tool_call>{"name": </tool_call>',
        ParsedReply('<tool_call>{"name": </tool_call>', [ToolCall("get_weather", '{"city": "Paris", "days": [1, 2]}')])),
    "bad call JSON": ('hi <tool_call>{"name": "f", "arguments": {</tool_call>',
                      ParsedReply('hi <tool_call>{"name": "f", "arguments": {</tool_call>')),
}


@pytest.mark.parametrize("name", list(REPLIES))
def test_whole_reply(name):
    text, expected = REPLIES[name]
    assert HermesToolParser().parse(text) == expected


def stream(text: str, cuts: list[int]) -> tuple[str, dict[int, dict]]:
    """Feed text in the pieces between cuts; reassemble content and calls as a client would."""
    parser, content, calls = HermesToolParser(), "", {}
    bounds = [0, *cuts, len(text)]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        piece, deltas = parser.feed(text[a:b], is_final=i == len(bounds) - 2)
        content += piece
        for d in deltas:
            if d.index not in calls:
                assert d.name is not None, "a call's first delta carries its name"
                calls[d.index] = {"name": d.name, "arguments": ""}
            else:
                assert d.name is None
            calls[d.index]["arguments"] += d.arguments
    return content, calls


@pytest.mark.parametrize("name", [n for n in REPLIES if n != "bad call JSON"])
def test_streamed_pieces_reassemble_to_the_whole_parse(name):
    text, expected = REPLIES[name]
    want = (expected.content or "", {i: {"name": c.name, "arguments": c.arguments}
                                     for i, c in enumerate(expected.tool_calls)})
    assert stream(text, list(range(1, len(text)))) == want  # one character at a time
    for cut in range(1, len(text)):  # and every split in two
        assert stream(text, [cut]) == want, cut


def test_arguments_stream_before_the_call_closes():
    parser = HermesToolParser()
    _, deltas = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', False)
    assert [(d.index, d.name, d.arguments) for d in deltas] == [(0, "get_weather", ""), (0, None, '{"city": "Pa')]


def forced_grammar_accepts(grammar: str, text: str) -> bool:
    xgr = pytest.importorskip("xgrammar")
    info = xgr.TokenizerInfo([chr(i) for i in range(32, 127)] + ["\n"])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(grammar))
    return matcher.accept_string(text)


WEATHER = {"type": "object", "properties": {"city": {"enum": ["paris", "rome"]}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)


def test_forced_call_grammar_is_the_hermes_form_of_a_valid_call():
    settings = ChatSettings("hermes")
    weather = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "rome"}}\n</tool_call>'
    time = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    named = forced_call_constraint(request(tools=TOOLS), "get_weather", settings).grammar
    assert forced_grammar_accepts(named, weather)
    assert not forced_grammar_accepts(named, time)
    assert not forced_grammar_accepts(named, weather.replace("rome", "oslo"))
    parallel = forced_call_constraint(request(tools=TOOLS, parallel_tool_calls=True), "required", settings).grammar
    assert forced_grammar_accepts(parallel, weather + "\n" + time)
    for fields in (dict(), dict(parallel_tool_calls=False)):  # by default one forced call
        single = forced_call_constraint(request(tools=TOOLS, **fields), "required", settings).grammar
        assert forced_grammar_accepts(single, time) and not forced_grammar_accepts(single, time + "\n" + weather)
    json_single = forced_call_constraint(request(tools=TOOLS), "required", ChatSettings()).json
    assert json_single["maxItems"] == 1


def test_a_call_cut_in_its_arguments_leaves_the_complete_ones():
    """required + a short max_tokens: the reply repeated its call and was cut inside the second one.
    The first comes back as tool_calls, nothing of the cut one in content; the finish reason is length."""
    cut = CALL_A + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    reply = ToolReply("required", ChatSettings("hermes"))
    content, calls = reply.whole(cut)
    assert content is None
    assert [c["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"city": "Paris", "days": [1, 2]}'}]
    assert reply.finish_reason("length") == "length" and reply.finish_reason("stop") == "tool_calls"
    streamed, _ = stream(cut, [len(CALL_A) + 5])
    assert streamed == ""  # streamed: no raw <tool_call> text either (the cut call's deltas say "length")


def test_rename_rules_leaves_literals_and_classes_alone():
    ebnf = 'root ::= "root" [root] root_1\nroot_1 ::= basic_root'
    assert rename_rules(ebnf, "root", "call_root") == \
        'call_root ::= "root" [root] call_root_1\ncall_root_1 ::= basic_root'


def test_without_a_parser_the_forced_call_is_vllms_json():
    named = forced_call_constraint(request(tools=TOOLS), "get_weather", ChatSettings())
    assert named.json == WEATHER
    reply = ToolReply("get_weather", ChatSettings())
    content, calls = reply.whole('{"city": "rome"}')
    assert content is None and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "rome"}'}
    reply = ToolReply("required", ChatSettings())
    _, calls = reply.whole('[{"name": "get_time", "parameters": {}}]')
    assert calls[0]["function"] == {"name": "get_time", "arguments": "{}"}
    assert reply.finish_reason("stop") == "tool_calls" and reply.finish_reason("length") == "length"


@pytest.mark.parametrize("fields, settings, expected", [
    (dict(), ChatSettings(), "none"),
    (dict(tools=TOOLS, tool_choice="none"), ChatSettings(), "none"),
    (dict(tools=TOOLS, tool_choice="required"), ChatSettings(), "required"),
    (dict(tools=[], tool_choice="required"), ChatSettings(), "none"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}), ChatSettings(),
     "get_time"),
    (dict(tools=TOOLS), ChatSettings("hermes", enable_auto_tool_choice=True), "auto"),
])
def test_tool_choice(fields, settings, expected):
    assert tool_choice_of(request(**fields), settings) == expected


@pytest.mark.parametrize("fields, words", [
    (dict(tools=TOOLS), "--enable-auto-tool-choice"),  # auto is the default with tools
    (dict(tool_choice="required"), "needs tools"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "'nope'"),
])
def test_refused_tool_choice(fields, words):
    with pytest.raises(ValueError, match=words):
        tool_choice_of(request(**fields), ChatSettings("hermes"))


def test_settings_and_registry_name_the_bad_value():
    with pytest.raises(ValueError, match="'nope'"):
        ChatSettings("nope")
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ChatSettings(enable_auto_tool_choice=True)
    assert get_tool_parser("hermes") is HermesToolParser
    assert json.loads(REPLIES["only a call"][1].tool_calls[0].arguments)["days"] == [1, 2]


def test_a_forced_call_takes_the_grammar_slot():
    from nanovllm import SamplingParams, StructuredOutputsParams
    from nanovllm.entrypoints.tool_calls import with_forced_call

    body, settings = request(tools=TOOLS), ChatSettings("hermes")
    params = with_forced_call(SamplingParams(temperature=0.5), body, "get_time", settings)
    assert params.temperature == 0.5 and 'get_time' in params.structured_outputs.grammar
    assert with_forced_call(SamplingParams(), body, "none", settings).structured_outputs is None
    with pytest.raises(ValueError, match="structured outputs"):
        with_forced_call(SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")), body, "required",
                         settings)
