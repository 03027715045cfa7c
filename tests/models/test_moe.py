"""Mixture-of-experts models (layers/moe.py, kernels/cpu_moe.c): tiny random Qwen3-MoE
(norm_topk_prob on and off, mlp_only_layers, decoder_sparse_step), Qwen2-MoE (shared expert) and
Mixtral checkpoints written by transformers give transformers' greedy tokens, in the one-call C
decode step and in the layer-by-layer path, also under chunked prefill, preemption, prefix caching
and TP=2; the C experts kernel equals the grouped torch loop, which equals transformers' own sparse
block; no expert that no token chose is read; bad configs and checkpoints are errors naming what
is wrong."""
import json
import os
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import check_tokens_close, hf_greedy
from nanovllm import LLM, SamplingParams
from nanovllm.kernels import cpu_kernels
from nanovllm.layers.quantization.moe_ops import experts_reference, select_experts
from nanovllm.executor.cpu_decode import FusedDecode
from moe_checkpoints import TINY, VOCAB, make_moe  # noqa: E402

MAX_NEW = 24


@pytest.fixture(scope="module", params=sorted(TINY))
def tiny_moe(request, tmp_path_factory) -> tuple[str, str]:
    return request.param, make_moe(str(tmp_path_factory.mktemp(request.param)), request.param)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory) -> str:
    return make_moe(str(tmp_path_factory.mktemp("qwen3_moe")), "qwen3_moe_norm", seed=1)


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 7, 17, 40)]


def greedy(path: str, batch, **kwargs) -> list[list[int]]:
    with LLM(path, kvcache_block_size=16, dtype="float32", kv_cache_dtype="float32", cpu_kvcache_bytes=32 << 20, **kwargs) as llm:
        outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    return [o["token_ids"] for o in outs]


def test_checkpoints_are_as_named(tiny_moe):
    """Guards the fixtures: the hub layout (one tensor per expert and matrix), the sparse layers."""
    name, path = tiny_moe
    names = load_file(os.path.join(path, "model.safetensors")).keys()
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    experts = {n.split(".experts.")[1].split(".")[0] for n in names if ".experts." in n}
    assert len(experts) == (cfg.get("num_experts") or cfg.get("num_local_experts"))
    sparse = {int(n.split(".")[2]) for n in names if ".experts." in n}
    layers = cfg["num_hidden_layers"]
    assert sparse == {"qwen3_moe_norm": {0, 2}, "qwen3_moe_step2": {1, 3}}.get(name, set(range(layers)))
    assert any("shared_expert_gate" in n for n in names) == (name == "qwen2_moe_shared")


def test_greedy_matches_transformers(tiny_moe):
    _, path = tiny_moe
    batch = prompts()
    ref = hf_greedy(path, batch, MAX_NEW)
    exact = check_tokens_close(greedy(path, batch), ref)
    assert exact >= len(batch) - 1, f"only {exact}/{len(batch)} prompts matched exactly"


def test_decode_step_runs_the_moe_layers_in_one_c_call(tiny_moe, monkeypatch):
    """The one-call decode step takes the sparse layers (shared expert included), and the
    layer-by-layer path (each block's own module) gives the same tokens."""
    if cpu_kernels.load() is None:
        pytest.skip("no C kernels on this machine")
    _, path = tiny_moe
    with LLM(path, kvcache_block_size=16, dtype="float32", kv_cache_dtype="float32", cpu_kvcache_bytes=32 << 20) as llm:
        fused = llm.llm_engine.model_runner.step_runner(FusedDecode)
        layers = llm.llm_engine.model_runner.model.model.layers
        sparse = sum(type(layer.mlp).__name__ == "SparseMoeBlock" for layer in layers)
        assert sparse > 0 and len(fused.moes) == sparse and fused.one_call_layers == len(layers)
    one_call = greedy(path, prompts())
    monkeypatch.setenv("NANOVLLM_CPU_FUSED_DECODE", "0")
    assert greedy(path, prompts()) == one_call


