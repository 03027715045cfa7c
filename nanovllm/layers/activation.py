"""SiLU-and-mul: the gated activation of the MLP, on the fused gate_up projection's output."""
import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)  # [num_tokens, 2 * intermediate] -> 2 x [num_tokens, intermediate]
        return F.silu(gate) * up
