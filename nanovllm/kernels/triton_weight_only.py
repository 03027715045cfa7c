"""y = x W^T for the pre-quantized formats' weights on CUDA (Triton), dequantized in the kernel
(layers/quantization/weight_only.py holds them in this layout on a GPU):
    int:  W[n, k] = (u[n, k] - z[n, g(k)]) * s[n, g(k)], u unsigned 4-bit (two per byte, the even
          input in the low nibble) or 8-bit (a byte each); or, with fp32 mins (GGUF's Q4_1 / Q5_1 /
          Q4_K, layers/quantization/gguf_triton.py), u[n, k] * s[n, g(k)] + m[n, g(k)]
    fp8:  W[n, k] = e4m3(u[n, k]) * s[n, g(k)], widened through fp16 (the sign bit to bit 15, the
          rest shifted up by 7 is the same value times 2^-8)
    fp4:  W[n, k] = e2m1(u[n, k]) * s[n, g(k)], u 4-bit E2M1 codes two per byte (MXFP4, s the
          block's 2^(e - 127)): sign bit 3, exponent bits 2-1, mantissa bit 0
g(k) = g_idx[k] (GPTQ's desc_act) or k // group. One program per BLOCK_M x BLOCK_N tile of y,
looping over the inputs: the weight tile is dequantized to x's dtype and multiplied with fp32
accumulation (tl.dot). Tested under TRITON_INTERPRET=1 on CPU against the dequantized matmul
(tests/kernels/test_triton_weight_only.py), compiled on CUDA by scripts/gpu_check.sh."""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass
class PackedWeight:
    """A weight in the kernel's layout (see the module docstring)."""

    q: torch.Tensor              # uint8 [n, k / 2] (bits 4) or [n, k] (bits 8, fp8)
    scales: torch.Tensor         # fp32 [n, groups]
    zeros: torch.Tensor | None   # int32 [n, groups] (int formats)
    g_idx: torch.Tensor | None   # int32 [k], or None: k // group
    group: int
    bits: int                    # 4 or 8
    fp8: bool
    n: int
    k: int
    mins: torch.Tensor | None = None  # fp32 [n, groups] (int formats with a min instead of zero points)
    fp4: bool = False            # q holds E2M1 codes (bits 4), W = e2m1(code) * scale


def pack_fp4(codes: torch.Tensor, scales: torch.Tensor, group: int) -> PackedWeight:
    """The kernel's layout of E2M1 codes [n, k] (0..15) with a scale per group of `group` inputs."""
    n, k = codes.shape
    u = codes.to(torch.uint8)
    return PackedWeight((u[:, 0::2] | (u[:, 1::2] << 4)).contiguous(), scales.float().contiguous(), None, None,
                        group, 4, False, n, k, fp4=True)


def pack(values: torch.Tensor, scales: torch.Tensor, group: int, zeros: torch.Tensor | None,
         g_idx: torch.Tensor | None, mins: torch.Tensor | None = None) -> PackedWeight | None:
    """The kernel's layout of a weight given as in weight_only.QuantizedWeight (with mins: values
    unsigned and no zero points, W = values * scales + mins per group), or None where its integers
    span more than 8 bits."""
    n, k = values.shape
    if mins is not None:
        shift = int(values.min())
        if zeros is not None or shift < 0:
            raise ValueError("a weight with mins takes unsigned values and no zero points")
        packed = pack(values, scales, group, None, g_idx)  # u = values - shift
        if packed is not None:
            packed.zeros, packed.mins = None, (mins.float() + shift * scales.float()).contiguous()
        return packed
    g = None if g_idx is None else g_idx.to(torch.int32).contiguous()
    scales = scales.float().contiguous()
    if values.dtype == torch.float8_e4m3fn:
        return PackedWeight(values.contiguous().view(torch.uint8), scales, None, g, group, 8, True, n, k)
    lo = int(values.min())
    u = values - lo  # unsigned, with the zero points moved by the same amount
    z = (zeros if zeros is not None else torch.zeros_like(scales, dtype=torch.int32)) - lo
    span = int(u.max())
    if span >= 256:
        return None
    bits = 4 if span < 16 and k % 2 == 0 else 8
    u = u.to(torch.uint8)
    q = (u[:, 0::2] | (u[:, 1::2] << 4)) if bits == 4 else u
    return PackedWeight(q.contiguous(), scales, z.to(torch.int32).contiguous(), g, group, bits, False, n, k)


