"""Bounded work per request: each limit answers at once with a 400 (413 for the body) naming the
field and the limit, before anything is queued, while other clients keep being served; and
`nanovllm serve` ends within a few seconds of SIGTERM/SIGINT, even mid-generation, an open stream
ending with an error event and [DONE] (no traceback).
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from nanovllm import SamplingParams  # noqa: E402
from nanovllm.entrypoints.limits import ServerLimits  # noqa: E402
from nanovllm.entrypoints.openai_server import build_app  # noqa: E402
from nanovllm.sampling_params import MAX_N  # noqa: E402

from helpers import make_qwen3  # noqa: E402
from process_helpers import free_ports  # noqa: E402
from server_fixtures import (  # noqa: E402,F401  (client, ref_llm, served are fixtures)
    MODEL, Server, client, ref_llm, serve_engine, served, wait_all_blocks_free, wait_for_health)

MAX_MODEL_LEN = 256  # server_fixtures.ENGINE_OPTIONS


def test_sampling_params_caps_n():
    start = time.monotonic()
    with pytest.raises(ValueError, match=rf"n must be in \[1, {MAX_N}\], got 1000000000"):
        SamplingParams(n=10**9)
    assert time.monotonic() - start < 0.1
    assert SamplingParams(n=MAX_N).n == MAX_N


def test_server_limits_are_validated():
    with pytest.raises(ValueError, match="max_n must be <= 1024"):
        ServerLimits(max_n=2000)
    with pytest.raises(ValueError, match="max_body_bytes must be an int >= 1, got 0"):
        ServerLimits(max_body_bytes=0)


def test_huge_n_and_body_are_refused_at_once_while_a_stream_goes_on(served, client, ref_llm):
    engine, url, _ = served
    prompt = "old quiet rivers"
    ref = ref_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                           use_tqdm=False)[0]
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=60, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    pieces = [next(stream).choices[0].text]

    start = time.monotonic()
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "n": 10**9})
    assert time.monotonic() - start < 1.0
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "n"
    assert "n must be <= 128" in r.json()["error"]["message"] and "got 1000000000" in r.json()["error"]["message"]

    # Raw sockets: a server that refuses a body it has not read closes with bytes unread, and the
    # TCP reset that follows can reach a client before the 413 does. Sending no more than the server
    # reads keeps the answer observable.
    start = time.monotonic()
    status, reply = raw_post(url, b"content-length: %d\r\n" % (10 * 2**20), b"")  # refused from the header
    assert time.monotonic() - start < 1.0
    assert status == 413
    assert reply["error"]["code"] == "request_too_large" and str(8 * 2**20) in reply["error"]["message"]

    chunk = b" " * 2**20  # no Content-Length: the limit is checked while reading
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(8)) + b"1\r\n \r\n"
    status, _ = raw_post(url, b"transfer-encoding: chunked\r\n", chunks)
    assert status == 413

    pieces += [chunk.choices[0].text for chunk in stream]
    assert "".join(pieces) == ref["text"]
    wait_all_blocks_free(engine)


def raw_post(url: str, headers: bytes, payload: bytes) -> tuple[int, dict]:
    """POST /v1/completions over a plain socket: (status, JSON body of the reply)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     + headers + b"\r\n" + payload)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body_bytes = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body_bytes)


def body(**fields) -> dict:
    return {"model": MODEL, "prompt": "the fox", "max_tokens": 2, **fields}


LIMITS = [
    ("/v1/completions", body(n=129), "n", ("n must be <= 128", "got 129")),
    ("/v1/completions", body(n=200, best_of=200), "n", ("n must be <= 128", "got 200")),
    ("/v1/completions", body(prompt=["fox"] * 1025), "prompt", "at most 1024"),
    ("/v1/completions", body(prompt=[[5]] * 1025), "prompt", "at most 1024"),
    ("/v1/completions", body(prompt=["fox"] * 9, n=128), "n", "9 prompts x n=128 make 1152 completions"),
    ("/v1/completions", body(logprobs=21), "logprobs", "logprobs must be <= 20, got 21"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 21}, "top_logprobs", "top_logprobs must be <= 20, got 21"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 500},
     "n", ("n must be <= 128", "got 500")),
]


