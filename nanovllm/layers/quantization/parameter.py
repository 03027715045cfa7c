"""Parameters that say how they are laid out, so weight loaders shard and place them by their tags
instead of assuming a dense [output, input] tensor (vLLM's model_executor/parameter.py):
output_dim / input_dim: which dimension runs along the layer's outputs / inputs (None: neither,
e.g. a bias has no input dim, a per-tensor scale neither); packed_dim and packed_factor: that
dimension holds packed_factor logical elements per entry (int4 in int32: 8)."""
from collections.abc import Callable

import torch
from torch import nn

from nanovllm.distributed.parallel import divide


def tagged_parameter(data: torch.Tensor, weight_loader: Callable, output_dim: int | None = None,
                     input_dim: int | None = None, packed_dim: int | None = None,
                     packed_factor: int = 1) -> nn.Parameter:
    param = nn.Parameter(data, requires_grad=False)
    param.output_dim, param.input_dim = output_dim, input_dim
    param.packed_dim, param.packed_factor = packed_dim, packed_factor
    param.weight_loader = weight_loader
    return param


class TaggedWeights(nn.Module):
    """A layer whose method registers its parameters through register_weight, each loaded by the
    layer's weight_loader."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *args) -> None:
        raise NotImplementedError

    def register_weight(self, name: str, data: torch.Tensor, **tags) -> nn.Parameter:
        """A parameter of this layer (tags: tagged_parameter's)."""
        param = tagged_parameter(data, self.weight_loader, **tags)
        self.register_parameter(name, param)
        return param


def in_param_units(param: nn.Parameter, dim: int, count: int, what: str) -> int:
    """count logical elements along dim as entries of param (divided by its packing there)."""
    if getattr(param, "packed_dim", None) != dim:
        return count
    if count % param.packed_factor:
        raise ValueError(f"{what}: {count} elements do not fill whole packed entries of {param.packed_factor}")
    return count // param.packed_factor


def shard_of(loaded: torch.Tensor, dim: int, rank: int, size: int, what: str) -> torch.Tensor:
    """This rank's contiguous 1/size of loaded along dim."""
    part = divide(loaded.size(dim), size, what)
    return loaded.narrow(dim, rank * part, part)


def copy_checked(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor for {what} has shape {tuple(loaded.shape)}, "
                         f"expected {tuple(param.shape)}")
    param.copy_(loaded)
