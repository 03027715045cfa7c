"""Bad input gets a clear ValueError/TypeError at the API boundary; the engine stays usable."""
import json
import os
import shutil

import pytest

from nanovllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(qwen3_gqa):
    with LLM(qwen3_gqa, kvcache_block_size=16, max_model_len=64, cpu_kvcache_bytes=6 * 16384, kv_cache_dtype="float32") as engine:
        yield engine


def test_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_folder_without_config(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        LLM(str(tmp_path))


def test_folder_without_safetensors(qwen3_gqa, tmp_path):
    shutil.copy(os.path.join(qwen3_gqa, "config.json"), tmp_path)
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(tmp_path))


def test_unsupported_architecture_lists_supported(qwen3_gqa, tmp_path):
    target = tmp_path / "m"
    shutil.copytree(qwen3_gqa, target)
    cfg = json.loads((target / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    cfg["model_type"] = "gpt2"
    (target / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unsupported model architecture GPT2LMHeadModel; supported: .*Qwen3ForCausalLM"):
        LLM(str(target))


def test_model_path_wrong_type():
    with pytest.raises(TypeError, match="model must be a path"):
        LLM(123)


def test_unknown_engine_kwarg(qwen3_gqa):
    with pytest.raises(TypeError, match="unknown engine argument.*max_num_seq"):
        LLM(qwen3_gqa, max_num_seq=4)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(device="tpu"), ValueError, "device must be one of"),
    (dict(dtype="int8"), ValueError, "dtype must be"),
    (dict(max_num_seqs=0), ValueError, "max_num_seqs must be >= 1, got 0"),
    (dict(max_model_len="long"), TypeError, "max_model_len must be an int"),
    (dict(kvcache_block_size=20), ValueError, "multiple of 16"),
    (dict(gpu_memory_utilization=1.5), ValueError, "gpu_memory_utilization"),
    (dict(attention_backend="magic"), ValueError, "attention_backend must be one of"),
    (dict(enforce_eager="yes"), TypeError, "enforce_eager must be a bool"),
    (dict(kvcache_prefault=1), TypeError, "kvcache_prefault must be a bool"),
    (dict(seed=-1), ValueError, r"seed must be in \[0, 2\*\*63\), got -1"),
    (dict(seed="1"), TypeError, "seed must be an int"),
])
def test_bad_engine_options(qwen3_gqa, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        LLM(qwen3_gqa, **kwargs)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(temperature=-0.5), ValueError, "temperature must be a finite number >= 0, got -0.5"),
    (dict(temperature="hot"), TypeError, "temperature must be a number"),
    (dict(max_tokens=0), ValueError, "max_tokens must be >= 1, or None for no limit, got 0"),
    (dict(max_tokens=2.5), TypeError, "max_tokens must be an int"),
    (dict(ignore_eos="no"), TypeError, "ignore_eos must be a bool"),
    (dict(temprature=1.0), TypeError, "temprature"),
])
def test_bad_sampling_params(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompt, exc, match", [
    ("", ValueError, "empty string"),
    ([], ValueError, "empty list"),
    ([5, 300], ValueError, r"outside the vocabulary \[0, 256\)"),
    ([5, -1], ValueError, "outside the vocabulary"),
    ([5, "x"], TypeError, "must be ints"),
    (3.5, TypeError, "string or a list of token ids"),
    (list(range(3, 67)), ValueError, "64 tokens, but max_model_len is 64"),
])
def test_bad_prompts_leave_engine_usable(llm, prompt, exc, match):
    good = [5, 6, 7]
    expected = llm.generate([good], GREEDY, use_tqdm=False)[0]["token_ids"]
    with pytest.raises(exc, match=match):
        llm.generate([good, prompt], GREEDY, use_tqdm=False)
    assert llm.llm_engine.scheduler.is_finished()  # nothing of the failed call was queued
    assert llm.generate([good], GREEDY, use_tqdm=False)[0]["token_ids"] == expected


def test_request_larger_than_whole_cache(llm):
    # The cache holds 6 blocks of 16 tokens; 60 prompt tokens + 40 new tokens need 7.
    assert llm.llm_engine.num_kvcache_blocks == 6
    with pytest.raises(ValueError, match="needs 7 KV cache blocks .* whole cache holds 6"):
        with LLM(llm.config.model, kvcache_block_size=16, max_model_len=128,
                 cpu_kvcache_bytes=6 * 16384, kv_cache_dtype="float32") as small:
            small.generate([list(range(3, 63))], SamplingParams(max_tokens=40), use_tqdm=False)


def test_sampling_params_list_length_mismatch(llm):
    with pytest.raises(ValueError, match="got 1 sampling_params for 2 prompts"):
        llm.generate([[5], [6]], [GREEDY], use_tqdm=False)


def test_sampling_params_wrong_type(llm):
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams"):
        llm.generate([[5]], {"temperature": 0}, use_tqdm=False)
