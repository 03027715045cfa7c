"""Attention backends: the registry of names, 'auto' selection and the checks Config and ModelRunner
run, all reading the rules each backend class states (see base.py for the interface).

Each backend module is imported lazily, so flash-attn or triton are only needed when picked.
Adding a backend: one module with an AttentionBackend subclass and one line in _BACKENDS (or a
register_backend call).
"""
import importlib
import logging

import torch

from nanovllm.layers.backends.base import AttentionBackend, AttentionBatch
from nanovllm.layers.backends.kv_formats import KV_FORMATS, KVFormat

__all__ = ["AttentionBackend", "AttentionBatch", "available_backends", "backend_class", "check_backend_kv_format",
           "check_backend_name",
           "get_backend", "pick_backend_name", "register_backend"]

logger = logging.getLogger(__name__)

# name -> "module:Class". NOTE: the order is the order in which 'auto' tries them.
_BACKENDS = {
    "flash": "nanovllm.layers.backends.flash_backend:FlashBackend",
    "triton": "nanovllm.layers.backends.triton_backend:TritonBackend",
    "torch": "nanovllm.layers.backends.torch_backend:TorchBackend",
}


def register_backend(name: str, target: str) -> None:
    """Make `name` a valid attention_backend, served by target "package.module:ClassName"."""
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"a backend name must be a non-empty string other than 'auto', got {name!r}")
    if not isinstance(target, str) or target.count(":") != 1:
        raise ValueError(f"a backend target must read 'package.module:ClassName', got {target!r}")
    _BACKENDS[name] = target


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def backend_class(name: str) -> type[AttentionBackend]:
    """The class registered under name; importing its module (not its optional packages)."""
    if name not in _BACKENDS:
        raise ValueError(f"attention backend {name!r} is not available; available: {available_backends()}")
    module_name, cls_name = _BACKENDS[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"attention backend {name!r} needs a package that is missing: {e}") from e
    return getattr(module, cls_name)


def check_backend_name(name: str, device: str) -> None:
    """Config's check: name is 'auto' or registered, and a named backend can run on device."""
    if not isinstance(name, str):
        raise TypeError(f"attention_backend must be a str, got {type(name).__name__} {name!r}")
    if name == "auto":
        return
    if name not in _BACKENDS:
        raise ValueError(f"attention_backend must be one of {['auto', *available_backends()]}, got {name!r}")
    reason = backend_class(name).unavailable_reason(device)
    if reason is not None:
        raise ValueError(f"attention_backend={name!r} on device={device!r}: {reason}")


def _why_not(cls: type[AttentionBackend], device: str, block_size: int | None,
             dtype: torch.dtype | None, kv_format: KVFormat | None) -> str | None:
    reason = cls.unavailable_reason(device)
    if reason is None and block_size is not None:
        reason = cls.block_size_error(block_size)
    if reason is None and dtype is not None:
        reason = cls.dtype_error(dtype)
    if reason is None and dtype is not None and kv_format is not None:
        reason = cls.kv_format_error(kv_format, dtype)
    return reason


def pick_backend_name(requested: str, device: str, block_size: int | None = None,
                      dtype: torch.dtype | None = None, kv_format: KVFormat | None = None) -> str:
    """'auto' becomes the first registered backend that may be auto-picked on device and whose rules
    accept it: flash (CUDA with flash-attn, fp16/bf16, block size a multiple of 256, a cache in the
    activations' dtype), then triton (CUDA; fp8 caches too), else torch. Passing over the first
    candidate logs why."""
    if requested != "auto":
        return requested
    first_reason = None
    for name in _BACKENDS:
        cls = backend_class(name)
        if device not in cls.auto_devices:
            continue
        reason = _why_not(cls, device, block_size, dtype, kv_format)
        if reason is None:
            if first_reason is not None:
                logger.warning("%s without the %s attention backend (%s): using the %s backend, which is slower",
                               device.upper(), first_reason[0], first_reason[1], name)
            return name
        first_reason = first_reason or (name, reason)
    raise ValueError(f"no attention backend can run on device {device!r}; available: {available_backends()}")


def check_backend_kv_format(name: str, kv_format: KVFormat, dtype: torch.dtype) -> None:
    """Config's check: a named backend reads caches in kv_format under activations of dtype."""
    if name != "auto":
        reason = backend_class(name).kv_format_error(kv_format, dtype)
        if reason is not None:
            raise ValueError(f"attention_backend={name!r} with kv_cache_dtype={kv_format.name!r}: {reason}")


def get_backend(name: str, device: str = "cpu", kv_format: KVFormat | None = None,
                dtype: torch.dtype = torch.float32) -> AttentionBackend:
    """A backend on device over caches in kv_format (None: fp32) under activations of dtype."""
    cls = backend_class(name)
    reason = cls.unavailable_reason(device) or cls.kv_format_error(kv_format or KV_FORMATS["float32"], dtype)
    if reason is not None:
        raise ValueError(f"attention backend {name!r} cannot run on device {device!r}: {reason}")
    return cls(device=device, kv_format=kv_format)
