"""The OpenAI-compatible server, driven by the official `openai` client over loopback.

References come from a second, offline LLM on the same checkpoint (LLM.generate / LLM.chat).
"""
import asyncio
import json
import socket
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from nanovllm import SamplingParams  # noqa: E402

from process_helpers import stop  # noqa: E402

from server_fixtures import (  # noqa: E402,F401  (client, ref_llm, served are fixtures)
    API_KEY, MODEL, client, prompt_of, ref_llm, served, wait_all_blocks_free, wait_for_health)


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
    real_run = llm.llm_engine.model_runner.run

    def run(out):
        time.sleep(seconds)
        return real_run(out)

    monkeypatch.setattr(llm.llm_engine.model_runner, "run", run)


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



def test_serve_command_line(qwen3_gqa, ref_llm):
    """`nanovllm serve` in a subprocess: engine options reach Config, the key is enforced."""
    import os
    import subprocess
    import sys

    from nanovllm.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["serve", "m", "--max-num-seqs", "4", "--no-enable-prefix-caching"])
    assert (args.host, args.port) == ("127.0.0.1", 8000)
    assert engine_kwargs(args) == {"max_num_seqs": 4, "enable_prefix_caching": False}
    args = build_parser().parse_args(["serve", "m", "--kvcache-prefault"])
    assert engine_kwargs(args) == {"kvcache_prefault": True}

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "nanovllm.cli", "serve", qwen3_gqa, "--port", str(port), "--api-key", API_KEY,
           "--served-model-name", "served", "--max-model-len", "256", "--kvcache-block-size", "16",
           "--cpu-kvcache-bytes", str(128 * 16384), "--kvcache-prefault", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_health(proc, url)
        assert httpx.get(url + "/v1/models").status_code == 401
        keyed = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
        assert [m.id for m in keyed.models.list().data] == ["served"]
        ref = ref_llm.generate(["the lazy dog"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
        out = keyed.completions.create(model="served", prompt="the lazy dog", max_tokens=8, temperature=0)
        assert out.choices[0].text == ref["text"]
    finally:
        stop(proc)
    assert proc.returncode == 0
    # The tiny model's template ignores tools: at --log-level warning, nothing said about it while no
    # request brought tools.
    assert "ignores tools" not in proc.stdout.read().decode()


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
