"""The C descriptions of a model's parts (kernels/cpu_kernels.h's structures) that the C decode step
(executor/cpu_decode.py) reads: a linear layer's weights through its method's view, a sparse MoE
block's experts with its router and shared expert, which layers the one call can run whole, and the
runs of layers alike."""
import ctypes

import torch
from torch import nn

from nanovllm.kernels import cpu_kernels
from nanovllm.kernels.cpu_structs import Linear, MoeExperts
from nanovllm.layers.gated_deltanet import GatedDeltaNet
from nanovllm.models.decoder import GatedMLP
from nanovllm.models.moe_block import SparseMoeBlock


def pointer(t: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> int | None:
    """The address of a dense tensor of dtype (None stays None)."""
    if t is None:
        return None
    if t.dtype != dtype or not t.is_contiguous() or t.numel() == 0:
        raise ValueError(f"not a dense {dtype} tensor: {t.dtype} {tuple(t.shape)}")
    return t.data_ptr()


def described(kernels: cpu_kernels.CpuKernels, module: nn.Module, bias: torch.Tensor | None = None) -> Linear | None:
    """The C description of module's weights (its method's view), or None where it has none."""
    view = module.quant_method.c_view(module)
    return None if view is None else cpu_kernels.linear_struct(kernels, view, bias)


def moe_description(kernels: cpu_kernels.CpuKernels, block: SparseMoeBlock) -> MoeExperts | None:
    """The C description of a sparse MoE block (its experts' method's, with the router and the
    shared expert filled in), or None where a part has no view."""
    experts = block.experts.quant_method.c_struct(block.experts)
    parts = [block.gate]
    if block.shared_expert is not None:
        parts += [block.shared_expert.gate_up_proj, block.shared_expert.down_proj, block.shared_expert_gate]
    described_parts = [described(kernels, m, m.bias) for m in parts]
    if experts is None or any(d is None for d in described_parts):
        return None
    moe = MoeExperts.from_buffer_copy(experts)
    moe.router = described_parts[0]
    if block.shared_expert is not None:
        moe.shared_gate_up, moe.shared_down, moe.shared_gate = described_parts[1:]
    moe.keep = (experts, described_parts)  # the copies' chained parts and expert arrays live there
    if not kernels.moe_is_valid(ctypes.byref(moe)):
        raise ValueError("a sparse MoE block's C description is not valid")
    return moe


def linear_attention(layer: nn.Module) -> GatedDeltaNet | None:
    """A hybrid's linear-attention module of the layer, or None (an attention layer)."""
    return getattr(layer, "linear_attn", None)


def layer_linears(kernels: cpu_kernels.CpuKernels, layer: nn.Module) -> tuple[list[Linear], MoeExperts | None] | None:
    """(qkv, o, gate_up, down; the MoE block's description, whose layers' gate_up and down are
    empty) of a layer the one-call step can run whole, else None. (A linear-attention layer's
    in_proj and out_proj stand as its qkv and o.)"""
    lin, mlp = linear_attention(layer), layer.mlp
    projections = (lin.in_proj, lin.out_proj) if lin is not None else (layer.self_attn.qkv_proj, layer.self_attn.o_proj)
    attention = [described(kernels, m, m.bias) for m in projections]
    if isinstance(mlp, SparseMoeBlock):
        moe = moe_description(kernels, mlp)
        linears = attention + [Linear(), Linear()]
        return None if moe is None or any(lin is None for lin in attention) else (linears, moe)
    if not isinstance(mlp, GatedMLP):
        return None
    linears = attention + [described(kernels, m, m.bias) for m in (mlp.gate_up_proj, mlp.down_proj)]
    return None if any(lin is None for lin in linears) else (linears, None)


def segments(in_c: list[bool]) -> list[tuple[int, int, bool]]:
    """Maximal runs (first, end, in_c) of consecutive layers alike."""
    runs: list[tuple[int, int, bool]] = []
    for i, flag in enumerate(in_c):
        if runs and runs[-1][2] == flag:
            runs[-1] = (runs[-1][0], i + 1, flag)
        else:
            runs.append((i, i + 1, flag))
    return runs
