"""GGUF block formats on a GPU: each matrix's blocks unpacked once at load into the Triton
weight-only kernel's layout (kernels/triton_weight_only.py: 4- or 8-bit unsigned integers, an fp32
scale per group and an integer zero point or an fp32 min), which dequantizes a tile at a time and
multiplies in the activations' dtype with fp32 accumulation. The raw blocks are dropped once
unpacked: the packed form is the one copy. Also used on a CPU under NANOVLLM_TRITON_WEIGHT_ONLY=1
(the Triton interpreter), which is how the tests run it.

What each format's block holds (ggml-common.h), as (values, scale, zero point or min) per group:
    Q8_0: int8 q, d                   w = d q                 group 32
    Q4_0: 4-bit q, d                  w = d (q - 8)           group 32
    Q5_0: 5-bit q, d                  w = d (q - 16)          group 32
    Q4_1 / Q5_1: q, d, m              w = d q + m             group 32
    Q4_K: q, d, dmin, 6-bit sc / mn   w = (d sc) q - dmin mn  group 32 (a sub-block)
    Q6_K: 6-bit q, d, int8 sc         w = (d sc) (q - 32)     group 16 (a sub-block)
    MXFP4: E2M1 codes, E8M0 e         w = 2^(e - 127) e2m1(q) group 32 (the kernel's fp4 mode: the
                                      codes held as they are, a scale per block)
    Q2_K, Q3_K, IQ4_NL, IQ4_XS and the grid i-quants: a signed integer per weight and a scale (Q2_K:
                                      and a min) per 16, gguf_decoded.py       group 16
F16 / BF16 matrices are held dense in the model's dtype."""
import torch
from torch import nn

from nanovllm.kernels.triton_weight_only import PackedWeight, pack, pack_fp4
from nanovllm.layers.quantization import gguf_decoded
from nanovllm.layers.quantization.gguf_decoded import f16_field
from nanovllm.layers.quantization.block_formats import TRITON_FORMATS as UNPACKED, block_shape


def _nibbles(b: torch.Tensor) -> torch.Tensor:
    """Bytes [..., 16] as the 32 values of a 32-weight block: the low nibbles, then the high ones."""
    return torch.cat([b & 0x0F, b >> 4], -1).to(torch.int32)


def _fifth_bits(b: torch.Tensor) -> torch.Tensor:
    """4 bytes [..., 4] (a little-endian uint32) as 32 values of 0 or 16: bit j for value j."""
    bits = torch.arange(8, device=b.device)
    return (((b[..., :, None].to(torch.int32) >> bits) & 1).reshape(*b.shape[:-1], 32)) << 4


