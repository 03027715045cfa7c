"""EngineArgs: the engine's settings as a user gives them (vLLM's EngineArgs), each value checked
without the model, so that a bad flag fails before anything is loaded or downloaded. Config
(config.py) resolves them against the checkpoint and the device; the CLIs check them first."""
import os
from dataclasses import dataclass

import torch

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
RUNNERS = ("auto", "generate", "pooling")
# EngineArgs.lora_dtype -> the adapter slots' dtype (None: the model's), vLLM's names.
LORA_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
               "int8": torch.int8}

# EngineArgs.cpu_input_bits -> the C kernels' input rounding mode (Linear.input_planes, cpu_quant.c):
# 1 int8, 2 two int8 planes, 0 per group.
CPU_INPUT_BITS = {"auto": 0, 8: 1, 14: 2}


def positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def parse_init_addr(addr: str) -> tuple[str, int]:
    """("HOST", PORT) of a "HOST:PORT" (an IPv6 host in brackets: "[::1]:PORT"); ValueError if malformed."""
    if not isinstance(addr, str):
        raise TypeError(f"dist_init_addr must be a 'HOST:PORT' str, got {type(addr).__name__} {addr!r}")
    host, sep, port = addr.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"dist_init_addr must be 'HOST:PORT' with a port in [1, 65535], got {addr!r}")
    return host, int(port)


def check_nodes(nnodes, node_rank, dist_init_addr, tensor_parallel_size: int | None = None) -> None:
    """Validate the multi-node options (tensor_parallel_size only when known)."""
    positive_int("nnodes", nnodes)
    if isinstance(node_rank, bool) or not isinstance(node_rank, int):
        raise TypeError(f"node_rank must be an int, got {type(node_rank).__name__} {node_rank!r}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank must be in [0, nnodes) = [0, {nnodes}), got {node_rank}")
    if tensor_parallel_size is not None and tensor_parallel_size % nnodes != 0:
        raise ValueError(f"tensor_parallel_size ({tensor_parallel_size}) must be divisible by nnodes ({nnodes}): "
                         "every node runs the same number of ranks")
    if dist_init_addr is not None:
        parse_init_addr(dist_init_addr)
    elif nnodes > 1:
        raise ValueError(f"dist_init_addr ('HOST:PORT' of node 0) is required when nnodes > 1 (nnodes={nnodes})")


def override_sampling(override: dict | None) -> tuple[dict, int | None]:
    """(SamplingParams keyword arguments, the max_tokens ceiling) of override_generation_config
    (vLLM's --override-generation-config): its fields win over the model's generation config, and
    its max_new_tokens is both the default and the most a request may ask for."""
    if override is None:
        return {}, None
    if not isinstance(override, dict):
        raise TypeError(f"override_generation_config must be a dict, got {type(override).__name__} {override!r}")
    from nanovllm.loader.checkpoint import GENERATION_CONFIG_FIELDS  # generation_config.json's names, as vLLM's flag
    from nanovllm.sampling_params import SamplingParams
    unknown = sorted(set(override) - set(GENERATION_CONFIG_FIELDS))
    if unknown:
        raise ValueError(f"override_generation_config has unknown key(s) {unknown}; known: "
                         f"{sorted(GENERATION_CONFIG_FIELDS)}")
    fields = {GENERATION_CONFIG_FIELDS[key]: value for key, value in override.items()}
    try:
        SamplingParams(**fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"override_generation_config: {e}") from None
    return fields, fields.get("max_tokens")


