"""Tiny random checkpoints of each supported family, made with transformers."""
import torch
from helpers import save_decisive


VOCAB = 256


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


TINY = {
    # Qwen2: GQA 4:2, biased q/k/v only, untied head.
    "qwen2_gqa": ("Qwen2", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
    # Qwen2 with MHA and tied embeddings.
    "qwen2_tied": ("Qwen2", dict(hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                                 num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)),
    # Llama with every optional bias on and head_dim (32) != hidden / heads (16).
    "llama_bias": ("Llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                 attention_bias=True, mlp_bias=True, tie_word_embeddings=False)),
    # Llama-3.x style: llama3 RoPE scaling over a short original context, tied embeddings.
    "llama3_tied": ("Llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
                                  rope_scaling=dict(LLAMA3_ROPE))),
}


def make_tiny(path: str, name: str, seed: int) -> str:
    import transformers

    family, shape = TINY[name]
    config = getattr(transformers, f"{family}Config")(
        vocab_size=VOCAB, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
        eos_token_id=1, bos_token_id=2, pad_token_id=0, **shape)
    config.architectures = [f"{family}ForCausalLM"]
    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    return save_decisive(model, path, VOCAB)

