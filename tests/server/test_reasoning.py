"""Reasoning parsers: a reply's <think> block returned apart from its answer, whole or streamed in
pieces cut anywhere (every cut gives the same split as the whole reply)."""
import pytest

from nanovllm.entrypoints.reasoning import get_reasoning_parser

CASES = [
    # (parser, reply, thinking, answer)
    ("qwen3", "<think>\nlet me see\n</think>\n\nParis.", "\nlet me see\n", "Paris."),
    ("qwen3", "Paris.", None, "Paris."),                      # no block: all answer
    ("qwen3", "<think></think>\n\nParis.", "", "Paris."),      # enable_thinking false's empty block
    ("qwen3", "<think>still going", "still going", ""),       # cut off inside the thinking
    ("qwen3", "a < b <thinking>", None, "a < b <thinking>"),   # a tag only counts at the start
    ("deepseek_r1", "hmm </think>Paris.", "hmm ", "Paris."),  # the prompt opened the thinking
    ("deepseek_r1", "<think>hmm</think>\nParis.", "hmm", "Paris."),
    ("deepseek_r1", "never closed", "never closed", ""),
    ("qwen3", "<think>a </thin b</think>c</think>", "a </thin b", "c</think>"),
]


@pytest.mark.parametrize("name, reply, thinking, answer", CASES)
def test_whole_replies(name, reply, thinking, answer):
    assert get_reasoning_parser(name).split(reply) == (thinking, answer)


@pytest.mark.parametrize("name, reply, thinking, answer", CASES)
def test_every_cut_streams_the_same(name, reply, thinking, answer):
    parser = get_reasoning_parser(name)
    for cuts in [(i,) for i in range(len(reply) + 1)] + [(i, j) for i in range(len(reply)) for j in range(i, len(reply))]:
        bounds = [0, *cuts, len(reply)]
        pieces = [reply[a:b] for a, b in zip(bounds, bounds[1:])]
        stream = parser.stream()
        got_r = got_c = ""
        for k, piece in enumerate(pieces):
            r, c = stream.feed(piece, finished=k == len(pieces) - 1)
            got_r, got_c = got_r + r, got_c + c
        assert (got_r if stream.saw_thinking else None, got_c) == (thinking, answer), pieces


def test_unknown_parser_is_named():
    with pytest.raises(ValueError, match="'qwen2' is not known; choose from \\['deepseek_r1', 'qwen3'\\]"):
        get_reasoning_parser("qwen2")


# ---- through the server: without a parser the thinking stays in the content ----------------------
# (with one: test_agent_apis.py, on Qwen3's own template, in all three APIs)
def test_without_a_parser_the_thinking_is_content(tmp_path):
    from helpers import make_byte_tokenizer, make_qwen3
    from server_fixtures import MODEL, openai, serve_engine

    from nanovllm import LLM
    from nanovllm.entrypoints.openai_server import build_app

    path = make_qwen3(str(tmp_path / "qwen3_bytes"), vocab_size=320, seed=3)
    make_byte_tokenizer(path)
    llm = LLM(path, dtype="float32", max_model_len=256, kvcache_block_size=16)
    with serve_engine(llm, [lambda engine: build_app(engine, MODEL)]) as (_, (url,)):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        message = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "capital of France?"}], max_tokens=40,
            extra_body={"structured_outputs": {"regex": "<think>ab\ncd</think>\n\nParis\\."}}).choices[0].message
    assert message.content == "<think>ab\ncd</think>\n\nParis." and getattr(message, "reasoning_content", None) is None
