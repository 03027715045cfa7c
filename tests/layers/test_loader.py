"""Loader: HF checkpoint names map onto packed parameters (q/k/v -> qkv_proj, gate/up ->
gate_up_proj); missing or unknown weights are errors; tied heads share the embedding."""
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanovllm.config import Config
from nanovllm.models import get_model_class
from nanovllm.loader import load_model


def build(path: str):
    config = Config(path)
    return get_model_class(config.hf_config)(config.hf_config)


def checkpoint(path: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(path, "model.safetensors"))


def test_packed_weights_land_in_place(qwen3_gqa):
    model = build(qwen3_gqa)
    load_model(model, qwen3_gqa)
    ckpt = checkpoint(qwen3_gqa)
    attn = model.model.layers[1].self_attn
    expected_qkv = torch.cat([ckpt[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(attn.qkv_proj.weight, expected_qkv)
    mlp = model.model.layers[1].mlp
    expected = torch.cat([ckpt["model.layers.1.mlp.gate_proj.weight"], ckpt["model.layers.1.mlp.up_proj.weight"]])
    assert torch.equal(mlp.gate_up_proj.weight, expected)
    assert torch.equal(model.lm_head.weight, ckpt["lm_head.weight"])
    assert torch.equal(attn.q_norm.weight, ckpt["model.layers.1.self_attn.q_norm.weight"])


def test_tied_head_shares_embedding(qwen3_bias_tied):
    model = build(qwen3_bias_tied)
    load_model(model, qwen3_bias_tied)
    ckpt = checkpoint(qwen3_bias_tied)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, ckpt["model.embed_tokens.weight"])
    bias = torch.cat([ckpt[f"model.layers.0.self_attn.{n}_proj.bias"] for n in "qkv"])
    assert torch.equal(model.model.layers[0].self_attn.qkv_proj.bias, bias)


def write_variant(src: str, dst, mutate) -> str:
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(src, name), dst)
    tensors = checkpoint(src)
    mutate(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return str(dst)


def test_missing_weight_is_named(qwen3_gqa, tmp_path):
    path = write_variant(qwen3_gqa, tmp_path / "m", lambda t: t.pop("model.layers.0.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks weights for: \['model.layers.0.mlp.up_proj.weight'\]"):
        load_model(build(path), path)


def test_unknown_weight_is_named(qwen3_gqa, tmp_path):
    def add(t):
        t["model.layers.0.extra.weight"] = torch.zeros(2)
    path = write_variant(qwen3_gqa, tmp_path / "u", add)
    with pytest.raises(ValueError, match="does not know: \\['model.layers.0.extra.weight'\\]"):
        load_model(build(path), path)


def test_wrong_shape_is_named(qwen3_gqa, tmp_path):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:-1]
    path = write_variant(qwen3_gqa, tmp_path / "s", shrink)
    with pytest.raises(ValueError, match="k_proj.weight.*shape"):
        load_model(build(path), path)
