"""Hybrid linear-attention models (Qwen3.5 dense and MoE, Qwen3-Next; models/qwen3_next.py,
layers/gated_deltanet.py) against transformers' greedy tokens (fp32, its torch fallback of the
gated delta rule): prompts longer than a 64-token chunk, chunked prefill splitting a chunk, batches
of mixed lengths, forced preemption; the chunked rule against the one-token rule; a reused state
slot starts from zero; bad configs named."""
import random

import pytest
import torch

from helpers import check_tokens_close, hf_greedy
from nanovllm import LLM, SamplingParams
from hybrid_checkpoints import MAX_NEW, SHAPE, VOCAB, generate, make_checkpoint, prompts, write_gguf  # noqa: E402


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def checkpoint(request, tmp_path_factory) -> tuple[str, str]:
    return request.param, make_checkpoint(request.param, str(tmp_path_factory.mktemp(request.param)))


@pytest.mark.parametrize("engine", [{}, {"max_num_batched_tokens": 40, "max_num_seqs": 2}], ids=["whole", "chunked"])
def test_greedy_matches_transformers(checkpoint, engine):
    """Whole prefills of a mixed batch; or chunks of 40 tokens (a 64-token delta-rule chunk split
    across steps, two sequences at a time, decode rows beside prefill rows)."""
    _, path = checkpoint
    ref = hf_greedy(path, prompts(), MAX_NEW, mask_eos=False)
    ours, _ = generate(path, prompts(), **engine)
    assert check_tokens_close(ours, ref) == len(ref)


def test_preemption_recomputes_the_state(checkpoint):
    """A cache too small for all four at once: sequences preempted and recomputed from their
    tokens (their state slots freed and taken again from zero) give the same tokens."""
    _, path = checkpoint
    rng = random.Random(1)
    batch = [[rng.randrange(3, VOCAB) for _ in range(120)] for _ in range(4)]
    want, _ = generate(path, batch)
    # 4 state slots (3 linear layers: conv inputs and delta state, fp32; at most half the budget) and 33
    # blocks of 16 tokens of the one full layer (K and V, 2 heads of 32, fp32): 8 blocks each at
    # admission, 9 each by the end
    channels = 2 * 2 * 16 + 4 * 32
    slot = 3 * 4 * (channels * 3 + 4 * 16 * 32)
    got, preempted = generate(path, batch, max_num_seqs=4, kv_cache_dtype="float32",
                              cpu_kvcache_bytes=4 * slot + 33 * (2 * 16 * 2 * 32 * 4))
    assert preempted > 0
    assert got == want


def test_tp2_matches_tp1(checkpoint):
    """Two ranks, each with half the key and value heads of every linear layer (their conv channels,
    A_log, dt_bias) and half the full layers' heads: the tokens of one rank, chunked and mixed."""
    _, path = checkpoint
    engine = dict(max_num_batched_tokens=40, max_num_seqs=2)
    want, _ = generate(path, prompts(), **engine)
    got, _ = generate(path, prompts(), tensor_parallel_size=2, **engine)
    assert got == want


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_steps_run_in_the_c_one_call(checkpoint, dtype, monkeypatch):
    """The C decode step (executor/cpu_decode.py, kernels/cpu_deltanet.c) runs every layer of these
    models in one call per step: gated attention with its partial rotary and output gate, Gated
    DeltaNet on each sequence's state slot, (1 + w) norms, the MoE block. Its steps ran (a batch
    past its rows lowered to 2 runs eager), and the tokens and log-probabilities equal the eager
    forward's of the same engine."""
    from nanovllm.executor.cpu_decode import FusedDecode
    _, path = checkpoint
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)
    with LLM(path, dtype=dtype, kvcache_block_size=16, cpu_kvcache_bytes=8 << 20) as llm:
        runner = llm.llm_engine.model_runner
        fused = runner.step_runner(FusedDecode)
        assert fused is not None and fused.hybrid and fused.one_call_layers == len(fused.modules)
        fused.max_rows = 2
        calls = []
        real = fused.kernels.decode_layers
        monkeypatch.setattr(fused.kernels, "decode_layers", lambda *args: calls.append(args[7]) or real(*args))
        batches = [prompts()[2:3], prompts()[:2], prompts()]
        with_c = [llm.generate(b, sp, use_tqdm=False) for b in batches]
        assert len(calls) >= 2 * (MAX_NEW - 1)  # the first two batches' decode steps
        runner.step_runners = []
        eager = [llm.generate(b, sp, use_tqdm=False) for b in batches]
    for c_outs, eager_outs in zip(with_c, eager):
        for a, b in zip(c_outs, eager_outs):
            assert a["token_ids"] == b["token_ids"]
            for la, lb in zip(a["logprobs"], b["logprobs"]):
                assert la.keys() == lb.keys()
                for tok in la:
                    assert la[tok] == pytest.approx(lb[tok], abs=3e-4)


