"""CudaPlatform: the engine on NVIDIA GPUs, one per rank: NCCL, pinned host->device copies, a KV
budget measured after a warm-up forward, captured decode graphs."""
import logging
import os
from collections.abc import Callable

import torch

from nanovllm.platforms.interface import Platform

logger = logging.getLogger(__name__)


class CudaPlatform(Platform):
    device_name = "cuda"
    dist_backend = "nccl"
    default_block_size = 256  # flash-attn's paged kernels want a multiple of 256
    kv_cache_in_host_memory = False
    default_max_num_batched_tokens = 16384  # nano-vLLM's, as vLLM's LLM class takes on large GPUs
    has_decode_graphs = True
    has_c_decode_step = False
    random_sample = "exponential_race"  # one exponential per token: no host sync and fully parallel

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()

    def check_tensor_parallel_size(self, tensor_parallel_size: int) -> None:
        if tensor_parallel_size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size ({tensor_parallel_size}) exceeds the "
                             f"{torch.cuda.device_count()} visible CUDA device(s): each rank needs its own GPU")

    def default_compile_ops(self, enforce_eager: bool) -> bool:
        return not enforce_eager  # fused kernels pay off at once

    def kv_cache_formats(self, compute_dtype: torch.dtype) -> tuple[str, tuple[str, ...]]:
        # The activations' dtype (any backend), or vLLM's fp8 at scale 1, which the Triton store
        # and attention kernels convert as they write and read (flash-attn is then passed over).
        auto, names = super().kv_cache_formats(compute_dtype)
        return auto, (*names, "fp8", "fp8_e4m3", "fp8_e5m2")

    def replica_env(self, index: int, num_replicas: int, tensor_parallel_size: int) -> dict[str, str]:
        # Replica i sees only its own GPUs (its ranks then count them from 0), taken in order from
        # the ones this process sees.
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = [d.strip() for d in visible.split(",") if d.strip()] if visible is not None \
            else [str(i) for i in range(torch.cuda.device_count())]
        needed = num_replicas * tensor_parallel_size
        if needed > len(devices):
            raise ValueError(f"--data-parallel-size {num_replicas} x --tensor-parallel-size {tensor_parallel_size} "
                             f"needs {needed} GPUs, but {len(devices)} are visible")
        mine = devices[index * tensor_parallel_size:(index + 1) * tensor_parallel_size]
        return {"CUDA_VISIBLE_DEVICES": ",".join(mine)}

    def device_of_rank(self, rank: int) -> torch.device:
        # NOTE: a node runs consecutive ranks, at most one per visible GPU (Config checks), so the
        # rank modulo the GPU count gives each rank of a node its own GPU (the rank itself on one node).
        count = torch.cuda.device_count()
        return torch.device("cuda", rank % count if count else rank)

    def set_up_rank(self, rank: int, tensor_parallel_size: int) -> None:
        # NOTE: replays and Triton launches use the current device.
        torch.cuda.set_device(self.device_of_rank(rank))

    def to_device(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        return t.pin_memory().to(device, non_blocking=True)

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

    def linear_kernel_options(self, dtype: torch.dtype, weight_dtype: torch.dtype | None,
                              has_c_kernels: bool) -> dict:
        """Block-format and pre-quantized weights through the Triton weight-only kernels, dense
        experts through the Triton grouped kernel, linear-attention decode steps through the Triton
        delta-rule step, LoRA updates through the Triton BGMV kernels (the `cuda` extra)."""
        return {"triton_weight_only": True, "fused_moe_triton": True, "state_triton": True, "lora_triton": True}

    def kv_cache_budget_bytes(self, device: torch.device, warmup: Callable[[], None], cpu_kvcache_bytes: int | None,
                              gpu_memory_utilization: float) -> int:
        """gpu_memory_utilization of the device, less what is in use after warmup() and the
        activation peak warmup() measured."""
        warmup()
        # Return the warm-up's cached blocks first, so `used` holds the weights but not the
        # activations; those are counted once, as peak - current.
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        stats = torch.cuda.memory_stats(device)
        peak, current = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
        budget = int(total * gpu_memory_utilization - used - peak + current)
        logger.info("KV cache budget %.2f GiB (device total %.2f GiB, used %.2f GiB, activation peak %.2f GiB)",
                    budget / 2**30, total / 2**30, used / 2**30, (peak - current) / 2**30)
        return budget
