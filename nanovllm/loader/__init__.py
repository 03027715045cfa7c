"""Where weights come from: one iterator of (checkpoint name, tensor) per source (safetensors
folders today), fed to model.load_weights, which maps the names onto its stacked and sharded
parameters (weights.py). Called once by ModelRunner."""
from collections.abc import Iterator

import torch
from torch import nn

from nanovllm.loader.safetensors import safetensors_weights
from nanovllm.loader.weights import StackedParam, load_weights


def weights_of(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights of the checkpoint at path."""
    return safetensors_weights(path)


def load_model(model: nn.Module, path: str) -> None:
    """Copy every tensor of the checkpoint at path into model; error on missing or unknown weights."""
    model.load_weights(weights_of(path))


__all__ = ["StackedParam", "load_model", "load_weights", "weights_of"]
