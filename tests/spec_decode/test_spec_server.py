"""Speculation behind the OpenAI server: completions through the official client equal those of
a server without it, and /metrics carries vLLM's spec_decode counters (read with
prometheus_client's own parser); a bad --speculative-config stops `nanovllm serve` before it
starts, with one line naming the field."""
import pytest

from server_fixtures import ENGINE_OPTIONS, MODEL, httpx, openai, serve_engine  # noqa: F401

from nanovllm import LLM
from nanovllm.entrypoints.openai_server import build_app

from cli_helpers import one_error_line, run

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PROMPTS = ["the quick brown fox the quick brown fox the quick", "seven bright stars", "a lazy dog a lazy dog"]


def completions(llm: LLM) -> tuple[list[str], str]:
    with serve_engine(llm, [lambda engine: build_app(engine, MODEL)]) as (_, (url,)):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        texts = [client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0,
                                           extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS]
        metrics = httpx.get(url + "/metrics", timeout=10).text
    return texts, metrics


def test_completions_and_metrics(qwen3_gqa):
    from prometheus_client.parser import text_string_to_metric_families

    plain, plain_metrics = completions(LLM(qwen3_gqa, **ENGINE_OPTIONS))
    spec, metrics = completions(LLM(qwen3_gqa, speculative_config=NGRAM, **ENGINE_OPTIONS))
    assert spec == plain
    assert "spec_decode" not in plain_metrics
    samples = {(s.name, s.labels.get("position")): s.value
               for family in text_string_to_metric_families(metrics) for s in family.samples
               if s.name.startswith("vllm:spec_decode") and s.name.endswith("_total")}
    drafts = samples[("vllm:spec_decode_num_drafts_total", None)]
    proposed = samples[("vllm:spec_decode_num_draft_tokens_total", None)]
    accepted = samples[("vllm:spec_decode_num_accepted_tokens_total", None)]
    emitted = samples[("vllm:spec_decode_num_emitted_tokens_total", None)]
    per_position = [samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(j))] for j in range(4)]
    assert 0 < accepted <= proposed
    assert emitted == accepted + drafts
    assert sum(per_position) == accepted
    assert per_position == sorted(per_position, reverse=True)  # position j is accepted only after j - 1


@pytest.mark.parametrize("config, words", [
    ('{"method": "bogus", "num_speculative_tokens": 2}', "speculative_config.method must be one of"),
    ('{"method": "ngram", "num_speculative_tokens": 99}', "num_speculative_tokens must be in [1, 16]"),
    ('{"model": "/no/such/draft", "num_speculative_tokens": 2}', "speculative_config.model: "),
    ('{"method": "ngram"', "argument --speculative-config: not valid JSON"),
])
def test_bad_config_stops_the_server_before_it_starts(qwen3_gqa, tmp_path, config, words):
    line = one_error_line(run("-m", "nanovllm.cli", "serve", qwen3_gqa, "--speculative-config", config,
                              "--log-level", "warning", cache=tmp_path))
    assert line.startswith("nanovllm serve: error: ") and words in line
