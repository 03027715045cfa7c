"""SamplingParams: vLLM's defaults and normalisations, and one validation error per field."""
import dataclasses
import logging

import pytest

from nanovllm import SamplingParams


def test_defaults_follow_vllm():
    sp = SamplingParams()
    expected = dict(n=1, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=None, stop=[],
                    stop_token_ids=[], ignore_eos=False, min_tokens=0, logprobs=None,
                    repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                    skip_special_tokens=True, include_stop_str_in_output=False)
    assert {k: getattr(sp, k) for k in expected} == expected
    assert sp.max_tokens == 64  # the project's default (vLLM's is 16)
    assert not sp.is_greedy and not sp.has_penalties


def test_existing_callers_keep_working():
    sp = SamplingParams(temperature=0.6, max_tokens=256, ignore_eos=True)
    assert (sp.temperature, sp.max_tokens, sp.ignore_eos) == (0.6, 256, True)
    assert SamplingParams(0.0, 8).is_greedy
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_normalisations():
    greedy = SamplingParams(temperature=0, top_k=5, top_p=0.5, min_p=0.3)
    assert greedy.is_greedy and (greedy.top_k, greedy.top_p, greedy.min_p) == (0, 1.0, 0.0)
    assert SamplingParams(temperature=1e-6).is_greedy
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="###").stop == ["###"]
    stops = ["a", "b"]
    sp = SamplingParams(stop=stops, stop_token_ids=(3, 4))
    stops.append("c")  # the params keep their own copy
    assert sp.stop == ["a", "b"] and sp.stop_token_ids == [3, 4]
    assert SamplingParams(presence_penalty=1).has_penalties
    assert SamplingParams(repetition_penalty=1.2).has_penalties


def test_tiny_positive_temperature_is_raised_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="nanovllm.sampling_params"):
        sp = SamplingParams(temperature=1e-3)
    assert sp.temperature == 1e-2 and not sp.is_greedy
    assert "temperature" in caplog.text


def test_replace_revalidates():
    sp = SamplingParams(n=3, seed=5, stop="x")
    child = dataclasses.replace(sp, n=1, seed=6)
    assert (child.n, child.seed, child.stop) == (1, 6, ["x"])
    with pytest.raises(ValueError, match="top_p"):
        dataclasses.replace(sp, top_p=0.0)


