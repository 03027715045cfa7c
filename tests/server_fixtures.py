"""Shared pieces of the server tests: an in-process uvicorn server over one AsyncEngine, the
offline reference engine, the openai client, and probes of the engine thread."""
import asyncio
import json
import socket
import threading
import time
from contextlib import contextmanager

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


def wait_for_health(proc, url: str, timeout_s: float = 90) -> None:
    """Wait until a `nanovllm serve` subprocess answers /health; fail with its output if it exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.monotonic() < deadline, "server did not come up"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)


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
    apps = [lambda engine: build_app(engine, MODEL), lambda engine: build_app(engine, MODEL, api_key=API_KEY)]
    with serve_engine(LLM(qwen3_gqa, **ENGINE_OPTIONS), apps) as (engine, (open_url, keyed_url)):
        yield engine, open_url, keyed_url


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0, timeout=60)


@contextmanager
def serve_engine(llm, apps):
    """AsyncEngine over llm and one Server per app builder (engine -> app); yields the servers'
    URLs, then stops the servers, the engine thread and the engine."""
    engine = AsyncEngine(llm).start()
    servers = [Server(make_app(engine)) for make_app in apps]
    try:
        yield engine, [server.url for server in servers]
    finally:
        for server in servers:
            server.stop()
        engine.shutdown(timeout=10)
        llm.exit()


def probe(engine: AsyncEngine, fn):
    """fn(llm), run on the engine thread between steps."""
    async def ask():
        return await engine.call(fn)
    return asyncio.run(ask())


def num_free_blocks(engine: AsyncEngine) -> tuple[int, int]:
    return probe(engine, lambda llm: (llm.llm_engine.scheduler.kv_cache_manager.num_free_blocks, llm.llm_engine.num_kvcache_blocks))


def wait_all_blocks_free(engine: AsyncEngine, timeout: float = 20.0) -> None:
    """Aborts reach the engine a moment after the client hangs up: wait, bounded."""
    deadline = time.monotonic() + timeout
    while True:
        free, total = num_free_blocks(engine)
        if free == total or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert (free, total) == (total, total)
    assert probe(engine, lambda llm: llm.llm_engine.is_finished())


def prompt_of(i: int) -> str:
    return " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(3 + i % 5))
