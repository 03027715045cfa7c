"""Triton fused experts for CUDA (layers/moe.py): the (token, expert) pairs of a step sorted by
expert and each expert's run padded to a whole block of BLOCK_M rows (align_pairs), then one
grouped GEMM launch per matrix: every program takes one block of pairs, which all share an expert,
and a BLOCK_N slice of that expert's outputs, gathering the pairs' input rows as it loads them.

    gate|up = x[token] w13[e]^T (+ b13[e])     (pairs x 2I)
    act     = silu(gate) * up, or the layer's activation (torch)
    y       = weight * (act w2[e]^T (+ b2[e]))  (pairs x H, the routing weight applied in the kernel)
    out     = sum of each token's top_k rows of y

The experts' matrices are dense, or in the weight-only kernel's packed layout (block formats and
MXFP4 held as stored, kernels/triton_weight_only.py: the same tile dequantization).

No host synchronisation (every size is bounded by the number of pairs and experts, not by how the
router spread them), so a decode step that uses it can be captured in a CUDA graph. Blocks past
the padded total are skipped by their expert id -1. Tested on CPU under TRITON_INTERPRET=1 against
the grouped torch loop (experts_reference), and on CUDA by scripts/gpu_check.sh."""
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nanovllm.kernels.triton_weight_only import PackedWeight, dequant_tile


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [max_padded], block_experts [max_padded / block_m]) for ids [T, top_k]: the
    pair indices (t * top_k + j) grouped by expert, each expert's group padded with the pair count
    P (a row no program stores) to a multiple of block_m; and the expert of each block (-1 past the
    padded total). max_padded = P + num_experts * (block_m - 1), rounded up to a block."""
    flat = ids.flatten().to(torch.int64)
    pairs = flat.numel()
    ones = torch.ones_like(flat)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, ones)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts
    order = torch.sort(flat, stable=True).indices  # pairs by expert, each expert's in token order
    rank = torch.arange(pairs, device=ids.device) - start[flat[order]]
    max_padded = -(-(pairs + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_pairs = torch.full((max_padded,), pairs, dtype=torch.int64, device=ids.device)
    sorted_pairs[padded_start[flat[order]] + rank] = order
    block_first = torch.arange(0, max_padded, block_m, device=ids.device)
    block_experts = torch.searchsorted(padded_end, block_first, right=True)
    block_experts = torch.where(block_first < padded_end[-1], block_experts, -1)
    return sorted_pairs, block_experts


@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, out_ptr, sorted_pairs_ptr, block_experts_ptr, weights_ptr,
                         s_ptr, z_ptr, m_ptr, N, K, num_pairs, stride_a, stride_we, stride_wn, stride_out,
                         stride_se, groups, group,
                         A_ROW_DIV: tl.constexpr, APPLY_WEIGHT: tl.constexpr, PACKED: tl.constexpr,
                         BITS: tl.constexpr, HAS_MIN: tl.constexpr, FP4: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Program (m, n): pairs sorted_pairs[m BLOCK_M:(m+1) BLOCK_M], all of expert block_experts[m],
    # times outputs [n BLOCK_N, (n+1) BLOCK_N) of that expert's [N, K] matrix. Input row of a pair:
    # pair // A_ROW_DIV (its token for the first matrix, the pair itself for the second). PACKED:
    # the experts' matrices are in the weight-only kernel's layout (w_ptr its codes, s / z / m its
    # scales, zero points, mins, stride_we / stride_se apart), dequantized tile by tile.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + offs_m).to(tl.int64)
    valid = pairs < num_pairs
    rows = tl.where(valid, pairs // A_ROW_DIV, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = w_ptr + expert * stride_we
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        a = tl.load(a_ptr + rows[:, None] * stride_a + ks[None, :], mask=valid[:, None] & (ks[None, :] < K), other=0.0)
        if PACKED:
            wmask = (offs_n[:, None] < N) & (ks[None, :] < K)
            at = expert * stride_se
            w = tl.trans(dequant_tile(w_base, s_ptr + at, z_ptr + at, m_ptr + at, s_ptr, offs_n, ks, wmask, K, groups,
                                      group, BITS, False, False, HAS_MIN, FP4).to(a.dtype))
        else:
            w = tl.load(w_base + offs_n[None, :] * stride_wn + ks[:, None],
                        mask=(offs_n[None, :] < N) & (ks[:, None] < K), other=0.0)
        acc += tl.dot(a, w, input_precision="ieee")
    if APPLY_WEIGHT:
        acc *= tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    tl.store(out_ptr + pairs[:, None] * stride_out + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & (offs_n[None, :] < N))


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor | PackedWeight, sorted_pairs: torch.Tensor,
                  block_experts: torch.Tensor, num_pairs: int, a_row_div: int, weights: torch.Tensor | None,
                  block_m: int) -> torch.Tensor:
    packed = isinstance(w, PackedWeight)
    n, k = (w.n, w.k) if packed else w.shape[1:]
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    if packed:
        codes, scales = w.q, w.scales
        zeros = w.zeros if w.zeros is not None else scales  # unread with mins or fp4
        mins = w.mins if w.mins is not None else scales  # unread without mins
        extra = dict(stride_we=codes.stride(0), stride_wn=0, stride_se=scales.stride(0), groups=scales.shape[2],
                     group=w.group, BITS=w.bits, HAS_MIN=w.mins is not None, FP4=w.fp4)
    else:
        codes = zeros = mins = scales = w
        extra = dict(stride_we=w.stride(0), stride_wn=w.stride(1), stride_se=0, groups=1, group=1, BITS=16,
                     HAS_MIN=False, FP4=False)
    _grouped_gemm_kernel[grid](
        a, codes, out, sorted_pairs, block_experts, weights if weights is not None else out, scales, zeros, mins,
        n, k, num_pairs, a.stride(0), stride_out=out.stride(0), A_ROW_DIV=a_row_div, APPLY_WEIGHT=weights is not None,
        PACKED=packed, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **extra)
    return out


def fused_experts(x: torch.Tensor, w13: torch.Tensor | PackedWeight, w2: torch.Tensor | PackedWeight,
                  weights: torch.Tensor, ids: torch.Tensor, biases: tuple[torch.Tensor, torch.Tensor] | None = None,
                  act_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = silu_and_mul,
                  block_m: int = 16) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) (layers/moe.py, experts_reference), for x
    [T, H], w13 [E, 2I, H], w2 [E, H, I] (dense, or packed by triton_weight_only.stack_experts),
    weights / ids [T, top_k]; biases (b13 [E, 2I], b2 [E, H]) and act_fn(gate, up) (fp32) as the layer's."""
    tokens, top_k = ids.shape
    x = x.contiguous()
    if not isinstance(w13, PackedWeight):
        w13, w2 = w13.contiguous(), w2.contiguous()
    num_pairs = tokens * top_k
    if num_pairs == 0:
        return torch.zeros(tokens, w2.shape[1] if isinstance(w2, torch.Tensor) else w2.n, dtype=x.dtype,
                           device=x.device)
    num_experts = w13.shape[0] if isinstance(w13, torch.Tensor) else w13.q.shape[0]
    sorted_pairs, block_experts = align_pairs(ids, num_experts, block_m)
    gate_up = _grouped_gemm(x, w13, sorted_pairs, block_experts, num_pairs, top_k, None, block_m)
    flat_ids = ids.flatten()
    if biases is not None:
        gate_up = gate_up + biases[0][flat_ids].to(gate_up.dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    act = act_fn(gate, up).to(x.dtype).contiguous()
    pair_weights = weights.to(torch.float32).flatten().contiguous()
    y = _grouped_gemm(act, w2, sorted_pairs, block_experts, num_pairs, 1, pair_weights, block_m).float()
    if biases is not None:  # the kernel weighted act w2^T; the bias takes the same weight
        y = y + pair_weights[:, None] * biases[1][flat_ids].float()
    return y.view(tokens, top_k, -1).sum(dim=1).to(x.dtype)
