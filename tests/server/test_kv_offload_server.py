"""`nanovllm serve --kv-offloading-dir`: a server killed (-9) and started again reads the prompt's
blocks from the directory and answers as it did cold, saying so in usage and /metrics."""
import os
import signal
import socket
import subprocess
import sys

import pytest

httpx = pytest.importorskip("httpx")

from process_helpers import stop, wait_until  # noqa: E402
from server_fixtures import wait_for_health  # noqa: E402

PROMPT = [(7 * i + 3) % 250 + 3 for i in range(100)]  # 6 full blocks of 16


def serve(model: str, root: str, port: int) -> subprocess.Popen:
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "nanovllm.cli", "serve", model, "--port", str(port), "--max-model-len", "256",
           "--kvcache-block-size", "16", "--cpu-kvcache-bytes", str(128 * 16384), "--log-level", "warning", "--served-model-name", "m",
           "--kv-offloading-dir", root, "--kv-offloading-dir-size", "0.01"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def ask(url: str) -> dict:
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 3}
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_killed_server_restarts_from_the_directory(qwen3_gqa, tmp_path):
    root = str(tmp_path / "tier")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = serve(qwen3_gqa, root, port)
    try:
        wait_for_health(proc, url)
        cold = ask(url)
        assert cold["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        # every full block written (the prompt's six and the first of its completion's tokens)
        assert wait_until(lambda: metric(url, "vllm:kv_offload_store_bytes_total") > 0
                          and len(os.listdir(os.path.join(root, next(d for d in os.listdir(root)
                                                                     if not d.startswith("."))))) >= 6, 30)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        stop(proc)
    proc = serve(qwen3_gqa, root, port)
    try:
        wait_for_health(proc, url)
        warm = ask(url)
        assert warm["usage"]["prompt_tokens_details"] == {"cached_tokens": 6 * 16}
        assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
        mine, theirs = warm["choices"][0]["logprobs"], cold["choices"][0]["logprobs"]
        assert mine["tokens"] == theirs["tokens"]
        assert mine["token_logprobs"] == pytest.approx(theirs["token_logprobs"], abs=1e-4)
        assert metric(url, "vllm:external_prefix_cache_hits_total") == 6 * 16
        assert metric(url, "vllm:external_prefix_cache_queries_total") == 6 * 16
        assert metric(url, "vllm:kv_offload_load_bytes_total") > 0
    finally:
        stop(proc)
    assert proc.returncode == 0