@pytest.mark.parametrize("path, request_body, param, words", LIMITS)
def test_each_limit_is_a_400_naming_field_and_limit(served, path, request_body, param, words):
    engine, url, _ = served
    steps_before = engine.num_steps
    r = httpx.post(url + path, json=request_body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    words = (words,) if isinstance(words, str) else words
    assert all(w in r.json()["error"]["message"] for w in words), r.text
    assert engine.num_steps == steps_before  # nothing was queued
    # At the limit it is served.
    if request_body.get("n") == 129:
        assert len(httpx.post(url + path, json=body(n=128), timeout=60).json()["choices"]) == 128


def test_max_tokens_beyond_the_context_is_a_400_naming_both_numbers(served, client, ref_llm):
    prompt = "the quick brown fox"
    num_prompt = len(ref_llm.tokenizer.encode(prompt))  # a word-level tokenizer: 4
    assert num_prompt == 4
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_MODEL_LEN)
    message = e.value.body["message"]
    assert e.value.body["param"] == "max_tokens"
    assert (f"maximum context length is {MAX_MODEL_LEN} tokens. However, you requested {MAX_MODEL_LEN + 4} "
            f"tokens (4 in the messages, {MAX_MODEL_LEN} in the completion)") in message
    # The longest of several prompts counts.
    with pytest.raises(openai.BadRequestError, match="you requested 257 tokens"):
        client.completions.create(model=MODEL, prompt=["fox", prompt], max_tokens=MAX_MODEL_LEN - 3)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_MODEL_LEN - 4, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == MAX_MODEL_LEN - 4  # exactly fits

    messages = [{"role": "user", "content": "fox"}]
    num_chat = len(ref_llm.apply_chat_template(messages))
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=300)
    assert e.value.body["param"] == "max_completion_tokens"
    assert f"you requested {num_chat + 300} tokens ({num_chat} in the messages, 300 in the completion)" \
        in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "fox " * 300}])
    assert e.value.body["param"] == "messages"
    assert f"maximum context length (max_model_len) is {MAX_MODEL_LEN} tokens. However, your request has " \
        f"{len(ref_llm.apply_chat_template([{'role': 'user', 'content': 'fox ' * 300}]))} input tokens" \
        in e.value.body["message"]


@pytest.mark.parametrize("prompt", [[[True, 1.0]], [True, 5], [5, 1.0], [[5, 6], [False]]])
def test_token_id_prompts_must_be_ints(served, prompt):
    r = httpx.post(served[1] + "/v1/completions", json=body(prompt=prompt))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("prompt")
    r = httpx.post(served[1] + "/v1/completions", json=body(stop_token_ids=[True]))
    assert r.status_code == 400 and "stop_token_ids" in r.json()["error"]["message"]


def test_limits_are_configurable(served):
    engine, _, _ = served
    small = Server(build_app(engine, MODEL, limits=ServerLimits(max_n=2, max_prompts=3, max_body_bytes=300)))
    try:
        r = httpx.post(small.url + "/v1/completions", json=body(n=3))
        assert r.status_code == 400 and "n must be <= 2 (this server's --max-n), got 3" in r.json()["error"]["message"]
        assert len(httpx.post(small.url + "/v1/completions", json=body(n=2), timeout=60).json()["choices"]) == 2
        r = httpx.post(small.url + "/v1/completions", json=body(prompt=["a", "b"], n=2))
        assert r.status_code == 400 and "make 4 completions" in r.json()["error"]["message"]
        padded = body(user="x" * 300)
        assert httpx.post(small.url + "/v1/completions", json=padded).status_code == 413
    finally:
        small.stop()


def test_serve_flags_make_the_limits():
    from nanovllm.cli import build_parser

    args = build_parser().parse_args(["serve", "m", "--max-n", "4", "--max-prompts", "8", "--max-body-bytes", "99"])
    assert (args.max_n, args.max_prompts, args.max_body_bytes) == (4, 8, 99)
    defaults = build_parser().parse_args(["serve", "m"])
    assert ServerLimits(defaults.max_n, defaults.max_prompts, defaults.max_body_bytes) == ServerLimits()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_serve_ends_within_seconds_of_a_signal_mid_generation(tmp_path, signum):
    model = make_qwen3(str(tmp_path / "m"), seed=3)
    port = free_ports(1)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "nanovllm.cli", "serve", model, "--port", str(port), "--max-model-len", "512",
           "--kvcache-block-size", "16", "--cpu-kvcache-bytes", str(64 * 2**20), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(proc, url)
        # 512 completions of 480 tokens: far longer than the shutdown's grace period (2 s).
        request = {"model": model, "prompt": [f"fox {i}" for i in range(32)], "n": 16, "max_tokens": 480,
                   "ignore_eos": True, "stream": True}
        num_finished, sent, events = 0, None, []
        with httpx.stream("POST", url + "/v1/completions", json=request, timeout=30) as r:
            for line in r.iter_lines():  # NOTE: no connection error: the stream is ended, not cut
                if line.startswith("data: "):
                    events.append(line[6:])
                if line.startswith("data: {") and "choices" in line:
                    num_finished += json.loads(line[6:])["choices"][0]["finish_reason"] is not None
                    if sent is None:  # generation is under way: stop the server
                        sent = time.monotonic()
                        proc.send_signal(signum)
        proc.wait(15)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = proc.stdout.read().decode()
    assert proc.returncode == 0, output
    assert took < 8, took
    assert num_finished < 512  # the generation was cut, not finished
    # The open stream got a last error event and [DONE]; the server printed no traceback.
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["message"] == "the server is shutting down"
    assert "Traceback" not in output and "CancelledError" not in output, output


