"""Platform: the interface every device class implements. Config picks one from Config.device
(platforms.get_platform); ModelRunner, the TP workers and the sampler ask it instead of the device.
A near-leaf: it answers traits and device operations in plain values (torch and utils/ only); the
rooms that act on them (the runner's kernels and step runners, the sampler's draw, the KV formats)
map its answers to their own objects."""
import os
from collections.abc import Callable

import torch


# "1": the Triton weight-only kernels on a CPU too (under TRITON_INTERPRET=1: how the tests run them
# without a GPU).
TRITON_WEIGHT_ONLY_ENV = "NANOVLLM_TRITON_WEIGHT_ONLY"


def triton_weight_only_asked() -> bool:
    return os.environ.get(TRITON_WEIGHT_ONLY_ENV) == "1"


class Platform:
    """Every device-dependent decision of the engine, for one kind of device.

    NOTE: a platform holds no state: it travels inside Config, pickled, to the TP workers.
    """

    # Set by every subclass:
    device_name: str          # the resolved Config.device
    dist_backend: str         # torch.distributed backend of tensor parallelism
    default_block_size: int   # kvcache_block_size when not given
    # Whether the KV cache lies in host memory (a tier's reads then land in it in place: kv_offload/).
    kv_cache_in_host_memory: bool
    default_max_num_batched_tokens: int  # max_num_batched_tokens (the prefill chunk) when not given
    has_decode_graphs: bool   # whether decode steps can be captured as CUDA graphs (ModelRunner.build_step_runners)
    has_c_decode_step: bool   # whether the C decode step runs here (the host CPU's kernels, executor/cpu_decode.py)
    # The sampler's draw of one token per row, by name (sample/sampler.py's RANDOM_SAMPLES).
    random_sample: str

    @classmethod
    def is_available(cls) -> bool:
        """Whether this process can run on the device at all."""
        raise NotImplementedError

    # ---- Config: validation and defaults ------------------------------------------------------
    def check_tensor_parallel_size(self, tensor_parallel_size: int) -> None:
        """Raise ValueError when this machine cannot hold that many ranks."""

    def default_compile_ops(self, enforce_eager: bool) -> bool:
        """Config.compile_ops when not given."""
        return False

    def kv_cache_formats(self, compute_dtype: torch.dtype) -> tuple[str, tuple[str, ...] | None]:
        """(what kv_cache_dtype="auto" means, the kv_cache_dtype names this device runs, None: every
        one the engine has) for the compute dtype: by default the cache holds the activations'
        dtype and nothing else (layers/backends/kv_formats.py resolves the name against these)."""
        name = str(compute_dtype).removeprefix("torch.")
        return name, ("auto", name)

    def resolve_auto_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        """The compute dtype for dtype="auto", given the checkpoint's."""
        return checkpoint_dtype

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of activations and the KV cache for the resolved Config dtype."""
        return dtype

    def weight_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """How the linear weights are held for the resolved Config dtype."""
        return dtype

    def default_kvcache_bytes(self, tensor_parallel_size: int) -> int | None:
        """Config.cpu_kvcache_bytes (per rank) when not given; None where the budget is measured."""
        return None

    def kv_cache_holding(self, prefault: bool) -> str:
        """How the KV cache's bytes are held, and the setting that bounds them (the start-up line)."""
        return "allocated; gpu_memory_utilization (--gpu-memory-utilization) bounds it"

    def replica_env(self, index: int, num_replicas: int, tensor_parallel_size: int) -> dict[str, str]:
        """Environment variables that give data-parallel replica `index` (of `num_replicas` engines
        on this host, each with tensor_parallel_size ranks) devices of its own; ValueError when the
        host has too few for them all (entrypoints/replicas.py)."""
        return {}

    # ---- one rank ----------------------------------------------------------------------------
    def device_of_rank(self, rank: int) -> torch.device:
        """The torch device rank `rank` computes on."""
        raise NotImplementedError

    def set_up_rank(self, rank: int, tensor_parallel_size: int) -> None:
        """Per-process settings of one tensor-parallel rank, before its process group starts."""

    def prepare_process(self) -> None:
        """Process-wide settings a ModelRunner makes once, before it builds the model."""

    def to_device(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A host tensor made available on device (a step's inputs, sampling tensors)."""
        return t

    def synchronize(self, device: torch.device) -> None:
        """Wait until the device has finished the work queued so far."""

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        """Start a fresh peak-memory measurement (see kv_cache_budget_bytes)."""

    # ---- model and KV cache ------------------------------------------------------------------
    def wants_c_kernels(self, dtype: torch.dtype) -> bool:
        """Whether the layers here use the host CPU's C kernels (kernels/cpu_kernels.py) for a
        model of activations dtype, where they build."""
        return False

    def linear_kernel_options(self, dtype: torch.dtype, weight_dtype: torch.dtype | None,
                              has_c_kernels: bool) -> dict:
        """The kernels the layers' methods may use on this machine, as layers/quantization's
        LinearKernels fields by name (dtype: the model's; weight_dtype: how dense weights are to
        be held, Config.weight_dtype; has_c_kernels: the C kernels built, where wants_c_kernels)."""
        return {"triton_weight_only": triton_weight_only_asked()}

    def after_weights_processed(self) -> None:
        """Once every layer holds its weights in the form it multiplies from (the loading's
        transient copies can go)."""

    def kv_cache_budget_bytes(self, device: torch.device, warmup: Callable[[], None], cpu_kvcache_bytes: int | None,
                              gpu_memory_utilization: float) -> int:
        """Bytes this rank may give the KV cache (Config's settings of both kinds given). warmup()
        runs the largest forward without a cache, for platforms that measure what the activations need."""
        raise NotImplementedError

    def allocate_kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                          prefault: bool = False) -> torch.Tensor:
        """A zero-filled cache tensor (written, so its pages are mapped whatever prefault says).
        NOTE: zeros, not garbage: attention reads (masked) unwritten slots, and a NaN there would
        poison the masked-out product."""
        return torch.zeros(shape, dtype=dtype, device=device)
