"""Which attention backend and KV store the engine picks, decided once from device, block size and
dtype (runs on CPU: flash-attn's presence is faked where needed)."""
import importlib.util
import logging

import pytest
import torch

from nanovllm.layers import backends
from nanovllm.layers.backends import backend_class, check_backend_kv_format, get_backend, pick_backend_name
from nanovllm.layers.backends.kv_formats import KV_FORMATS
from nanovllm.layers.backends.base import kv_store_for, store_kvcache_torch
from nanovllm.layers.backends.torch_backend import TorchBackend


@pytest.fixture
def fake_flash_attn(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "flash_attn" else real(name, *a))


def test_auto_on_cpu_is_torch():
    assert pick_backend_name("auto", "cpu", 16, torch.float32) == "torch"


def test_explicit_choice_is_kept():
    assert pick_backend_name("flash", "cuda", 256, torch.bfloat16) == "flash"
    assert pick_backend_name("torch", "cuda", 256, torch.bfloat16) == "torch"


def test_auto_on_cuda_picks_flash_when_usable(fake_flash_attn):
    assert pick_backend_name("auto", "cuda", 256, torch.bfloat16) == "flash"
    assert pick_backend_name("auto", "cuda", 512, torch.float16) == "flash"


@pytest.mark.parametrize("block_size,dtype,reason", [
    (16, torch.bfloat16, "kvcache_block_size 16 is not a multiple of 256"),
    (256, torch.float32, "fp16/bf16 only"),
])
def test_auto_on_cuda_skips_flash_it_cannot_use(fake_flash_attn, caplog, block_size, dtype, reason):
    with caplog.at_level(logging.WARNING, logger=backends.__name__):
        picked = pick_backend_name("auto", "cuda", block_size, dtype)
    assert picked != "flash"
    assert reason in caplog.text and picked in caplog.text


def test_fp8_cache_on_cuda_picks_triton_over_flash(fake_flash_attn, caplog):
    # flash-attn reads caches in the activations' dtype only; the Triton kernels read fp8 too.
    fp8, bf16 = KV_FORMATS["fp8_e4m3"], KV_FORMATS["bfloat16"]
    assert pick_backend_name("auto", "cuda", 256, torch.bfloat16, bf16) == "flash"
    with caplog.at_level(logging.WARNING, logger=backends.__name__):
        assert pick_backend_name("auto", "cuda", 256, torch.bfloat16, fp8) == "triton"
    assert "not fp8_e4m3" in caplog.text
    assert backend_class("triton").kv_format_error(KV_FORMATS["fp8_e5m2"], torch.float16) is None
    assert "the torch backend reads every format" in backend_class("triton").kv_format_error(
        KV_FORMATS["int8"], torch.bfloat16)
    with pytest.raises(ValueError, match="attention_backend='flash' with kv_cache_dtype='fp8_e4m3'"):
        check_backend_kv_format("flash", fp8, torch.bfloat16)


def test_auto_on_cuda_without_flash_attn_warns(monkeypatch, caplog):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "flash_attn" else real(name, *a))
    with caplog.at_level(logging.WARNING, logger=backends.__name__):
        picked = pick_backend_name("auto", "cuda", 256, torch.bfloat16)
    assert picked in ("torch", "triton")
    assert "flash-attn is not installed" in caplog.text


def test_flash_backend_refuses_cpu():
    with pytest.raises(ValueError, match="CUDA only"):
        get_backend("flash", "cpu")


def test_kv_store_is_triton_on_cuda_and_torch_elsewhere():
    pytest.importorskip("triton")
    from nanovllm.kernels.store_kvcache import store_kvcache_triton

    assert kv_store_for("cpu") is store_kvcache_torch
    assert kv_store_for("cuda") is store_kvcache_triton
    assert get_backend("torch", "cpu")._store is store_kvcache_torch


# ---- the registry: a backend added by one register_backend line -----------------------------
class CountingBackend(TorchBackend):
    """The torch backend under another name, counting the metadata it builds per kind of step."""

    name = "counting"

    def __init__(self, device: str = "cpu", kv_format=None):
        super().__init__(device, kv_format)
        self.prepared = {"prefill": 0, "decode": 0}

    def prepare(self, batch):
        self.prepared["prefill" if batch.is_prefill else "decode"] += 1
        return super().prepare(batch)


class NowhereBackend(TorchBackend):
    name = "nowhere"

    @classmethod
    def unavailable_reason(cls, device: str) -> str | None:
        return f"it never runs, not even on {device}"


@pytest.fixture
def registry(monkeypatch):
    """A copy of the registry for one test, so registrations do not leak into others."""
    monkeypatch.setattr(backends, "_BACKENDS", dict(backends._BACKENDS))
    backends.register_backend("counting", f"{__name__}:CountingBackend")
    backends.register_backend("nowhere", f"{__name__}:NowhereBackend")


def test_registered_backend_is_accepted_and_runs(registry, qwen3_gqa):
    from nanovllm import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = [[5, 6, 7], list(range(10, 40))]
    outputs = {}
    for name in ("counting", "torch"):
        with LLM(qwen3_gqa, device="cpu", attention_backend=name, kvcache_block_size=16, max_model_len=64,
                 cpu_kvcache_bytes=1 << 20) as llm:
            backend = llm.llm_engine.model_runner.backend
            outputs[name] = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
            if name == "counting":
                assert type(backend) is CountingBackend
                # One prefill step for both prompts, then 4 decode steps (the 5th token needs none).
                assert backend.prepared == {"prefill": 1, "decode": 4}
    assert outputs["counting"] == outputs["torch"] and all(len(t) == 5 for t in outputs["torch"])


def test_unknown_backend_names_the_known_ones(registry, qwen3_gqa):
    from nanovllm.config import Config

    with pytest.raises(ValueError, match="attention_backend must be one of") as e:
        Config(qwen3_gqa, device="cpu", attention_backend="magic")
    for known in ("auto", "torch", "flash", "triton", "counting"):
        assert repr(known) in str(e.value)
    with pytest.raises(ValueError, match="is not available; available"):
        get_backend("magic", "cpu")


def test_registered_backend_rules_are_read(registry, qwen3_gqa):
    from nanovllm.config import Config

    with pytest.raises(ValueError, match="never runs, not even on cpu"):
        Config(qwen3_gqa, device="cpu", attention_backend="nowhere")
    with pytest.raises(ValueError, match="never runs"):
        get_backend("nowhere", "cpu")
    # 'auto' only picks a backend that names the device in auto_devices.
    assert pick_backend_name("auto", "cpu", 16, torch.float32) == "torch"


def test_register_backend_rejects_bad_targets(registry):
    with pytest.raises(ValueError, match="package.module:ClassName"):
        backends.register_backend("x", "no_colon_here")
    with pytest.raises(ValueError, match="other than 'auto'"):
        backends.register_backend("auto", f"{__name__}:CountingBackend")


def test_flash_rules_are_stated_once():
    from nanovllm.layers.backends.flash_backend import FlashBackend

    assert FlashBackend.block_size_error(512) is None and FlashBackend.dtype_error(torch.float16) is None
    with pytest.raises(ValueError, match="kvcache_block_size 16 is not a multiple of 256"):
        FlashBackend.check_block_size(16)
    with pytest.raises(ValueError, match="fp16/bf16 only"):
        FlashBackend.check_dtype(torch.float32)
