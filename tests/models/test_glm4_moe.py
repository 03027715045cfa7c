"""GLM-4.5 (Glm4MoeForCausalLM) against transformers (fp32, log-probabilities within 1e-4): partial
rotary, q/k norm, biased q/k/v, a dense first layer, and MoE blocks under DeepSeek-V3's router
(sigmoid scores, a correction bias, expert groups, routed_scaling_factor) with a shared expert;
whole and chunked prefills, prefix hits, preemption and TP=2. The router alone against
transformers' own router module; llama.cpp's glm4moe GGUF files (F32, Q8_0) of a checkpoint."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import save_decisive
from lora_adapters import assert_like_peft, peft_greedy
from nanovllm import LLM, SamplingParams
from sliding_checkpoints import check_tp2_equals_tp1

VOCAB, MAX_NEW = 256, 12
FP32 = dict(dtype="float32", kv_cache_dtype="float32", kvcache_block_size=16, cpu_kvcache_bytes=8 << 20)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)
PROMPTS = [[3 + (13 * i + 7 * n) % 250 for i in range(n)] for n in (1, 9, 23, 45)]
# 8 experts in 4 groups of 2, the best 2 groups open, 2 experts a token
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
              rms_norm_eps=1e-6, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
              n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
              use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5, tie_word_embeddings=False,
              eos_token_id=1, bos_token_id=2, pad_token_id=0)


def make_glm4_moe(path: str) -> str:
    import transformers
    config = transformers.Glm4MoeConfig(**CONFIG)
    config.architectures = ["Glm4MoeForCausalLM"]
    torch.manual_seed(3)
    model = transformers.Glm4MoeForCausalLM(config)
    with torch.no_grad():  # a correction bias of the scores' size, so that it moves the choice
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.3)
    return save_decisive(model, path, VOCAB)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = make_glm4_moe(str(tmp_path_factory.mktemp("glm4moe")))
    return path, peft_greedy(path, None, PROMPTS, MAX_NEW)


@pytest.mark.parametrize("engine", [dict(), dict(max_num_batched_tokens=16, max_num_seqs=4)], ids=["whole", "chunked"])
def test_greedy_and_logprobs_match_transformers(checkpoint, engine):
    from nanovllm.executor.cpu_decode import FusedDecode
    path, refs = checkpoint
    with LLM(path, **FP32, **engine) as llm:
        # the C step runs whole layers in its one call: attention (partial rotary, q/k norm), the dense
        # MLP, and the MoE blocks (router, experts by the grouped rule, ungated shared experts)
        fused = llm.llm_engine.model_runner.step_runner(FusedDecode)
        assert [(bool(layer.moe), layer.in_c) for layer in fused.layers] == [(False, 1), (True, 1), (True, 1)]
        layers = llm.llm_engine.model_runner.model.model.layers
        assert layers[0].self_attn.rotary_emb.rotary_dim == 16  # half of head_dim 32
        from safetensors.torch import load_file
        saved = load_file(f"{path}/model.safetensors")["model.layers.2.mlp.gate.e_score_correction_bias"]
        assert torch.equal(layers[2].mlp.experts.e_score_correction_bias, saved)  # the router's, renamed
        for attempt in ("first", "second"):  # the second from prefix-cache hits
            assert_like_peft(llm.generate(PROMPTS, GREEDY, use_tqdm=False), refs, f"{attempt} pass")


def experts_layers(llm):
    from nanovllm.layers.moe import FusedMoE
    return [m for m in llm.llm_engine.model_runner.model.modules() if isinstance(m, FusedMoE)]


def test_the_experts_in_torch_match_too(checkpoint):
    """With the C experts kernel set aside, the experts and moe_ops.select_grouped in torch."""
    path, refs = checkpoint
    with LLM(path, **FP32) as llm:
        for layer in experts_layers(llm):
            assert layer.quant_method.c_moe is not None and layer.quant_method.c_moe.n_group == 4
            layer.quant_method.c_moe = None
        assert_like_peft(llm.generate(PROMPTS, GREEDY, use_tqdm=False), refs, "torch experts")


@pytest.mark.parametrize("where", ["c", "torch"])
def test_the_grouped_router_matters(checkpoint, where):
    """The softmax top-k router in its place (in C: n_group 0; in torch: no grouped rule): not
    transformers' answers."""
    path, refs = checkpoint
    with LLM(path, **FP32) as llm:
        for layer in experts_layers(llm):
            if where == "c":
                layer.quant_method.c_moe.n_group = 0
            else:
                layer.quant_method.c_moe, layer.grouped = None, None
        with pytest.raises(AssertionError):
            assert_like_peft(llm.generate(PROMPTS, GREEDY, use_tqdm=False), refs, "softmax router")


