"""The gated activations of the MLP, on the fused gate_up projection's output: SiLU (Llama, Qwen)
and GELU with the tanh approximation (Gemma)."""
import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)  # [num_tokens, 2 * intermediate] -> 2 x [num_tokens, intermediate]
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


_GATED = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul, "gelu_tanh": GeluTanhAndMul}


def gated_activation(name: str) -> nn.Module:
    """The gated activation of a config's hidden_act / hidden_activation name."""
    if name not in _GATED:
        raise ValueError(f"hidden activation {name!r} is not supported ({sorted(_GATED)})")
    return _GATED[name]()
