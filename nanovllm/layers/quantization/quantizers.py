"""Quantizers of dense weights into GGUF block rows (`quantization=` at load, layers/quantization/
gguf.py and gguf_moe.py): the `gguf` package's reference quantizers, bit for bit, and our Q4_K
quantizer, which gguf.quants does not have."""
import numpy as np
import torch


def quantize_rows(weight: torch.Tensor, type_name: str) -> torch.Tensor:
    """A dense [n, k] weight as raw rows of type_name: by gguf.quants' reference quantizer, or for
    q4_k (which gguf.quants does not quantize) by quantize_q4_k."""
    data = weight.detach().to("cpu", torch.float32).contiguous().numpy()
    if type_name == "q4_k":
        return torch.from_numpy(quantize_q4_k(data))
    from gguf import GGMLQuantizationType, quants
    raw = quants.quantize(data, GGMLQuantizationType[type_name.upper()])
    return torch.from_numpy(np.ascontiguousarray(raw).reshape(weight.shape[0], -1))


Q4_K_FITS = 4  # rounds of fitting each sub-block's scale and min to its 4-bit values


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """[n, k] fp32 (k a multiple of 256) as Q4_K rows (ggml-common.h's block_q4_K: fp16 d and dmin,
    12 bytes of 6-bit sub-block scales and mins, 128 bytes of 4-bit values; a value is
    d sc_j q - dmin m_j in sub-block j of 32).

    Each sub-block's (scale, min) starts from its range and is refit a few times by least squares,
    weighted by x^2 + mean(x^2) (the larger weights matter more to a matmul's output), to the
    values its 4-bit codes take; the 8 scales and mins of a block are then rounded to 6 bits under
    their block's d and dmin, and the codes recomputed under the rounded ones."""
    n, k = x.shape
    if k % 256:
        raise ValueError(f"q4_k needs inputs in whole blocks of 256, got {k}")
    sub = x.reshape(n, k // 256, 8, 32).astype(np.float64)
    w = sub * sub + np.mean(sub * sub, axis=-1, keepdims=True) + 1e-12
    lo = np.minimum(sub.min(axis=-1, keepdims=True), 0.0)      # the offset is -dmin m, m >= 0
    scale = (sub.max(axis=-1, keepdims=True) - lo) / 15.0
    for _ in range(Q4_K_FITS):
        q = np.clip(np.rint((sub - lo) / np.where(scale > 0, scale, 1.0)), 0, 15)
        # weighted least squares of sub ~ scale q + lo
        sw, sq, sqq = w.sum(-1, keepdims=True), (w * q).sum(-1, keepdims=True), (w * q * q).sum(-1, keepdims=True)
        sx, sqx = (w * sub).sum(-1, keepdims=True), (w * q * sub).sum(-1, keepdims=True)
        det = sw * sqq - sq * sq
        ok = det > 1e-20
        new_scale = np.where(ok, (sw * sqx - sq * sx) / np.where(ok, det, 1.0), scale)
        new_lo = np.where(ok, (sx - new_scale * sq) / sw, lo)
        new_lo = np.minimum(new_lo, 0.0)
        scale, lo = np.maximum(new_scale, 0.0), new_lo
    mins = -lo[..., 0]                                           # [n, blocks, 8], >= 0
    scales = scale[..., 0]
    d = (scales.max(axis=-1) / 63.0).astype(np.float16)          # [n, blocks]
    dmin = (mins.max(axis=-1) / 63.0).astype(np.float16)
    d32, dmin32 = d.astype(np.float64)[..., None], dmin.astype(np.float64)[..., None]
    sc = np.clip(np.rint(scales / np.where(d32 > 0, d32, 1.0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(mins / np.where(dmin32 > 0, dmin32, 1.0)), 0, 63).astype(np.uint8)
    step = (d32 * sc)[..., None]
    offset = (dmin32 * mn)[..., None]
    q = np.clip(np.rint((sub + offset) / np.where(step > 0, step, 1.0)), 0, 15).astype(np.uint8)
    blocks = np.zeros((n, k // 256, 144), dtype=np.uint8)
    blocks[..., 0:2] = d.view(np.uint8).reshape(n, k // 256, 2)
    blocks[..., 2:4] = dmin.view(np.uint8).reshape(n, k // 256, 2)
    packed = blocks[..., 4:16]
    packed[..., 0:4] = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)   # sub-blocks 4-7 keep their top 2 bits
    packed[..., 4:8] = (mn[..., 0:4] & 63) | ((mn[..., 4:8] >> 4) << 6)   # in the first eight bytes
    packed[..., 8:12] = (sc[..., 4:8] & 15) | ((mn[..., 4:8] & 15) << 4)
    q64 = q.reshape(n, k // 256, 4, 2, 32)                       # 64 values: low nibbles, then high
    blocks[..., 16:] = (q64[..., 0, :] | (q64[..., 1, :] << 4)).reshape(n, k // 256, 128)
    return blocks.reshape(n, -1)