# MXFP4's E2M1 codes doubled (gguf's kvalues): integers, so a block is exact as values x 2^(e - 128).
E2M1_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def mxfp4_codes(raw: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 rows uint8 [n, row bytes] as (codes int32 [n, k] in order, E8M0 exponents int32 [n, k / 32])."""
    b = raw.reshape(raw.shape[0], k // 32, 17)
    return _nibbles(b[..., 1:]).reshape(raw.shape[0], k), b[..., 0].to(torch.int32)


def e8m0(e: torch.Tensor, bias: int) -> torch.Tensor:
    """2^(e - bias) in fp32, exact (ldexp of 1)."""
    return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e - bias)


def unpack_blocks(raw: torch.Tensor, type_name: str, k: int):
    """Raw rows uint8 [n, row bytes] of a block format as (values int32 [n, k], scales fp32
    [n, groups], group, zero points int32 [n, groups] or None, mins fp32 [n, groups] or None)."""
    if type_name not in UNPACKED:
        raise ValueError(f"no GPU unpacking for {type_name}; supported: {list(UNPACKED)} and f16 / bf16")
    if type_name in gguf_decoded.FORMATS:  # a signed integer and a scale (Q2_K: and a min) per 16 weights
        values, scales, mins = gguf_decoded.unpack(raw, type_name, k)
        return values, scales, 16, None, mins
    size, nbytes = block_shape(type_name)
    n = raw.shape[0]
    b = raw.reshape(n, k // size, nbytes)
    zeros = mins = None
    if type_name == "mxfp4":
        codes, e = mxfp4_codes(raw, k)
        values = torch.tensor(E2M1_DOUBLED, dtype=torch.int32, device=raw.device)[codes]
        return values, e8m0(e, 128), 32, None, None
    if type_name == "q8_0":
        values, scales, group = b[..., 2:].contiguous().view(torch.int8).to(torch.int32), f16_field(b, 0), 32
    elif type_name in ("q4_0", "q5_0"):
        values, scales, group = _nibbles(b[..., -16:]), f16_field(b, 0), 32
        if type_name == "q5_0":
            values = values | _fifth_bits(b[..., 2:6])
        zeros = torch.full_like(scales, 8 if type_name == "q4_0" else 16, dtype=torch.int32)
    elif type_name in ("q4_1", "q5_1"):
        values, scales, mins, group = _nibbles(b[..., -16:]), f16_field(b, 0), f16_field(b, 2), 32
        if type_name == "q5_1":
            values = values | _fifth_bits(b[..., 4:8])
    elif type_name == "q4_k":
        p = b[..., 4:16].to(torch.int32)
        sc = torch.cat([p[..., 0:4] & 63, (p[..., 8:12] & 0x0F) | ((p[..., 0:4] >> 6) << 4)], -1)
        mn = torch.cat([p[..., 4:8] & 63, (p[..., 8:12] >> 4) | ((p[..., 4:8] >> 6) << 4)], -1)
        qs = b[..., 16:].reshape(n, -1, 4, 32)  # per 64 values: low nibbles, then high
        values = torch.stack([qs & 0x0F, qs >> 4], 3).reshape(n, -1, 256).to(torch.int32)
        scales = (f16_field(b, 0)[..., None] * sc).reshape(n, -1)
        mins = (-f16_field(b, 2)[..., None] * mn).reshape(n, -1)
        group = 32
    else:  # q6_k
        ql = b[..., 0:128].reshape(n, -1, 2, 2, 32).to(torch.int32)  # [half, low bits of quarters 0-1 / 2-3]
        qh = b[..., 128:192].reshape(n, -1, 2, 1, 32).to(torch.int32)
        quarters = []
        for t in range(4):  # value l of quarter t: ql[l + 32 (t & 1)] >> 4 (t >> 1), qh[l] >> 2t
            low = (ql[..., t & 1, :] >> (4 * (t >> 1))) & 0x0F
            quarters.append(low | (((qh[..., 0, :] >> (2 * t)) & 3) << 4))
        values = torch.stack(quarters, 3).reshape(n, -1, 256)
        sc = b[..., 192:208].contiguous().view(torch.int8).float()
        scales, group = (f16_field(b, 208)[..., None] * sc).reshape(n, -1), 16
        zeros = torch.full_like(scales, 32, dtype=torch.int32)
    return values.reshape(n, k), scales.reshape(n, -1), group, zeros, mins


def dequantize(raw: torch.Tensor, type_name: str, k: int) -> torch.Tensor:
    """The fp32 weights [n, k] of raw block rows (what the kernel multiplies by)."""
    values, scales, group, zeros, mins = unpack_blocks(raw, type_name, k)
    if zeros is not None:
        values = values - zeros.repeat_interleave(group, 1)
    w = values.float() * scales.repeat_interleave(group, 1)
    return w if mins is None else w + mins.repeat_interleave(group, 1)


def hold(raw: torch.Tensor, type_name: str, k: int, dtype: torch.dtype) -> PackedWeight | torch.Tensor:
    """One matrix's raw rows in the form the GPU multiplies from: the Triton kernel's layout for a
    block format, a dense [n, k] tensor of dtype for F16 / BF16."""
    if type_name in ("f16", "bf16"):
        half = torch.float16 if type_name == "f16" else torch.bfloat16
        return raw.contiguous().view(half).reshape(raw.shape[0], k).to(dtype)
    if type_name == "mxfp4":  # held as its codes (4 bits) and a scale per block of 32
        codes, e = mxfp4_codes(raw, k)
        return pack_fp4(codes, e8m0(e, 127), 32)
    values, scales, group, zeros, mins = unpack_blocks(raw, type_name, k)
    return pack(values, scales, group, zeros, None, mins=mins)


def held_once(param: nn.Parameter, type_name: str, k: int, dtype: torch.dtype) -> PackedWeight | torch.Tensor:
    """hold() of a parameter's raw rows, done once: a tied table's second user (the embedding and
    the LM head) gets the first one's, remembered on the parameter, whose raw rows are then dropped."""
    if getattr(param, "triton_held", None) is None:
        param.triton_held = hold(param.data, type_name, k, dtype)
        param.data = torch.empty(0, dtype=torch.uint8, device=param.device)
    return param.triton_held


def linear(parts: list, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., k] @ the stacked parts' rows^T (+ bias), in x's dtype."""
    from nanovllm.kernels.triton_weight_only import weight_only_linear
    flat = x.reshape(-1, x.shape[-1])
    ys = [flat @ p.t() if isinstance(p, torch.Tensor) else weight_only_linear(flat, p) for p in parts]
    y = ys[0] if len(ys) == 1 else torch.cat(ys, -1)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], y.shape[-1])


def rows(held: PackedWeight | torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ids of a held matrix, dequantized (fp32; an embedding's lookup)."""
    if isinstance(held, torch.Tensor):
        return held[ids].float()
    q = held.q[ids].to(torch.int32)
    u = torch.stack([q & 0x0F, q >> 4], -1).reshape(len(ids), -1) if held.bits == 4 else q
    s = held.scales[ids].repeat_interleave(held.group, 1)
    if held.fp4:  # codes -> E2M1 values (the doubled table, halved)
        return torch.tensor(E2M1_DOUBLED, dtype=torch.float32, device=q.device)[u] * 0.5 * s
    if held.mins is not None:
        return u.float() * s + held.mins[ids].repeat_interleave(held.group, 1)
    return (u - held.zeros[ids].repeat_interleave(held.group, 1)).float() * s
