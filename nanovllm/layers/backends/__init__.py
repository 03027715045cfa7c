"""Attention backends: how K/V are stored into the paged cache and how attention reads it.

Each backend module is imported lazily, so flash-attn or triton are only needed when picked.
"""
import importlib
import logging

import torch

logger = logging.getLogger(__name__)

_BACKENDS = {
    "torch": "nanovllm.layers.backends.torch_backend:TorchBackend",
    "triton": "nanovllm.layers.backends.triton_backend:TritonBackend",
}


class AttentionBackend:
    """Interface. Shapes: q [num_tokens, num_heads, head_dim]; k, v [num_tokens, num_kv_heads,
    head_dim]; caches [num_blocks, block_size, num_kv_heads, head_dim]."""

    name = "base"

    def check_block_size(self, block_size: int) -> None:
        """Raise ValueError if this backend cannot work with the given KV block size."""

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


def pick_backend_name(requested: str, device: str) -> str:
    """'auto' becomes flash (CUDA with flash-attn), then triton (CUDA), else torch."""
    if requested != "auto":
        return requested
    if device != "cuda":
        return "torch"
    for name, module in (("flash", "flash_attn"), ("triton", "triton")):
        if name in _BACKENDS and importlib.util.find_spec(module) is not None:
            return name
    return "torch"


def get_backend(name: str) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"attention backend {name!r} is not available; available: {available_backends()}")
    module_name, cls_name = _BACKENDS[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"attention backend {name!r} needs a package that is missing: {e}") from e
    return getattr(module, cls_name)()