def test_a_reused_slot_starts_from_zero(tmp_path):
    """One state slot: the second request takes the slot the first left full of its state, and
    still decodes as it does alone."""
    path = make_checkpoint("qwen3_5", str(tmp_path))
    first, second = prompts()[3], prompts()[0]  # a one-token prompt: a stale conv history would move it
    alone, _ = generate(path, [second])
    with LLM(path, dtype="float32", cpu_kvcache_bytes=8 << 20, max_num_seqs=1) as llm:
        assert llm.llm_engine.scheduler.kv_cache_manager.num_state_slots == 1
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
        llm.generate([first], params, use_tqdm=False)
        layer = llm.llm_engine.model_runner.state_layers[0]
        assert layer.state.delta.abs().sum() > 0  # the first request's state is left in the slot
        again = llm.generate([second], params, use_tqdm=False)[0]["token_ids"]
    assert again == alone[0]


def test_chunked_rule_equals_the_one_token_rule():
    """delta_rule_chunked (the UT transform, chunks of 64) against the recurrence token by token,
    from a nonzero state, over lengths around a chunk."""
    from nanovllm.layers.gated_deltanet import delta_rule_chunked, delta_rule_step, l2_normalized
    g = torch.Generator().manual_seed(0)
    heads, dk, dv = 3, 8, 5
    for length in (1, 63, 64, 65, 150):
        q = l2_normalized(torch.randn(heads, length, dk, generator=g)) * dk ** -0.5
        k = l2_normalized(torch.randn(heads, length, dk, generator=g))
        v = torch.randn(heads, length, dv, generator=g)
        decay = -torch.rand(heads, length, generator=g) * 0.5
        beta = torch.rand(heads, length, generator=g)
        start = torch.randn(heads, dk, dv, generator=g)
        state, out = start.clone(), []
        for t in range(length):
            out.append(delta_rule_step(state.unsqueeze(0), q[None, :, t], k[None, :, t], v[None, :, t],
                                       decay[None, :, t], beta[None, :, t])[0])
        chunked_state = start.clone()
        chunked = delta_rule_chunked(chunked_state, q, k, v, decay, beta)
        torch.testing.assert_close(chunked, torch.stack(out, 1), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(chunked_state, state, rtol=1e-4, atol=1e-4)


def test_bad_configs_are_named(tmp_path):
    import transformers

    from nanovllm.models.qwen3_next import hybrid_layer_types
    config = transformers.Qwen3_5TextConfig(**SHAPE)
    config.layer_types = ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"layer_types\[1\] is 'sliding_attention'"):
        hybrid_layer_types(config)
    path = make_checkpoint("qwen3_5", str(tmp_path / "k"))
    import json
    import os
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["linear_conv_kernel_dim"] = 12
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="linear_conv_kernel_dim is 12"):
        LLM(path, dtype="float32", cpu_kvcache_bytes=8 << 20)


