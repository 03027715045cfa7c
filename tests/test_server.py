"""The OpenAI-compatible server, driven by the official `openai` client over loopback.

References come from a second, offline LLM on the same checkpoint (LLM.generate / LLM.chat).
"""
import asyncio
import json
import socket
import threading
import time

import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.entrypoints.async_engine import AsyncEngine  # noqa: E402
from nanovllm.entrypoints.openai_server import build_app  # noqa: E402

from helpers import WORDS  # noqa: E402

MODEL = "tiny-qwen3"
API_KEY = "sekret"
ENGINE_OPTIONS = dict(kvcache_block_size=16, max_model_len=256, cpu_kvcache_bytes=128 * 16384)


class Server:
    """uvicorn in a thread on a free loopback port (the socket is bound here, so no race)."""

    def __init__(self, app):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def ref_llm(qwen3_gqa):
    with LLM(qwen3_gqa, **ENGINE_OPTIONS) as llm:
        yield llm


@pytest.fixture(scope="module")
def served(qwen3_gqa):
    """One engine behind two servers: an open one and one that wants API_KEY."""
    llm = LLM(qwen3_gqa, **ENGINE_OPTIONS)
    engine = AsyncEngine(llm).start()
    open_server = Server(build_app(engine, MODEL))
    keyed_server = Server(build_app(engine, MODEL, api_key=API_KEY))
    yield engine, open_server.url, keyed_server.url
    open_server.stop()
    keyed_server.stop()
    engine.shutdown(timeout=10)
    llm.exit()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0, timeout=60)


def probe(engine: AsyncEngine, fn):
    """fn(llm), run on the engine thread between steps."""
    async def ask():
        return await engine.call(fn)
    return asyncio.run(ask())


def num_free_blocks(engine: AsyncEngine) -> tuple[int, int]:
    return probe(engine, lambda llm: (llm.scheduler.block_manager.num_free_blocks, llm.num_kvcache_blocks))


def wait_all_blocks_free(engine: AsyncEngine, timeout: float = 20.0) -> None:
    """Aborts reach the engine a moment after the client hangs up: wait, bounded."""
    deadline = time.monotonic() + timeout
    while True:
        free, total = num_free_blocks(engine)
        if free == total or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert (free, total) == (total, total)
    assert probe(engine, lambda llm: llm.is_finished())


def prompt_of(i: int) -> str:
    return " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(3 + i % 5))


def test_completion_equals_offline_generate(client, ref_llm):
    prompt = "the quick brown fox"
    ref = ref_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    assert out.choices[0].text == ref["text"]
    assert out.choices[0].finish_reason == ref["finish_reason"]
    assert out.usage.prompt_tokens == len(ref["prompt_token_ids"])
    assert out.usage.completion_tokens == len(ref["token_ids"])
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref["finish_reason"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref["token_ids"])


def test_raw_event_stream_format(served, client):
    body = {"model": MODEL, "prompt": "the fox", "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", served[1] + "/v1/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: {") for e in events[:-2])
    expected = client.completions.create(model=MODEL, prompt="the fox", max_tokens=5, temperature=0)
    assert "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-2]) == expected.choices[0].text


@pytest.mark.parametrize("prompts", [["seven bright stars", "the city of paris"], [[5, 9, 14, 3], [7, 7]]])
def test_several_prompts_of_text_or_token_ids(client, ref_llm, prompts):
    refs = ref_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True), use_tqdm=False)
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=9, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [r["text"] for r in refs]
    assert out.usage.prompt_tokens == sum(len(r["prompt_token_ids"]) for r in refs)
    assert out.usage.completion_tokens == 18
    single = client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=9, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert single.choices[0].text == refs[1]["text"]


