"""Granite 4.0-H (GraniteMoeHybridForCausalLM: models/granite_hybrid.py, layers/mamba2.py) against
transformers (fp32, its torch SSD fallback; greedy tokens and log-probabilities within 1e-4):
Mamba-2 layers beside attention, MoE blocks with the shared MLP, Granite's multipliers; prompts past
one and two 64-token SSD chunks, whole and chunked prefills (a chunk split across steps), a second
pass, forced preemption, TP=2 (one group: B and C whole on each rank, the norm summed across them;
two groups: split), the decode step in the C one call, in a C call per Mamba-2 layer, in torch.
Each checked to fail with the SSM state or the conv state dropped between steps. The chunked scan
against the one-token rule. llama.cpp's granitehybrid GGUF files."""
import json
import random
from pathlib import Path

import pytest
import torch

from lora_adapters import assert_like_peft, peft_greedy
from nanovllm import LLM, SamplingParams
from state_models import (FP32, GRANITE_PROMPTS as PROMPTS, GRANITE_SHAPE as SHAPE, check_eager_mamba2_decode, counted,
                          generate, llamacpp_file, make_granite as make, mixers, without_one_call,
                          zeroed_before_each_step)

VOCAB, MAX_NEW = 256, 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)
@pytest.fixture(scope="module", params=["groups1", "groups2"])
def checkpoint(request, tmp_path_factory):
    extra = dict(mamba_n_groups=2) if request.param == "groups2" else dict(num_local_experts=0,
                                                                          position_embedding_type=None)
    path = make(str(tmp_path_factory.mktemp(request.param)), **extra)
    return path, peft_greedy(path, None, PROMPTS, MAX_NEW)




@pytest.mark.parametrize("engine", [dict(), dict(max_num_batched_tokens=40, max_num_seqs=2)], ids=["whole", "chunked"])
def test_greedy_and_logprobs_match_transformers(checkpoint, engine, monkeypatch):
    """The decode steps in the C one call (every layer: the Mamba-2 mixers, attention, the MoE block
    or shared MLP, Granite's multipliers; its calls counted), a second pass of the same prompts."""
    from nanovllm.executor.cpu_decode import FusedDecode
    path, refs = checkpoint
    with LLM(path, **FP32, **engine) as llm:
        fused = llm.llm_engine.model_runner.step_runner(FusedDecode)
        assert fused is not None and fused.hybrid and fused.one_call_layers == 4
        assert [bool(layer.mamba2) for layer in fused.layers] == [True, False, True, False]
        assert fused.desc.embed_scale == 12.0 and fused.desc.logit_scale == 0.25
        calls = counted(monkeypatch, fused.kernels, "decode_layers")
        for attempt in ("first", "second"):
            assert_like_peft(llm.generate(PROMPTS, GREEDY, use_tqdm=False), refs, f"{attempt} pass")
        assert len(calls) >= 2 * (MAX_NEW - 1)


@pytest.mark.parametrize("where", ["c", "torch"])
def test_the_eager_decode_matches_too(checkpoint, where, monkeypatch):
    check_eager_mamba2_decode(*checkpoint, PROMPTS, GREEDY, where, monkeypatch)


@pytest.mark.parametrize("which", ["ssm", "conv"])
@pytest.mark.parametrize("where", ["one call", "torch"])
def test_each_state_matters(checkpoint, which, where, monkeypatch):
    """The SSM states, or the conv states, zeroed before each step: not transformers' answers."""
    path, refs = checkpoint
    with LLM(path, **FP32, max_num_batched_tokens=40, max_num_seqs=2) as llm:
        layers = mixers(llm)
        if where == "torch":
            without_one_call(llm)
            for m in layers:
                m.c_desc = None
        zeroed_before_each_step(monkeypatch, [getattr(m.state, which) for m in layers])
        with pytest.raises(AssertionError):
            assert_like_peft(llm.generate(PROMPTS, GREEDY, use_tqdm=False), refs, f"no {which} state")


def test_preemption_recomputes_the_state(checkpoint):
    path, _ = checkpoint
    rng = random.Random(1)
    batch = [[rng.randrange(3, VOCAB) for _ in range(120)] for _ in range(4)]
    want, _ = generate(path, batch, MAX_NEW)
    with LLM(path, **FP32) as llm:
        slot = sum(m.slot_bytes() for m in mixers(llm))
    # 4 state slots, and 33 blocks of 16 tokens of the two attention layers (K and V, 2 heads of 16,
    # fp32): 8 blocks each at admission, 9 by the end
    got, preempted = generate(path, batch, MAX_NEW, max_num_seqs=4,
                              cpu_kvcache_bytes=4 * slot + 33 * (2 * 2 * 16 * 2 * 16 * 4))
    assert preempted > 0
    assert got == want


def test_tp2_matches_tp1(checkpoint):
    """Two ranks, each half the Mamba-2 heads (their x, z, dt, conv channels, A_log, D, dt_bias and
    norm weights) and half the attention heads: one rank's tokens, chunked and mixed."""
    path, _ = checkpoint
    engine = dict(max_num_batched_tokens=40, max_num_seqs=2)
    want, _ = generate(path, PROMPTS, MAX_NEW, **engine)
    got, _ = generate(path, PROMPTS, MAX_NEW, tensor_parallel_size=2, **engine)
    assert got == want