def test_a_dead_worker_is_seen_and_the_server_exits(tmp_path):
    """`nanovllm serve -tp 2`: every socket of its process tree listens on loopback (HTTP, the
    rendezvous store, gloo). Rank 1 SIGKILLed while idle: the engine notices by itself (no
    request needed), /health turns 503 with the worker named, and the process ends with status 1
    (a supervisor's cue), logging which rank died."""
    psutil = pytest.importorskip("psutil")
    model = make_qwen3(str(tmp_path / "m"), seed=3)
    port = free_ports(1)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "nanovllm.cli", "serve", model, "--port", str(port), "-tp", "2", "--max-model-len",
           "256", "--kvcache-block-size", "16", "--cpu-kvcache-bytes", str(8 * 2**20), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(proc, url)
        tree = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
        listening = {(c.laddr.ip, c.laddr.port) for p in tree for c in p.net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN}
        assert ("127.0.0.1", port) in listening and {ip for ip, _ in listening} == {"127.0.0.1"}, listening
        (worker,) = [p for p in tree[1:] if "spawn_main" in " ".join(p.cmdline())]  # not the resource tracker
        killed = time.monotonic()
        worker.kill()
        health = None
        while proc.poll() is None and time.monotonic() - killed < 30:
            try:
                r = httpx.get(url + "/health", timeout=2)
                if r.status_code == 503:
                    health = r.json()
            except httpx.TransportError:
                pass  # the server already stopped listening
            time.sleep(0.05)
        proc.wait(30)
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = proc.stdout.read().decode()
    assert proc.returncode == 1, output
    assert took < 10, took  # the issue: /health non-200 within 10 s; here the process is gone by then
    assert "the engine died: tensor-parallel worker nanovllm-tp-rank1" in output and "exit code -9" in output, output
    if health is not None:  # seen unless the exit came within one poll
        assert health["error"]["type"] == "server_error"


def test_a_worker_dying_mid_stream_ends_every_request(tmp_path):
    """In process, TP=2 behind the app: rank 1 killed while a stream decodes. The stream ends with an
    error event naming the dead worker and [DONE]; /health is 503 and a new request a 503, at once."""
    from nanovllm import LLM
    model = make_qwen3(str(tmp_path / "m"), seed=3)
    llm = LLM(model, tensor_parallel_size=2, max_model_len=256, kvcache_block_size=16, cpu_kvcache_bytes=8 * 2**20)
    (worker,) = llm.llm_engine.model_runner.pool.workers
    with serve_engine(llm, [lambda engine: build_app(engine, "m")]) as (engine, (url,)):
        events = []
        request = {"prompt": "the fox", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=request, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 3:
                        os.kill(worker.pid, signal.SIGKILL)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "tensor-parallel worker nanovllm-tp-rank1" in error["message"] and "died" in error["message"], error
        assert len(events) < 200
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and engine.died is not None
        late = httpx.post(url + "/v1/completions", json={"prompt": "the fox", "max_tokens": 2})
        assert late.status_code == 503 and late.json()["error"]["type"] == "server_error"


def test_a_model_runner_that_keeps_failing_kills_the_engine(qwen3_gqa):
    """One failed step fails only its request and the engine goes on (/health 200); steps that fail
    MAX_FAILED_STEPS_IN_A_ROW times in a row mean a broken runner: the engine is dead (/health 503,
    new requests 503), named so in the reason."""
    from nanovllm import LLM
    from nanovllm.entrypoints.async_engine import MAX_FAILED_STEPS_IN_A_ROW
    llm = LLM(qwen3_gqa, kvcache_block_size=16, max_model_len=256, cpu_kvcache_bytes=128 * 16384)
    real_run, failures = llm.llm_engine.model_runner.run, []

    def run(out):
        if failures and failures[0] > 0:
            failures[0] -= 1
            raise RuntimeError("the runner broke")
        return real_run(out)
    llm.llm_engine.model_runner.run = run
    body = {"prompt": "the fox", "max_tokens": 4, "temperature": 0}
    with serve_engine(llm, [lambda engine: build_app(engine, "m")]) as (engine, (url,)):
        failures.append(1)  # one transient failure
        bad = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert bad.status_code >= 500 and "the runner broke" in bad.json()["error"]["message"]
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200
        assert httpx.get(url + "/health").status_code == 200
        failures[0] = 10 ** 6  # from now on every step fails
        for _ in range(MAX_FAILED_STEPS_IN_A_ROW):
            assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code >= 500
        deadline = time.monotonic() + 10
        while httpx.get(url + "/health").status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(url + "/health").status_code == 503
        assert engine.died.startswith(f"{MAX_FAILED_STEPS_IN_A_ROW} engine steps in a row failed"), engine.died
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 503