def test_chat_equals_offline_chat(client, ref_llm):
    messages = [{"role": "system", "content": "old quiet rivers"},
                {"role": "user", "content": "where do people talk"}]
    ref = ref_llm.chat(messages, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref["text"]
    assert out.usage.prompt_tokens == len(ref["prompt_token_ids"])
    assert out.usage.completion_tokens == len(ref["token_ids"])

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                            stream=True)
    chunks = [c for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref["text"]
    assert chunks[-1].choices[0].finish_reason == ref["finish_reason"]


def test_models_and_health(served, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(served[1] + "/health").status_code == 200
    missing = httpx.get(served[1] + "/v1/engines")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_32_concurrent_streams_equal_their_offline_results(served, ref_llm):
    engine, url, _ = served
    prompts = [prompt_of(i) for i in range(32)]
    lengths = [3 + (i * 5) % 29 for i in range(32)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    refs = ref_llm.generate(prompts, params, use_tqdm=False)

    async def one(aclient, prompt, n):
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True})
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as ac:
            return await asyncio.gather(*(one(ac, p, n) for p, n in zip(prompts, lengths)))

    steps_before = engine.num_steps
    results = asyncio.run(all_of_them())
    assert [r[0] for r in results] == [r["text"] for r in refs]
    assert all(r[1] == "length" for r in results)
    # Continuous batching: far fewer steps than running the 32 requests one after another.
    assert engine.num_steps - steps_before < sum(lengths) // 2
    wait_all_blocks_free(engine)


def slow_down_steps(monkeypatch, llm, seconds: float) -> None:
    """Each model step takes at least `seconds`: long requests surely outlive the client."""
    real_run = llm.model_runner.run

    def run(out):
        time.sleep(seconds)
        return real_run(out)

    monkeypatch.setattr(llm.model_runner, "run", run)


def test_disconnected_streams_are_aborted_and_others_unaffected(served, ref_llm, monkeypatch):
    engine, url, _ = served
    slow_down_steps(monkeypatch, engine.llm, 0.01)
    keep = [prompt_of(i) for i in range(3)]
    refs = ref_llm.generate(keep, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    aborted_before = engine.num_aborted

    async def hang_up(aclient, prompt):
        # Asks for the whole context: it cannot finish on its own before the client leaves.
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=240, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True})
        n = 0
        async for _ in stream:
            n += 1
            if n == 3:
                break
        await stream.close()
        return n

    async def finish(aclient, prompt):
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True})
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def run():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as ac:
            return await asyncio.gather(*(hang_up(ac, prompt_of(10 + i)) for i in range(4)),
                                        *(finish(ac, p) for p in keep))

    results = asyncio.run(run())
    assert results[:4] == [3] * 4
    assert results[4:] == [r["text"] for r in refs]
    wait_all_blocks_free(engine)
    assert engine.num_aborted - aborted_before == 4


def test_non_streaming_client_that_leaves_is_aborted(served, client, monkeypatch):
    engine, url, _ = served
    slow_down_steps(monkeypatch, engine.llm, 0.02)
    aborted_before = engine.num_aborted
    impatient = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "fox"}],
                                          max_tokens=240, extra_body={"ignore_eos": True})
    wait_all_blocks_free(engine)
    assert engine.num_aborted - aborted_before == 1
    monkeypatch.undo()
    assert client.completions.create(model=MODEL, prompt="fox", max_tokens=2).usage.completion_tokens == 2


def post(url: str, body, headers: dict | None = None) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(url, content=body, headers={"content-type": "application/json", **(headers or {})})
    return httpx.post(url, json=body, headers=headers)


BAD_REQUESTS = [
    ("/v1/completions", b'{"model": "tiny-qwen3", "prompt": "the fox"', "not valid JSON"),
    ("/v1/completions", b'["the fox"]', "JSON object"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "the fox"}, "does not exist"),
    ("/v1/completions", {"model": MODEL}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "the fox", "temperature": -1}, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "the fox", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "the fox", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "the fox", "max_tokens": 2.5}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "the fox", "max_tokenz": 5}, "max_tokenz"),
    ("/v1/completions", {"model": MODEL, "prompt": "the fox", "top_p": 0}, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "the fox", "top_k": -2}, "top_k"),
    ("/v1/completions", {"model": MODEL, "prompt": "the fox", "n": 0}, "n must be"),
    ("/v1/completions", {"model": MODEL, "prompt": "the fox", "stop": ["ok", ""]}, "empty string"),
    ("/v1/completions", {"model": MODEL, "prompt": "the fox", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "the fox", "presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "the fox", "stop_token_ids": [100000]}, "vocabulary"),
    ("/v1/completions", {"model": MODEL, "prompt": "the fox", "logit_bias": {"5": 1.0}}, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "the fox", "echo": True}, "echo"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, "empty"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, "empty"),
    ("/v1/completions", {"model": MODEL, "prompt": [3, 99999]}, "outside the vocabulary"),
    ("/v1/completions", {"model": MODEL, "prompt": "fox " * 300}, "max_model_len"),
    ("/v1/completions", {"model": MODEL, "prompt": ["the fox", ""], "stream": True}, "empty"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "hi"}]}, "role"),
    ("/v1/chat/completions", {"model": "other", "messages": [{"role": "user", "content": "hi"}]}, "does not exist"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "fox " * 300}]},
     "max_model_len"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "top_logprobs": 2}, "logprobs"),
]


