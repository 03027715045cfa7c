"""RMSNorm, optionally fused with the residual add that precedes it. Used by every decoder layer."""
import torch
from torch import nn

from nanovllm.layers.c_description import CDescriber, describes, pointer


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def rms_forward(self, x: torch.Tensor) -> torch.Tensor:
        orig_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        # NOTE: cast before scaling by the weight, as HF does, so bf16 results match it.
        return self.weight * x.to(orig_dtype)

    def add_rms_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add happens in the model dtype, as in the HF reference.
        x = x + residual
        return self.rms_forward(x), x

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.rms_forward(x)
        return self.add_rms_forward(x, residual)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is stored as an offset from one, x * (1 + w), scaled in fp32
    before the cast back (as transformers' Gemma3RMSNorm does)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps)
        nn.init.zeros_(self.weight)

    def rms_forward(self, x: torch.Tensor) -> torch.Tensor:
        orig_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (x * (1.0 + self.weight.float())).to(orig_dtype)


# To the C decode step a norm is the address of its multiplier; the step takes one eps for all.
@describes(RMSNorm)
def _c_norm(norm: RMSNorm, c: CDescriber) -> int:
    c.eps.add(norm.eps)
    return pointer(norm.weight)


@describes(GemmaRMSNorm)
def _c_gemma_norm(norm: GemmaRMSNorm, c: CDescriber) -> int:
    c.eps.add(norm.eps)
    return c.keep((1.0 + norm.weight.float()).contiguous())  # the C step multiplies by the weight as given
