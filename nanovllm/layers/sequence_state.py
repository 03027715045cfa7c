"""Layers that keep a fixed-size state per sequence instead of a KV cache (the hybrids' Gated
DeltaNet, LFM2's short convolutions, Mamba-2 mixers): what each describes of itself to the state cache
(executor/state_cache.py), and the batch view of a step they read (Context.state). A sequence's
state lives in a slot of its own, handed out by the KV cache manager (engine/state_pool.py) when
the sequence is admitted; its first step starts from zero state, so a reused slot never leaks."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class StateBatch:
    """What a step's state layers read (Context.state): each sequence's state slot, its new tokens
    this step (in order, as the step's rows lie) and whether it starts from zero state (its first
    tokens: a fresh or a recomputed sequence)."""

    slots: torch.Tensor | None  # [num_seqs] int64; None: no slots (nothing kept, every sequence fresh)
    query_lens: list[int]
    fresh: list[bool]


class SequenceStateLayer(nn.Module):
    """A layer with a state slot per sequence. The state cache sizes the slots by slot_bytes(),
    makes them with new_state() and hands them over with attach_state(); c_kernels are the CPU's C
    kernels where its decode step runs in C (the state fp32 and dense), use_triton where a GPU runs
    it in Triton."""

    def slot_bytes(self) -> int:
        raise NotImplementedError

    def new_state(self, slots: int, device):
        raise NotImplementedError

    def attach_state(self, state, c_kernels=None, use_triton: bool = False) -> None:
        raise NotImplementedError


def causal_conv(history: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A depthwise causal convolution over one sequence's new inputs x [channels, n] after its
    stored last inputs history [channels, kernel - 1] (zeros for a fresh sequence); weight
    [channels, kernel]. Returns (out [channels, n], the new history [channels, kernel - 1])."""
    padded = torch.cat((history, x), dim=1)
    out = F.conv1d(padded.unsqueeze(0), weight.unsqueeze(1), bias, groups=weight.shape[0])[0]
    return out, padded[:, padded.shape[1] - history.shape[1]:]


def causal_conv_step(history: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One input of each of B sequences, x [B, channels], after their histories [B, channels,
    kernel - 1]. Returns (out [B, channels], the new histories)."""
    padded = torch.cat((history, x.unsqueeze(-1)), dim=-1)
    out = (padded * weight).sum(-1)
    return (out if bias is None else out + bias), padded[..., 1:]
