"""LFM2 and LFM2-MoE (models/lfm2.py, layers/short_conv.py) against transformers (fp32, greedy
tokens and log-probabilities within 1e-4): short-convolution layers beside attention layers with
q/k norm, the adjusted MLP width, LFM2-MoE's sigmoid router with its expert bias; whole and chunked
prefills (a prompt's convolution split across steps), a second pass, forced preemption, TP=2; the
C one-call decode step and the torch one. Each is checked to fail with the convolution's state
dropped between steps or the router's bias left out. llama.cpp's lfm2 / lfm2moe GGUF files."""
import random
from pathlib import Path

import pytest
import torch

from helpers import save_decisive
from lora_adapters import assert_like_peft, peft_greedy
from nanovllm import LLM, SamplingParams
from state_models import FP32, counted, generate, llamacpp_file, modules_of, without_one_call, zeroed_before_each_step

VOCAB, MAX_NEW = 256, 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)
PROMPTS = [[3 + (13 * i + 7 * n) % 250 for i in range(n)] for n in (1, 9, 23, 45)]
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, norm_eps=1e-5, conv_L_cache=3,
             layer_types=["conv", "full_attention", "conv", "full_attention"], eos_token_id=1, bos_token_id=2,
             pad_token_id=0)
# LFM2: the MLP 2/3 of intermediate_size rounded up to 32 (64); LFM2-MoE: one dense layer, then 8
# experts of 32 under the biased sigmoid router, 2 a token, the weights scaled by 2
DENSE = dict(block_multiple_of=32, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True)
MOE = dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, num_dense_layers=1,
           routed_scaling_factor=2.0)


def build(family: str, seed: int = 3, **overrides):
    import transformers
    name = "Lfm2" if family == "lfm2" else "Lfm2Moe"
    config = getattr(transformers, f"{name}Config")(**{**SHAPE, **(DENSE if family == "lfm2" else MOE), **overrides})
    config.architectures = [f"{name}ForCausalLM"]
    torch.manual_seed(seed)
    model = getattr(transformers, f"{name}ForCausalLM")(config)
    with torch.no_grad():  # (a buffer: save_decisive leaves it) a bias of the scores' size, so that it moves the choice
        for layer in model.model.layers[config.num_dense_layers:] if family != "lfm2" else []:
            layer.feed_forward.expert_bias.normal_(0, 0.3)
    return model


@pytest.fixture(scope="module", params=["lfm2", "lfm2_moe"])
def checkpoint(request, tmp_path_factory):
    path = save_decisive(build(request.param), str(tmp_path_factory.mktemp(request.param)), VOCAB)
    return request.param, path, peft_greedy(path, None, PROMPTS, MAX_NEW)


def short_convs(llm):
    from nanovllm.layers.short_conv import ShortConv
    return modules_of(llm, ShortConv)


@pytest.mark.parametrize("engine", [dict(), dict(max_num_batched_tokens=16, max_num_seqs=4)], ids=["whole", "chunked"])
def test_greedy_and_logprobs_match_transformers(checkpoint, engine, monkeypatch):
    """The decode steps in the C one call (its calls counted), a second pass of the same prompts."""
    from nanovllm.executor.cpu_decode import FusedDecode
    family, path, refs = checkpoint
    with LLM(path, **FP32, **engine) as llm:
        fused = llm.llm_engine.model_runner.step_runner(FusedDecode)
        assert fused is not None and fused.hybrid and fused.one_call_layers == 4
        assert [bool(layer.short_conv) for layer in fused.layers] == [True, False, True, False]
        if family == "lfm2":  # the adjusted width: int(2 * 96 / 3) = 64, a multiple of 32
            assert llm.llm_engine.model_runner.model.model.layers[0].mlp.down_proj.input_size == 64
        calls = counted(monkeypatch, fused.kernels, "decode_layers")
        for attempt in ("first", "second"):
            assert_like_peft(llm.generate(PROMPTS, GREEDY, use_tqdm=False), refs, f"{attempt} pass")
        assert len(calls) >= 2 * (MAX_NEW - 1)


def test_biased_convolutions(tmp_path):
    """conv_bias: in_proj, the taps and out_proj biased, through the C step and torch's prefill."""
    path = save_decisive(build("lfm2", conv_bias=True), str(tmp_path), VOCAB)
    refs = peft_greedy(path, None, PROMPTS, MAX_NEW)
    with LLM(path, **FP32) as llm:
        assert all(conv.c_desc.conv_bias for conv in short_convs(llm))
        assert_like_peft(llm.generate(PROMPTS, GREEDY, use_tqdm=False), refs, "biased")


def test_the_torch_steps_match_too(checkpoint):
    """With the C step set aside, the short convolution's torch decode (every sequence's state at once)."""
    _, path, refs = checkpoint
    with LLM(path, **FP32, max_num_batched_tokens=16, max_num_seqs=4) as llm:
        without_one_call(llm)
        assert_like_peft(llm.generate(PROMPTS, GREEDY, use_tqdm=False), refs, "torch steps")


@pytest.mark.parametrize("where", ["c", "torch"])
def test_the_convolution_state_matters(checkpoint, where, monkeypatch):
    """Every state slot zeroed before each step (the taps then see only this step's inputs): not
    transformers' answers, with the decode steps in C or in torch."""
    _, path, refs = checkpoint
    with LLM(path, **FP32, max_num_batched_tokens=16, max_num_seqs=4) as llm:
        if where == "torch":
            without_one_call(llm)
        zeroed_before_each_step(monkeypatch, [conv.state for conv in short_convs(llm)])
        with pytest.raises(AssertionError):
            assert_like_peft(llm.generate(PROMPTS, GREEDY, use_tqdm=False), refs, "no state")


