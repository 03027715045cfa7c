"""Where weights come from: a Checkpoint (checkpoint.py) opened once gives the config, the
tokenizer, the weight format and one iterator of (checkpoint name, tensor) per source (safetensors
folders, GGUF files), fed to model.load_weights, which maps the names onto its stacked and sharded
parameters (weights.py)."""
from torch import nn

from nanovllm.loader.checkpoint import Checkpoint
from nanovllm.loader.weights import StackedParam, load_weights


def load_model(model: nn.Module, checkpoint: "Checkpoint | str") -> None:
    """Copy every tensor of the checkpoint (or the one at that path) into model; error on missing or
    unknown weights."""
    if not isinstance(checkpoint, Checkpoint):
        checkpoint = Checkpoint(checkpoint)
    model.load_weights(checkpoint.weights())


__all__ = ["Checkpoint", "StackedParam", "load_model", "load_weights"]
