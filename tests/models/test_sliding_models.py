"""Families with sliding-window layers against transformers' greedy tokens (fp32): Mistral (a window
on every layer), Gemma 3 (sliding and full layers, a rope theta per kind, Gemma's norms, GELU-tanh,
scaled embeddings), Gemma 2 (soft-capped attention scores and final logits), GPT-OSS (attention
sinks, biases, YaRN, its router and clamped-SwiGLU experts) and Qwen2 with use_sliding_window; windows far shorter than the prompts and the
generations, through whole prefills, chunked prefills and prefix-cache hits; bad configs named."""

import pytest
import torch

from helpers import hf_greedy, save_decisive
from nanovllm import LLM, SamplingParams
from sliding_checkpoints import COMMON, VOCAB, WINDOW, check_greedy_against_transformers, check_tp2_equals_tp1, config_of, make_checkpoint  # noqa: E402


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


