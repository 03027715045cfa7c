"""vLLM's request surface beyond OpenAI's: continuous_usage_stats, /tokenize and /detokenize,
/version, /metrics (Prometheus); an unknown model is OpenAI's 404; /openapi.json documents the
error bodies; `nanovllm serve` without MODEL serves the default model.
"""
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
prometheus_client = pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from nanovllm import SamplingParams  # noqa: E402

from server_fixtures import (  # noqa: E402,F401  (client, ref_llm, served are fixtures)
    MODEL, client, ref_llm, served, wait_all_blocks_free)

MESSAGES = [{"role": "system", "content": "old quiet rivers"}, {"role": "user", "content": "where do people talk"}]


def test_unknown_model_is_404_model_not_found(served, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="the fox", max_tokens=2)
    assert e.value.status_code == 404
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    assert "'gpt-4' does not exist" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=MESSAGES, max_tokens=2)
    r = httpx.post(served[1] + "/tokenize", json={"model": "other", "prompt": "fox"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("n", [1, 2])
def test_continuous_usage_stats_in_every_chunk(client, ref_llm, n):
    prompt = "the quick brown fox"
    ref = ref_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                           use_tqdm=False)[0]
    chunks = list(client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=0, n=n, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12 * n
    num_prompt = len(ref["prompt_token_ids"])
    seen = 0  # tokens streamed so far, by hand from each chunk's logprobs
    for chunk in chunks[:-1]:
        seen += len(chunk.choices[0].logprobs.tokens)
        assert chunk.usage.prompt_tokens == num_prompt
        assert chunk.usage.completion_tokens == seen
        assert chunk.usage.total_tokens == num_prompt + seen
    assert seen == 12 * n
    if n == 1:
        assert "".join(c.choices[0].text for c in chunks[:-1]) == ref["text"]


def test_continuous_usage_stats_in_chat_and_only_with_include_usage(client, ref_llm):
    num_prompt = len(ref_llm.apply_chat_template(MESSAGES))
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, stream=True, logprobs=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (chunks[0].usage.prompt_tokens, chunks[0].usage.completion_tokens) == (num_prompt, 0)
    seen = 0
    for chunk in chunks[1:-1]:
        seen += len(chunk.choices[0].logprobs.content) if chunk.choices[0].logprobs else 0
        assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens) == (num_prompt, seen)
    assert seen == 6 and chunks[-1].usage.completion_tokens == 6
    # As in vLLM, continuous_usage_stats alone (without include_usage) adds no usage.
    plain = list(client.completions.create(model=MODEL, prompt="fox", max_tokens=3, stream=True,
                                           stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in plain)


def test_tokenize_and_detokenize_round_trip(served, client, ref_llm):
    url = served[1]
    prompt = "the quick brown fox jumps"
    r = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": prompt})
    assert r.status_code == 200, r.text
    expected = ref_llm.tokenizer.encode(prompt)
    assert r.json() == {"count": len(expected), "max_model_len": 256, "tokens": expected}
    assert httpx.post(url + "/detokenize", json={"tokens": expected}).json() == \
        {"prompt": ref_llm.tokenizer.decode(expected)}
    assert ref_llm.tokenizer.decode(expected) == prompt

    with_strs = httpx.post(url + "/tokenize", json={"prompt": prompt, "return_token_strs": True}).json()
    assert with_strs["token_strs"] == ref_llm.tokenizer.convert_ids_to_tokens(expected)

    chat = httpx.post(url + "/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == ref_llm.apply_chat_template(MESSAGES)
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert chat["count"] == out.usage.prompt_tokens
    bare = httpx.post(url + "/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert bare["tokens"] == ref_llm.tokenizer.encode(
        ref_llm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=False))
    assert bare["count"] < chat["count"]


@pytest.mark.parametrize("path, request_body, words", [
    ("/tokenize", {"prompt": "fox", "messages": MESSAGES}, "exactly one of prompt and messages"),
    ("/tokenize", {}, "exactly one of prompt and messages"),
    ("/tokenize", {"prompt": "fox", "extra": 1}, "extra"),
    ("/detokenize", {"tokens": [3, 100000]}, "outside the vocabulary"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
])
def test_tokenize_errors_are_400(served, path, request_body, words):
    r = httpx.post(served[1] + path, json=request_body)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]


def test_version(served):
    from importlib.metadata import version

    r = httpx.get(served[1] + "/version")
    assert r.status_code == 200 and r.json() == {"version": version("nano-vllm")}


def scrape(url: str) -> dict:
    """{(metric family name, sample name, labels as a tuple): value} from /metrics."""
    r = httpx.get(url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def test_metrics_move_by_the_exact_numbers_of_a_request(served, client, ref_llm):
    engine, url, _ = served
    wait_all_blocks_free(engine)
    label = (("model_name", MODEL),)
    before = scrape(url)
    assert before[("vllm:num_requests_running", label)] == 0
    assert before[("vllm:num_requests_waiting", label)] == 0
    assert before[("vllm:kv_cache_usage_perc", label)] == 0

    prompts = ["seven bright stars", "the city of paris in spring"]
    num_prompt = sum(len(ref_llm.tokenizer.encode(p)) for p in prompts)
    client.completions.create(model=MODEL, prompt=prompts, max_tokens=7, n=2, extra_body={"ignore_eos": True})
    streamed = client.completions.create(model=MODEL, prompt="fox", max_tokens=5, stream=True,
                                         extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed)
    after = scrape(url)

    def moved(name: str, labels: tuple = label) -> float:
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert moved("vllm:prompt_tokens_total") == num_prompt + 1
    assert moved("vllm:generation_tokens_total") == 4 * 7 + 5
    assert moved("vllm:time_to_first_token_seconds_count") == 4 + 1  # one per completion
    assert moved("vllm:inter_token_latency_seconds_count") == 4 * 6 + 4  # every later token
    assert moved("vllm:e2e_request_latency_seconds_count") == 2  # one per HTTP request
    assert moved("vllm:e2e_request_latency_seconds_sum") > 0
    inf = label + (("le", "+Inf"),)
    assert after[("vllm:time_to_first_token_seconds_bucket", tuple(sorted(inf)))] == \
        after[("vllm:time_to_first_token_seconds_count", label)]


def test_metrics_gauges_see_a_running_request(served, client, monkeypatch):
    """While a stream is open its sequence runs and holds KV blocks; the gauges say so."""
    engine, url, _ = served
    wait_all_blocks_free(engine)
    real_run = engine.llm.llm_engine.model_runner.run

    def slow_run(out):  # the request surely outlives the scrape
        time.sleep(0.02)
        return real_run(out)

    monkeypatch.setattr(engine.llm.llm_engine.model_runner, "run", slow_run)
    label = (("model_name", MODEL),)
    stream = client.completions.create(model=MODEL, prompt="fox " * 40, max_tokens=200, stream=True,
                                       extra_body={"ignore_eos": True})
    next(stream)
    during = scrape(url)
    stream.close()
    wait_all_blocks_free(engine)
    monkeypatch.undo()
    running = during[("vllm:num_requests_running", label)] + during[("vllm:num_requests_waiting", label)]
    assert running == 1
    assert 0 < during[("vllm:kv_cache_usage_perc", label)] <= 1


def test_openapi_documents_the_error_bodies(served):
    schema = httpx.get(served[1] + "/openapi.json").json()
    for path, body in [("/v1/completions", "ErrorResponse"), ("/v1/chat/completions", "ErrorResponse"),
                       ("/v1/responses", "ErrorResponse"), ("/v1/messages", "AnthropicError")]:
        responses = schema["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "404", "413"} <= set(responses)
        assert "422" not in responses  # validation errors are sent as 400
        ref = responses["400"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith("/" + body)
    error = schema["components"]["schemas"]["ErrorInfo"]
    assert set(error["properties"]) == {"message", "type", "param", "code"}
    assert {"/tokenize", "/detokenize", "/version", "/metrics"} <= set(schema["paths"])


def test_serve_without_model_uses_the_default_model(monkeypatch, qwen3_gqa):
    import nanovllm.utils.default_model as default_model
    from nanovllm.cli import build_parser, model_path

    asked = []
    monkeypatch.setattr(default_model, "default_model", lambda cache_dir=None, device="auto": asked.append(device)
                        or qwen3_gqa)
    monkeypatch.setattr(default_model, "default_model_path", lambda cache_dir=None: "folder")
    args = build_parser().parse_args(["serve", "--port", "9"])
    assert args.model is None and model_path(args) == qwen3_gqa and asked == ["auto"]
    assert model_path(build_parser().parse_args(["serve", "--device", "cpu"])) == qwen3_gqa and asked[-1] == "cpu"
    # quantizing at load needs the dense weights: the converted folder
    assert model_path(build_parser().parse_args(["serve", "--quantization", "q8_0"])) == "folder"
    assert model_path(build_parser().parse_args(["serve", "/some/dir"])) == "/some/dir"


def test_the_default_model_is_served_by_its_name(monkeypatch, qwen3_gqa):
    """Without MODEL the server answers to SmolLM2-135M-Instruct (its cache folder still accepted);
    --served-model-name wins; a given MODEL is served as given."""
    import nanovllm.utils.default_model as default_model
    from nanovllm.cli import build_parser, model_path, served_names

    monkeypatch.setattr(default_model, "default_model", lambda cache_dir=None, device="auto": qwen3_gqa)
    args = build_parser().parse_args(["serve"])
    assert served_names(args, model_path(args)) == ("SmolLM2-135M-Instruct", (qwen3_gqa,))
    args = build_parser().parse_args(["serve", "--served-model-name", "mine"])
    assert served_names(args, model_path(args)) == ("mine", ())
    args = build_parser().parse_args(["serve", "/some/dir"])
    assert served_names(args, model_path(args)) == ("/some/dir", ())


def test_model_may_be_left_out_or_named_by_an_alias(served, ref_llm, qwen3_gqa):
    """vLLM's rule with one model served: no `model` means that one; an alias (the default model's
    folder) is accepted too, and answers carry the served name."""
    from nanovllm.entrypoints.lora_routes import ServedModels
    from nanovllm.entrypoints.openai_server import ApiError
    url = served[1]
    ref = ref_llm.generate(["the fox"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    r = httpx.post(url + "/v1/completions", json={"prompt": "the fox", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == MODEL and r.json()["choices"][0]["text"] == ref["text"]
    r = httpx.post(url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == MODEL
    served_models = ServedModels("SmolLM2-135M-Instruct", (qwen3_gqa,))
    assert served_models.resolve(qwen3_gqa) is None and served_models.resolve(None) is None  # the base model
    with pytest.raises(ApiError, match=r"'other' does not exist; this server serves \['SmolLM2-135M-Instruct'\]"):
        served_models.resolve("other")
