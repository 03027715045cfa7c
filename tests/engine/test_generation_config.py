"""Sampling defaults from the model (vLLM's --generation-config): generation_config.json's fields,
or a GGUF file's general.sampling.* metadata, apply where a request leaves a field unset, in
LLM.generate and in the server; a field the request sets wins; "vllm" turns them off; a folder
path reads another file; the default model gets its model card's settings."""
import json
import shutil
from pathlib import Path

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.config import Config

from gguf_helpers import write_tiny

ENGINE = dict(dtype="float32", kv_cache_dtype="float32", kvcache_block_size=16, max_model_len=128)
PROMPTS = [[5, 6, 7], list(range(10, 30)), [40, 41, 42, 43]]


def with_generation_config(source: str, dest: Path, fields: dict) -> str:
    shutil.copytree(source, dest)
    config = json.loads((dest / "generation_config.json").read_text())
    (dest / "generation_config.json").write_text(json.dumps({**config, **fields}))
    return str(dest)


@pytest.fixture(scope="module")
def greedy_model(qwen3_gqa, tmp_path_factory) -> str:
    """The tiny model, its generation_config.json asking for greedy decoding and top_k 5."""
    return with_generation_config(qwen3_gqa, tmp_path_factory.mktemp("gen") / "m", {"temperature": 0.0, "top_k": 5})


def test_unset_fields_take_the_models_values_and_set_ones_win(greedy_model, qwen3_gqa):
    with LLM(greedy_model, **ENGINE) as llm:
        assert llm.config.sampling_defaults == {"temperature": 0.0, "top_k": 5}
        assert llm.get_default_sampling_params().temperature == 0.0
        unset = [o["token_ids"] for o in llm.generate(PROMPTS, use_tqdm=False)]
        greedy = [o["token_ids"] for o in llm.generate(PROMPTS, SamplingParams(temperature=0.0), use_tqdm=False)]
        hot = [o["token_ids"] for o in llm.generate(PROMPTS, SamplingParams(temperature=1.5, seed=3),
                                                    use_tqdm=False)]
    assert unset == greedy
    assert hot != greedy  # an explicit SamplingParams is taken as given
    with LLM(greedy_model, generation_config="vllm", **ENGINE) as llm:  # plain defaults
        assert llm.get_default_sampling_params().temperature == SamplingParams().temperature == 1.0
        assert llm.config.sampling_defaults == {}
    assert Config(qwen3_gqa).sampling_defaults == {}  # transformers' own file states no sampling


def test_a_folder_path_reads_another_file(qwen3_gqa, greedy_model):
    config = Config(qwen3_gqa, generation_config=greedy_model)
    assert config.sampling_defaults == {"temperature": 0.0, "top_k": 5}


@pytest.mark.parametrize("fields, source, words", [
    ({}, "/no/such/folder", "is not a folder holding a generation_config.json"),
    ({"temperature": -1.0}, "auto", "are not valid: temperature must be"),
    ({"top_p": "high"}, "auto", "are not valid: top_p must be a number"),
])
def test_bad_generation_configs_are_named(qwen3_gqa, tmp_path, fields, source, words):
    model = with_generation_config(qwen3_gqa, tmp_path / "m", fields)
    with pytest.raises(ValueError, match="generation_config") as e:
        Config(model, generation_config=source)
    assert words in str(e.value)


def test_gguf_sampling_metadata(tmp_path):
    path = write_tiny(tmp_path / "tiny.gguf", "qwen3", {}, metadata={
        "general.sampling.temp": 0.25, "general.sampling.top_k": 7, "general.sampling.top_p": 0.5})
    assert Config(str(path)).sampling_defaults == pytest.approx({"temperature": 0.25, "top_k": 7, "top_p": 0.5})
    plain = write_tiny(tmp_path / "plain.gguf", "qwen3", {})
    assert Config(str(plain)).sampling_defaults == {}


