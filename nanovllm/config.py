"""Config: every engine knob, validated once at construction. Built by LLMEngine from LLM kwargs."""
import dataclasses
import logging
import os
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

import torch

from nanovllm.platforms import Platform, get_platform

if TYPE_CHECKING:
    from nanovllm.spec_decode.config import SpeculativeConfig
    from nanovllm.layers.backends.kv_formats import KVFormat
    from nanovllm.layers.quantization import QuantizationConfig
    from nanovllm.loader.checkpoint import Checkpoint

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def _positive_int(name: str, value) -> None:
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
    _positive_int("nnodes", nnodes)
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


# Config.cpu_input_bits -> the C kernels' input rounding mode (Linear.input_planes, cpu_quant.c):
# 1 int8, 2 two int8 planes, 0 per group.
CPU_INPUT_BITS = {"auto": 0, 8: 1, 14: 2}


@dataclass
class Config:
    """Engine settings. Derived values (hf_config, torch_dtype, the resolved device and its
    platform) are set once here; every device-dependent default comes from the platform."""

    model: str
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
    speculative_config: "dict | SpeculativeConfig | None" = None
    # Sampling defaults for requests that leave a field unset (vLLM's --generation-config): "auto" the
    # model's own (generation_config.json's temperature / top_p / top_k / min_p / repetition_penalty,
    # a GGUF file's general.sampling.* metadata), "vllm" none (SamplingParams' defaults), or a folder
    # whose generation_config.json holds them.
    generation_config: str = "auto"
    # vLLM's --runner: "generate" (and "auto") build the engine to generate; "pooling" to embed only
    # (LLM.embed, /v1/embeddings): one KV cache block is held (embedding runs KV-free prefills) and
    # generation requests are refused with a ValueError naming it.
    runner: str = "auto"
    # Derived, filled in __post_init__.
    checkpoint: "Checkpoint" = field(init=False, repr=False, compare=False)  # loader/checkpoint.py
    hf_config: object = field(init=False, repr=False)
    quant_config: "QuantizationConfig" = field(init=False, repr=False, compare=False)  # the weight format
    torch_dtype: torch.dtype = field(init=False)  # activations
    kv_format: "KVFormat" = field(init=False, repr=False, compare=False)  # the KV cache's, from kv_cache_dtype
    weight_dtype: torch.dtype = field(init=False)  # how the linear weights are held (platform.weight_dtype)
    eos_token_ids: frozenset = field(init=False)
    sampling_defaults: dict = field(init=False)  # from generation_config: SamplingParams keyword arguments
    platform: Platform = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if type(self.cpu_input_bits) not in (int, str) or self.cpu_input_bits not in CPU_INPUT_BITS:
            raise ValueError(f"cpu_input_bits must be 'auto', 8 or 14, got {self.cpu_input_bits!r}")
        from nanovllm.loader.checkpoint import Checkpoint
        self.checkpoint = Checkpoint(self.model)  # ValueError for a missing or malformed checkpoint
        self.hf_config = self.checkpoint.hf_config
        self.model = self.checkpoint.path
        from nanovllm.models import get_model_class
        # unsupported architectures fail here, naming the supported ones
        packed = getattr(get_model_class(self.hf_config), "packed_modules_mapping", {})
        # the weight format, checked (a pre-quantized checkpoint's tensor index too) before any rank starts
        self.quant_config = self.checkpoint.quant_config(self.quantization, packed, CPU_INPUT_BITS[self.cpu_input_bits])
        self.platform = get_platform(self.device)  # raises on an unknown or absent device
        self.device = self.platform.device_name
        self.quant_config.check_device(self.device, self.hf_config)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int, got {type(self.seed).__name__} {self.seed!r}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = self.platform.default_max_num_batched_tokens
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "tensor_parallel_size"):
            _positive_int(name, getattr(self, name))
        if self.kvcache_block_size is None:
            self.kvcache_block_size = self.platform.default_block_size
        _positive_int("kvcache_block_size", self.kvcache_block_size)
        if self.kvcache_block_size % 16 != 0:
            raise ValueError(f"kvcache_block_size must be a multiple of 16, got {self.kvcache_block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cpu_kvcache_bytes is not None:
            _positive_int("cpu_kvcache_bytes", self.cpu_kvcache_bytes)
        from nanovllm.layers.backends import check_backend_name
        check_backend_name(self.attention_backend, self.device)  # registered, and runs on this device
        for name in ("enforce_eager", "enable_prefix_caching", "kvcache_prefault"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.compile_ops is None:
            self.compile_ops = self.platform.default_compile_ops(self.enforce_eager)
        elif not isinstance(self.compile_ops, bool):
            raise TypeError(f"compile_ops must be a bool or None (auto), got {self.compile_ops!r}")
        max_pos = getattr(self.hf_config, "max_position_embeddings", None)
        if max_pos is not None:
            from nanovllm.layers.rotary_embedding import rope_positions, rope_settings
            max_pos = rope_positions(max_pos, rope_settings(self.hf_config)[1])  # YaRN reaches past it
        if max_pos is not None and self.max_model_len > max_pos:
            logger.info("max_model_len %d capped to the model's positions (%d)", self.max_model_len, max_pos)
            self.max_model_len = max_pos
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                             f"max_num_seqs ({self.max_num_seqs})")
        dtype = self._resolve_dtype()
        self.torch_dtype, self.weight_dtype = self.platform.compute_dtype(dtype), self.platform.weight_dtype(dtype)
        self.kv_format = self.platform.kv_cache_format(self.kv_cache_dtype, self.torch_dtype)
        from nanovllm.layers.backends import check_backend_kv_format
        check_backend_kv_format(self.attention_backend, self.kv_format, self.torch_dtype)
        self.eos_token_ids = self.checkpoint.eos_token_ids()
        self._check_tensor_parallel()
        if self.cpu_kvcache_bytes is None:
            self.cpu_kvcache_bytes = self.platform.default_kvcache_bytes(self.tensor_parallel_size // self.nnodes)
        self._check_speculative()
        self.sampling_defaults = self._sampling_defaults()
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"runner must be 'auto', 'generate' or 'pooling', got {self.runner!r}")

    def _sampling_defaults(self) -> dict:
        from nanovllm.loader.checkpoint import generation_config_defaults
        from nanovllm.sampling_params import SamplingParams
        source = self.generation_config
        if not isinstance(source, str) or not source:
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder, got {source!r}")
        if source == "vllm":
            return {}
        if source == "auto":
            defaults = self.checkpoint.sampling_defaults()
        else:
            defaults = generation_config_defaults(source) if os.path.isdir(source) else None
            if defaults is None:
                raise ValueError(f"generation_config {source!r} is not a folder holding a generation_config.json "
                                 "('auto': the model's own; 'vllm': none)")
        try:
            SamplingParams(**defaults)
        except (TypeError, ValueError) as e:
            raise ValueError(f"the sampling defaults of generation_config {source!r} are not valid: {e}") from None
        return defaults

    def _check_speculative(self) -> None:
        from nanovllm.spec_decode.config import SpeculativeConfig
        self.speculative_config = spec = SpeculativeConfig.parse(self.speculative_config)
        if spec is None or spec.method != "draft_model":
            return
        from nanovllm.loader.checkpoint import Checkpoint
        try:
            draft = Checkpoint(spec.model)
        except (ValueError, OSError) as e:
            raise ValueError(f"speculative_config.model: {e}") from None
        if draft.hf_config.vocab_size != self.hf_config.vocab_size:
            raise ValueError(f"the draft model {spec.model} has a vocabulary of {draft.hf_config.vocab_size} "
                             f"tokens, the target {self.hf_config.vocab_size}: a draft must share the target's "
                             "tokenizer")

    def _check_tensor_parallel(self) -> None:
        tp = self.tensor_parallel_size
        check_nodes(self.nnodes, self.node_rank, self.dist_init_addr, tp)
        if self.dist_init_addr is not None and self.dist_port is not None:
            raise ValueError(f"give dist_init_addr ({self.dist_init_addr!r}) or dist_port ({self.dist_port}), "
                             "not both: the address holds the port")
        self.platform.check_tensor_parallel_size(tp // self.nnodes)  # the ranks of one node
        if tp > 1:  # the weight format's blocks and groups split whole
            from nanovllm.models.decoder import row_parallel_inputs
            self.quant_config.check_tensor_parallel(tp, row_parallel_inputs(self.hf_config))
        if self.dist_port is not None:
            _positive_int("dist_port", self.dist_port)
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
        hf = self.hf_config
        # Each rank holds whole heads, an equal slice of the MLP and of the vocabulary.
        sizes = {
            "num_attention_heads": hf.num_attention_heads,
            "num_key_value_heads": getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            "intermediate_size": hf.intermediate_size,
            "vocab_size": hf.vocab_size,
        }
        for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):  # each expert split too
            if getattr(hf, name, None):
                sizes[name] = getattr(hf, name)
        for name, size in sizes.items():
            if size % tp != 0:
                raise ValueError(f"tensor_parallel_size ({tp}) must divide the model's {name} ({size}): "
                                 "each rank holds an equal share of it")

    def _resolve_dtype(self) -> torch.dtype:
        if isinstance(self.dtype, torch.dtype):
            dtype = self.dtype
        elif self.dtype == "auto":
            dtype = getattr(self.hf_config, "dtype", None) or getattr(self.hf_config, "torch_dtype", None)
            if isinstance(dtype, str):
                dtype = _DTYPES.get(dtype, torch.float32)
            dtype = self.platform.resolve_auto_dtype(dtype or torch.float32)
        elif self.dtype in _DTYPES:
            dtype = _DTYPES[self.dtype]
        else:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype {dtype} is not supported")
        return dtype


CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(Config) if f.init)
