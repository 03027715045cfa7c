"""The agent APIs (Chat Completions, Responses, Messages) through their official clients against a
`nanovllm serve` subprocess with --reasoning-parser qwen3 and --tool-call-parser hermes, on a tiny
Qwen3 with Qwen3's own chat template whose greedy reply is known by construction:
"<think>why</think>Paris." (agent_fixtures.make_scripted_qwen3). Thinking apart in all three,
whole and streamed; enable_thinking false's prompt; structured outputs and forced tool calls after
the thinking; tool-result round trips (prompts checked against transformers' rendering); errors in
each API's shape, refused before anything is queued."""
import json
from typing import Literal

import pytest

from agent_fixtures import make_scripted_qwen3, qwen3_chat_template, serve

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

KEY = "sekret"
MODEL = "scripted"
SCRIPT = ["\n", "<think>", "w", "h", "y", "</think>", "P", "a", "r", "i", "s", ".", "<|im_end|>"]
THINKING, ANSWER = "why", "Paris."
QUESTION = "capital of France?"
WEATHER = {"type": "object", "properties": {"city": {"enum": ["paris", "rome"]}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("scripted_qwen3"))
    tokenizer = make_scripted_qwen3(path, SCRIPT, qwen3_chat_template())
    return path, tokenizer


@pytest.fixture(scope="module")
def url(scripted):
    with serve(scripted[0], "--api-key", KEY, "--served-model-name", MODEL, "--max-model-len", "2048",
               "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice") as url:
        yield url


@pytest.fixture(scope="module")
def oai(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(url):
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=60)


def prompt_len(scripted, conversation, **kwargs) -> int:
    """The prompt's length as transformers renders the conversation through Qwen3's template."""
    text = scripted[1].apply_chat_template(conversation, add_generation_prompt=True, tokenize=False, **kwargs)
    return len(scripted[1].encode(text, add_special_tokens=False))


def prompt_tokens_counted(url) -> float:
    """vllm:prompt_tokens_total from /metrics: what the engine was given so far."""
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:prompt_tokens_total"))


USER = [{"role": "user", "content": QUESTION}]


# ---- thinking apart, whole and streamed, in all three APIs -------------------------------------------
def test_chat_completions_thinking(oai):
    message = oai.chat.completions.create(model=MODEL, messages=USER, temperature=0).choices[0].message
    assert (message.reasoning_content, message.content) == (THINKING, ANSWER)
    reasoning = content = ""
    for chunk in oai.chat.completions.create(model=MODEL, messages=USER, temperature=0, stream=True):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (THINKING, ANSWER)


def test_responses_thinking(oai, scripted):
    response = oai.responses.create(model=MODEL, input=QUESTION, temperature=0)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == THINKING and response.output_text == ANSWER
    assert response.status == "completed" and response.usage.input_tokens == prompt_len(scripted, USER)
    assert response.usage.output_tokens == len(SCRIPT) - 1
    kinds, reasoning, text, final = [], "", "", None
    for event in oai.responses.create(model=MODEL, input=QUESTION, temperature=0, stream=True):
        kinds.append(event.type)
        reasoning += event.delta if event.type == "response.reasoning_text.delta" else ""
        text += event.delta if event.type == "response.output_text.delta" else ""
        final = event.response if event.type == "response.completed" else final
    assert (reasoning, text) == (THINKING, ANSWER)
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 2
    assert [item.type for item in final.output] == ["reasoning", "message"] and final.output_text == ANSWER
    with oai.responses.stream(model=MODEL, input=QUESTION, temperature=0) as stream:  # the client's helper
        assert stream.get_final_response().output_text == ANSWER


def test_messages_thinking(claude, scripted):
    message = claude.messages.create(model=MODEL, max_tokens=64, messages=USER, extra_body={"temperature": 0})
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == \
        [("thinking", THINKING), ("text", ANSWER)]
    # Anthropic's split: computed input tokens plus those read from the prefix cache make the prompt.
    usage = message.usage
    assert message.stop_reason == "end_turn" and usage.cache_creation_input_tokens == 0
    assert usage.input_tokens + usage.cache_read_input_tokens == prompt_len(scripted, USER)
    with claude.messages.stream(model=MODEL, max_tokens=64, messages=USER, extra_body={"temperature": 0}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == ANSWER and [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == THINKING


def test_enable_thinking_false_renders_the_no_think_prompt(oai, claude, scripted):
    off, on = prompt_len(scripted, USER, enable_thinking=False), prompt_len(scripted, USER)
    assert off > on  # the template writes an empty <think></think> into the prompt
    chat = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=4,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert chat.usage.prompt_tokens == off
    response = oai.responses.create(model=MODEL, input=QUESTION, max_output_tokens=4, reasoning={"effort": "none"})
    assert response.usage.input_tokens == off and response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    message = claude.messages.create(model=MODEL, max_tokens=4, messages=USER, thinking={"type": "disabled"})
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == off
    assert message.stop_reason == "max_tokens"


# ---- constraints apply to the answer after the thinking ------------------------------------------------
def test_structured_output_after_thinking(oai):
    response = oai.responses.create(model=MODEL, input=QUESTION, temperature=0,
                                    text={"format": {"type": "json_schema", "name": "city", "schema": CITY}})
    assert response.output[0].type == "reasoning" and response.output[0].content[0].text == THINKING
    jsonschema.validate(json.loads(response.output_text), CITY)
    message = oai.chat.completions.create(model=MODEL, messages=USER, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}).choices[0].message
    assert message.reasoning_content == THINKING
    jsonschema.validate(json.loads(message.content), CITY)


RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": "weather", "parameters": WEATHER}
ANTHROPIC_TOOL = {"name": "get_weather", "description": "weather", "input_schema": WEATHER}


def test_responses_forced_call_and_round_trip(oai, scripted):
    first = oai.responses.create(model=MODEL, input=QUESTION, tools=[RESPONSES_TOOL], tool_choice="required",
                                 temperature=0)
    reasoning, call = first.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == THINKING
    assert isinstance(call, openai.types.responses.ResponseFunctionToolCall) and call.name == "get_weather"
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, WEATHER)
    assert first.status == "completed" and first.id.startswith("resp_")
    # Streamed: the argument deltas add up to the call in the final response.
    events = list(oai.responses.create(model=MODEL, input=QUESTION, tools=[RESPONSES_TOOL], stream=True,
                                       tool_choice={"type": "function", "name": "get_weather"}, temperature=0))
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    final = events[-1].response
    assert final.output[-1].type == "function_call" and final.output[-1].arguments == pieces
    jsonschema.validate(json.loads(pieces), WEATHER)
    # The tool's result, by previous_response_id and by resending the items: the same prompt, which is
    # transformers' rendering of the whole conversation.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    chained = oai.responses.create(model=MODEL, previous_response_id=first.id, input=[result], tools=[RESPONSES_TOOL],
                                   temperature=0)
    resent = oai.responses.create(model=MODEL, tools=[RESPONSES_TOOL], temperature=0, input=[
        {"role": "user", "content": QUESTION}, reasoning.model_dump(exclude_none=True),
        call.model_dump(exclude_none=True), result])
    tool_call = {"id": call.call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    conversation = USER + [{"role": "assistant", "content": "", "reasoning_content": THINKING, "tool_calls": [tool_call]},
                           {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]
    want = prompt_len(scripted, conversation, tools=[{"type": "function", "function": {
        "name": "get_weather", "description": "weather", "parameters": WEATHER}}])
    assert chained.usage.input_tokens == resent.usage.input_tokens == want
    assert chained.output_text == resent.output_text == ANSWER
    assert chained.previous_response_id == first.id
    assert oai.responses.retrieve(chained.id).output_text == ANSWER
    oai.responses.delete(chained.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(chained.id)


def test_messages_forced_call_and_round_trip(claude, scripted):
    first = claude.messages.create(model=MODEL, max_tokens=200, messages=USER, tools=[ANTHROPIC_TOOL],
                                   tool_choice={"type": "any"}, extra_body={"temperature": 0})
    thinking, call = first.content
    assert thinking.type == "thinking" and thinking.thinking == THINKING
    assert isinstance(call, anthropic.types.ToolUseBlock) and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER)
    assert first.stop_reason == "tool_use"
    with claude.messages.stream(model=MODEL, max_tokens=200, messages=USER, tools=[ANTHROPIC_TOOL],
                                tool_choice={"type": "tool", "name": "get_weather"},
                                extra_body={"temperature": 0}) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[-1].type == "tool_use" and streamed.stop_reason == "tool_use"
    jsonschema.validate(streamed.content[-1].input, WEATHER)
    messages = USER + [{"role": "assistant", "content": [thinking.model_dump(), call.model_dump(exclude_none=True)]},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}]}]
    answer = claude.messages.create(model=MODEL, max_tokens=64, messages=messages, tools=[ANTHROPIC_TOOL],
                                    extra_body={"temperature": 0})
    assert [b.type for b in answer.content] == ["thinking", "text"] and answer.content[1].text == ANSWER
    tool_call = {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.input}}
    conversation = USER + [{"role": "assistant", "content": "", "reasoning_content": THINKING, "tool_calls": [tool_call]},
                           {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    want = prompt_len(scripted, conversation, tools=[{"type": "function", "function": {
        "name": "get_weather", "description": "weather", "parameters": WEATHER}}])
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == want
    assert claude.messages.count_tokens(model=MODEL, messages=messages, tools=[ANTHROPIC_TOOL]).input_tokens == want


# ---- bad input: each API's error shape, nothing queued ---------------------------------------------------
def test_bad_input_is_refused_before_anything_is_queued(oai, claude, url):
    before = prompt_tokens_counted(url)
    bad_responses = [
        (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), "'input_image'"),
        (dict(input=[{"type": "function_call_output", "call_id": "call_x", "output": "1"}]), "no earlier function_call"),
        (dict(input=[{"role": "user", "content": "hi"}] * 1025), "at most 1024"),
        (dict(input="hi", tools=[{"type": "web_search"}]), "'web_search' are not supported"),
        (dict(input=[{"type": "item_reference", "id": "x"}]), "'item_reference' are not supported"),
    ]
    for kwargs, words in bad_responses:
        with pytest.raises(openai.BadRequestError) as e:
            oai.responses.create(model=MODEL, **kwargs)
        assert words in e.value.body["message"] and e.value.body["type"] == "invalid_request_error", e.value.body
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.create(model=MODEL, input="hi", previous_response_id="resp_nothing")
    assert e.value.body["param"] == "previous_response_id", e.value.body
    with pytest.raises(openai.NotFoundError) as e:  # the path's id, named as the path names it
        oai.responses.retrieve("resp_nothing")
    assert e.value.body["param"] == "response_id", e.value.body
    bad_messages = [
        ([{"role": "user", "content": [{"type": "image", "source": {}}]}], "'image' are not supported"),
        ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}],
         "names no earlier tool_use"),
        ([{"role": "user", "content": "hi"}] * 1025, "at most 1024"),
    ]
    for messages, words in bad_messages:
        with pytest.raises(anthropic.BadRequestError) as e:
            claude.messages.create(model=MODEL, max_tokens=4, messages=messages)
        body = e.value.body
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        assert words in body["error"]["message"], body
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=USER)
    assert e.value.body["error"]["type"] == "authentication_error"
    assert prompt_tokens_counted(url) == before


