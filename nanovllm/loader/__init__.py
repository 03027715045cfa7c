"""Where weights come from: one iterator of (checkpoint name, tensor) per source (safetensors
folders, GGUF files), fed to model.load_weights, which maps the names onto its stacked and sharded
parameters (weights.py). Called once by ModelRunner."""
from collections.abc import Iterator

import torch
from torch import nn

from nanovllm.loader.gguf import is_gguf_path, open_gguf, release_gguf
from nanovllm.loader.safetensors import safetensors_weights
from nanovllm.loader.weights import StackedParam, load_weights


def weights_of(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights of the checkpoint at path (a folder of safetensors files, or a .gguf file)."""
    if is_gguf_path(path):
        return _gguf_weights(path)
    return safetensors_weights(path)


def _gguf_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        yield from open_gguf(path).weights()
    finally:
        release_gguf(path)


def load_model(model: nn.Module, path: str) -> None:
    """Copy every tensor of the checkpoint at path into model; error on missing or unknown weights."""
    model.load_weights(weights_of(path))


__all__ = ["StackedParam", "load_model", "load_weights", "weights_of"]