@pytest.mark.parametrize("length", [1, 63, 64, 65, 150])
def test_chunked_scan_matches_the_one_token_rule(length):
    """ssd_chunked from a nonzero state against ssd_step token by token: outputs and final state."""
    from nanovllm.layers.mamba2 import ssd_chunked, ssd_step
    torch.manual_seed(length)
    heads, p, n = 3, 4, 5
    x, B, C = torch.randn(length, heads, p), torch.randn(length, heads, n), torch.randn(length, heads, n)
    dt, A = torch.rand(length, heads) * 0.5, -torch.rand(heads) * 2
    start = torch.randn(heads, p, n)
    state = start.clone()
    got = ssd_chunked(state, x, dt, A, B, C, chunk=64)
    ref_state = start.clone()[None]
    want = torch.stack([ssd_step(ref_state, x[t][None], dt[t][None], A, B[t][None], C[t][None])[0]
                        for t in range(length)])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, ref_state[0], rtol=1e-4, atol=1e-4)


def granite_file(tmp_path: Path, hf: str, outtype: str) -> Path:
    """hf as llama.cpp's converter writes a granitehybrid file: its config's layer types in the hub's
    names first (mamba / attention, which the converter looks for)."""
    config = json.loads((Path(hf) / "config.json").read_text())
    config["layer_types"] = ["mamba" if t == "linear_attention" else "attention" for t in config["layer_types"]]
    (Path(hf) / "config.json").write_text(json.dumps(config))
    return llamacpp_file(tmp_path, hf, outtype)


@pytest.mark.parametrize("experts, outtype", [(4, "f32"), (0, "f32"), (4, "q8_0")], ids=["moe", "dense", "moe-q8_0"])
def test_llamacpp_gguf_files(tmp_path, experts, outtype):
    """llama.cpp's granitehybrid files of a checkpoint (the Qwen2 vocabulary's size; no rotary, as
    Granite 4.0-H has none): F32 files, with experts (the shared MLP as *_shexp) and without (as
    ffn_*), give transformers' tokens and log-probabilities (1e-4); the Q8_0 file (its shared down
    projection F16: 48 inputs are not whole blocks) transformers' log-probabilities within Q8_0's
    rounding, teacher-forced on its tokens."""
    import transformers
    config = transformers.GraniteMoeHybridConfig(**{**SHAPE, "vocab_size": 151936, "position_embedding_type": None,
                                                    "num_local_experts": experts})
    config.architectures = ["GraniteMoeHybridForCausalLM"]
    torch.manual_seed(4)
    model = transformers.GraniteMoeHybridForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.1)
        for layer in model.model.layers:
            if layer.mamba is not None:
                layer.mamba.dt_bias.uniform_(-2.0, 0.5)
                layer.mamba.A_log.uniform_(-1.0, 1.0)
                layer.mamba.D.normal_(1.0, 0.3)
                layer.mamba.conv1d.bias.normal_(0, 0.1)
                layer.mamba.norm.weight.normal_(1, 0.1)
    hf = str(tmp_path / "hf")
    model.save_pretrained(hf)
    prompts = [PROMPTS[1], PROMPTS[2]]
    refs = peft_greedy(hf, None, prompts, MAX_NEW)
    with LLM(str(granite_file(tmp_path, hf, outtype)), **FP32) as llm:
        got = llm.llm_engine.config.hf_config
        from nanovllm.models.granite_hybrid import granite_layer_kinds
        assert granite_layer_kinds(got) == ["mamba", "attention"] * 2 and got.position_embedding_type is None
        if outtype == "f32":
            assert_like_peft(llm.generate(prompts, GREEDY, use_tqdm=False), refs, "F32 file")
            return
        for prompt, (tokens, logprobs) in zip(prompts, refs):
            out = llm.generate([prompt + tokens], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                               use_tqdm=False)[0]
            ours = torch.tensor([entry[t] for entry, t in zip(out["prompt_logprobs"][len(prompt):], tokens)])
            theirs = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]
            assert (ours - theirs).abs().max() < 0.05, (ours - theirs).abs()


def test_bad_configs_are_named():
    from types import SimpleNamespace
    from nanovllm.layers.mamba2 import Mamba2Mixer
    from nanovllm.models.granite_hybrid import granite_layer_kinds
    with pytest.raises(ValueError, match="layer_types\\[1\\] is 'conv'"):
        granite_layer_kinds(SimpleNamespace(num_hidden_layers=2, layer_types=["mamba", "conv"]))
    config = SimpleNamespace(hidden_size=64, mamba_n_heads=8, mamba_n_groups=3, mamba_d_head=16, mamba_d_state=16,
                             mamba_d_conv=4, mamba_expand=2, rms_norm_eps=1e-6)
    with pytest.raises(ValueError, match="mamba_n_groups \\(3\\) must divide mamba_n_heads \\(8\\)"):
        Mamba2Mixer(config)
    with pytest.raises(ValueError, match="mamba_n_heads x mamba_d_head \\(8 x 8\\)"):
        Mamba2Mixer(SimpleNamespace(**{**vars(config), "mamba_n_groups": 1, "mamba_d_head": 8}))
