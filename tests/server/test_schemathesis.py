"""Schemathesis fuzzes the server from its own /openapi.json (a bounded run; the full one is
scripts/check_schemathesis.sh): no 5xx, only documented statuses, content types, headers and
bodies, schema-invalid requests refused with a 4xx, a 405 with Allow for an undeclared method.
"""
import os
import re
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("schemathesis")
pytest.importorskip("uvicorn")

from nanovllm import LLM  # noqa: E402
from nanovllm.entrypoints.async_engine import AsyncEngine  # noqa: E402
from nanovllm.entrypoints.limits import ServerLimits  # noqa: E402
from nanovllm.entrypoints.openai_server import build_app  # noqa: E402

from server_fixtures import MODEL, Server  # noqa: E402

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# NOTE: positive_data_acceptance ("every schema-valid request gets a 2xx") is left out, here and in
# scripts/check_schemathesis.sh: the server rightly refuses, with a documented 400, requests no JSON
# schema can describe: constraints across fields (top_logprobs needs logprobs, exactly one of prompt
# and messages in /tokenize, min_tokens <= max_tokens, prompt + max_tokens within max_model_len,
# prompts x n within --max-prompts), bounds known only from the model or the flags (token ids below
# the vocabulary size, n <= --max-n), a chat template's own refusals, and `1.0` as a token id (JSON
# Schema counts it as an integer; token ids stay strictly ints so `true` or `1.5` never pass).
# ignored_auth needs a server with --api-key: the script runs that pass.
EXCLUDED = "positive_data_acceptance,ignored_auth"


@pytest.fixture(scope="module")
def server_url(qwen3_gqa):
    # Short generations: chat without max_tokens runs to max_model_len, so keep it small; few
    # prompts and completions per request (the fuzzer asks for the limits it finds).
    llm = LLM(qwen3_gqa, kvcache_block_size=16, max_model_len=64, cpu_kvcache_bytes=128 * 16384)
    engine = AsyncEngine(llm).start()
    server = Server(build_app(engine, MODEL, limits=ServerLimits(max_n=2, max_prompts=4)))
    yield server.url
    server.stop()
    engine.shutdown(timeout=10)
    llm.exit()


def schemathesis_command() -> list[str]:
    cli = shutil.which("schemathesis") or os.path.join(os.path.dirname(sys.executable), "schemathesis")
    return [cli]


def test_server_conforms_to_its_openapi_schema(server_url, tmp_path):
    env = dict(os.environ, SCHEMATHESIS_HOOKS="schemathesis_hooks", NANOVLLM_SERVED_MODEL=MODEL,
               PYTHONPATH=TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run(
        schemathesis_command() + ["run", server_url + "/openapi.json", "--checks", "all",
                                  "--exclude-checks", EXCLUDED, "--max-examples", "15", "--seed", "1",
                                  "--workers", "1", "--request-timeout", "60", "--continue-on-failure",
                                  "--max-failures", "50", "--no-color"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)  # its cache goes to cwd
    summary = run.stdout[run.stdout.rfind("SUMMARY"):]
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    selected = re.search(r"Selected: (\d+)/(\d+)\s+Tested: (\d+)", summary)
    assert selected and len(set(selected.groups())) == 1, summary  # every operation was fuzzed


def test_findings_stay_fixed(server_url):
    """What schemathesis found, checked by hand: a 405 names the allowed methods; streamed answers'
    content type is documented; the sampling bounds are in the schema and refused in their words."""
    import httpx

    r = httpx.request("TRACE", server_url + "/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST" and "error" in r.json()
    spec = httpx.get(server_url + "/openapi.json").json()
    ok = spec["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert set(ok) == {"application/json", "text/event-stream"}
    # the JSON bodies are described, and real answers fit their description
    import jsonschema
    for path, body, model in [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                                       "logprobs": True, "top_logprobs": 2}, "ChatCompletionResponse"),
                              ("/v1/completions", {"prompt": "the fox", "max_tokens": 3, "logprobs": 2, "echo": True,
                                                   "prompt_logprobs": 1}, "CompletionResponse"),
                              ("/tokenize", {"prompt": "the fox", "return_token_strs": True}, "TokenizeResponse")]:
        documented = spec["paths"][path]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
        assert documented == {"$ref": f"#/components/schemas/{model}"}
        answer = httpx.post(server_url + path, json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        jsonschema.validate(answer.json(), {**documented, "components": spec["components"]})
    with pytest.raises(jsonschema.ValidationError):  # the description is not a schema that takes anything
        jsonschema.validate({"object": "chat.completion"}, {"$ref": "#/components/schemas/ChatCompletionResponse",
                                                             "components": spec["components"]})
    assert ok["text/event-stream"]["schema"]["properties"]["data"] == {"type": "string"}  # one event
    fields = spec["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"minimum": 0, "type": "number"} in fields["temperature"]["anyOf"]
    assert {"exclusiveMinimum": 0, "maximum": 1, "type": "number"} in fields["top_p"]["anyOf"]
    assert {"minimum": 0, "maximum": 20, "type": "integer"} in fields["logprobs"]["anyOf"]
    assert spec["paths"]["/health"]["get"]["responses"].keys() == {"200", "503"}
    body = {"model": MODEL, "prompt": "the fox", "top_p": 1.5}
    r = httpx.post(server_url + "/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"] == {
        "message": "top_p must be <= 1.0, got 1.5", "type": "invalid_request_error", "param": "top_p", "code": None}
    # The 500 it found: a tiny repetition_penalty made NaN probabilities (tests/engine/test_sampler.py).
    body = {"model": MODEL, "messages": [{"role": "user"}], "repetition_penalty": 5e-324, "max_tokens": 4}
    r = httpx.post(server_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