def test_the_server_applies_them(greedy_model):
    from server_fixtures import MODEL, openai, serve_engine  # noqa: F401 (skips without the server extra)
    from nanovllm.entrypoints.openai_server import build_app

    with LLM(greedy_model, **ENGINE) as ref:
        want = ref.generate(["the quick brown fox"], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    llm = LLM(greedy_model, **ENGINE)
    with serve_engine(llm, [lambda engine: build_app(engine, MODEL)]) as (_, (url,)):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        unset = client.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=12)
        hot = [client.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=12,
                                         temperature=1.5, seed=s).choices[0].text for s in range(3)]
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=8)
        chat_again = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=8)
    assert unset.choices[0].text == want[0]["text"]
    assert any(h != want[0]["text"] for h in hot)
    assert chat.choices[0].message.content == chat_again.choices[0].message.content  # greedy: the same


def test_the_default_model_gets_its_cards_settings(tmp_path):
    from nanovllm.utils.default_model import CARD_SAMPLING, default_generation_config
    folder = default_generation_config(tmp_path)
    assert json.loads((Path(folder) / "generation_config.json").read_text()) == CARD_SAMPLING == \
        {"temperature": 0.2, "top_p": 0.9}
    assert default_generation_config(tmp_path) == folder  # written once, found again


def test_override_generation_config_wins_and_sets_a_ceiling(greedy_model, qwen3_gqa):
    config = Config(greedy_model, override_generation_config={"top_k": 9, "max_new_tokens": 7})
    assert config.sampling_defaults == {"temperature": 0.0, "top_k": 9, "max_tokens": 7}  # over the model's
    assert config.max_tokens_ceiling == 7
    config = Config(greedy_model, generation_config="vllm", override_generation_config={"temperature": 0.5})
    assert config.sampling_defaults == {"temperature": 0.5} and config.max_tokens_ceiling is None
    hot = with_generation_config(qwen3_gqa, Path(greedy_model).parent / "m_max", {"max_new_tokens": 11})
    config = Config(hot)  # generation_config.json's max_new_tokens: a default, not a ceiling (as vLLM)
    assert config.sampling_defaults == {"max_tokens": 11} and config.max_tokens_ceiling is None


@pytest.mark.parametrize("override, words", [
    ({"temprature": 0}, "unknown key(s) ['temprature']"),
    ({"max_new_tokens": 0}, "max_tokens must be >= 1"),
    ([1], "must be a dict"),
])
def test_bad_overrides_are_named_without_the_model(override, words):
    from nanovllm.engine_args import EngineArgs
    with pytest.raises((ValueError, TypeError), match="override_generation_config") as e:
        EngineArgs(None, override_generation_config=override)  # no model needed to check it
    assert words in str(e.value)


def test_the_server_default_and_ceiling_of_max_tokens(qwen3_gqa, tmp_path):
    """Without an override, a chat or Responses request that sets no limit runs to max_model_len (as
    OpenAI and vLLM); --override-generation-config's max_new_tokens is the default and the ceiling,
    while a smaller ask is kept."""
    from server_fixtures import MODEL, openai, serve_engine  # noqa: F401 (skips without the server extra)
    from nanovllm.entrypoints.openai_server import build_app

    engine = dict(ENGINE, max_model_len=64)
    messages = [{"role": "user", "content": "hi"}]
    extra = {"temperature": 0}  # greedy: the tiny model's answer to "hi" holds no EOS before the context's end

    def lengths(llm):
        with serve_engine(llm, [lambda engine: build_app(engine, MODEL)]) as (_, (url,)):
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
            chat = [client.chat.completions.create(model=MODEL, messages=messages, extra_body=extra, **asked)
                    for asked in ({}, {"max_tokens": 40}, {"max_completion_tokens": 3})]
            resp = client.responses.create(model=MODEL, input="hi", temperature=0)
            completion = client.completions.create(model=MODEL, prompt="hi", extra_body=extra)
            prompt = chat[0].usage.prompt_tokens
        return prompt, [c.usage.completion_tokens for c in chat], resp.usage.output_tokens, \
            completion.usage.completion_tokens

    prompt, chat, responses, completion = lengths(LLM(qwen3_gqa, **engine))
    assert chat == [64 - prompt, 40, 3] and responses == 64 - prompt  # no limit: the context's end
    assert completion == 16  # /v1/completions keeps OpenAI's default
    override = {"max_new_tokens": 5, "temperature": 0}
    _, chat, responses, completion = lengths(LLM(qwen3_gqa, override_generation_config=override, **engine))
    assert chat == [5, 5, 3] and responses == 5 and completion == 5
