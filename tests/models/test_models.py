"""Model families beyond Qwen3: tiny random Qwen2 and Llama checkpoints (incl. llama3 RoPE scaling,
biases, tied embeddings) give transformers' greedy tokens; llama3 RoPE frequencies equal
transformers' own; the registry rejects unknown architectures by naming the known ones."""
import json
import os
import random
from types import SimpleNamespace

import pytest
import torch

from helpers import check_tokens_close, hf_greedy
from nanovllm import LLM, SamplingParams
from nanovllm.layers.rotary_embedding import get_rope, rope_settings
from nanovllm.models import supported_architectures
from tiny_models import LLAMA3_ROPE, TINY, VOCAB, make_tiny  # noqa: E402

MAX_NEW = 40


@pytest.fixture(scope="module", params=sorted(TINY))
def tiny_checkpoint(request, tmp_path_factory) -> tuple[str, str]:
    name = request.param
    return name, make_tiny(str(tmp_path_factory.mktemp(name)), name, seed=len(name))


def test_tiny_checkpoint_is_as_named(tiny_checkpoint):
    """Guards the fixtures: the saved configs carry what each parity case claims to cover."""
    name, path = tiny_checkpoint
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["rope_parameters"]["rope_type"] == ("llama3" if name.startswith("llama3") else "default")
    assert cfg["tie_word_embeddings"] == name.endswith("tied")
    assert cfg.get("attention_bias", False) == (name == "llama_bias")


def test_greedy_matches_transformers(tiny_checkpoint):
    _, path = tiny_checkpoint
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 7, 16, 17, 40, 61)]
    ref = hf_greedy(path, prompts, MAX_NEW, mask_eos=False)
    with LLM(path, kvcache_block_size=16, dtype="float32", cpu_kvcache_bytes=32 << 20) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
                            use_tqdm=False)
    assert all(len(o["token_ids"]) == MAX_NEW for o in outs)
    exact = check_tokens_close([o["token_ids"] for o in outs], ref)
    # fp32 and the same math: only a near-tie could flip a token, so nearly all must be exact.
    assert exact >= len(prompts) - 1, f"only {exact}/{len(prompts)} prompts matched exactly"


