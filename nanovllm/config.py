"""Config: the engine's settings (EngineArgs) resolved once, at construction, against the checkpoint and the
device. Built by LLMEngine from LLM kwargs."""
import dataclasses
import logging
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

import torch

from nanovllm.engine_args import CPU_INPUT_BITS, DTYPES, EngineArgs, override_sampling

if TYPE_CHECKING:
    from nanovllm.layers.backends.kv_formats import KVFormat
    from nanovllm.layers.quantization import QuantizationConfig
    from nanovllm.loader.checkpoint import Checkpoint

logger = logging.getLogger(__name__)

__all__ = ["CONFIG_FIELDS", "CPU_INPUT_BITS", "Config"]


@dataclass
class Config(EngineArgs):
    """Engine settings (EngineArgs, checked there without the model) resolved against the
    checkpoint and the device. Derived values (hf_config, torch_dtype, the resolved device and its
    platform) are set once here; every device-dependent default comes from the platform."""

    # Derived, filled in __post_init__.
    checkpoint: "Checkpoint" = field(init=False, repr=False, compare=False)  # loader/checkpoint.py
    hf_config: object = field(init=False, repr=False)
    model_class: type = field(init=False, repr=False, compare=False)  # the architecture's (models.get_model_class)
    # Whether layers of different attention kinds get block tables of their own (engine/kv_groups.py):
    # not when a proposer reads the target's one table (a draft model's KV cache shares its block ids).
    split_kv_groups: bool = field(init=False)
    quant_config: "QuantizationConfig" = field(init=False, repr=False, compare=False)  # the weight format
    torch_dtype: torch.dtype = field(init=False)  # activations
    kv_format: "KVFormat" = field(init=False, repr=False, compare=False)  # the KV cache's, from kv_cache_dtype
    weight_dtype: torch.dtype = field(init=False)  # how the linear weights are held (platform.weight_dtype)
    eos_token_ids: frozenset = field(init=False)
    sampling_defaults: dict = field(init=False)  # from generation_config: SamplingParams keyword arguments
    # override_generation_config's max_new_tokens: the most tokens a server request may ask for
    max_tokens_ceiling: int | None = field(init=False)
    # The device's platforms.Platform (EngineArgs.device_platform): traits and device operations.
    platform: object = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()  # every value that needs no model
        from nanovllm.loader.checkpoint import Checkpoint
        self.checkpoint = Checkpoint(self.model)  # ValueError for a missing or malformed checkpoint
        self.hf_config = self.checkpoint.hf_config
        self.model = self.checkpoint.path
        from nanovllm.models import get_model_class
        self.model_class = get_model_class(self.hf_config)  # unsupported architectures fail here, naming the supported ones
        packed = getattr(self.model_class, "packed_modules_mapping", {})
        # the weight format, checked (a pre-quantized checkpoint's tensor index too) before any rank starts
        self.quant_config = self.checkpoint.quant_config(self.quantization, packed, CPU_INPUT_BITS[self.cpu_input_bits])
        self.platform = self.device_platform()
        self.device = self.platform.device_name
        self.quant_config.check_device(self.device, self.hf_config)
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = self.platform.default_max_num_batched_tokens
        if self.kvcache_block_size is None:
            self.kvcache_block_size = self.platform.default_block_size
        if self.compile_ops is None:
            self.compile_ops = self.platform.default_compile_ops(self.enforce_eager)
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
        from nanovllm.layers.backends import check_backend_kv_format, kv_formats
        self.kv_format = kv_formats.resolve(self.kv_cache_dtype, self.torch_dtype, self.platform)
        check_backend_kv_format(self.attention_backend, self.kv_format, self.torch_dtype)
        self.eos_token_ids = self.checkpoint.eos_token_ids()
        self._check_tensor_parallel()
        if self.cpu_kvcache_bytes is None:
            self.cpu_kvcache_bytes = self.platform.default_kvcache_bytes(self.tensor_parallel_size // self.nnodes)
        self._check_draft_model()
        spec = self.speculative_config
        self.split_kv_groups = spec is None or not spec.reads_target_block_table
        self.sampling_defaults, self.max_tokens_ceiling = self._sampling_defaults()

    def _sampling_defaults(self) -> tuple[dict, int | None]:
        """(the SamplingParams defaults for fields a request leaves unset, the max_tokens ceiling):
        generation_config's fields, override_generation_config's over them."""
        from nanovllm.loader.checkpoint import generation_config_defaults
        from nanovllm.sampling_params import SamplingParams
        source = self.generation_config
        if source == "vllm":
            defaults = {}
        elif source == "auto":
            defaults = self.checkpoint.sampling_defaults()
        else:
            defaults = generation_config_defaults(source)
        try:
            SamplingParams(**defaults)
        except (TypeError, ValueError) as e:
            raise ValueError(f"the sampling defaults of generation_config {source!r} are not valid: {e}") from None
        override, ceiling = override_sampling(self.override_generation_config)
        return {**defaults, **override}, ceiling

    def _check_draft_model(self) -> None:
        spec = self.speculative_config  # parsed by EngineArgs
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
        tp = self.tensor_parallel_size  # its value, the nodes and the dist_* settings checked by EngineArgs
        self.platform.check_tensor_parallel_size(tp // self.nnodes)  # the ranks of one node
        if tp > 1:  # the weight format's blocks and groups split whole
            from nanovllm.models.decoder import row_parallel_inputs
            self.quant_config.check_tensor_parallel(tp, row_parallel_inputs(self.hf_config))
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
                dtype = DTYPES.get(dtype, torch.float32)
            dtype = self.platform.resolve_auto_dtype(dtype or torch.float32)
        else:  # a name EngineArgs checked
            dtype = DTYPES[self.dtype]
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype {dtype} is not supported")
        return dtype


CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(Config) if f.init)
