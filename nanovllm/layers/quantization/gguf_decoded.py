"""The decoded-block formats (Q2_K, Q3_K, IQ4_NL, IQ4_XS and the grid i-quants IQ2_XXS, IQ2_XS,
IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M) unpacked in torch for the GPU's Triton weight-only kernel
(gguf_triton.py): every one is, per 16 weights, a signed integer per weight times a float scale
(plus a float min for Q2_K), the form kernels/cpu_quant_decoded.h decodes on a CPU. The layouts are
ggml's (ggml-common.h); the i-quants' grids come from the gguf package (gguf.quants), as on the CPU.

unpack(raw, type_name, k) -> (values int32 [n, k], scales fp32 [n, k / 16], mins fp32 [n, k / 16]
or None): w[16 j + e] = scales[j] values[16 j + e] (+ mins[j])."""
import torch

# The IQ4 formats' 16 levels.
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
FORMATS = ("q2_k", "q3_k", "iq4_nl", "iq4_xs", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m")
_grids: dict[str, torch.Tensor] = {}


def grid(name: str, device) -> torch.Tensor:
    """gguf.quants' grid of an i-quant (iq2_xxs, ..., iq1_s) as int32 [rows, 4 or 8]."""
    if name not in _grids:
        import gguf.quants
        cls = getattr(gguf.quants, name.upper())
        cls.init_grid()
        _grids[name] = torch.from_numpy(cls.grid.reshape(cls.grid_shape).copy()).to(torch.int32)
    return _grids[name].to(device)


def _u(b: torch.Tensor, width: int) -> torch.Tensor:
    """Little-endian unsigned integers of `width` bytes: b [..., m * width] -> int64 [..., m]."""
    b = b.to(torch.int64).reshape(*b.shape[:-1], -1, width)
    return sum(b[..., i] << (8 * i) for i in range(width))


def f16_field(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 field at byte `at` of every block, as fp32 [..., blocks] (gguf_triton's formats too)."""
    return blocks[..., at:at + 2].contiguous().view(torch.float16)[..., 0].float()


def _bits(x: torch.Tensor, count: int, width: int = 1) -> torch.Tensor:
    """Fields of `width` bits of x [...]: [..., count], the lowest first."""
    shifts = torch.arange(0, count * width, width, device=x.device)
    return (x.to(torch.int64)[..., None] >> shifts) & ((1 << width) - 1)


def _signs(bits: torch.Tensor) -> torch.Tensor:
    """Sign bytes [...] as +-1 [..., 8] (bit i set: value i negative)."""
    return 1 - 2 * _bits(bits, 8)


def _ksigns(index: torch.Tensor) -> torch.Tensor:
    """A 7-bit sign index as its sign byte: bit 7 makes the count of negatives even (ggml's ksigns)."""
    parity = _bits(index, 7).sum(-1) & 1
    return index.to(torch.int64) | (parity << 7)


def _rows(name: str, index: torch.Tensor) -> torch.Tensor:
    g = grid(name, index.device)
    return g[index.to(torch.int64)]


def unpack(raw: torch.Tensor, type_name: str, k: int):
    from nanovllm.layers.quantization.block_formats import block_shape
    size, nbytes = block_shape(type_name)
    n = raw.shape[0]
    b = raw.reshape(n, k // size, nbytes)
    B = b.shape[1]
    mins = None
    if type_name == "q2_k":
        sc, d, dmin = b[..., 0:16].to(torch.int64), f16_field(b, 80), f16_field(b, 82)
        v = _bits(b[..., 16:80].reshape(n, B, 2, 32), 4, 2).permute(0, 1, 2, 4, 3)  # [h, s, l]
        scales, mins = d[..., None] * (sc & 15), -dmin[..., None] * (sc >> 4)
    elif type_name == "q3_k":
        d, sc = f16_field(b, 108), b[..., 96:108].to(torch.int64)
        low = _bits(b[..., 32:96].reshape(n, B, 2, 32), 4, 2).permute(0, 1, 2, 4, 3).reshape(n, B, 256)
        high = _bits(b[..., 0:32], 8).permute(0, 1, 3, 2).reshape(n, B, 256)  # value 32 b + l: bit b of hmask[l]
        v = low - 4 * (1 - high)
        s = (torch.cat([sc[..., :8] & 15, sc[..., :8] >> 4], -1) |
             (_bits(sc[..., 8:12], 4, 2).permute(0, 1, 3, 2).reshape(n, B, 16) << 4)) - 32
        scales = d[..., None] * s
    elif type_name == "iq4_nl":
        levels = torch.tensor(IQ4_LEVELS, dtype=torch.int32, device=raw.device)
        q = b[..., 2:18].to(torch.int64)
        v = levels[torch.cat([q & 15, q >> 4], -1)]
        scales = f16_field(b, 0)[..., None].expand(n, B, 2)
    elif type_name == "iq4_xs":
        levels = torch.tensor(IQ4_LEVELS, dtype=torch.int32, device=raw.device)
        d, sh, sl = f16_field(b, 0), _u(b[..., 2:4], 2)[..., 0], b[..., 4:8].to(torch.int64)
        q = b[..., 8:136].reshape(n, B, 8, 16).to(torch.int64)
        v = levels[torch.cat([q & 15, q >> 4], -1)]
        ls = (torch.stack([sl & 15, sl >> 4], -1).reshape(n, B, 8) | (_bits(sh, 8, 2) << 4)) - 32
        scales = (d[..., None] * ls).repeat_interleave(2, -1)
    elif type_name == "iq2_xxs":
        d, q = f16_field(b, 0), b[..., 2:66].reshape(n, B, 8, 8)
        aux = _u(q[..., 4:8], 4)[..., 0]
        signs = _signs(_ksigns((aux[..., None] >> torch.arange(0, 28, 7, device=raw.device)) & 127))
        v = _rows("iq2_xxs", q[..., 0:4]) * signs
        scales = (d[..., None] * (0.5 + (aux >> 28).float()) * 0.25).repeat_interleave(2, -1)
    elif type_name == "iq2_xs":
        d, q = f16_field(b, 0), _u(b[..., 2:66], 2)
        v = _rows("iq2_xs", q & 511) * _signs(_ksigns(q >> 9))
        scales = d[..., None] * (0.5 + _bits(b[..., 66:74], 2, 4).reshape(n, B, 16).float()) * 0.25
    elif type_name == "iq2_s":
        d, qs, signs, qh = f16_field(b, 0), b[..., 2:34].to(torch.int64), b[..., 34:66], b[..., 66:74]
        v = _rows("iq2_s", qs | (_bits(qh, 4, 2).reshape(n, B, 32) << 8)) * _signs(signs)
        scales = d[..., None] * (0.5 + _bits(b[..., 74:82], 2, 4).reshape(n, B, 16).float()) * 0.25
    elif type_name == "iq3_xxs":
        d, qs, aux = f16_field(b, 0), b[..., 2:66].reshape(n, B, 8, 8), _u(b[..., 66:98], 4)
        signs = _signs(_ksigns((aux[..., None] >> torch.arange(0, 28, 7, device=raw.device)) & 127))
        v = _rows("iq3_xxs", qs).reshape(n, B, 8, 4, 8) * signs
        scales = (d[..., None] * (0.5 + (aux >> 28).float()) * 0.5).repeat_interleave(2, -1)
    elif type_name == "iq3_s":
        d, qs, qh, signs = f16_field(b, 0), b[..., 2:66].to(torch.int64), b[..., 66:74], b[..., 74:106]
        v = _rows("iq3_s", qs | (_bits(qh, 8).reshape(n, B, 64) << 8)).reshape(n, B, 32, 8) * _signs(signs)
        scales = (d[..., None] * (1 + 2 * _bits(b[..., 106:110], 2, 4).reshape(n, B, 8)).float()).repeat_interleave(2, -1)
    elif type_name == "iq1_s":  # w = dl (g +- 1/8) = dl / 8 (8 g +- 1)
        d, qs, qh = f16_field(b, 0), b[..., 2:34].to(torch.int64).reshape(n, B, 8, 4), _u(b[..., 34:50], 2)
        index = qs | (_bits(qh, 4, 3) << 8)
        delta = 1 - 2 * (qh >> 15)
        v = 8 * _rows("iq1_s", index) + delta[..., None, None]
        scales = (d[..., None] * (2 * ((qh >> 12) & 7) + 1).float() * 0.125).repeat_interleave(2, -1)
    elif type_name == "iq1_m":
        qs, qh, sc = b[..., 0:32].to(torch.int64), b[..., 32:48], _u(b[..., 48:56], 2)
        bits = sum(((sc[..., i] >> 12) << (4 * i)) for i in range(4)).to(torch.int16)
        d = bits.view(torch.float16).float()
        nib = _bits(qh, 2, 4).reshape(n, B, 32)
        v = 8 * _rows("iq1_s", qs | ((nib & 7) << 8)) + (1 - 2 * (nib >> 3))[..., None]
        scales = d[..., None] * (2 * _bits(sc, 4, 3).reshape(n, B, 16) + 1).float() * 0.125
    else:
        raise ValueError(f"{type_name} is not a decoded-block format; those are {', '.join(FORMATS)}")
    scales = scales.reshape(n, -1).float()
    return v.reshape(n, k).to(torch.int32), scales, None if mins is None else mins.reshape(n, -1).float()
