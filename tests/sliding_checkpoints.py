"""Sliding-window checkpoints (Mistral, Gemma 2 / 3) made with transformers, and the greedy / TP checks the sliding-window tests share."""
import random
import torch
from helpers import check_tokens_close, hf_greedy, save_decisive
from nanovllm import LLM, SamplingParams


VOCAB, WINDOW, MAX_NEW = 256, 8, 30


COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6,
              eos_token_id=1, bos_token_id=2, pad_token_id=0)


def config_of(name: str):
    import transformers
    if name == "mistral":
        return transformers.MistralConfig(**COMMON, sliding_window=WINDOW, tie_word_embeddings=False), "Mistral"
    if name == "gemma3":
        config = transformers.Gemma3TextConfig(
            **COMMON, sliding_window=WINDOW, query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "default", "rope_theta": 1000.0}})
        return config, "Gemma3"
    if name == "gemma2":
        # Caps below the tiny model's score and logit spreads, so both change the tokens.
        config = transformers.Gemma2Config(**COMMON, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                           layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                           attn_logit_softcapping=0.2, final_logit_softcapping=3.0)
        return config, "Gemma2"
    if name == "gpt_oss":
        shape = {k: v for k, v in COMMON.items() if k != "intermediate_size"}
        config = transformers.GptOssConfig(
            **shape, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"], tie_word_embeddings=False,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 10000.0})
        return config, "GptOss"
    return transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                                    tie_word_embeddings=False), "Qwen2"


def make_checkpoint(name: str, path: str) -> str:
    import transformers
    config, family = config_of(name)
    config.architectures = [f"{family}ForCausalLM"]
    torch.manual_seed(7)
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.self_attn, "sinks"):  # sinks of the size of the scores, so they count
                layer.self_attn.sinks.normal_(0, 1.0)
    return save_decisive(model, path, VOCAB)


def check_greedy_against_transformers(path: str, engine: dict, max_new: int = MAX_NEW, **hf_load) -> None:
    """Prompts of 1-45 tokens (past the window): transformers' greedy tokens (all but one prompt
    exactly, the rest within check_tokens_close), and the same again from prefix-cache hits.
    hf_load: more from_pretrained arguments for transformers."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 7, 20, 45)]
    ref = hf_greedy(path, prompts, max_new, mask_eos=False, **hf_load)
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    with LLM(path, kvcache_block_size=16, dtype="float32", cpu_kvcache_bytes=8 << 20, **engine) as llm:
        first = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        again = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]  # prefix-cache hits
    exact = check_tokens_close(first, ref)
    assert exact >= len(prompts) - 1, f"only {exact}/{len(prompts)} prompts matched exactly"
    assert again == first


def check_tp2_equals_tp1(path: str) -> None:
    """test_tp's mixed workload (prefix hits, chunked prefill, forced preemption) gives the same
    tokens on two ranks as on one, preempting in both."""
    from tp_workloads import run_mixed_workload
    # NOTE: 6 blocks' worth of every layer: the sliding layers free theirs (engine/kv_groups.py), so
    # test_tp's 10 would fit the workload without preempting.
    tokens1, _, preempted1, _, _ = run_mixed_workload(path, tp=1, blocks=6)
    tokens2, _, preempted2, _, _ = run_mixed_workload(path, tp=2, blocks=6)
    assert preempted1 > 0 and preempted2 > 0
    assert tokens2 == tokens1

