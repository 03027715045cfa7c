"""The Triton LoRA update (kernels/triton_lora.py, the CUDA platform's) against the torch formula under
TRITON_INTERPRET=1 on a CPU: rows of several adapter slots and of the base model (slot -1) in any order,
stacked parts (q | k | v, gate | up) of sizes off a power of two, A and B in fp32 and bf16; and an
engine whose adapter layers run the kernel giving PEFT's tokens."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from nanovllm.kernels.triton_lora import column_parts, lora_add  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(x, y, a, b, row_slots, part_sizes):
    rank = b.shape[1]
    out = y.clone()
    offsets = [sum(part_sizes[:p]) for p in range(len(part_sizes))]
    for i, slot in enumerate(row_slots.tolist()):
        if slot < 0:
            continue
        t = a[slot].float() @ x[i]
        for p, (offset, size) in enumerate(zip(offsets, part_sizes)):
            out[i, offset:offset + size] += t[p * rank:(p + 1) * rank] @ b[slot, :, offset:offset + size].float()
    return out


@pytest.mark.parametrize("part_sizes,k,rank", [([48, 16, 16], 72, 8), ([40, 40], 64, 16), ([100], 130, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_matches_torch(part_sizes, k, rank, dtype):
    g = torch.Generator().manual_seed(k + rank)
    slots, n = 3, sum(part_sizes)
    row_slots = torch.tensor([2, -1, 0, 2, 1, -1])
    x = torch.randn(len(row_slots), k, generator=g)
    y = torch.randn(len(row_slots), n, generator=g)
    a = torch.randn(slots, len(part_sizes) * rank, k, generator=g).to(dtype)
    b = torch.randn(slots, rank, n, generator=g).to(dtype)
    want = reference(x, y, a, b, row_slots, part_sizes)
    got = lora_add(*(t.to(DEVICE) for t in (x, y.clone(), a, b, row_slots)), column_parts(part_sizes, DEVICE))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.cpu()[[1, 5]], y[[1, 5]])  # the base model's rows untouched


def test_shapes_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match="do not fit"):
        lora_add(torch.zeros(2, 8), torch.zeros(2, 5), torch.zeros(1, 4, 8), torch.zeros(1, 4, 6),
                 torch.zeros(2, dtype=torch.int64), column_parts([6], "cpu"))


def test_engine_runs_its_adapters_through_the_kernel(qwen3_gqa, tmp_path):
    """Every adapter layer on the kernel (the C step set aside): PEFT's greedy tokens, with rows of two
    adapters and the base model in each step."""
    from lora_adapters import make_peft_adapter, peft_greedy
    from nanovllm import LLM, LoRARequest, SamplingParams
    pytest.importorskip("peft")
    import nanovllm.kernels.triton_lora as module
    adapters = [make_peft_adapter(qwen3_gqa, str(tmp_path / f"a{i}"), seed=i, r=8) for i in range(2)]
    prompts = [[3, 5, 7, 9, 11], [20, 30, 40, 50], [8, 9, 10]]
    want = [peft_greedy(qwen3_gqa, path, [p], 6)[0][0] for path, p in zip([adapters[0], adapters[1], None], prompts)]
    calls = []
    real = module.lora_add
    module.lora_add = lambda *args: calls.append(1) or real(*args)
    try:
        with LLM(qwen3_gqa, enable_lora=True, max_loras=2, dtype="float32", kv_cache_dtype="float32") as llm:
            runner = llm.llm_engine.model_runner
            runner.step_runners = []
            runner.lora.use_kernels(triton=True)
            sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
            got = llm.generate(prompts, sp, use_tqdm=False,
                               lora_request=[LoRARequest("a", 1, adapters[0]), LoRARequest("b", 2, adapters[1]), None])
    finally:
        module.lora_add = real
    assert calls and [o["token_ids"] for o in got] == want


@pytest.mark.skipif(torch.cuda.is_available(), reason="fakes torch.cuda's graph API on a CPU")
def test_decode_graphs_read_the_rows_slots_from_their_buffer(qwen3_gqa, tmp_path, monkeypatch):
    """With adapters, every decode graph is captured with the Triton updates reading each row's slot
    from a static buffer (torch.cuda's graph API faked: a replay reruns the captured Context, as a
    real graph would). Replayed steps with rows of two adapters and the base model give PEFT's tokens,
    so each replay used the slots its step copied in, not those of the capture."""
    from helpers import fake_cuda_graphs
    from lora_adapters import make_peft_adapter, peft_greedy
    from nanovllm import LLM, LoRARequest, SamplingParams
    from nanovllm.executor.cuda_graph import DecodeGraphs
    pytest.importorskip("peft")
    adapters = [make_peft_adapter(qwen3_gqa, str(tmp_path / f"a{i}"), seed=i, r=8) for i in range(2)]
    prompts = [[3, 5, 7, 9, 11], [20, 30, 40, 50], [8, 9, 10]]
    want = [peft_greedy(qwen3_gqa, path, [p], 6)[0][0] for path, p in zip([adapters[0], adapters[1], None], prompts)]
    captures = fake_cuda_graphs(monkeypatch)
    with LLM(qwen3_gqa, enable_lora=True, max_loras=2, max_num_seqs=4, dtype="float32",
             kv_cache_dtype="float32") as llm:
        runner = llm.llm_engine.model_runner
        runner.lora.use_kernels(triton=True)
        config = llm.llm_engine.config
        graphs = DecodeGraphs(runner.model, runner.backend, 4, config.max_model_len, runner.block_size,
                              config.hf_config.hidden_size, torch.float32, torch.device("cpu"), runner.lora)
        graphs.capture()
        assert graphs.runs_lora and all(layer.allocated for layer in runner.lora.layers.values())
        for graph in captures:
            graph.model, graph.buffers = runner.model, graphs.buffers
            assert graph.context.lora.device_row_slots.data_ptr() == graphs.buffers.lora_slots.data_ptr()
        runner.step_runners = [graphs]
        sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        got = llm.generate(prompts, sp, use_tqdm=False,
                           lora_request=[LoRARequest("a", 1, adapters[0]), LoRARequest("b", 2, adapters[1]), None])
    assert sum(g.replays for g in captures) >= 5  # every decode step replayed a graph
    assert [o["token_ids"] for o in got] == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA GPU (scripts/gpu_check.sh)")
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_on_a_gpu_adapter_steps_match_peft_with_and_without_graphs(qwen3_gqa, tmp_path, enforce_eager):
    """On CUDA: rows of two adapters and the base model give PEFT's tokens, eagerly and with the decode
    steps replaying real CUDA graphs captured with the adapter slots as inputs."""
    from lora_adapters import make_peft_adapter, peft_greedy
    from nanovllm import LLM, LoRARequest, SamplingParams
    from nanovllm.executor.cuda_graph import DecodeGraphs
    pytest.importorskip("peft")
    adapters = [make_peft_adapter(qwen3_gqa, str(tmp_path / f"a{i}"), seed=i, r=8) for i in range(2)]
    prompts = [[3, 5, 7, 9, 11], [20, 30, 40, 50], [8, 9, 10]]
    want = [peft_greedy(qwen3_gqa, path, [p], 6)[0][0] for path, p in zip([adapters[0], adapters[1], None], prompts)]
    with LLM(qwen3_gqa, device="cuda", enable_lora=True, max_loras=2, max_num_seqs=4, dtype="float32",
             kv_cache_dtype="float32", enforce_eager=enforce_eager) as llm:
        graphs = llm.llm_engine.model_runner.step_runner(DecodeGraphs)
        assert (graphs is None) == enforce_eager and (enforce_eager or graphs.runs_lora)
        got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False,
                           lora_request=[LoRARequest("a", 1, adapters[0]), LoRARequest("b", 2, adapters[1]), None])
    assert [o["token_ids"] for o in got] == want