def test_scheduling_and_tp2_keep_transformers_tokens(qwen3_moe):
    """A prefix-cache hit, a chunked prompt and preemption (test_tp's workload), at TP=1 and TP=2:
    every request's tokens are transformers' greedy tokens for its prompt."""
    from tp_workloads import run_mixed_workload

    tokens1, steps1, preempted1, _, _ = run_mixed_workload(qwen3_moe, tp=1)
    tokens2, _, preempted2, _, _ = run_mixed_workload(qwen3_moe, tp=2)
    assert preempted1 > 0 and preempted2 > 0
    assert any(cached > 0 for is_prefill, seqs in steps1 if is_prefill for cached, *_ in seqs)
    assert tokens2 == tokens1
    block = 16
    shared = list(range(3, 3 + 2 * block))
    batch = [shared + [99], shared + [100, 101], list(range(40, 80)), list(range(150, 162)), list(range(200, 220))]
    ref = hf_greedy(qwen3_moe, batch, 24)
    exact = check_tokens_close(tokens1, [(t[:len(ours)], logits) for (t, logits), ours in zip(ref, tokens1)])
    assert exact >= len(batch) - 1


# ---- the experts kernels ------------------------------------------------------------------------
def random_experts(num_experts: int, hidden: int, inter: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.2
    w2 = torch.randn(num_experts, hidden, inter, generator=g) * 0.2
    return w13, w2, g


def c_moe(w13, w2, top_k, renormalize):
    from nanovllm.layers.quantization.unquantized import dense_c_view

    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("no C kernels on this machine")
    views = [[dense_c_view(w[e]) for e in range(w.shape[0])] for w in (w13, w2)]
    return kernels, cpu_kernels.moe_experts_struct(kernels, views[0], views[1], top_k, renormalize)


@pytest.mark.parametrize("rows,top_k,renormalize", [(1, 2, True), (3, 3, False), (17, 2, False), (64, 4, True)])
def test_c_experts_equal_the_grouped_torch_loop(rows, top_k, renormalize):
    w13, w2, g = random_experts(8, 64, 40, seed=rows)
    x = torch.randn(rows, 64, generator=g)
    logits = torch.randn(rows, 8, generator=g)
    logits[:, 5:] -= 100.0  # experts 5-7 receive no token
    kernels, moe = c_moe(w13, w2, top_k, renormalize)
    ours = cpu_kernels.moe_experts(kernels, moe, x, logits)
    weights, ids = select_experts(logits, top_k, renormalize)
    assert not (ids >= 5).any()
    torch.testing.assert_close(ours, experts_reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_experts_no_token_chose_are_not_read():
    """NaN in every expert no row routes to: a kernel that touched them (a dense pass over all
    experts, masked by zero weights) would give NaN."""
    w13, w2, g = random_experts(16, 64, 32, seed=5)
    x = torch.randn(2, 64, generator=g)
    logits = torch.full((2, 16), -50.0)
    logits[0, [3, 9]] = torch.tensor([1.0, 0.5])
    logits[1, [9, 12]] = torch.tensor([0.2, 0.9])
    weights, ids = select_experts(logits, 2, True)
    expected = experts_reference(x, w13, w2, weights, ids)
    poisoned13, poisoned2 = w13.clone(), w2.clone()
    for e in set(range(16)) - {3, 9, 12}:
        poisoned13[e], poisoned2[e] = float("nan"), float("nan")
    kernels, moe = c_moe(poisoned13, poisoned2, 2, True)
    ours = cpu_kernels.moe_experts(kernels, moe, x, logits)
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(experts_reference(x, poisoned13, poisoned2, weights, ids), expected)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_sparse_block_equals_transformers_block(norm_topk_prob):
    """Our SparseMoeBlock (the torch path and the C experts) against transformers' Qwen2-MoE block
    (router, experts and the shared expert with its gate) on the same weights."""
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    from nanovllm.models.moe_block import SparseMoeBlock, expert_stacked_params
    from nanovllm.loader import load_weights
    from nanovllm.models.decoder import DecoderForCausalLM
    from nanovllm.models.qwen_moe import Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(hidden_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                            num_experts=6, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob)
    torch.manual_seed(0)
    hf = Qwen2MoeSparseMoeBlock(config).float()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    ours = SparseMoeBlock(config, "mlp", None, norm_topk_prob, 24)
    hub = {"mlp.gate.weight": hf.gate.weight, "mlp.shared_expert_gate.weight": hf.shared_expert_gate.weight}
    for part in ("gate_proj", "up_proj", "down_proj"):
        hub[f"mlp.shared_expert.{part}.weight"] = getattr(hf.shared_expert, part).weight
    inter = config.moe_intermediate_size
    for e in range(6):  # transformers holds them stacked; the hub files hold one tensor per expert
        hub[f"mlp.experts.{e}.gate_proj.weight"] = hf.experts.gate_up_proj[e, :inter]
        hub[f"mlp.experts.{e}.up_proj.weight"] = hf.experts.gate_up_proj[e, inter:]
        hub[f"mlp.experts.{e}.down_proj.weight"] = hf.experts.down_proj[e]
    holder = torch.nn.Module()
    holder.mlp = ours
    stacked = expert_stacked_params(6) + DecoderForCausalLM.stacked_params(Qwen2MoeForCausalLM)
    load_weights(holder, [(n, t.detach()) for n, t in hub.items()], stacked)
    x = torch.randn(9, 32)
    with torch.no_grad():
        expected = hf(x[None])[0]
        torch.testing.assert_close(ours(x), expected, rtol=1e-5, atol=1e-5)
        from nanovllm.layers.quantization import LinearKernels
        kernels = cpu_kernels.load()
        if kernels is not None:  # the C experts on the same weights
            ours.experts.quant_method.process_weights_after_loading(
                ours.experts, LinearKernels(c_kernels=kernels), False)
            assert ours.experts.quant_method.c_struct(ours.experts) is not None
            torch.testing.assert_close(ours(x), expected, rtol=1e-5, atol=1e-5)


# ---- bad configs and checkpoints ----------------------------------------------------------------
def rewrite_config(path: str, **changes) -> None:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def test_unknown_router_option_is_named(tmp_path):
    path = make_moe(str(tmp_path / "m"), "qwen3_moe_norm")
    rewrite_config(path, scoring_func="sigmoid")
    with pytest.raises(ValueError, match="scoring_func='sigmoid'"):
        LLM(path, dtype="float32", cpu_kvcache_bytes=1 << 20)


def test_missing_expert_tensor_is_named(tmp_path):
    path = make_moe(str(tmp_path / "m"), "qwen3_moe_norm")
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        LLM(path, dtype="float32", cpu_kvcache_bytes=1 << 20)


def test_intermediate_size_that_does_not_split_is_named(tmp_path):
    path = make_moe(str(tmp_path / "m"), "qwen3_moe_norm")
    rewrite_config(path, moe_intermediate_size=33)
    with pytest.raises(ValueError, match=r"must divide the model's moe_intermediate_size \(33\)"):
        LLM(path, dtype="float32", tensor_parallel_size=2, cpu_kvcache_bytes=1 << 20)


def test_each_rank_loads_its_part_of_every_expert(qwen3_moe, monkeypatch):
    from nanovllm.config import Config
    from nanovllm.layers import embed_head, linear, moe
    from nanovllm.loader import load_model
    from nanovllm.models import get_model_class

    ckpt = load_file(os.path.join(qwen3_moe, "model.safetensors"))
    for rank in (0, 1):
        for module in (linear, embed_head, moe):
            monkeypatch.setattr(module, "get_tp_rank", lambda: rank)
            monkeypatch.setattr(module, "get_tp_size", lambda: 2)
        hf_config = Config(qwen3_moe, dtype="float32").hf_config
        model = get_model_class(hf_config)(hf_config).float()
        load_model(model, qwen3_moe)
        experts = model.model.layers[2].mlp.experts
        for e in range(8):
            name = f"model.layers.2.mlp.experts.{e}"
            half = lambda part, dim: ckpt[f"{name}.{part}.weight"].chunk(2, dim=dim)[rank]  # noqa: E731
            assert torch.equal(experts.w13_weight[e], torch.cat([half("gate_proj", 0), half("up_proj", 0)]))
            assert torch.equal(experts.w2_weight[e], half("down_proj", 1))
        assert torch.equal(model.model.layers[2].mlp.gate.weight, ckpt["model.layers.2.mlp.gate.weight"])


def test_efficiency_counts_the_active_experts(qwen3_moe):
    """bench.py --efficiency's batch-1 floor counts top_k of each sparse layer's experts (by hand:
    2 sparse layers x 8 experts x 3 matrices of 64 x 32 fp32; 2 of the 8 read per token)."""
    from nanovllm.utils.efficiency import active_expert_params, expert_bytes

    with LLM(qwen3_moe, dtype="float32", cpu_kvcache_bytes=1 << 20) as llm:
        model = llm.llm_engine.model_runner.model
        assert expert_bytes(model) == (2 * 8 * 3 * 64 * 32 * 4, 2 * 2 * 3 * 64 * 32 * 4)
        assert active_expert_params(model) == 2 * 2 * 3 * 64 * 32