def _hf_llama_cos_sin(config, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    x = torch.zeros(1, len(positions), 1)
    cos, sin = LlamaRotaryEmbedding(config)(x, positions[None])
    half = cos.shape[-1] // 2  # HF repeats the half-width table twice
    return cos[0, :, :half], sin[0, :, :half]


@pytest.mark.parametrize("head_dim,theta,max_pos,scaling", [
    (16, 10000.0, 512, LLAMA3_ROPE),
    # Llama-3.1's published settings (shorter max_position to keep the table small).
    (128, 500000.0, 16384, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # Llama-3.2-like factor, and no original_max_position_embeddings: both fall back to max_position.
    (64, 500000.0, 2048, {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0}),
])
def test_llama3_rope_matches_transformers(head_dim, theta, max_pos, scaling):
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim,
                         max_position_embeddings=max_pos, rope_scaling=dict(scaling, rope_theta=theta))
    positions = torch.tensor([0, 1, 15, 63, 64, 200, max_pos - 1])
    our_theta, our_scaling = rope_settings(config)
    assert our_theta == theta and our_scaling["rope_type"] == "llama3"
    ours = get_rope(head_dim, head_dim, max_pos, our_theta, our_scaling).cos_sin_cache[positions, 0]
    cos, sin = _hf_llama_cos_sin(config, positions)
    torch.testing.assert_close(ours, torch.cat([cos, sin], dim=-1), rtol=1e-6, atol=1e-6)
    # The scaling must matter here, or this test could not tell it from plain RoPE.
    plain = get_rope(head_dim, head_dim, max_pos, theta).cos_sin_cache[positions, 0]
    assert not torch.allclose(plain, ours, atol=1e-3)

    # The same settings in the 4.x form (top-level rope_theta + rope_scaling) read the same way.
    legacy = SimpleNamespace(rope_theta=theta, rope_scaling=dict(scaling))
    legacy_theta, legacy_scaling = rope_settings(legacy)
    legacy_rope = get_rope(head_dim, head_dim, max_pos, legacy_theta, legacy_scaling)
    torch.testing.assert_close(legacy_rope.cos_sin_cache[positions, 0], ours, rtol=0, atol=0)


@pytest.mark.parametrize("head_dim,theta,max_pos,scaling", [
    # Qwen3's published long-context setting (32k -> 128k), on a short original context.
    (32, 1000000.0, 64, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    (128, 1000000.0, 40960, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    # DeepSeek-style mscale ratio and explicit betas; no original context (falls back to max_position)
    (64, 10000.0, 256, {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16, "beta_slow": 2, "mscale": 0.707,
                        "mscale_all_dim": 0.707, "original_max_position_embeddings": 256}),
    (16, 10000.0, 128, {"rope_type": "linear", "factor": 2.0}),
])
def test_scaled_rope_matches_transformers(head_dim, theta, max_pos, scaling):
    """YaRN and linear scaling: cos and sin (with YaRN's attention factor in them) equal
    transformers', past the original context too; the positions reach original x factor."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim,
                         max_position_embeddings=max_pos, rope_scaling=dict(scaling, rope_theta=theta))
    our_theta, our_scaling = rope_settings(config)
    rope = get_rope(head_dim, head_dim, max_pos, our_theta, our_scaling)
    reach = int((scaling.get("original_max_position_embeddings") or max_pos) * scaling["factor"])
    assert rope.cos_sin_cache.shape[0] == max(max_pos, reach)
    positions = torch.tensor([0, 1, 15, 63, 64, 200, max_pos - 1, reach - 1])
    ours = rope.cos_sin_cache[positions, 0]
    cos, sin = _hf_llama_cos_sin(config, positions)
    torch.testing.assert_close(ours, torch.cat([cos, sin], dim=-1), rtol=1e-5, atol=1e-5)
    inside = positions < max_pos  # the scaling must matter where plain RoPE reaches too
    plain = get_rope(head_dim, head_dim, max_pos, theta).cos_sin_cache[positions[inside], 0]
    assert not torch.allclose(plain, ours[inside], atol=1e-3)


def test_yarn_greedy_matches_transformers_past_the_original_context(tmp_path):
    """A tiny Qwen3 with YaRN over a 64-token original context: prompts of 90-200 tokens give
    transformers' greedy tokens (fp32 KV), and max_model_len reaches original x factor (256)."""
    from helpers import make_qwen3

    path = make_qwen3(str(tmp_path / "yarn"), max_position_embeddings=64, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0})
    rng = random.Random(1)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (90, 130, 200)]
    ref = hf_greedy(path, prompts, 16)
    with LLM(path, kv_cache_dtype="float32", max_model_len=1024) as llm:
        assert llm.config.max_model_len == 256
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert [o["token_ids"] for o in outs] == [tokens for tokens, _ in ref]


def test_unsupported_rope_type_is_rejected():
    with pytest.raises(ValueError, match="longrope"):
        get_rope(16, 16, 64, 10000.0, {"rope_type": "longrope", "factor": 2.0})


def test_unsupported_architecture_lists_supported(tmp_path):
    path = make_tiny(str(tmp_path / "m"), "llama_bias", seed=0)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError) as info:
        LLM(path, dtype="float32", cpu_kvcache_bytes=1 << 20)
    message = str(info.value)
    assert "GPTNeoXForCausalLM" in message
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in message and arch in supported_architectures()


def test_layers_share_one_rope_table():
    from transformers import LlamaConfig

    from nanovllm.models.llama import LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                         vocab_size=64, max_position_embeddings=128)
    model = LlamaForCausalLM(config)
    assert len({id(layer.self_attn.rotary_emb) for layer in model.model.layers}) == 1