BAD = [
    # (field, value, exception, words the message must contain)
    ("temperature", -0.5, ValueError, ["temperature", "-0.5"]),
    ("temperature", "hot", TypeError, ["temperature", "'hot'"]),
    ("temperature", float("nan"), ValueError, ["temperature", "nan"]),
    ("temperature", float("inf"), ValueError, ["temperature", "inf"]),
    ("max_tokens", 0, ValueError, ["max_tokens", "0"]),
    ("max_tokens", 2.5, TypeError, ["max_tokens", "2.5"]),
    ("ignore_eos", 1, TypeError, ["ignore_eos", "1"]),
    ("n", 0, ValueError, ["n must", "0"]),
    ("n", "2", TypeError, ["n must", "'2'"]),
    ("top_p", 0.0, ValueError, ["top_p", "0.0"]),
    ("top_p", 1.5, ValueError, ["top_p", "1.5"]),
    ("top_p", None, TypeError, ["top_p", "None"]),
    ("top_k", -2, ValueError, ["top_k", "-2"]),
    ("top_k", 3.0, TypeError, ["top_k", "3.0"]),
    ("min_p", -0.1, ValueError, ["min_p", "-0.1"]),
    ("min_p", 1.1, ValueError, ["min_p", "1.1"]),
    ("seed", 1.5, TypeError, ["seed", "1.5"]),
    ("seed", True, TypeError, ["seed", "True"]),
    ("min_tokens", -1, ValueError, ["min_tokens", "-1"]),
    ("min_tokens", 100, ValueError, ["min_tokens", "100", "max_tokens"]),
    ("min_tokens", "3", TypeError, ["min_tokens", "'3'"]),
    ("stop", 5, TypeError, ["stop", "5"]),
    ("stop", ["ok", 7], TypeError, ["stop", "7"]),
    ("stop", ["ok", ""], ValueError, ["stop", "empty"]),
    ("stop_token_ids", 3, TypeError, ["stop_token_ids", "3"]),
    ("stop_token_ids", [1, "2"], TypeError, ["stop_token_ids", "'2'"]),
    ("stop_token_ids", [1, -2], ValueError, ["stop_token_ids", "-2"]),
    ("include_stop_str_in_output", "yes", TypeError, ["include_stop_str_in_output", "'yes'"]),
    ("repetition_penalty", 0.0, ValueError, ["repetition_penalty", "0.0"]),
    ("repetition_penalty", "x", TypeError, ["repetition_penalty", "'x'"]),
    ("presence_penalty", 2.5, ValueError, ["presence_penalty", "2.5"]),
    ("presence_penalty", float("nan"), ValueError, ["presence_penalty", "nan"]),
    ("frequency_penalty", -3, ValueError, ["frequency_penalty", "-3"]),
    ("logprobs", -1, ValueError, ["logprobs", "-1"]),
    ("logprobs", 2.0, TypeError, ["logprobs", "2.0"]),
    ("prompt_logprobs", -1, ValueError, ["prompt_logprobs", "[0, 20]", "-1"]),
    ("prompt_logprobs", 21, ValueError, ["prompt_logprobs", "[0, 20]", "21"]),
    ("prompt_logprobs", 2.0, TypeError, ["prompt_logprobs", "2.0"]),
    ("skip_special_tokens", None, TypeError, ["skip_special_tokens", "None"]),
    ("spaces_between_special_tokens", 1, TypeError, ["spaces_between_special_tokens", "1"]),
    ("structured_outputs", {"regex": "a"}, TypeError, ["structured_outputs", "dict"]),
]


@pytest.mark.parametrize("field,value,exc,words", BAD, ids=[f"{b[0]}={b[1]!r}" for b in BAD])
def test_each_field_rejects_bad_values(field, value, exc, words):
    kwargs = {field: value}
    if field == "min_tokens" and value == 100:
        kwargs["max_tokens"] = 10
    with pytest.raises(exc) as info:
        SamplingParams(**kwargs)
    for word in words:
        assert word in str(info.value)


# Fields that also take None say so in words, in the order "must be X, or None for Y, got V".
NONE_MEANS = [
    ("max_tokens", 0, ValueError, "max_tokens must be >= 1, or None for no limit, got 0"),
    ("max_tokens", 2.5, TypeError, "max_tokens must be an int, or None for no limit, got float 2.5"),
    ("logprobs", -1, ValueError, "logprobs must be >= 0, or None for no logprobs, got -1"),
    ("logprobs", "3", TypeError, "logprobs must be an int, or None for no logprobs, got str '3'"),
    ("seed", 1.5, TypeError, "seed must be an int, or None for no per-request seed, got float 1.5"),
    ("top_k", -2, ValueError, "top_k must be >= 1, or 0 or -1 for no top-k, got -2"),
    ("stop", 5, TypeError, "stop must be a string, a list of strings or None, got int 5"),
    ("stop_token_ids", 3, TypeError, "stop_token_ids must be a list of ints or None, got int 3"),
    ("structured_outputs", "a", TypeError,
     "structured_outputs must be a StructuredOutputsParams, or None for no constraint, got str 'a'"),
]


@pytest.mark.parametrize("field,value,exc,message", NONE_MEANS, ids=[f"{n[0]}={n[1]!r}" for n in NONE_MEANS])
def test_messages_say_what_none_means(field, value, exc, message):
    with pytest.raises(exc) as info:
        SamplingParams(**{field: value})
    assert str(info.value) == message


def test_every_field_has_a_validation_case():
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert fields == {b[0] for b in BAD}


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="best_of_all"):
        SamplingParams(best_of_all=2)
