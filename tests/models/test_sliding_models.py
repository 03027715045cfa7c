"""Families with sliding-window layers against transformers' greedy tokens (fp32): Mistral (a window
on every layer), Gemma 3 (sliding and full layers, a rope theta per kind, Gemma's norms, GELU-tanh,
scaled embeddings), Gemma 2 (soft-capped attention scores and final logits), GPT-OSS (attention
sinks, biases, YaRN, its router and clamped-SwiGLU experts) and Qwen2 with use_sliding_window; windows far shorter than the prompts and the
generations, through whole prefills, chunked prefills and prefix-cache hits; bad configs named."""
import random

import pytest
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


@pytest.fixture(scope="module", params=["mistral", "gemma3", "gemma2", "gpt_oss", "qwen2"])
def checkpoint(request, tmp_path_factory) -> tuple[str, str]:
    return request.param, make_checkpoint(request.param, str(tmp_path_factory.mktemp(request.param)))


def test_checkpoint_is_as_named(checkpoint):
    """Guards the fixture: the layers the engine builds have the windows the configs ask for."""
    name, path = checkpoint
    with LLM(path, dtype="float32", cpu_kvcache_bytes=8 << 20) as llm:
        windows = [layer.self_attn.attn.sliding_window for layer in llm.llm_engine.model_runner.model.model.layers]
        if name == "gemma3":
            ropes = [layer.self_attn.rotary_emb for layer in llm.llm_engine.model_runner.model.model.layers]
            assert ropes[0] is ropes[2] and ropes[0] is not ropes[1]
        caps = [layer.self_attn.attn.logit_softcap for layer in llm.llm_engine.model_runner.model.model.layers]
        sinks = [layer.self_attn.attn.sinks is not None for layer in llm.llm_engine.model_runner.model.model.layers]
    assert windows == {"mistral": [WINDOW] * 3, "gemma3": [WINDOW, None, WINDOW], "gemma2": [WINDOW, None, WINDOW],
                       "gpt_oss": [WINDOW, None, WINDOW], "qwen2": [None, WINDOW, WINDOW]}[name]
    assert sinks == [name == "gpt_oss"] * 3
    assert caps == ([0.2] * 3 if name == "gemma2" else [None] * 3)


@pytest.mark.parametrize("engine", [dict(), dict(max_num_batched_tokens=16, max_num_seqs=4)],
                         ids=["whole", "chunked"])
def test_greedy_matches_transformers(checkpoint, engine):
    check_greedy_against_transformers(checkpoint[1], engine)


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


def test_bad_window_configs_are_named(tmp_path):
    import transformers

    from nanovllm.models.decoder import sliding_window_of
    config = transformers.MistralConfig(**COMMON, sliding_window=WINDOW)
    config.layer_types = ["sliding_attention", "chunked_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"layer_types\[1\] is 'chunked_attention'"):
        sliding_window_of(config, 1)
    config.layer_types = ["sliding_attention"] * 3
    config.sliding_window = 0
    with pytest.raises(ValueError, match="sliding_window is 0"):
        sliding_window_of(config, 0)
    config.sliding_window = 513  # COMMON's max_position_embeddings is 512
    with pytest.raises(ValueError, match="sliding_window 513 is larger than the model's context"):
        sliding_window_of(config, 2)
    config.sliding_window = 512
    assert sliding_window_of(config, 2) == 512
    config.layer_types = ["full_attention"]
    with pytest.raises(ValueError, match="1 entries for 3 layers"):
        sliding_window_of(config, 0)


def test_gemma2_final_logits_are_capped(tmp_path):
    """A monotonic cap never changes a greedy token, so the log-probabilities tell: equal to
    transformers' over its capped logits."""
    import transformers
    config, _ = config_of("gemma2")
    config.architectures = ["Gemma2ForCausalLM"]
    torch.manual_seed(7)
    path = save_decisive(transformers.Gemma2ForCausalLM(config), str(tmp_path), VOCAB)
    prompt = [5, 17, 99, 3, 42]
    (ref_tokens, ref_logits), = hf_greedy(path, [prompt], 1, mask_eos=False)
    want = torch.log_softmax(ref_logits[0].float(), -1)
    with LLM(path, dtype="float32", cpu_kvcache_bytes=8 << 20) as llm:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=5), use_tqdm=False)[0]
    got = out["logprobs"][0]
    assert out["token_ids"] == ref_tokens and len(got) >= 5
    for token, logprob in got.items():
        assert abs(logprob - want[token].item()) < 1e-3, (token, logprob, want[token].item())


@pytest.mark.parametrize("name", ["gemma3", "gpt_oss"])
def test_tp2_matches_tp1_with_prefix_hits_chunks_and_preemption(name, tmp_path):
    """Each rank holds its heads' sinks and its slice of the attention; windows and norms alike."""
    check_tp2_equals_tp1(make_checkpoint(name, str(tmp_path)))


def check_tp2_equals_tp1(path: str) -> None:
    """test_tp's mixed workload (prefix hits, chunked prefill, forced preemption) gives the same
    tokens on two ranks as on one, preempting in both."""
    from test_tp import run_mixed_workload
    # NOTE: 6 blocks' worth of every layer: the sliding layers free theirs (engine/kv_groups.py), so
    # test_tp's 10 would fit the workload without preempting.
    tokens1, _, preempted1, _, _ = run_mixed_workload(path, tp=1, blocks=6)
    tokens2, _, preempted2, _, _ = run_mixed_workload(path, tp=2, blocks=6)
    assert preempted1 > 0 and preempted2 > 0
    assert tokens2 == tokens1
