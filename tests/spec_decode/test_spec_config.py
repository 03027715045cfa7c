"""speculative_config: every bad value is a clear ValueError before anything starts; the n-gram
lookup against a brute-force search."""
import random

import numpy as np
import pytest

from nanovllm import LLM
from nanovllm.spec_decode.config import SpeculativeConfig
from nanovllm.spec_decode.ngram import find_continuation

from helpers import make_qwen3


@pytest.mark.parametrize("value, words", [
    ({"method": "medusa2", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "eagle3", "num_speculative_tokens": 2}, "not built yet"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be in [1, 16]"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens must be in [1, 16]"),
    ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens must be an int"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
     "prompt_lookup_min (5) must be <= prompt_lookup_max (3)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "for method 'draft_model'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown key(s) ['lookahead']"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
    ("ngram", "must be a dict"),
])
def test_bad_fields_are_named(value, words):
    with pytest.raises(ValueError) as e:
        SpeculativeConfig.parse(value)
    assert words in str(e.value)


def test_defaults_and_vllm_shorthand():
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_max, c.prompt_lookup_min, c.disable_by_batch_size) == (4, 2, 16)
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 1})
    assert (c.prompt_lookup_max, c.prompt_lookup_min) == (1, 1)
    c = SpeculativeConfig.parse({"model": "/some/draft", "num_speculative_tokens": 5})  # method from "model"
    assert (c.method, c.model) == ("draft_model", "/some/draft")


def test_bad_drafts_are_refused_before_anything_starts(qwen3_gqa, tmp_path, monkeypatch):
    started = []

    def runner(config):
        started.append(config)
        raise RuntimeError("a model runner was started")
    monkeypatch.setattr("nanovllm.engine.llm_engine.ModelRunner", runner)
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError, match="speculative_config.model: .*no-such-model"):
        LLM(qwen3_gqa, speculative_config={"method": "draft_model", "model": missing, "num_speculative_tokens": 2})
    other = make_qwen3(str(tmp_path / "other_vocab"), vocab_size=320)
    with pytest.raises(ValueError, match="vocabulary of 320 tokens, the target 256"):
        LLM(qwen3_gqa, speculative_config={"method": "draft_model", "model": other, "num_speculative_tokens": 2})
    assert started == []


def brute_force(tokens: list[int], n_max: int, n_min: int, k: int) -> list[int]:
    for n in range(n_max, n_min - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest earlier occurrence first
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_find_continuation_matches_brute_force():
    rng = random.Random(0)
    cases = 0
    for _ in range(3000):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        n_max = rng.randrange(1, 6)
        n_min = rng.randrange(1, n_max + 1)
        k = rng.randrange(1, 6)
        want = brute_force(tokens, n_max, n_min, k)
        assert find_continuation(np.asarray(tokens), n_max, n_min, k) == want, (tokens, n_max, n_min, k)
        cases += bool(want)
    assert cases > 1000  # most cases had a match to find


def test_find_continuation_prefers_the_longest_then_latest_match():
    #            0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 9, 5, 2, 3, 8, 7, 1, 2, 3]
    assert find_continuation(np.asarray(tokens), 3, 1, 2) == [9, 5]  # "1 2 3" at 0 beats "2 3" at 5
    assert find_continuation(np.asarray(tokens), 2, 1, 2) == [8, 7]  # "2 3": the latest, at 5
    assert find_continuation(np.asarray([4, 5, 6]), 3, 1, 2) == []
