"""Hardware limits measured in-process, and how close the engine's decode gets to them.

Used by `bench.py --efficiency`: a matmul peak (GFLOP/s of large GEMMs in the engine dtype) and a
memory-copy bandwidth, then large-batch decode FLOP/s over that peak and batch-1 decode time over
the memory floor (bytes of weights read per token / copy bandwidth).
"""
import time
from collections.abc import Callable

import torch
from torch import nn

from nanovllm import SamplingParams
from nanovllm.layers.quantization import linear_layers


def _best_time(fn: Callable[[], object], synchronize: Callable[[], None], repeat: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_peak_flops(dtype: torch.dtype, device: torch.device,
                      synchronize: Callable[[], None] = lambda: None) -> float:
    """Best FLOP/s over GEMMs shaped like a large decode batch through the model's projections."""
    best = 0.0
    for m, k, n in ((512, 1024, 3072), (1024, 1024, 4096), (512, 3072, 1024)):
        a = torch.randn(m, k, dtype=dtype, device=device)
        w = torch.randn(n, k, dtype=dtype, device=device)
        t = _best_time(lambda: torch.nn.functional.linear(a, w), synchronize)
        best = max(best, 2 * m * k * n / t)
    return best


def copy_bandwidth(device: torch.device, size_bytes: int = 256 << 20,
                   synchronize: Callable[[], None] = lambda: None) -> float:
    """Bytes/s of a large tensor copy, counting the read and the write."""
    src = torch.empty(size_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    t = _best_time(lambda: dst.copy_(src), synchronize)
    return 2 * size_bytes / t


def read_bandwidth(device: torch.device, size_bytes: int = 256 << 20,
                   synchronize: Callable[[], None] = lambda: None) -> float:
    """Bytes/s of reading a large tensor once (a sum over it): the rate a one-sequence decode step,
    which reads every weight once and writes little, can at best read its weights at. On a CPU
    c_read_bandwidth measures it closer (a torch sum reads at ~90% of the read kernel's rate)."""
    src = torch.ones(size_bytes // 4, dtype=torch.float32, device=device)
    t = _best_time(lambda: src.sum(), synchronize)
    return size_bytes / t


def c_read_bandwidth(kernels, size_bytes: int = 1 << 30, repeat: int = 10) -> float:
    """Bytes/s of the C kernels' read kernel (kernels/cpu_kernels.c, read_bytes: the widest loads the
    build has, every thread of torch's count) over size_bytes of touched memory, best of `repeat`:
    the CPU's read floor."""
    src = torch.ones(size_bytes, dtype=torch.uint8)
    t = _best_time(lambda: kernels.read_bytes(src.data_ptr(), size_bytes), lambda: None, repeat)
    return size_bytes / t


def decode_bytes_per_token(model: nn.Module, kv_bytes_per_token: int, context: int) -> int:
    """Bytes a one-sequence decode step reads: every matmul's weights as held (the LM head's
    included), the top_k experts of each MoE layer, and the KV cache of `context` tokens."""
    return matmul_weight_bytes(model) + expert_bytes(model)[1] + kv_bytes_per_token * context


def matmul_weight_bytes(model: nn.Module) -> int:
    """Bytes of matmul_weights(model)."""
    return sum(w.numel() * w.element_size() for w in matmul_weights(model))


def matmul_weights(model: nn.Module) -> list[torch.Tensor]:
    """Weights multiplied every step: every linear projection plus the LM head, in the form their
    methods read them (the oneDNN-packed copy where the platform packed them)."""
    return [w for layer in linear_layers(model) for w in layer.quant_method.streamed_weights(layer)]


def expert_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of every expert's weights, bytes of the top_k experts one token reads) over the
    model's mixture-of-experts layers (0, 0 without them)."""
    from nanovllm.layers.moe import FusedMoE
    total = active = 0
    for layer in model.modules():
        if isinstance(layer, FusedMoE):
            size = sum(w.numel() * w.element_size() for w in layer.quant_method.streamed_weights(layer))
            total += size
            active += size * layer.top_k // layer.num_experts
    return total, active


def active_expert_params(model: nn.Module) -> int:
    """The expert weights one token multiplies (top_k of each MoE layer's experts)."""
    from nanovllm.layers.moe import FusedMoE
    return sum(layer.top_k * 3 * layer.hidden_size * layer.intermediate_size
               for layer in model.modules() if isinstance(layer, FusedMoE))


def time_decode_steps(llm, batch: int, prompt_len: int, steps: int) -> float:
    """Seconds per decode step with `batch` running sequences (prefill excluded)."""
    params = SamplingParams(temperature=0.6, max_tokens=steps + 4, ignore_eos=True)
    seqs = [llm.llm_engine.add_request([(7 * i + j) % 1000 + 1 for j in range(prompt_len)], params) for i in range(batch)]
    while llm.llm_engine.scheduler.waiting:
        llm.llm_engine.step()
    llm.llm_engine.step()  # first decode step: warm
    start = time.perf_counter()
    for _ in range(steps):
        llm.llm_engine.step()
    elapsed = (time.perf_counter() - start) / steps
    for seq in seqs:
        llm.llm_engine.abort_request(seq)
    return elapsed


def measure_efficiency(llm, large_batch: int = 64, steps: int = 8) -> dict:
    runner = llm.llm_engine.model_runner
    dtype, device = runner.dtype, runner.device

    def synchronize() -> None:
        llm.config.platform.synchronize(device)

    peak = matmul_peak_flops(dtype, device, synchronize)
    bandwidth = copy_bandwidth(device, synchronize=synchronize)
    params = sum(layer.output_size * layer.input_size for layer in linear_layers(runner.model))
    params += active_expert_params(runner.model)
    weight_bytes = matmul_weight_bytes(runner.model)
    batch = min(large_batch, llm.config.max_num_seqs)
    t_large = time_decode_steps(llm, batch, 32, steps)
    achieved = 2 * params * batch / t_large
    t_one = time_decode_steps(llm, 1, 32, steps)
    all_experts, active_experts = expert_bytes(runner.model)
    floor = (weight_bytes + active_experts) / bandwidth
    out = {
        "matmul_peak_gflops": peak / 1e9, "copy_bandwidth_gbs": bandwidth / 1e9,
        "large_batch": batch, "large_batch_step_ms": t_large * 1e3,
        "large_batch_decode_gflops": achieved / 1e9, "large_batch_fraction_of_peak": achieved / peak,
        "batch1_step_ms": t_one * 1e3, "batch1_floor_ms": floor * 1e3, "batch1_over_floor": t_one / floor,
    }
    if all_experts:
        # A mixture of experts reads its top_k experts per token at batch 1: the floor above counts
        # those; reading every expert would take this long.
        out["batch1_floor_all_experts_ms"] = (weight_bytes + all_experts) / bandwidth * 1e3
        out["batch1_bytes_at_copy_bandwidth_mb"] = t_one * bandwidth / 1e6
        out["expert_mb_all"], out["expert_mb_active"] = all_experts / 1e6, active_experts / 1e6
        print(f"experts: {all_experts / 1e6:.0f} MB, {active_experts / 1e6:.0f} MB of them active per token; batch 1 "
              f"at the copy bandwidth reads {t_one * bandwidth / 1e6:.0f} MB per step (active weights "
              f"{(weight_bytes + active_experts) / 1e6:.0f} MB, all {(weight_bytes + all_experts) / 1e6:.0f} MB)")
    print(f"matmul peak {peak / 1e9:.1f} GFLOP/s, copy bandwidth {bandwidth / 1e9:.1f} GB/s ({dtype})")
    print(f"decode batch {batch}: {t_large * 1e3:.1f} ms/step, {achieved / 1e9:.1f} GFLOP/s "
          f"= {achieved / peak:.0%} of matmul peak")
    print(f"decode batch 1: {t_one * 1e3:.1f} ms/token, memory floor {floor * 1e3:.1f} ms "
          f"({(weight_bytes + active_experts) / 1e6:.0f} MB weights) -> {t_one / floor:.2f}x the floor")
    return out
