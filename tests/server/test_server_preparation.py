"""A request's preparation runs beside the engine's steps, on the preparation threads: tokenizing
(a slow one, standing in for a multi-MB prompt, delays only its own request while a stream keeps
flowing), compiling its grammar (the engine thread then finds it cached), and a bad schema fails
only its own request."""
import asyncio
import threading
import time

import pytest

from server_fixtures import ENGINE_OPTIONS, MODEL, openai, serve_engine  # noqa: F401

from nanovllm import LLM
from nanovllm.entrypoints.openai_server import build_app

SLOW_S = 2.0


@pytest.fixture(scope="module")
def traced(qwen3_gqa):
    """A server whose tokenizer and grammar compiler record the thread they run on; prompts that
    start with "SLOW" take SLOW_S seconds to tokenize."""
    llm = LLM(qwen3_gqa, **ENGINE_OPTIONS)
    seen = {"encode": [], "compile": []}
    real_encode, real_compile = llm.tokenizer.encode, llm.llm_engine.grammars._compile

    def encode(text, *args, **kwargs):
        seen["encode"].append(threading.current_thread().name)
        if isinstance(text, str) and text.startswith("SLOW"):
            time.sleep(SLOW_S)
        return real_encode(text, *args, **kwargs)

    def compile_(params):
        seen["compile"].append(threading.current_thread().name)
        return real_compile(params)

    llm.tokenizer.encode, llm.llm_engine.grammars._compile = encode, compile_
    with serve_engine(llm, [lambda engine: build_app(engine, MODEL)]) as (engine, (url,)):
        yield url, seen


def test_a_slow_tokenization_does_not_stall_the_streams(traced):
    url, seen = traced

    async def run():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as ac:
            stream = await ac.completions.create(model=MODEL, prompt="the quick fox", max_tokens=200, stream=True,
                                                 temperature=0, extra_body={"ignore_eos": True})
            times, slow = [], None
            async for _ in stream:
                times.append(time.perf_counter())
                if slow is None:  # once the stream flows, a request whose prompt tokenizes for SLOW_S
                    slow = asyncio.create_task(ac.completions.create(model=MODEL, prompt="SLOW the fox",
                                                                     max_tokens=2, temperature=0))
            slow_started = times[0]
            reply = await slow
            return times, slow_started, time.perf_counter(), reply

    times, slow_started, slow_done, reply = asyncio.run(run())
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert len(times) >= 100 and slow_done - slow_started >= SLOW_S
    assert max(gaps) < SLOW_S / 2, max(gaps)  # on the engine thread, the stream would stop for SLOW_S
    assert reply.choices[0].text is not None
    assert seen["encode"] and all(name.startswith("nanovllm-prepare") for name in seen["encode"]), seen["encode"]


def test_grammars_compile_on_the_preparation_thread(traced):
    url, seen = traced
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    client.completions.create(model=MODEL, prompt="the fox", max_tokens=8, temperature=0,
                              extra_body={"structured_outputs": {"json": schema}})
    assert seen["compile"] and all(name.startswith("nanovllm-prepare") for name in seen["compile"]), seen["compile"]
    with pytest.raises(openai.BadRequestError, match="not a valid regex"):
        client.completions.create(model=MODEL, prompt="the fox", max_tokens=8,
                                  extra_body={"structured_outputs": {"regex": "(unclosed"}})
    ok = client.completions.create(model=MODEL, prompt="the fox", max_tokens=4, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_four_streams_flow_while_a_7mb_prompt_and_a_200_property_schema_arrive(traced):
    """The issue's case, with the real tokenizer and xgrammar: four clients stream (one request after
    another) while a 7 MB string prompt (refused once tokenized: far over max_model_len; ~3 s of
    tokenizing here) and then a 200-property JSON schema arrive; no stream's gap between chunks
    reaches 1 s (on the engine thread, the prompt alone stopped them for its whole tokenizing)."""
    url, _ = traced
    schema = {"type": "object", "properties": {f"field_{i}": {"type": "integer"} for i in range(200)},
              "required": [f"field_{i}" for i in range(200)], "additionalProperties": False}

    async def run():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as ac:
            done = asyncio.Event()

            async def stream(times):  # one stream after another (max_model_len is short) until done
                while not done.is_set():
                    s = await ac.completions.create(model=MODEL, prompt="the quick fox", max_tokens=200,
                                                    stream=True, temperature=0, extra_body={"ignore_eos": True})
                    async for _ in s:
                        times.append(time.perf_counter())
            times = [[] for _ in range(4)]
            streams = [asyncio.create_task(stream(t)) for t in times]
            while not all(times):
                await asyncio.sleep(0.01)
            sent = time.perf_counter()
            with pytest.raises(openai.BadRequestError, match="maximum context length"):
                await ac.completions.create(model=MODEL, prompt="fox " * (7 * 2**20 // 4), max_tokens=1)
            refused = time.perf_counter()
            big = await ac.completions.create(model=MODEL, prompt="the fox", max_tokens=4, temperature=0,
                                              extra_body={"structured_outputs": {"json": schema}})
            done.set()
            await asyncio.gather(*streams)
            return times, big, sent, refused

    times, big, sent, refused = asyncio.run(run())
    assert big.choices[0].finish_reason in ("stop", "length")
    print(f"7 MB prompt refused after {refused - sent:.2f} s; streams ended {max(t[-1] for t in times) - sent:.2f} s "
          f"after it was sent")
    assert all(t[-1] > refused for t in times)  # the streams were still decoding all along
    for t in times:
        assert max(b - a for a, b in zip(t, t[1:])) < 1.0
