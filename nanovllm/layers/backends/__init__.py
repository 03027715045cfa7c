"""Attention backends: how K/V are stored into the paged cache and how attention reads it.

Each backend module is imported lazily, so flash-attn or triton are only needed when picked.
"""
import importlib
import importlib.util
import logging

import torch

logger = logging.getLogger(__name__)

_BACKENDS = {
    "torch": "nanovllm.layers.backends.torch_backend:TorchBackend",
    "flash": "nanovllm.layers.backends.flash_backend:FlashBackend",
    "triton": "nanovllm.layers.backends.triton_backend:TritonBackend",
}
# flash-attn's paged KV kernels address the cache in pages of a multiple of this many tokens.
FLASH_BLOCK_MULTIPLE = 256


class AttentionBackend:
    """Interface. Shapes: q [num_tokens, num_heads, head_dim]; k, v [num_tokens, num_kv_heads,
    head_dim]; caches [num_blocks, block_size, num_kv_heads, head_dim]."""

    name = "base"

    def __init__(self, device: str = "cpu"):
        self.device = device

    def check_block_size(self, block_size: int) -> None:
        """Raise ValueError if this backend cannot work with the given KV block size."""

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Raise ValueError if this backend cannot compute in the given dtype."""

    def store_kvcache(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        raise NotImplementedError

    def prefill(self, q, k, v, k_cache, v_cache, context, scale: float) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, q, k_cache, v_cache, context, scale: float) -> torch.Tensor:
        raise NotImplementedError


def register_backend(name: str, target: str) -> None:
    _BACKENDS[name] = target


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def _flash_usable(block_size: int | None, dtype: torch.dtype | None) -> str | None:
    """Why 'auto' cannot pick flash here, or None when it can."""
    if importlib.util.find_spec("flash_attn") is None:
        return "flash-attn is not installed"
    if block_size is not None and block_size % FLASH_BLOCK_MULTIPLE != 0:
        return f"kvcache_block_size {block_size} is not a multiple of {FLASH_BLOCK_MULTIPLE}"
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        return f"flash-attn computes in fp16/bf16 only, the model runs in {dtype}"
    return None


def pick_backend_name(requested: str, device: str, block_size: int | None = None,
                      dtype: torch.dtype | None = None) -> str:
    """'auto' becomes flash (CUDA with flash-attn, fp16/bf16, block size a multiple of 256), then
    triton (CUDA), else torch."""
    if requested != "auto":
        return requested
    if device != "cuda":
        return "torch"
    why_not_flash = _flash_usable(block_size, dtype)
    if why_not_flash is None:
        return "flash"
    has_triton = "triton" in _BACKENDS and importlib.util.find_spec("triton") is not None
    picked = "triton" if has_triton else "torch"
    logger.warning("CUDA without the flash attention backend (%s): using the %s backend, which is slower",
                   why_not_flash, picked)
    return picked


def get_backend(name: str, device: str = "cpu") -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"attention backend {name!r} is not available; available: {available_backends()}")
    module_name, cls_name = _BACKENDS[name].split(":")
    try:
        module = importlib.import_module(module_name)
        return getattr(module, cls_name)(device=device)
    except ImportError as e:
        raise ValueError(f"attention backend {name!r} needs a package that is missing: {e}") from e
