"""The OpenAI-compatible server's error paths: malformed or invalid requests get a 400 naming what
was wrong, a missing or wrong API key a 401, and a failing engine step fails only its own
requests; after each, the server keeps serving the others.
"""
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from nanovllm import SamplingParams  # noqa: E402

from server_fixtures import (  # noqa: E402,F401  (client, ref_llm, served are fixtures)
    API_KEY, MODEL, client, ref_llm, served, wait_all_blocks_free)

def post(url: str, body, headers: dict | None = None) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(url, content=body, headers={"content-type": "application/json", **(headers or {})})
    return httpx.post(url, json=body, headers=headers)


BAD_REQUESTS = [
    ("/v1/completions", b'{"model": "tiny-qwen3", "prompt": "the fox"', "not valid JSON"),
    ("/v1/completions", b'["the fox"]', "JSON object"),
    ("/v1/completions", {"model": MODEL}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "the fox", "temperature": -1}, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "the fox", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "the fox", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "the fox", "max_tokens": 2.5}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "the fox", "max_tokenz": 5},
     "max_tokenz: unknown field; did you mean 'max_tokens'?"),
    ("/v1/completions", {"model": MODEL, "prompt": "the fox", "temprature": 0.5},
     "temprature: unknown field; did you mean 'temperature'?"),
    ("/v1/completions", {"model": MODEL, "prompt": "the fox", "qqqqq": 1}, "qqqqq: unknown field"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokenz": 4}, "did you mean 'max_completion_tokens'?"),
    ("/v1/completions", {"model": MODEL, "prompt": "the fox", "top_p": 0}, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "the fox", "top_k": -2}, "top_k"),
    ("/v1/completions", {"model": MODEL, "prompt": "the fox", "n": 0}, "n must be"),
    ("/v1/completions", {"model": MODEL, "prompt": "the fox", "stop": ["ok", ""]}, "empty string"),
    ("/v1/completions", {"model": MODEL, "prompt": "the fox", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "the fox", "presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "the fox", "stop_token_ids": [100000]}, "vocabulary"),
    ("/v1/completions", {"model": MODEL, "prompt": "the fox", "logit_bias": {"5": 1.0}}, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "the fox", "echo": True, "stream": True}, "echo"),
    ("/v1/completions", {"model": MODEL, "prompt": "the fox", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, "empty"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, "empty"),
    ("/v1/completions", {"model": MODEL, "prompt": [3, 99999]}, "outside the vocabulary"),
    # An unknown model is a 404 (tests/server/test_server_routes.py).
    ("/v1/completions", {"model": MODEL, "prompt": "fox " * 300}, "max_model_len"),
    ("/v1/completions", {"model": MODEL, "prompt": ["the fox", ""], "stream": True}, "empty"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "hi"}]}, "role"),
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
    real_run = llm.llm_engine.model_runner.run

    def run(out):
        if any(POISON in seq.prompt_token_ids for seq in out.seqs):
            raise RuntimeError("poisoned batch")
        return real_run(out)

    monkeypatch.setattr(llm.llm_engine.model_runner, "run", run)
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
