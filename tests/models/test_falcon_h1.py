"""Falcon-H1 (FalconH1ForCausalLM: models/falcon_h1.py) against transformers (fp32; greedy tokens and
log-probabilities within 1e-4): a Mamba-2 mixer and attention side by side in every layer, every muP
multiplier away from 1 (folded into the weights at load), the mixer's output ungated-normed (no
norm) or normed before the gate with two groups; prompts past two SSD chunks, whole and chunked
prefills, a second pass, forced preemption, TP=2; the decode steps in the C one call (counted), or
each mixer's step one C call, or the torch step. Checked to fail with the multipliers left unfolded,
and with the SSM state dropped. llama.cpp's falcon-h1 GGUF file (the multipliers folded by its
converter)."""
import random

import pytest
import torch

from helpers import save_decisive
from lora_adapters import assert_like_peft, peft_greedy
from nanovllm import LLM, SamplingParams
from state_models import (FP32, check_eager_mamba2_decode, counted, generate, llamacpp_file, mixers,
                          zeroed_before_each_step)

VOCAB, MAX_NEW = 256, 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 9, 70, 150)]
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, mamba_d_ssm=96, mamba_n_heads=6, mamba_d_head=16, mamba_n_groups=1,
             mamba_d_state=16, mamba_d_conv=4, max_position_embeddings=512, embedding_multiplier=5.0,
             lm_head_multiplier=0.3, ssm_multipliers=[0.5, 1.5, 0.7, 1.2, 0.9], mlp_multipliers=[1.3, 0.6],
             key_multiplier=0.8, attention_in_multiplier=1.1, attention_out_multiplier=0.9, ssm_in_multiplier=1.2,
             ssm_out_multiplier=0.7, eos_token_id=1, bos_token_id=2, pad_token_id=0)
VARIANTS = {"no-norm": dict(mamba_rms_norm=False),
            "norm-before-gate": dict(mamba_rms_norm=True, mamba_norm_before_gate=True, mamba_n_groups=2)}


def make(path: str, **overrides) -> str:
    import transformers
    config = transformers.FalconH1Config(**{**SHAPE, **overrides})
    config.architectures = ["FalconH1ForCausalLM"]
    torch.manual_seed(3)
    model = transformers.FalconH1ForCausalLM(config)
    with torch.no_grad():  # time steps of a useful size, decays of A
        for layer in model.model.layers:
            layer.mamba.dt_bias.uniform_(-2.0, 0.5)
            layer.mamba.A_log.uniform_(-1.0, 1.0)
            layer.mamba.D.normal_(1.0, 0.3)
    return save_decisive(model, path, VOCAB)


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    path = make(str(tmp_path_factory.mktemp(request.param)), **VARIANTS[request.param])
    return path, peft_greedy(path, None, PROMPTS, MAX_NEW)


@pytest.mark.parametrize("engine", [dict(), dict(max_num_batched_tokens=40, max_num_seqs=2)], ids=["whole", "chunked"])
def test_greedy_and_logprobs_match_transformers(checkpoint, engine, monkeypatch):
    """The decode steps in the C one call (each layer's mixer and attention side by side, their
    outputs summed; its calls counted), a second pass of the same prompts."""
    from nanovllm.executor.cpu_decode import FusedDecode
    path, refs = checkpoint
    with LLM(path, **FP32, **engine) as llm:
        fused = llm.llm_engine.model_runner.step_runner(FusedDecode)
        assert fused is not None and fused.hybrid and fused.one_call_layers == 3
        assert all(layer.mamba2 and layer.qkv.data for layer in fused.layers)
        calls = counted(monkeypatch, fused.kernels, "decode_layers")
        for attempt in ("first", "second"):
            assert_like_peft(llm.generate(PROMPTS, GREEDY, use_tqdm=False), refs, f"{attempt} pass")
        assert len(calls) >= 2 * (MAX_NEW - 1)


@pytest.mark.parametrize("where", ["c", "torch"])
def test_the_eager_decode_matches_too(checkpoint, where, monkeypatch):
    """With the one call set aside: each mixer's decode step one C call (counted), or the torch step."""
    check_eager_mamba2_decode(*checkpoint, PROMPTS, GREEDY, where, monkeypatch)


