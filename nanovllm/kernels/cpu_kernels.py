"""The CPU kernels in C, built once with the system C compiler into the nanovllm cache and loaded
with ctypes: paged decode attention (TorchBackend.decode, fp32 caches on CPU), linear layers over a
few rows with fp32 or bf16 weights (cpu_kernels.c), and the whole decode step of a Llama-family
model (cpu_decode.c, driven by executor/cpu_decode.py).

Without a C compiler, or when the build fails, or with NANOVLLM_CPU_KERNEL=0, load() returns None
and the callers keep their torch paths (same results; slower, see docs/performance.md).
"""
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from nanovllm.utils.cache import cache_root
from nanovllm.utils.cpu_info import cpu_flags_line

logger = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(name) for name in ("cpu_kernels.c", "cpu_decode.c")]
HEADER = Path(__file__).with_name("cpu_kernels.h")
DISABLE_ENV = "NANOVLLM_CPU_KERNEL"
# -march=native: the library is built on, and cached for, the machine that runs it (the CPU's
# flags are part of its file name).
CFLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=c11"]

_kernels = None
_tried = False


def library_path() -> Path:
    cpu = cpu_flags_line() or os.uname().machine
    text = b"".join(path.read_bytes() for path in (*SOURCES, HEADER))
    key = hashlib.sha256(text + " ".join(CFLAGS).encode() + cpu.encode())
    return cache_root() / "kernels" / f"cpu_kernels-{key.hexdigest()[:16]}.so"


def build(path: Path) -> None:
    """Compile into a temporary file and rename it into place, so concurrent builds (TP workers)
    never load a half-written library."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        result = subprocess.run([compiler, *CFLAGS, *map(str, SOURCES), "-o", tmp, "-lm"], capture_output=True,
                                text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class CpuKernels:
    """The library's functions, typed for ctypes."""

    def __init__(self, lib: ctypes.CDLL):
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self.decode_attention = lib.paged_decode_attention_f32
        self.decode_attention.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64,
                                          ctypes.c_float, i64, ctypes.c_int]
        self.decode_attention.restype = ctypes.c_int
        self.linear = lib.linear_f32
        self.linear.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
        self.linear.restype = None
        self.decode_forward = lib.decode_forward
        self.decode_forward.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, ptr, ctypes.c_int]
        self.decode_forward.restype = ctypes.c_int
        self.decode_add_rms_norm = lib.decode_add_rms_norm
        self.decode_add_rms_norm.argtypes = [ptr, ptr, ptr, ctypes.c_int, ptr, i64, ptr, ctypes.c_int]
        self.decode_add_rms_norm.restype = None
        self.decode_attention_layer = lib.decode_attention_layer
        self.decode_attention_layer.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, ptr, ctypes.c_int]
        self.decode_attention_layer.restype = ctypes.c_int
        self.rope_store_layer = lib.rope_store_layer
        self.rope_store_layer.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ctypes.c_int]
        self.rope_store_layer.restype = None
        self.decode_silu_mul = lib.decode_silu_mul
        self.decode_silu_mul.argtypes = [ptr, i64, i64, ptr, ctypes.c_int]
        self.decode_silu_mul.restype = None


def load() -> CpuKernels | None:
    """The kernels, built on first use; None where they cannot be had (logged once)."""
    global _kernels, _tried
    if _tried:
        return _kernels
    _tried = True
    if os.environ.get(DISABLE_ENV, "1").lower() in ("0", "false", "off", "no"):
        return None
    try:
        path = library_path()
        if not path.is_file():
            build(path)
        _kernels = CpuKernels(ctypes.CDLL(str(path)))
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
        logger.warning("CPU C kernels unavailable, using the torch paths: %s", e)
        return None
    return _kernels


# The kernels' weight element types (cpu_kernels.h).
WEIGHT_TYPES = {torch.float32: 0, torch.bfloat16: 1}


def weight_type(weight: torch.Tensor) -> int:
    if weight.dtype not in WEIGHT_TYPES or not weight.is_contiguous():
        raise ValueError(f"the C kernels take dense fp32 or bf16 weights, got {weight.dtype}")
    return WEIGHT_TYPES[weight.dtype]


def linear(kernels: CpuKernels, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, k] (fp32) @ weight[n, k]^T (+ bias, fp32) -> [rows, n] fp32; weight dense fp32 or bf16."""
    x = x.contiguous()
    assert x.dtype == torch.float32 and (bias is None or bias.dtype == torch.float32)
    n, k = weight.shape
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    kernels.linear(weight.data_ptr(), weight_type(weight), None if bias is None else bias.data_ptr(), x.data_ptr(),
                   y.data_ptr(), x.shape[0], n, k, torch.get_num_threads())
    return y


def paged_decode_attention(kernels: CpuKernels, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, max_context: int,
                           scale: float) -> torch.Tensor:
    """q [num_seqs, num_heads, head_dim] (fp32) -> attention output of the same shape."""
    q = q.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    context_lens = context_lens.to(torch.int32).contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.dtype == k_cache.dtype == torch.float32
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    threads = torch.get_num_threads()
    # Whole sequences per work item when there are enough of them to keep every thread busy; else
    # each sequence's KV heads split so that about 4 items per thread exist.
    splits = min(num_kv_heads, -(-4 * threads // num_seqs))
    kv_heads_per_item = -(-num_kv_heads // splits)
    failed = kernels.decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), context_lens.data_ptr(),
        out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, block_size, block_tables.shape[1],
        max_context, scale, kv_heads_per_item, threads)
    if failed:
        raise MemoryError("CPU attention kernel could not allocate its score buffers")
    return out
