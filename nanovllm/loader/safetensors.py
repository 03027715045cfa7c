"""Weights from a HuggingFace folder's *.safetensors files (read without executing anything)."""
import glob
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open


def safetensors_files(path: str) -> list[str]:
    return sorted(glob.glob(os.path.join(path, "*.safetensors")))


def safetensors_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) of every tensor in path/*.safetensors, file by file."""
    files = safetensors_files(path)
    if not files:
        raise ValueError(f"no *.safetensors files in {path!r}")
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except OSError as e:  # a truncated or malformed file
            raise ValueError(f"cannot read {file!r}: {e}") from e
