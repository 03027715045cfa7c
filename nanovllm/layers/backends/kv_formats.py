"""The KV cache's storage formats (Config.kv_cache_dtype, with vLLM's names).

A cached token holds, per layer and KV head, one K row and one V row of head_dim values, each stored
as `row_units(head_dim)` elements of the format's storage dtype:

  float32, bfloat16, float16  the values, rounded to nearest even (torch's `.to(dtype)`);
  int8                        llama.cpp's q8_0 blocks (its `-ctk q8_0` cache): per 32 values an fp16
                              scale d = max|x| / 127 and 32 int8 round(x / d), 34 bytes; head_dim a
                              multiple of 32;
  fp8_e4m3, fp8_e5m2          the values clamped to the format's largest finite value and rounded
                              (vLLM's fp8 cache at scale 1; "fp8" is e4m3, as in vLLM).

Attention reads the rows in their stored format (the C kernels convert as they read; the torch code
below dequantizes a gathered copy, the reference they are tested against, and the path without a C
compiler); over int8 rows it multiplies a query rounded to 8 bits (KVFormat.round_query). The
quantize / dequantize pair here is that reference; the C store (cpu_kv_formats.c, kv_store_row)
writes the same bytes (tests/kernels/test_kv_formats.py).
"""
from dataclasses import dataclass

import torch

Q8_BLOCK = 32  # values per int8 block
Q8_BLOCK_BYTES = 34  # fp16 scale + 32 int8


@dataclass(frozen=True)
class KVFormat:
    name: str
    storage: torch.dtype
    c_type: int  # the C kernels' KV type id (cpu_kernels.h, KV_FORMATS)
    limit: float | None = None  # fp8: the largest finite value, where values are clamped

    @property
    def blocked(self) -> bool:
        return self.name == "int8"

    def row_units(self, head_dim: int) -> int:
        """Storage elements of one head's row."""
        return head_dim // Q8_BLOCK * Q8_BLOCK_BYTES if self.blocked else head_dim

    def row_bytes(self, head_dim: int) -> int:
        return self.row_units(head_dim) * self.storage.itemsize

    def token_bytes(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes one cached token takes over all layers, K and V, scales included."""
        return 2 * num_layers * num_kv_heads * self.row_bytes(head_dim)

    def head_dim_error(self, head_dim: int) -> str | None:
        if self.blocked and head_dim % Q8_BLOCK != 0:
            return f"kv_cache_dtype='int8' stores blocks of {Q8_BLOCK} values; head_dim {head_dim} is not a multiple"
        return None

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., head_dim] (any float dtype) -> its stored rows [..., row_units] in self.storage."""
        if self.blocked:
            return quantize_q8_0(x)
        if self.limit is not None:
            x = x.float().clamp(-self.limit, self.limit)
        return x.to(self.storage)

    def round_query(self, q: torch.Tensor) -> torch.Tensor:
        """q [..., head_dim] as attention over this format multiplies it. int8 (as llama.cpp's q8_0
        cache): rounded to 8 bits per block of 32 (scale max|q| / 127 in fp32, to nearest even),
        so that q . k is a sum of int8 products, which the C decode kernel computes in integers; the
        other formats take q as it is."""
        if not self.blocked:
            return q
        x = q.float().reshape(-1, Q8_BLOCK)
        d, inv = q8_scales(x)
        return ((x * inv).round() * d).reshape(q.shape).to(q.dtype)

    def dequantize(self, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Stored rows [..., row_units] -> values [..., head_dim] in dtype."""
        if self.blocked:
            return dequantize_q8_0(rows).to(dtype)
        return rows.to(dtype)


def q8_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d, 1 / d) of each fp32 block [n, 32]: d = max|x| / 127, and 0 for 1 / d where d is 0."""
    d = blocks.abs().amax(dim=1, keepdim=True) / 127.0
    return d, torch.where(d == 0, torch.zeros_like(d), 1.0 / d)


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """ggml's quantize_row_q8_0_ref: d = max|x| / 127 (stored as fp16), q = round(x / d) half away
    from zero (computed with 1 / d in fp32), per block of 32. [..., D] -> uint8 [..., D / 32 * 34]."""
    shape = x.shape
    blocks = x.float().reshape(-1, Q8_BLOCK)
    d, inv = q8_scales(blocks)
    v = blocks * inv
    a = v.abs()  # C's roundf, half away from zero, without floor(a + 0.5)'s rounding of the sum
    q = (torch.sign(v) * (a.floor() + (2 * (a - a.floor())).floor())).to(torch.int8)
    out = torch.cat([d.to(torch.float16).view(torch.uint8), q.view(torch.uint8)], dim=1)
    return out.reshape(*shape[:-1], shape[-1] // Q8_BLOCK * Q8_BLOCK_BYTES)


def dequantize_q8_0(rows: torch.Tensor) -> torch.Tensor:
    """uint8 [..., D / 32 * 34] -> fp32 [..., D]: d * q per block."""
    shape = rows.shape
    blocks = rows.reshape(-1, Q8_BLOCK_BYTES)
    d = blocks[:, :2].contiguous().view(torch.float16).float()
    q = blocks[:, 2:].contiguous().view(torch.int8).float()
    return (d * q).reshape(*shape[:-1], shape[-1] // Q8_BLOCK_BYTES * Q8_BLOCK)


# NOTE: c_type is the row of KV_FORMATS in kernels/cpu_kernels.h.
KV_FORMATS = {f.name: f for f in (
    KVFormat("float32", torch.float32, 0),
    KVFormat("bfloat16", torch.bfloat16, 1),
    KVFormat("float16", torch.float16, 2),
    KVFormat("int8", torch.uint8, 3),
    KVFormat("fp8_e4m3", torch.float8_e4m3fn, 4, limit=448.0),
    KVFormat("fp8_e5m2", torch.float8_e5m2, 5, limit=57344.0),
)}
ALIASES = {"fp8": "fp8_e4m3"}
NAMES = ("auto", *KV_FORMATS, *ALIASES)


def kv_format(name: str) -> KVFormat:
    """The format of a resolved name (not "auto")."""
    return KV_FORMATS[ALIASES.get(name, name)]


def check_name(name) -> None:
    if not isinstance(name, str) or name not in NAMES:
        raise ValueError(f"kv_cache_dtype must be one of {list(NAMES)}, got {name!r}")


def resolve(name: str, compute_dtype: torch.dtype, platform) -> KVFormat:
    """The KV storage format of Config.kv_cache_dtype on a platform (its kv_cache_formats: what
    "auto" means there and the names it runs); ValueError naming the ones it runs."""
    check_name(name)
    auto, names = platform.kv_cache_formats(compute_dtype)
    names = NAMES if names is None else names
    if name not in names:
        raise ValueError(f"kv_cache_dtype={name!r} cannot run on {platform.device_name} with {compute_dtype} "
                         f"activations; it runs {list(names)}")
    return kv_format(auto if name == "auto" else name)
