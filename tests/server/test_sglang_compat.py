"""What sglang-router needs of a worker (entrypoints/sglang_compat.py): SGLang's probe routes, and
the request fields the router adds to every request, each honoured or a 400 naming it."""
import pytest

httpx = pytest.importorskip("httpx")

from nanovllm import SamplingParams  # noqa: E402

from server_fixtures import ENGINE_OPTIONS, MODEL, client, ref_llm, served  # noqa: E402,F401  (fixtures)

PROMPTS = ["the quick brown fox", "seven bright stars shine", "old quiet rivers and small", "people talk near"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# The bodies sglang-router 0.3.2 sends for a plain client request (logged from a worker): it adds
# every one of these fields itself.
ROUTER_COMPLETION = {"prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0.0, "stream": False,
                     "echo": False, "no_stop_trim": False, "ignore_eos": True, "skip_special_tokens": True,
                     "return_hidden_states": False}
ROUTER_CHAT = {"messages": [{"role": "user", "content": "the quick brown fox"}], "logprobs": False,
               "max_completion_tokens": 8, "stream": False, "temperature": 0.0, "no_stop_trim": False,
               "ignore_eos": True, "continue_final_message": False, "skip_special_tokens": True,
               "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False}


def test_probe_routes_answer_sglangs_fields(served, qwen3_gqa):
    url = served[1]
    info = httpx.get(url + "/model_info").json()
    assert info == httpx.get(url + "/get_model_info").json()
    assert info["model_path"] == info["tokenizer_path"] == qwen3_gqa
    assert info["is_generation"] is True and info["served_model_name"] == MODEL
    server = httpx.get(url + "/server_info").json()
    assert server == httpx.get(url + "/get_server_info").json()
    assert {k: server[k] for k in info} == info
    assert (server["context_length"], server["page_size"], server["dp_size"], server["tp_size"]) == (256, 16, 1, 1)
    # blocks of 16 tokens x 2 layers x (K, V) x 2 KV heads x 32 dims x 2 bytes (kv_cache_dtype auto: float16)
    assert server["max_total_num_tokens"] == ENGINE_OPTIONS["cpu_kvcache_bytes"] // 8192 * 16
    assert server["version"] == httpx.get(url + "/version").json()["version"]


def test_fields_the_router_adds_are_accepted(served, ref_llm):
    ref = ref_llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0]["text"]
    out = httpx.post(served[1] + "/v1/completions", json={"model": MODEL, **ROUTER_COMPLETION}, timeout=60)
    assert out.status_code == 200 and out.json()["choices"][0]["text"] == ref
    chat_ref = ref_llm.chat([ROUTER_CHAT["messages"]], GREEDY, use_tqdm=False)[0]["text"]
    out = httpx.post(served[1] + "/v1/chat/completions", json={"model": MODEL, **ROUTER_CHAT}, timeout=60)
    assert out.status_code == 200 and out.json()["choices"][0]["message"]["content"] == chat_ref
    # Both values of the reasoning fields leave the text whole (no reasoning parser, as in SGLang without one).
    flipped = {**ROUTER_CHAT, "separate_reasoning": False, "stream_reasoning": False}
    out = httpx.post(served[1] + "/v1/chat/completions", json={"model": MODEL, **flipped}, timeout=60)
    assert out.status_code == 200 and out.json()["choices"][0]["message"]["content"] == chat_ref


@pytest.mark.parametrize("route, body, named", [
    ("/v1/completions", {**ROUTER_COMPLETION, "return_hidden_states": True}, "return_hidden_states"),
    ("/v1/chat/completions", {**ROUTER_CHAT, "return_hidden_states": True}, "return_hidden_states"),
    ("/v1/completions", {**ROUTER_COMPLETION, "no_stop_trim": True, "include_stop_str_in_output": False},
     "no_stop_trim"),
    # Still unknown: fields the router adds only to chat, SGLang's other fields, anything else.
    ("/v1/completions", {**ROUTER_COMPLETION, "separate_reasoning": True}, "separate_reasoning"),
    ("/v1/completions", {**ROUTER_COMPLETION, "regex": "a+"}, "regex"),
    ("/v1/chat/completions", {**ROUTER_CHAT, "lora_path": "x"}, "lora_path"),
])
def test_unsupported_sglang_values_are_400_naming_the_field(served, route, body, named):
    out = httpx.post(served[1] + route, json={"model": MODEL, **body}, timeout=60)
    assert out.status_code == 400 and named in out.json()["error"]["message"]


def test_no_stop_trim_keeps_the_stop_string(client, ref_llm):
    words = ref_llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)[0]["text"].split(" ")
    stop = words[2]
    ref = ref_llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=stop,
                                                        include_stop_str_in_output=True), use_tqdm=False)[0]
    assert ref["text"].endswith(stop)
    out = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0, stop=stop,
                                    extra_body={"ignore_eos": True, "no_stop_trim": True})
    assert (out.choices[0].text, out.choices[0].finish_reason) == (ref["text"], "stop")