@pytest.mark.parametrize("seed", range(3))
def test_router_matches_transformers_router(seed):
    """Random logits through transformers' Glm4MoeTopkRouter and moe_ops.select_grouped: the same
    experts and weights per token."""
    import transformers
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
    from nanovllm.layers.quantization.moe_ops import GroupedTopK, select_grouped
    config = transformers.Glm4MoeConfig(**{**CONFIG, "n_routed_experts": 16, "n_group": 4, "topk_group": 2,
                                           "num_experts_per_tok": 3})
    torch.manual_seed(seed)
    router = Glm4MoeTopkRouter(config)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        router.e_score_correction_bias.normal_(0, 0.5)
    x = torch.randn(40, config.hidden_size)
    logits, want_w, want_ids = router(x)
    got_w, got_ids = select_grouped(logits, 3, True, GroupedTopK(4, 2, config.routed_scaling_factor),
                                    router.e_score_correction_bias)
    order_want, order_got = want_ids.argsort(dim=-1), got_ids.argsort(dim=-1)
    assert torch.equal(want_ids.gather(1, order_want), got_ids.gather(1, order_got))
    torch.testing.assert_close(want_w.gather(1, order_want), got_w.gather(1, order_got))


def test_bad_groups_are_named():
    from nanovllm.layers.moe import FusedMoE
    from nanovllm.layers.quantization.moe_ops import GroupedTopK
    with pytest.raises(ValueError, match="n_group 3 / topk_group 1 do not split 8 experts"):
        FusedMoE(8, 2, 16, 32, True, prefix="m", grouped=GroupedTopK(3, 1, 1.0))


def test_tp2_matches_tp1_with_prefix_hits_chunks_and_preemption(tmp_path):
    check_tp2_equals_tp1(make_glm4_moe(str(tmp_path)))


def llamacpp_file(tmp_path, outtype: str, hf: str) -> Path:
    """hf written by llama.cpp's convert_hf_to_gguf.py as a glm4moe file. Its GLM vocabulary step
    wants a tokenizer it knows: the vendored Qwen2 one (llamacpp_build.with_qwen2_tokenizer), with
    the GLM special tokens it looks up added on unused ids."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import llamacpp_build
    from nanovllm.utils.cache import cache_root
    llama = llamacpp_build.source_fetched(cache_root())
    if llama is None:
        pytest.skip("llama.cpp's converters are not fetched: run `python scripts/llamacpp_build.py --source` "
                    "(the README's test command does)")
    folder = llamacpp_build.with_qwen2_tokenizer(hf, llama, tmp_path / f"{outtype}-vocab", llamacpp_build.GLM_SPECIALS)
    out = tmp_path / f"glm4moe-{outtype}.gguf"
    done = subprocess.run([sys.executable, str(llama / "convert_hf_to_gguf.py"), str(folder), "--outtype", outtype,
                           "--outfile", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def test_llamacpp_gguf_files(tmp_path):
    """llama.cpp's glm4moe files of a checkpoint (the Qwen2 vocabulary's size; its config names an MTP
    layer, which the file's block count includes and the model leaves out): F32 gives transformers'
    tokens and log-probabilities (1e-4); Q8_0, whose experts run quantized under the C grouped
    router, transformers' log-probabilities within Q8_0's rounding."""
    import transformers
    config = transformers.Glm4MoeConfig(**{**CONFIG, "vocab_size": 151936, "num_nextn_predict_layers": 1})
    config.architectures = ["Glm4MoeForCausalLM"]
    torch.manual_seed(4)
    model = transformers.Glm4MoeForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2 or p.abs().sum() == 0:
                p.normal_(0, 0.1)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.3)
    hf = str(tmp_path / "hf")
    model.save_pretrained(hf)  # no tokenizer: the converter gets the Qwen2 one
    prompts = PROMPTS[1:3]
    refs = peft_greedy(hf, None, prompts, MAX_NEW)
    with LLM(str(llamacpp_file(tmp_path, "f32", hf)), **FP32) as llm:
        assert llm.llm_engine.config.hf_config.num_hidden_layers == 3  # the MTP layer left out
        assert_like_peft(llm.generate(prompts, GREEDY, use_tqdm=False), refs, "F32 file")
    # Q8_0: teacher-forced on transformers' greedy sequences (this random model's 151936-way
    # distributions are near flat, so rounding flips near-tied argmaxes)
    with LLM(str(llamacpp_file(tmp_path, "q8_0", hf)), **FP32) as llm:
        for prompt, (tokens, logprobs) in zip(prompts, refs):
            seq = prompt + tokens
            out = llm.generate([seq], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                               use_tqdm=False)[0]
            ours = torch.tensor([entry[t] for entry, t in zip(out["prompt_logprobs"][len(prompt):], tokens)])
            theirs = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]
            assert (ours - theirs).abs().max() < 0.06, (ours - theirs).abs().max()
