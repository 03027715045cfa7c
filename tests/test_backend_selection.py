"""Which attention backend and KV store the engine picks, decided once from device, block size and
dtype (runs on CPU: flash-attn's presence is faked where needed)."""
import importlib.util
import logging

import pytest
import torch

from nanovllm.layers import backends
from nanovllm.layers.backends import get_backend, pick_backend_name
from nanovllm.layers.backends.torch_backend import kv_store_for, store_kvcache_torch


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
