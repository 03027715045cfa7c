"""Bad adapters and bad requests: each is a clear error naming what is wrong, raised before anything is
queued, and the engine goes on serving the others."""
import json
import os
import shutil

import pytest

from nanovllm import LLM, LoRARequest, SamplingParams
from lora_adapters import make_peft_adapter

pytest.importorskip("peft")

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def good(qwen3_gqa, tmp_path_factory):
    return make_peft_adapter(qwen3_gqa, str(tmp_path_factory.mktemp("good")), seed=1, r=8)


@pytest.fixture(scope="module")
def llm(qwen3_gqa):
    with LLM(qwen3_gqa, enable_lora=True, max_lora_rank=8, kvcache_block_size=16) as engine:
        yield engine


def edited(good: str, tmp_path, **config) -> str:
    """A copy of the good adapter with adapter_config.json fields replaced."""
    path = str(tmp_path / "edited")
    shutil.copytree(good, path)
    with open(os.path.join(path, "adapter_config.json")) as f:
        data = json.load(f)
    data.update(config)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(data, f)
    return path


def refused(llm, request, *words):
    with pytest.raises(ValueError) as e:
        llm.generate([PROMPT], GREEDY, use_tqdm=False, lora_request=request)
    for word in words:
        assert word in str(e.value), str(e.value)
    scheduler = llm.llm_engine.scheduler
    assert scheduler.is_finished(), "a refused request left something queued"


def test_bad_adapters_are_refused_by_name(llm, good, qwen3_gqa, tmp_path):
    refused(llm, LoRARequest("missing", 1, str(tmp_path / "nowhere")), "'missing'", "does not exist")
    empty = tmp_path / "empty"
    empty.mkdir()
    refused(llm, LoRARequest("empty", 2, str(empty)), "adapter_config.json")
    refused(llm, LoRARequest("dora", 3, edited(good, tmp_path / "d", use_dora=True)), "DoRA")
    refused(llm, LoRARequest("saves", 4, edited(good, tmp_path / "s", modules_to_save=["lm_head"])),
            "modules_to_save")
    big = make_peft_adapter(qwen3_gqa, str(tmp_path / "big"), seed=2, r=16)
    refused(llm, LoRARequest("big", 5, big), "rank 16", "max_lora_rank=8")
    broken = edited(good, tmp_path / "b")
    with open(os.path.join(broken, "adapter_model.safetensors"), "r+b") as f:
        f.truncate(100)
    refused(llm, LoRARequest("broken", 6, broken), "malformed")
    pickled = edited(good, tmp_path / "p")
    os.rename(os.path.join(pickled, "adapter_model.safetensors"), os.path.join(pickled, "adapter_model.bin"))
    refused(llm, LoRARequest("pickled", 7, pickled), "never loaded")


def test_an_adapter_of_another_model_is_refused(llm, tmp_path):
    """Trained on a model of another shape: the projection sizes do not match."""
    from helpers import make_qwen3
    other = make_qwen3(str(tmp_path / "other"), shape="bias_tied", seed=3)
    adapter = make_peft_adapter(other, str(tmp_path / "adapter"), seed=4, r=4)
    refused(llm, LoRARequest("other", 8, adapter), "'other'", "another base model")


def test_the_engine_goes_on_after_refusals(llm, good):
    out = llm.generate([PROMPT, PROMPT], GREEDY, use_tqdm=False, lora_request=[LoRARequest("good", 9, good), None])
    assert all(len(o["token_ids"]) == 4 for o in out)


def test_requests_need_an_engine_with_enable_lora(qwen3_gqa, good):
    with LLM(qwen3_gqa, kvcache_block_size=16) as plain:
        with pytest.raises(ValueError, match="enable_lora=True"):
            plain.generate([PROMPT], GREEDY, use_tqdm=False, lora_request=LoRARequest("good", 1, good))


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_loras=0), "max_loras"),
    (dict(max_lora_rank=-1), "max_lora_rank"),
    (dict(max_loras=4, max_cpu_loras=2), "max_cpu_loras"),
    (dict(enable_lora="yes"), "enable_lora"),
    (dict(lora_dtype="int4"), "lora_dtype"),
])
def test_engine_options_are_checked(qwen3_gqa, kwargs, message):
    with pytest.raises((TypeError, ValueError), match=message):
        LLM(qwen3_gqa, **kwargs)


def test_int8_slots_are_refused_where_the_triton_kernels_run():
    """int8 slots are read by the CPU's C step and torch path only (kernels/cpu_lora.c)."""
    import torch
    from nanovllm.lora.layers import slot_dtype
    with pytest.raises(ValueError, match="lora_dtype 'int8'"):
        slot_dtype(torch.int8, torch.nn.Module(), torch.bfloat16, triton=True)


def test_lora_request_fields_are_checked():
    for args in (("", 1, "x"), ("a", 0, "x"), ("a", True, "x"), ("a", 1, "")):
        with pytest.raises(ValueError):
            LoRARequest(*args)
