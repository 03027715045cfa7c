"""CpuPlatform: the engine on the host CPU: eager forward, gloo for tensor parallelism, a KV budget
from a share of free RAM, oneDNN packing for fp32 weights and the C kernels for few-row inputs."""
import logging
import mmap
import os
from collections.abc import Callable

import numpy as np
import torch

from nanovllm.platforms.interface import Platform, triton_weight_only_asked
from nanovllm.utils.cpu_info import available_ram_bytes
from nanovllm.utils.cpu_memory import keep_freed_memory, release_freed_memory, return_freed_memory
from nanovllm.utils.threads import wait_note

logger = logging.getLogger(__name__)

# The default KV budget: a safe share of free RAM (the model and activations need the rest).
KV_RAM_SHARE = 0.25
KV_MAX_BYTES = 8 << 30
# 2 MiB pages for the KV cache where each layer's K (and V) run is at least this long: a page's first
# touch maps 2 MiB of every run, 3% of a run this long (docs/performance.md, "The KV cache's memory")
HUGE_PAGE_RUN_BYTES = 64 << 20


def threads_per_rank(tp_size: int) -> int:
    """CPU threads for one rank, so that N ranks together do not oversubscribe the cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // tp_size)


def can_pack_weights(dtype: torch.dtype) -> bool:
    """Whether linear weights can be held in oneDNN's packed layout: fp32 with oneDNN in this torch
    (faster than MKL at every batch size measured, docs/performance.md, "oneDNN packing"). bf16 stays
    on MKL (packed bf16 was not measured; `auto` picks fp32 on CPUs, "fp32 activations on a CPU")."""
    return dtype == torch.float32 and torch.backends.mkldnn.is_available()


AUTO_KV_FORMAT = "float16"  # kv_cache_dtype="auto" on a CPU


class CpuPlatform(Platform):
    device_name = "cpu"
    dist_backend = "gloo"
    default_block_size = 16  # small blocks share prefixes better
    kv_cache_in_host_memory = True
    # vLLM's LLM-class default outside large GPUs: a long prompt's chunks keep their fp32 activations
    # near the cores (at 32768 tokens, chunks of 16384 prefilled 7% slower than chunks of 4096 and
    # peaked 1.5 GiB higher; one chunk of 32768, 3.7 GiB higher: docs/performance.md, "The prefill chunk"), while
    # bench.py's batches of short prompts ran alike at 2048-16384 (its early "tried and not kept")
    default_max_num_batched_tokens = 8192
    has_decode_graphs = False
    has_c_decode_step = True
    # One uniform per row: drawing a random number per vocabulary entry is the sampler's main cost on CPU.
    random_sample = "inverse_cdf"

    @classmethod
    def is_available(cls) -> bool:
        return True

    def default_compile_ops(self, enforce_eager: bool) -> bool:
        # Compiling takes tens of seconds, more than short runs save; opt in for long bf16 runs
        # (eager bf16 RMSNorm is slow here).
        return False

    def kv_cache_formats(self, compute_dtype: torch.dtype) -> tuple[str, tuple[str, ...] | None]:
        # Every format: the C attention converts each as it reads it, the torch path dequantizes.
        # "auto" is 16 bits: half fp32's bytes per token, which decode behind a long prompt reads
        # in full each step (docs/performance.md, "A 16-bit KV cache by default": fp16 and bf16 decode alike; fp16 keeps
        # 3 more mantissa bits).
        return AUTO_KV_FORMAT, None

    def resolve_auto_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        # fp32 on every CPU: the fast CPU paths (oneDNN-packed weights, the C kernels) compute in
        # fp32, and bf16 compute ran slower end to end even on a CPU with AVX512-BF16
        # (docs/performance.md, "fp32 activations on a CPU"); fp16 matmuls are slow on any CPU. A 16-bit
        # checkpoint is upcast once at load. dtype="bfloat16" asks for bf16 weights under fp32
        # activations (compute_dtype).
        return torch.float32

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        # bf16 on CPU means bf16 weights (weight_dtype) under fp32 activations and KV cache, as
        # llama.cpp runs its F16 files: the bf16 matmuls and the torch attention they would need
        # ran 2.5x slower than fp32 here (docs/performance.md, "fp32 activations on a CPU").
        return torch.float32 if dtype == torch.bfloat16 else dtype

    def default_kvcache_bytes(self, tensor_parallel_size: int) -> int | None:
        # NOTE: the budget is per rank; N ranks share the machine's RAM.
        share = min(int(available_ram_bytes() * KV_RAM_SHARE), KV_MAX_BYTES)
        return max(1, share // tensor_parallel_size)

    def kv_cache_holding(self, prefault: bool) -> str:
        # Without kvcache_prefault the pages are mapped as tokens first land in them: the process's
        # RSS grows with the tokens cached, not with the reservation.
        touched = "every page touched at start-up (kvcache_prefault)" if prefault else "reserved, pages touched as used"
        return f"{touched}; cpu_kvcache_bytes (--cpu-kvcache-bytes) bounds it"

    def device_of_rank(self, rank: int) -> torch.device:
        return torch.device("cpu")

    def set_up_rank(self, rank: int, tensor_parallel_size: int) -> None:
        torch.set_num_threads(threads_per_rank(tensor_parallel_size))

    def prepare_process(self) -> None:
        return_freed_memory()  # while the weights load; keep_freed_memory() once they are held
        note = wait_note()
        if note:
            logger.info(note)

    def after_weights_processed(self) -> None:
        release_freed_memory()  # what the heap still holds of the loading
        keep_freed_memory()

    def wants_c_kernels(self, dtype: torch.dtype) -> bool:
        return can_pack_weights(dtype)

    def linear_kernel_options(self, dtype: torch.dtype, weight_dtype: torch.dtype | None,
                              has_c_kernels: bool) -> dict:
        """Weights held once, in the form their kernel reads: dense fp32, or dense bf16 for bf16
        weights, read in place by the C kernels at every row count (docs/performance.md, "Weights held once";
        an fp32 copy of bf16 weights for oneDNN would triple the bytes a user asked to halve).
        Without the C kernels: oneDNN packing (bf16 weights then stay fp32, the same values).
        Otherwise MKL, in the transposed orientation for layers whose output is at least as wide as
        their input."""
        triton = triton_weight_only_asked()
        if not can_pack_weights(dtype):
            return {"transposed_when_wide": True, "triton_weight_only": triton}
        if not has_c_kernels:
            return {"onednn_packing": True, "triton_weight_only": triton}
        return {"c_weight_dtype": torch.bfloat16 if weight_dtype == torch.bfloat16 else torch.float32,
                "triton_weight_only": triton}

    def kv_cache_budget_bytes(self, device: torch.device, warmup: Callable[[], None], cpu_kvcache_bytes: int | None,
                              gpu_memory_utilization: float) -> int:
        return cpu_kvcache_bytes

    def allocate_kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                          prefault: bool = False) -> torch.Tensor:
        """Backed by an anonymous mmap, whose pages the OS zeroes lazily on first touch: a
        multi-GB cache costs nothing at start-up. Transparent huge pages asked for (MADV_HUGEPAGE,
        where the OS offers them): decode attention streams the cache from memory, and with 4 KiB
        pages the hardware prefetcher stops at every page's end and every page needs its own TLB
        entry (2 MiB pages: decode attention at 32k tokens 1.2x faster; docs/performance.md, "The KV cache's memory"),
        where each layer's K and V runs are at least HUGE_PAGE_RUN_BYTES.
        prefault: every page mapped (and zeroed) now, so no KV write of a step waits for a fresh page.
        The tensor keeps the mapping alive."""
        nbytes = int(np.prod(shape)) * dtype.itemsize
        buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        # (not for a small cache: the first token touches a page in each layer's K and V run, so
        # with 2 MiB pages a 0.6B model's first token mapped 112 of its 224 MiB)
        if hasattr(mmap, "MADV_HUGEPAGE") and nbytes // max(1, shape[0] * shape[1]) >= HUGE_PAGE_RUN_BYTES:
            try:
                buffer.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # a kernel without transparent huge pages: 4 KiB pages
                pass
        cache = torch.frombuffer(buffer, dtype=dtype)
        if prefault:  # a write per page (after the advice, so that the faults map huge pages)
            cache[:: mmap.PAGESIZE // dtype.itemsize].zero_()
        return cache.view(shape)
