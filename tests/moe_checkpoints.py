"""Tiny mixture-of-experts checkpoints made with transformers."""
import torch
from helpers import save_decisive


VOCAB = 256


BASE = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=2, pad_token_id=0)


TINY = {
    # renormalized top-2 of 8, layer 1 a dense MLP
    "qwen3_moe_norm": ("Qwen3Moe", dict(head_dim=16, intermediate_size=96, moe_intermediate_size=32,
                                        num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                                        norm_topk_prob=True, mlp_only_layers=[1])),
    # plain softmax weights of top-3, every second layer sparse
    "qwen3_moe_step2": ("Qwen3Moe", dict(head_dim=16, intermediate_size=96, moe_intermediate_size=32,
                                         num_hidden_layers=4, num_experts=8, num_experts_per_tok=3,
                                         norm_topk_prob=False, decoder_sparse_step=2)),
    # a shared expert with its sigmoid gate, biased q/k/v
    "qwen2_moe_shared": ("Qwen2Moe", dict(intermediate_size=96, moe_intermediate_size=32,
                                          shared_expert_intermediate_size=64, num_hidden_layers=2,
                                          num_experts=6, num_experts_per_tok=2, norm_topk_prob=False)),
    "mixtral": ("Mixtral", dict(intermediate_size=32, num_hidden_layers=2, num_local_experts=4,
                                num_experts_per_tok=2)),
}


def make_moe(path: str, name: str, seed: int = 0) -> str:
    import transformers

    family, shape = TINY[name]
    config = getattr(transformers, f"{family}Config")(**BASE, **shape)
    config.architectures = [f"{family}ForCausalLM"]
    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    return save_decisive(model, path, VOCAB)  # decisive routings too