@pytest.mark.parametrize("path, body, words", BAD_REQUESTS)
def test_bad_requests_get_400_and_the_server_keeps_serving(served, client, ref_llm, path, body, words):
    engine, url, _ = served
    r = post(url + path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert words in error["message"]
    ref = ref_llm.generate(["paris"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert client.completions.create(model=MODEL, prompt="paris", max_tokens=3, temperature=0).choices[0].text \
        == ref["text"]
    wait_all_blocks_free(engine)


def test_api_key(served):
    _, _, url = served
    body = {"model": MODEL, "prompt": "the fox", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = post(url + "/v1/completions", body, headers)
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/openapi.json").status_code == 401
    assert post(url + "/v1/completions", b"{broken", {}).status_code == 401  # auth comes first
    assert httpx.get(url + "/health").status_code == 200
    keyed = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    assert keyed.completions.create(model=MODEL, prompt="the fox", max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()


POISON = 250  # a prompt holding this token id makes the model runner raise


def test_failed_engine_step_fails_only_its_requests(served, client, ref_llm, monkeypatch):
    engine, url, _ = served
    llm = engine.llm
    real_run = llm.model_runner.run

    def run(out):
        if any(POISON in seq.prompt_token_ids for seq in out.seqs):
            raise RuntimeError("poisoned batch")
        return real_run(out)

    monkeypatch.setattr(llm.model_runner, "run", run)
    ref = ref_llm.generate(["old quiet rivers"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                           use_tqdm=False)[0]
    stream = client.completions.create(model=MODEL, prompt="old quiet rivers", max_tokens=30, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    pieces = [next(stream).choices[0].text]  # running: it never shares a prefill step with the poison
    with pytest.raises(openai.InternalServerError, match="poisoned batch"):
        client.completions.create(model=MODEL, prompt=[3, POISON, 4], max_tokens=5)
    poisoned = client.completions.create(model=MODEL, prompt=[POISON], max_tokens=5, stream=True)
    with pytest.raises(openai.APIError, match="poisoned batch"):
        list(poisoned)
    pieces += [chunk.choices[0].text for chunk in stream]
    assert "".join(pieces) == ref["text"]
    monkeypatch.undo()
    assert client.completions.create(model=MODEL, prompt=[3, POISON, 4], max_tokens=2).usage.completion_tokens == 2
    assert httpx.get(url + "/health").status_code == 200
    wait_all_blocks_free(engine)


def test_serve_command_line(qwen3_gqa, ref_llm):
    """`nanovllm serve` in a subprocess: engine options reach Config, the key is enforced."""
    import os
    import subprocess
    import sys

    from nanovllm.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["serve", "m", "--max-num-seqs", "4", "--no-enable-prefix-caching"])
    assert (args.host, args.port) == ("127.0.0.1", 8000)
    assert engine_kwargs(args) == {"max_num_seqs": 4, "enable_prefix_caching": False}

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "nanovllm.cli", "serve", qwen3_gqa, "--port", str(port), "--api-key", API_KEY,
           "--served-model-name", "served", "--max-model-len", "256", "--kvcache-block-size", "16",
           "--cpu-kvcache-bytes", str(128 * 16384), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "server did not come up"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert httpx.get(url + "/v1/models").status_code == 401
        keyed = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
        assert [m.id for m in keyed.models.list().data] == ["served"]
        ref = ref_llm.generate(["the lazy dog"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
        out = keyed.completions.create(model="served", prompt="the lazy dog", max_tokens=8, temperature=0)
        assert out.choices[0].text == ref["text"]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0


# ---- sampling options over HTTP: each response equals the offline engine's for the same params ----

def stream_text(chunks) -> tuple[str, str | None]:
    chunks = list(chunks)
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].choices[0].finish_reason


def test_stop_strings(client, ref_llm):
    prompt = "old quiet rivers and"
    greedy = ref_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                              use_tqdm=False)[0]
    words = greedy["text"].split(" ")
    spanning = words[3][-2:] + " " + words[4][:2]  # starts in one token, ends in the next
    for stop, include in ((spanning, False), (spanning, True), ([words[6], "never there"], False)):
        sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=stop,
                            include_stop_str_in_output=include)
        ref = ref_llm.generate([prompt], sp, use_tqdm=False)[0]
        assert ref["finish_reason"] == "stop" and len(ref["text"]) < len(greedy["text"])
        kwargs = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=stop,
                      extra_body={"ignore_eos": True, "include_stop_str_in_output": include})
        out = client.completions.create(**kwargs)
        assert (out.choices[0].text, out.choices[0].finish_reason) == (ref["text"], "stop")
        assert out.usage.completion_tokens == len(ref["token_ids"])
        # The stream never sends text that the stop string later cuts off.
        assert stream_text(client.completions.create(stream=True, **kwargs)) == (ref["text"], "stop")


def test_seeded_sampling_and_n(client, ref_llm):
    prompt = "seven bright stars"
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=1234, n=3, ignore_eos=True)
    ref = ref_llm.generate([prompt], sp, use_tqdm=False)[0]["outputs"]
    assert len({r["text"] for r in ref}) > 1  # completions of one seeded request differ
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, n=3,
                  extra_body={"ignore_eos": True})
    out = client.completions.create(**kwargs)
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == [r["text"] for r in ref]
    assert out.usage.completion_tokens == 36
    texts = ["", "", ""]
    for chunk in client.completions.create(stream=True, **kwargs):
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [r["text"] for r in ref]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], n=2,
                                          max_tokens=12, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    ref_chat = ref_llm.chat([{"role": "user", "content": prompt}],
                            SamplingParams(temperature=1.0, max_tokens=12, seed=7, n=2, ignore_eos=True),
                            use_tqdm=False)[0]["outputs"]
    assert [c.message.content for c in chat.choices] == [r["text"] for r in ref_chat]


def test_logprobs(client, ref_llm):
    prompt = "the city of paris"
    ref = ref_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True),
                           use_tqdm=False)[0]
    chosen = [d[t] for d, t in zip(ref["logprobs"], ref["token_ids"])]
    token_texts = [ref_llm.tokenizer.decode([t]) for t in ref["token_ids"]]
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=3,
                  extra_body={"ignore_eos": True})
    lp = client.completions.create(**kwargs).choices[0].logprobs
    assert lp.tokens == token_texts
    assert lp.token_logprobs == pytest.approx(chosen, abs=1e-4)
    assert all(len(top) == 3 and max(top.values()) == pytest.approx(lp_, abs=1e-4)  # greedy: chosen is best
               for top, lp_ in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == [sum(len(t) for t in token_texts[:i]) for i in range(len(token_texts))]
    streamed = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kwargs)
                if c.choices[0].logprobs]
    assert sum((s.token_logprobs for s in streamed), []) == pytest.approx(chosen, abs=1e-4)
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset

    messages = [{"role": "user", "content": prompt}]
    ref_chat = ref_llm.chat(messages, SamplingParams(temperature=0, max_tokens=8, logprobs=2), use_tqdm=False)[0]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(
        [d[t] for d, t in zip(ref_chat["logprobs"], ref_chat["token_ids"])], abs=1e-4)
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token for c in content)
    assert all(bytes(c.bytes) == c.token.encode() for c in content)


def test_another_engine_in_the_process_steps_alongside(served, ref_llm):
    """The attention context is per thread: an offline LLM used while the server's engine thread
    steps (here: the references, computed during the streams) sees only its own batches."""
    _, url, _ = served
    prompts = [prompt_of(i) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    async def stream(ac, prompt):
        s = await ac.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True})
        return "".join([chunk.choices[0].text async for chunk in s])

    async def run():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as ac:
            streams = asyncio.gather(*(stream(ac, p) for p in prompts))
            # Offline generation on this thread while the engine thread serves the streams.
            refs = [await asyncio.to_thread(ref_llm.generate, prompts, params, use_tqdm=False) for _ in range(3)]
            return await streams, refs

    texts, refs = asyncio.run(run())
    assert refs[0] == refs[1] == refs[2]
    assert texts == [r["text"] for r in refs[0]]