def test_the_multipliers_matter(checkpoint, monkeypatch):
    """The weights loaded as the checkpoint holds them (no multiplier folded in): not transformers'."""
    import nanovllm.models.falcon_h1 as module
    path, refs = checkpoint
    monkeypatch.setattr(module, "falcon_scales", lambda config, name, tensor: tensor)
    with LLM(path, **FP32) as llm:
        with pytest.raises(AssertionError):
            assert_like_peft(llm.generate(PROMPTS, GREEDY, use_tqdm=False), refs, "unscaled")


def test_the_ssm_state_matters(checkpoint, monkeypatch):
    path, refs = checkpoint
    with LLM(path, **FP32, max_num_batched_tokens=40, max_num_seqs=2) as llm:
        zeroed_before_each_step(monkeypatch, [m.state.ssm for m in mixers(llm)])
        with pytest.raises(AssertionError):
            assert_like_peft(llm.generate(PROMPTS, GREEDY, use_tqdm=False), refs, "no ssm state")


def test_preemption_and_tp2(checkpoint):
    """A cache too small for all four 120-token prompts at once (sequences preempted and recomputed
    from zero state) gives the same tokens; so do two ranks (each half the Mamba-2 and attention
    heads), chunked and mixed."""
    path, _ = checkpoint
    rng = random.Random(1)
    batch = [[rng.randrange(3, VOCAB) for _ in range(120)] for _ in range(4)]
    want, _ = generate(path, batch, MAX_NEW)
    with LLM(path, **FP32) as llm:
        slot = sum(m.slot_bytes() for m in mixers(llm))
    # 4 state slots, and 49 blocks of 16 tokens of the three attention layers (K and V, 2 heads of
    # 16, fp32): 8 blocks each at admission, 9 by the end
    got, preempted = generate(path, batch, MAX_NEW, max_num_seqs=4,
                              cpu_kvcache_bytes=4 * slot + 33 * (3 * 2 * 16 * 2 * 16 * 4))
    assert preempted > 0 and got == want
    engine = dict(max_num_batched_tokens=40, max_num_seqs=2)
    want, _ = generate(path, PROMPTS, MAX_NEW, **engine)
    got, _ = generate(path, PROMPTS, MAX_NEW, tensor_parallel_size=2, **engine)
    assert got == want


def test_tied_embeddings_with_two_scales_are_refused(tmp_path):
    path = make(str(tmp_path), tie_word_embeddings=True)
    with pytest.raises(ValueError, match="tied embeddings and embedding_multiplier != lm_head_multiplier"):
        LLM(path, **FP32)


def test_llamacpp_gguf_file(tmp_path):
    """llama.cpp's converter's F32 falcon-h1 file of a checkpoint without the mixer norm (as
    Falcon-H1's configs have it; the converter folds every multiplier into the weights, and the file
    states none): transformers' tokens and log-probabilities (1e-4)."""
    import transformers
    config = transformers.FalconH1Config(**{**SHAPE, "vocab_size": 151936, **VARIANTS["no-norm"]})
    config.architectures = ["FalconH1ForCausalLM"]
    torch.manual_seed(4)
    model = transformers.FalconH1ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.1)
        for layer in model.model.layers:
            layer.mamba.dt_bias.uniform_(-2.0, 0.5)
            layer.mamba.A_log.uniform_(-1.0, 1.0)
            layer.mamba.D.normal_(1.0, 0.3)
            layer.mamba.conv1d.bias.normal_(0, 0.1)
    hf = str(tmp_path / "hf")
    model.save_pretrained(hf)
    out = llamacpp_file(tmp_path, hf, "f32")
    prompts = [PROMPTS[1], PROMPTS[2]]
    refs = peft_greedy(hf, None, prompts, MAX_NEW)
    with LLM(str(out), **FP32) as llm:
        got = llm.llm_engine.config.hf_config
        assert got.mamba_d_ssm == 96 and not got.mamba_rms_norm and got.num_hidden_layers == 3
        assert_like_peft(llm.generate(prompts, GREEDY, use_tqdm=False), refs, "F32 file")
