"""Structured outputs through the OpenAI server with the official client: response_format
(json_schema, json_object, text), vLLM's structured_outputs and guided_* extras, streamed and n=2;
a bad schema is a 400. A tiny random model for bounded schemas, the default model for json_object."""
import json
import os
import re
from pathlib import Path

import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from server_fixtures import Server, openai  # noqa: E402
from helpers import make_byte_tokenizer, make_qwen3  # noqa: E402
from nanovllm import LLM  # noqa: E402
from nanovllm.entrypoints.async_engine import AsyncEngine  # noqa: E402
from nanovllm.entrypoints.openai_server import build_app  # noqa: E402
from nanovllm.utils import default_model as dm  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "mood", "count"],
          "properties": {"answer": {"type": "boolean"}, "mood": {"enum": ["happy", "sad"]},
                         "count": {"type": "integer", "minimum": 1, "maximum": 5},
                         "note": {"type": "string", "pattern": "^[a-z]{0,6}$"}}}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "How are you?"}]


def serve(path: str, **options):
    llm = LLM(path, max_model_len=512, max_num_seqs=4, **options)
    engine = AsyncEngine(llm).start()
    server = Server(build_app(engine, "m"))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return llm, engine, server, client


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    path = make_qwen3(str(tmp_path_factory.mktemp("qwen3_bytes_server")), vocab_size=300, seed=5)
    make_byte_tokenizer(path)
    llm, engine, server, client = serve(path, kvcache_block_size=16)
    yield client
    server.stop()
    engine.shutdown(timeout=10)
    llm.exit()


def check(text: str) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    return value


def test_chat_json_schema_n2_and_streamed(client):
    reply = client.chat.completions.create(model="m", messages=MESSAGES, n=2, temperature=1.0, max_tokens=80,
                                           response_format=JSON_SCHEMA_FORMAT)
    assert len(reply.choices) == 2
    for choice in reply.choices:
        check(choice.message.content)
        assert choice.finish_reason == "stop"
    stream = client.chat.completions.create(model="m", messages=MESSAGES, n=2, temperature=1.0, max_tokens=80,
                                            seed=4, response_format=JSON_SCHEMA_FORMAT, stream=True)
    texts = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert all(check(t) for t in texts.values())


def test_completions_json_schema(client):
    reply = client.completions.create(model="m", prompt=["a", "bb"], max_tokens=80, temperature=0.9,
                                      extra_body={"response_format": JSON_SCHEMA_FORMAT})
    assert len(reply.choices) == 2 and all(check(c.text) for c in reply.choices)


@pytest.mark.parametrize("extra, matches", [
    ({"structured_outputs": {"choice": ["red", "green"]}}, lambda t: t in ("red", "green")),
    ({"structured_outputs": {"regex": r"\d{3}-[xy]"}}, lambda t: re.fullmatch(r"\d{3}-[xy]", t)),
    ({"structured_outputs": {"json": SCHEMA}}, check),
    ({"structured_outputs": {"grammar": 'root ::= "go" ("!" | "?")'}}, lambda t: t in ("go!", "go?")),
    ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
    ({"guided_regex": "[ab]{4}"}, lambda t: re.fullmatch("[ab]{4}", t)),
    ({"guided_json": json.dumps(SCHEMA)}, check),
    ({"guided_grammar": 'root ::= [0-9] "."'}, lambda t: re.fullmatch(r"[0-9]\.", t)),
], ids=["choice", "regex", "json", "grammar", "guided_choice", "guided_regex", "guided_json", "guided_grammar"])
def test_vllm_extras(client, extra, matches):
    reply = client.chat.completions.create(model="m", messages=MESSAGES, n=2, temperature=1.0, max_tokens=80,
                                           extra_body=extra)
    assert all(matches(c.message.content) for c in reply.choices)


def test_text_format_is_unconstrained(client):
    kwargs = dict(model="m", messages=MESSAGES, temperature=0, max_tokens=12)
    plain = client.chat.completions.create(**kwargs)
    text = client.chat.completions.create(**kwargs, response_format={"type": "text"})
    assert text.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize("extra, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "not a valid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ({"guided_grammar": "root ::= nowhere"}, "structured_outputs.grammar"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "at most"),
])
def test_bad_constraint_is_a_400(client, extra, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=8, extra_body=extra)
    assert words in str(info.value)


@pytest.fixture(scope="module")
def default_client():
    cache = Path(os.environ.get(dm.CACHE_ENV) or REPO / ".cache" / "nanovllm")
    llm, engine, server, client = serve(dm.default_model_path(cache), dtype="float32")
    yield client
    server.stop()
    engine.shutdown(timeout=10)
    llm.exit()


def test_json_object_with_the_default_model(default_client):
    messages = [{"role": "user", "content": "Give a JSON object describing a cat with its name and age."}]
    reply = default_client.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=80,
                                                   response_format={"type": "json_object"})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and isinstance(json.loads(choice.message.content), dict)