# ---- agent frameworks ------------------------------------------------------------------------------------
def test_openai_agents_sdk_runs_an_agent_with_a_function_tool(url):
    agents = pytest.importorskip("agents")
    calls = []

    @agents.function_tool  # an enum argument: a free string would be the random model's to end
    def get_weather(city: Literal["paris", "rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny"

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=client)
    agent = agents.Agent(name="weather", instructions="answer briefly", tools=[get_weather], model=model,
                         model_settings=agents.ModelSettings(tool_choice="required", temperature=0))
    agents.set_tracing_disabled(True)
    result = agents.Runner.run_sync(agent, QUESTION)
    assert len(calls) == 1 and calls[0] in ("paris", "rome")  # the forced call ran the tool once
    assert result.final_output == ANSWER  # then tool_choice went back to auto, and the model answered
    kinds = [item.type for item in result.new_items]
    assert kinds.count("tool_call_item") == 1 and kinds.count("tool_call_output_item") == 1


def test_pydantic_ai_agent_over_the_messages_api(url):
    pytest.importorskip("pydantic_ai")
    from pydantic import BaseModel
    from pydantic_ai import Agent
    from pydantic_ai.models.anthropic import AnthropicModel, AnthropicModelSettings
    from pydantic_ai.providers.anthropic import AnthropicProvider
    class City(BaseModel):
        city: Literal["Paris", "Rome"]

    client = anthropic.AsyncAnthropic(base_url=url, api_key=KEY, max_retries=0, timeout=60)
    model = AnthropicModel(MODEL, provider=AnthropicProvider(anthropic_client=client))
    agent = Agent(model, output_type=City, model_settings=AnthropicModelSettings(temperature=0, max_tokens=200))
    result = agent.run_sync(QUESTION)  # a forced call of the output tool, parsed into City
    assert isinstance(result.output, City)


def test_openai_agents_sdk_streamed_run(url):
    """The SDK's streamed run (Runner.run_streamed) reads our Responses events into its own."""
    agents = pytest.importorskip("agents")
    import asyncio

    @agents.function_tool
    def get_weather(city: Literal["paris", "rome"]) -> str:
        """The weather in a city."""
        return "sunny"

    async def run():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        agent = agents.Agent(name="weather", tools=[get_weather],
                             model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
                             model_settings=agents.ModelSettings(tool_choice="required", temperature=0))
        agents.set_tracing_disabled(True)
        result = agents.Runner.run_streamed(agent, QUESTION)
        kinds = [event.type async for event in result.stream_events()]
        return result, kinds
    result, kinds = asyncio.run(run())
    assert result.final_output == ANSWER and "raw_response_event" in kinds and "run_item_stream_event" in kinds