@pytest.mark.parametrize("name,arch", [("qwen3_5", "qwen35"), ("qwen3_5_moe", "qwen35moe")])
def test_gguf_file_runs_as_the_checkpoint(name, arch, tmp_path):
    """The checkpoint written as llama.cpp's file of it: the layer kinds, the linear layers'
    shapes and the partial rotary read from the metadata, the stored forms undone, the value heads
    run in the file's tiled order: transformers' greedy tokens on the checkpoint (F32 file) and
    the checkpoint's own tokens within vLLM's top-5 rule (Q8_0 matrices)."""
    pytest.importorskip("gguf")
    folder = make_checkpoint(name, str(tmp_path / name))
    ref = hf_greedy(folder, prompts(), MAX_NEW, mask_eos=False)
    ours, _ = generate(write_gguf(folder, str(tmp_path / "f32.gguf"), arch), prompts())
    assert check_tokens_close(ours, ref) == len(ref)
    # Q8_0 matrices, multiplied in blocks by the C kernels (14-bit inputs: their rounding negligible):
    # transformers' greedy tokens on the checkpoint whose matrices are those blocks' values
    import shutil

    import gguf
    from safetensors.torch import load_file, save_file
    rounded = str(tmp_path / "rounded")
    shutil.copytree(folder, rounded)
    tensors = load_file(f"{rounded}/model.safetensors")
    for name, x in tensors.items():
        if x.dim() == 2 and x.shape[1] % 32 == 0 and not name.endswith(("in_proj_b.weight", "in_proj_a.weight",
                                                                      "mlp.gate.weight", "shared_expert_gate.weight")):
            q = gguf.quants.quantize(x.float().numpy(), gguf.GGMLQuantizationType.Q8_0)
            tensors[name] = torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)).reshape(x.shape)
    save_file(tensors, f"{rounded}/model.safetensors", metadata={"format": "pt"})
    path = write_gguf(folder, str(tmp_path / "q8.gguf"), arch, quantized=True)
    quantized, _ = generate(path, prompts(), cpu_input_bits=14)
    assert check_tokens_close(quantized, hf_greedy(rounded, prompts(), MAX_NEW, mask_eos=False)) == len(ref)


@pytest.mark.parametrize("tiled", [False, True])
def test_c_decode_step_equals_torch(tiled):
    """kernels/cpu_deltanet.c against the torch decode step (its reference): three sequences in
    scattered slots of a nonzero state, value heads grouped or tiled over the key heads; the gates
    from the in_proj row and the gated norm after the rule."""
    import transformers

    from nanovllm.kernels import cpu_kernels
    from nanovllm.layers.gated_deltanet import GatedDeltaNet
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("no C compiler")
    config = transformers.Qwen3_5TextConfig(**SHAPE)
    config.linear_value_head_order = "tiled" if tiled else "grouped"
    g = torch.Generator().manual_seed(0)
    layer = GatedDeltaNet(config)
    for param in (layer.conv1d.weight, layer.A_log, layer.dt_bias, layer.norm.weight):
        param.data.normal_(0, 0.3, generator=g)
    layer.attach_state(layer.new_state(6, "cpu"))
    layer.state.conv.normal_(0, 1, generator=g)
    layer.state.delta.normal_(0, 1, generator=g)
    rows, nv = 3, layer.num_v_heads
    proj = torch.randn(rows, layer.channels + layer.value_dim + 2 * nv, generator=g)
    mixed, z, b, a = proj.split([layer.channels, layer.value_dim, nv, nv], dim=-1)
    slots = torch.tensor([4, 0, 2])
    conv, delta = layer.state.conv.clone(), layer.state.delta.clone()
    out = layer.run_decode(mixed, *layer.gates(b, a), slots)
    want = layer.norm(out, z.reshape(out.shape)).flatten(1)
    want_conv, want_delta = layer.state.conv.clone(), layer.state.delta.clone()
    layer.state.conv.copy_(conv)
    layer.state.delta.copy_(delta)
    layer.attach_state(layer.state, kernels)
    got = layer.run_decode_c(proj, slots)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(layer.state.conv, want_conv)
    torch.testing.assert_close(layer.state.delta, want_delta, rtol=1e-4, atol=1e-4)
    assert torch.equal(layer.state.delta[[1, 3, 5]], delta[[1, 3, 5]])  # other slots untouched