@triton.jit
def dequant_tile(q_ptr, s_ptr, z_ptr, m_ptr, g_ptr, rn, k, wmask, K, groups, group,
                 BITS: tl.constexpr, FP8: tl.constexpr, HAS_G: tl.constexpr, HAS_MIN: tl.constexpr,
                 FP4: tl.constexpr):
    """The fp32 weights W[rn, k] ([BLOCK_N, BLOCK_K]; 0 where wmask is off) of one matrix in the
    layout above (q_ptr, s_ptr, ...: that matrix's first row; the experts kernel offsets them)."""
    if BITS == 4:
        byte = tl.load(q_ptr + rn[:, None] * (K // 2) + k[None, :] // 2, mask=wmask, other=0).to(tl.int32)
        u = (byte >> ((k[None, :] % 2) * 4)) & 0xF
    else:
        u = tl.load(q_ptr + rn[:, None] * K + k[None, :], mask=wmask, other=0).to(tl.int32)
    if HAS_G:
        g = tl.load(g_ptr + k, mask=k < K, other=0)
    else:
        g = k // group
    s = tl.load(s_ptr + rn[:, None] * groups + g[None, :], mask=wmask, other=0.0)
    if FP8:
        h = ((u & 0x80) << 8) | ((u & 0x7F) << 7)
        w = h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * (s * 256.0)
    elif FP4:  # E2M1: exponent 0 is 0.5 m (0, 0.5), else (1 + 0.5 m) 2^(exponent - 1)
        e = (u >> 1) & 3
        m = (u & 1).to(tl.float32)
        mag = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * tl.exp2((e - 1).to(tl.float32)))
        w = tl.where((u & 8) != 0, -mag, mag) * s
    elif HAS_MIN:
        mn = tl.load(m_ptr + rn[:, None] * groups + g[None, :], mask=wmask, other=0.0)
        w = u.to(tl.float32) * s + mn
    else:
        z = tl.load(z_ptr + rn[:, None] * groups + g[None, :], mask=wmask, other=0)
        w = (u - z).to(tl.float32) * s
    return w


@triton.jit
def _weight_only_gemm(x_ptr, q_ptr, s_ptr, z_ptr, m_ptr, g_ptr, y_ptr, M, N, K, groups, group, stride_xm, stride_ym,
                      BITS: tl.constexpr, FP8: tl.constexpr, HAS_G: tl.constexpr, HAS_MIN: tl.constexpr,
                      FP4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        kmask = k < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=(rm[:, None] < M) & kmask[None, :], other=0.0)
        wmask = (rn[:, None] < N) & kmask[None, :]
        w = dequant_tile(q_ptr, s_ptr, z_ptr, m_ptr, g_ptr, rn, k, wmask, K, groups, group,
                         BITS, FP8, HAS_G, HAS_MIN, FP4)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def stack_experts(parts: list[PackedWeight]) -> PackedWeight:
    """One PackedWeight of the experts' matrices (each tensor with a leading expert dim), for the
    experts kernel (kernels/fused_moe.py). ValueError where the experts were packed differently."""
    first = parts[0]
    kinds = {(p.bits, p.fp8, p.fp4, p.group, p.n, p.k, p.zeros is None, p.mins is None, p.g_idx is None) for p in parts}
    if len(kinds) != 1 or first.g_idx is not None:
        raise ValueError("the experts' matrices are not all packed alike (bits, group, zero points or mins)")

    def stacked(t):
        return None if t is None else torch.stack(t).contiguous()
    return PackedWeight(stacked([p.q for p in parts]), stacked([p.scales for p in parts]),
                        stacked([p.zeros for p in parts]) if first.zeros is not None else None, None, first.group,
                        first.bits, first.fp8, first.n, first.k,
                        stacked([p.mins for p in parts]) if first.mins is not None else None, first.fp4)


def weight_only_linear(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, k] @ W^T (+ bias) -> [m, n] in x's dtype."""
    x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, w.n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 64
    block_n, block_k = 64, 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(w.n, block_n))
    zeros = w.zeros if w.zeros is not None else w.scales  # unread for fp8 and with mins
    mins = w.mins if w.mins is not None else w.scales  # unread without HAS_MIN
    g_idx = w.g_idx if w.g_idx is not None else w.scales  # unread without HAS_G
    _weight_only_gemm[grid](x, w.q, w.scales, zeros, mins, g_idx, y, m, w.n, w.k, w.scales.shape[1], w.group,
                            x.stride(0), y.stride(0), BITS=w.bits, FP8=w.fp8, HAS_G=w.g_idx is not None,
                            HAS_MIN=w.mins is not None, FP4=w.fp4, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y if bias is None else y + bias