def test_the_expert_bias_matters(tmp_path):
    """LFM2-MoE's router with its bias left out of the choice: not transformers' answers."""
    path = save_decisive(build("lfm2_moe"), str(tmp_path), VOCAB)
    refs = peft_greedy(path, None, PROMPTS, MAX_NEW)
    with LLM(path, **FP32) as llm:
        from nanovllm.layers.moe import FusedMoE
        experts = [m for m in llm.llm_engine.model_runner.model.modules() if isinstance(m, FusedMoE)]
        assert len(experts) == 3 and all(e.e_score_correction_bias.abs().sum() > 0 for e in experts)
        for layer in experts:
            layer.e_score_correction_bias.zero_()
        with pytest.raises(AssertionError):
            assert_like_peft(llm.generate(PROMPTS, GREEDY, use_tqdm=False), refs, "no expert bias")


def test_preemption_recomputes_the_state(checkpoint):
    """A cache too small for all four at once: sequences preempted and recomputed from their tokens
    (their state slots freed and taken again from zero) give the same tokens."""
    _, path, _ = checkpoint
    rng = random.Random(1)
    batch = [[rng.randrange(3, VOCAB) for _ in range(120)] for _ in range(4)]
    want, _ = generate(path, batch, MAX_NEW)
    # 4 slots of 2 conv layers' 64 channels x 2 inputs (fp32), and 33 blocks of 16 tokens of the two
    # attention layers (K and V, 2 heads of 16): 8 blocks each at admission, 9 by the end
    slot = 2 * 64 * 2 * 4
    got, preempted = generate(path, batch, MAX_NEW, max_num_seqs=4,
                              cpu_kvcache_bytes=4 * slot + 33 * (2 * 2 * 16 * 2 * 16 * 4))
    assert preempted > 0
    assert got == want


def test_tp2_matches_tp1(checkpoint):
    """Two ranks, each with half of every short convolution's channels (its B, C and x rows, taps and
    out_proj inputs) and half the attention heads: the tokens of one rank, chunked and mixed."""
    _, path, _ = checkpoint
    engine = dict(max_num_batched_tokens=16, max_num_seqs=2)
    want, _ = generate(path, PROMPTS, MAX_NEW, **engine)
    got, _ = generate(path, PROMPTS, MAX_NEW, tensor_parallel_size=2, **engine)
    assert got == want


def q8_0_rounded(model, gguf_path: Path) -> None:
    """model's matrices as the file holds them: each one the file stores as Q8_0 (every matrix whose
    rows are whole blocks of 32, the conv taps and, where the file keeps it F32, the router not)
    quantized and dequantized by gguf.quants, the converter's own quantizer."""
    import gguf
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(gguf_path)).tensors}
    router_q8 = types.get("blk.1.ffn_gate_inp.weight") == gguf.GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and p.shape[-1] % 32 == 0 and (router_q8 or ".feed_forward.gate." not in name):
                rows = p.detach().reshape(-1, p.shape[-1]).numpy()
                blocks = gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q8_0)
                rounded = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0)
                p.copy_(torch.from_numpy(rounded).reshape(p.shape))


@pytest.mark.parametrize("family, outtype", [("lfm2", "f32"), ("lfm2_moe", "q8_0")])
def test_llamacpp_gguf_files(tmp_path, family, outtype):
    """llama.cpp's lfm2 / lfm2moe files of a checkpoint (the Qwen2 vocabulary's size; the converter
    writes LFM2's adjusted MLP width, each layer's kind as its KV heads, no routed scale, so the MoE's
    is 1 here): F32 gives transformers' tokens and log-probabilities (1e-4); Q8_0, its matrices
    multiplied as the file's blocks, transformers' on the same weights dequantized (1e-3: the inputs
    rounded to 14 bits)."""
    model = build(family, seed=4, vocab_size=151936, **({} if family == "lfm2" else dict(routed_scaling_factor=1.0)))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2 or p.abs().sum() == 0:
                p.normal_(0, 0.1)
    hf = str(tmp_path / "hf")
    model.save_pretrained(hf)
    path = llamacpp_file(tmp_path, hf, outtype)
    if outtype == "q8_0":
        q8_0_rounded(model, path)
        hf = str(tmp_path / "hf-q8")
        model.save_pretrained(hf)
    prompts = PROMPTS[1:3]
    refs = peft_greedy(hf, None, prompts, MAX_NEW)
    with LLM(str(path), **FP32, cpu_input_bits=14) as llm:
        config = llm.llm_engine.config.hf_config
        assert config.layer_types == SHAPE["layer_types"] and config.num_key_value_heads == 2
        in_proj = llm.llm_engine.model_runner.model.model.layers[0].conv.in_proj
        held = type(in_proj.quant_method).__name__
        assert held == ("GGUFLinearMethod" if outtype == "q8_0" else "UnquantizedLinearMethod")  # B, C, x as blocks
        assert_like_peft(llm.generate(prompts, GREEDY, use_tqdm=False), refs, f"{outtype} file",
                         atol=1e-4 if outtype == "f32" else 1e-3)


def test_bad_configs_are_named():
    from types import SimpleNamespace
    from nanovllm.models.lfm2 import lfm2_layer_types
    from nanovllm.layers.short_conv import ShortConv
    with pytest.raises(ValueError, match="layer_types\\[1\\] is 'mamba'"):
        lfm2_layer_types(SimpleNamespace(num_hidden_layers=2, layer_types=["conv", "mamba"]))
    with pytest.raises(ValueError, match="conv_L_cache is 12"):
        ShortConv(SimpleNamespace(hidden_size=8, conv_L_cache=12))
