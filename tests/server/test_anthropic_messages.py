"""/v1/messages through the official `anthropic` client: text whole and streamed (its event
sequence parsed by the client), stop sequences and max_tokens as Anthropic's stop reasons,
count_tokens, x-api-key, and errors in Anthropic's shape (unsupported content blocks, bad fields)."""
import pytest

from server_fixtures import MODEL, serve_engine

from nanovllm import LLM, SamplingParams
from nanovllm.entrypoints.openai_server import build_app

anthropic = pytest.importorskip("anthropic")
ENGINE = dict(dtype="float32", kvcache_block_size=16, max_model_len=256)
KEY = "sekret"


@pytest.fixture(scope="module")
def server(qwen3_gqa):
    llm = LLM(qwen3_gqa, **ENGINE)
    with serve_engine(llm, [lambda engine: build_app(engine, MODEL, api_key=KEY)]) as (_, (url,)):
        yield url, anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(qwen3_gqa):
    with LLM(qwen3_gqa, **ENGINE) as llm:
        conversation = [{"role": "system", "content": "the lazy dog"}, {"role": "user", "content": "the quick fox"}]
        prompt = llm.apply_chat_template(conversation)
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
        return prompt, out


def ask(client, **kwargs):
    # NOTE: this anthropic client takes no temperature argument any more; the API field still exists.
    args = dict(model=MODEL, max_tokens=12, extra_body={"temperature": 0}, system="the lazy dog",
                messages=[{"role": "user", "content": [{"type": "text", "text": "the quick fox"}]}])
    return client.messages.create(**{**args, **kwargs})


def test_text_whole_and_streamed(server, reference):
    _, client = server
    prompt, want = reference
    message = ask(client)
    assert message.content[0].type == "text" and message.content[0].text == want["text"]
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[want["finish_reason"]]
    assert (message.usage.input_tokens, message.usage.output_tokens) == (len(prompt), len(want["token_ids"]))
    with client.messages.stream(model=MODEL, max_tokens=12, extra_body={"temperature": 0}, system="the lazy dog",
                                messages=[{"role": "user", "content": "the quick fox"}]) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == want["text"] and len(pieces) > 1
    assert final.content[0].text == want["text"] and final.stop_reason == message.stop_reason
    assert client.messages.count_tokens(model=MODEL, system="the lazy dog",
                                        messages=[{"role": "user", "content": "the quick fox"}]).input_tokens == len(prompt)


def test_stop_sequences(server, reference):
    _, client = server
    words = reference[1]["text"].split(" ")
    if len(words) < 3:
        pytest.skip("the reference reply is too short to stop inside")
    message = ask(client, stop_sequences=[words[2]])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == words[2]
    assert words[2] not in message.content[0].text


def test_errors_in_anthropics_shape(server):
    url, client = server
    with pytest.raises(anthropic.BadRequestError) as e:
        ask(client, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "'image' are not supported" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        ask(client, max_tokens=0)
    assert "max_tokens" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        ask(client, max_tokens=10_000)
    assert "maximum context length is 256 tokens" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