@dataclass
class EngineArgs:
    """Engine settings as given. __post_init__ checks every value that needs no model (ValueError /
    TypeError naming the setting); Config checks the rest against the checkpoint and the device."""

    model: str | None
    device: str = "auto"
    dtype: str | torch.dtype = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # tokens in one step, the prefill chunk (None: the platform's)
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.9
    cpu_kvcache_bytes: int | None = None
    # CPU: map every KV cache page at start-up, as llama.cpp clears its cache (a first write to fresh
    # memory costs 2-16 us per 4 KB page on a VM, i.e. a fifth of a 128-token prefill's time); off,
    # pages are mapped as tokens first land in them (a multi-GB cache then costs nothing at start-up).
    kvcache_prefault: bool = False
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    compile_ops: bool | None = None
    kvcache_block_size: int | None = None
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    # How the KV cache stores K and V (vLLM's name and values; layers/backends/kv_formats.py):
    # "auto" (CPU: 16 bits; CUDA: the activations' dtype), "float32", "bfloat16", "float16", "int8"
    # (llama.cpp's q8_0 blocks), "fp8" / "fp8_e4m3" / "fp8_e5m2". The platform says which it runs.
    kv_cache_dtype: str = "auto"
    seed: int = 0  # seeds the sampler's generator for requests without a seed of their own
    dist_port: int | None = None  # TP rendezvous port on 127.0.0.1; None picks a free one per engine
    dist_shm_name: str | None = None  # TP call channel's shared-memory name; None makes a unique one
    dist_timeout_s: float = 600.0  # TP collectives and startup give up after this long
    nnodes: int = 1  # machines the tensor-parallel ranks are spread over (tensor_parallel_size / nnodes each)
    node_rank: int = 0  # this machine's index; node 0 runs the engine (rank 0)
    dist_init_addr: str | None = None  # "HOST:PORT" of node 0's rendezvous; required when nnodes > 1
    # A dense checkpoint's weights quantized at load into a GGUF block format ("q8_0", "q4_0", ...);
    # None: the checkpoint's own format (a .gguf file always keeps its own).
    quantization: str | None = None
    # CPU block-format kernels (GGUF files, quantization=): how each group of a layer's inputs is
    # rounded. "auto": to int8 where that keeps the group's rounding noise 40 dB below its signal
    # (most groups), to 14-bit integers (two int8 planes) where it would not (groups holding an
    # outlier channel), in every format, the A16 pre-quantized ones (W8A16, W4A16, GPTQ, AWQ)
    # included; 14: 14-bit everywhere (within fp16's error of fp32, as vLLM keeps A16 activations in
    # 16 bits; twice int8's integer work); 8: int8 everywhere (llama.cpp's Q8 inputs; a small model's
    # greedy answer can change).
    cpu_input_bits: int | str = "auto"
    # Speculative decoding, vLLM's dict (spec_decode/config.py): {"method": "ngram", ...} or
    # {"method": "draft_model", "model": PATH, ...}; parsed into a SpeculativeConfig here.
    speculative_config: "dict | object | None" = None
    # Sampling defaults for requests that leave a field unset (vLLM's --generation-config): "auto" the
    # model's own (generation_config.json's temperature / top_p / top_k / min_p / repetition_penalty /
    # max_new_tokens, a GGUF file's general.sampling.* metadata), "vllm" none (SamplingParams'
    # defaults), or a folder whose generation_config.json holds them.
    generation_config: str = "auto"
    # vLLM's --override-generation-config: generation_config.json fields that win over the model's
    # (loader/checkpoint.py GENERATION_CONFIG_FIELDS); its max_new_tokens is also the most tokens a server request may ask for.
    override_generation_config: dict | None = None
    # vLLM's --runner: "generate" (and "auto") build the engine to generate; "pooling" to embed only
    # (LLM.embed, /v1/embeddings): one KV cache block is held (embedding runs KV-free prefills) and
    # generation requests are refused with a ValueError naming it.
    runner: str = "auto"
    # A tier under the prefix cache (kv_offload/; docs/serving.md "Prompts that outlive RAM and
    # restarts"): vLLM's kv_offloading_backend ("native"; None: off unless a size or directory below is
    # given) and kv_offloading_size (GiB of host RAM: on a GPU the first tier; on a CPU a second copy
    # of what the cache holds, rarely worth it), and beside them kv_offloading_dir (a directory that
    # outlives the process and is shared by replicas) and kv_offloading_dir_size (GiB it may hold).
    kv_offloading_backend: str | None = None
    kv_offloading_size: float | None = None
    kv_offloading_dir: str | None = None
    kv_offloading_dir_size: float = 8.0
    # LoRA adapters (lora/, vLLM's names): enable_lora lets requests name an adapter (lora_request=,
    # the server's --lora-modules); max_loras adapters run in one step (each a slot of every targeted
    # layer), max_lora_rank the highest rank they may have, max_cpu_loras how many read adapters are
    # kept on the host (None: max_loras), lora_dtype the slots' precision ("auto": int8 with a scale
    # per row on a CPU with a quantized base model, else the model's; "int8" / "bfloat16" quarter /
    # halve the bytes a CPU step with many adapters reads, docs/lora.md).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"

    def __post_init__(self) -> None:
        if type(self.cpu_input_bits) not in (int, str) or self.cpu_input_bits not in CPU_INPUT_BITS:
            raise ValueError(f"cpu_input_bits must be 'auto', 8 or 14, got {self.cpu_input_bits!r}")
        if not isinstance(self.dtype, torch.dtype) and self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int, got {type(self.seed).__name__} {self.seed!r}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        for name in ("max_num_seqs", "max_model_len", "tensor_parallel_size"):
            positive_int(name, getattr(self, name))
        for name in ("max_num_batched_tokens", "kvcache_block_size", "cpu_kvcache_bytes"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))
        if self.kvcache_block_size is not None and self.kvcache_block_size % 16 != 0:
            raise ValueError(f"kvcache_block_size must be a multiple of 16, got {self.kvcache_block_size}")
        if isinstance(self.gpu_memory_utilization, bool) or not isinstance(self.gpu_memory_utilization, (int, float)) \
                or not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        for name in ("max_loras", "max_lora_rank"):
            positive_int(name, getattr(self, name))
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be one of {list(LORA_DTYPES)}, got {self.lora_dtype!r}")
        if self.max_cpu_loras is not None:
            positive_int("max_cpu_loras", self.max_cpu_loras)
            if self.max_cpu_loras < self.max_loras:
                raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}): "
                                 "every adapter in a slot is also kept on the host")
        for name in ("enforce_eager", "enable_prefix_caching", "kvcache_prefault", "enable_lora"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.compile_ops is not None and not isinstance(self.compile_ops, bool):
            raise TypeError(f"compile_ops must be a bool or None (auto), got {self.compile_ops!r}")
        from nanovllm.layers.backends import check_backend_name
        # an unknown or absent device; a backend that is not registered or cannot run on it
        check_backend_name(self.attention_backend, self.device_platform().device_name)
        from nanovllm.layers.backends import kv_formats
        kv_formats.check_name(self.kv_cache_dtype)
        from nanovllm.layers.quantization import check_quantization_name
        check_quantization_name(self.quantization)
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be 'auto', 'generate' or 'pooling', got {self.runner!r}")
        self._check_distributed()
        self._check_kv_offloading()
        from nanovllm.spec_decode.config import SpeculativeConfig
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self._check_generation_config()

    def device_platform(self):
        """The platform of self.device (platforms/: "auto" is CUDA where this process sees a GPU);
        ValueError for an unknown device or one this process does not see."""
        from nanovllm.platforms import get_platform
        return get_platform(self.device)

    def _check_kv_offloading(self) -> None:
        for name in ("kv_offloading_size", "kv_offloading_dir_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise ValueError(f"{name} must be a positive number of GiB, got {value!r}")
        if self.kv_offloading_dir is not None and (not isinstance(self.kv_offloading_dir, str) or not self.kv_offloading_dir):
            raise ValueError(f"kv_offloading_dir must be a directory's path, got {self.kv_offloading_dir!r}")
        backend = self.kv_offloading_backend
        if backend is None and (self.kv_offloading_size is not None or self.kv_offloading_dir is not None):
            self.kv_offloading_backend = backend = "native"
        if backend is None:
            return
        if backend != "native":
            raise ValueError(f"kv_offloading_backend must be 'native' (the only backend here), got {backend!r}")
        if self.kv_offloading_size is None and self.kv_offloading_dir is None:
            raise ValueError("kv_offloading_backend='native' needs kv_offloading_size (GiB of host RAM) or "
                             "kv_offloading_dir (a directory)")
        if self.tensor_parallel_size > 1:
            raise ValueError("KV offloading runs with tensor_parallel_size 1 (each rank's cache holds its own heads); "
                             f"got tensor_parallel_size={self.tensor_parallel_size}")

    def _check_distributed(self) -> None:
        check_nodes(self.nnodes, self.node_rank, self.dist_init_addr, self.tensor_parallel_size)
        if self.dist_init_addr is not None and self.dist_port is not None:
            raise ValueError(f"give dist_init_addr ({self.dist_init_addr!r}) or dist_port ({self.dist_port}), "
                             "not both: the address holds the port")
        if self.dist_port is not None:
            positive_int("dist_port", self.dist_port)
            if self.dist_port > 65535:
                raise ValueError(f"dist_port must be in [1, 65535], got {self.dist_port}")
        if self.dist_shm_name is not None:
            if not isinstance(self.dist_shm_name, str):
                raise TypeError(f"dist_shm_name must be a str, got {type(self.dist_shm_name).__name__}")
            if not self.dist_shm_name or "/" in self.dist_shm_name:
                raise ValueError(f"dist_shm_name must be a non-empty name without '/', got {self.dist_shm_name!r}")
        if isinstance(self.dist_timeout_s, bool) or not isinstance(self.dist_timeout_s, (int, float)) \
                or not self.dist_timeout_s > 0:
            raise ValueError(f"dist_timeout_s must be a positive number of seconds, got {self.dist_timeout_s!r}")

    def _check_generation_config(self) -> None:
        source = self.generation_config
        if not isinstance(source, str) or not source:
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder, got {source!r}")
        if source not in ("auto", "vllm") and not os.path.isfile(os.path.join(source, "generation_config.json")):
            raise ValueError(f"generation_config {source!r} is not a folder holding a generation_config.json "
                             "('auto': the model's own; 'vllm': none)")
        override_sampling(self.override_generation_config)
