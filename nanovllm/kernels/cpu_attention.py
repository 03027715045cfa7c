"""The CPU decode-attention kernel (cpu_attention.c): built once with the system C compiler into
the nanovllm cache, loaded with ctypes, called by TorchBackend.decode for fp32 caches on CPU.

Without a C compiler, or when the build fails, or with NANOVLLM_CPU_KERNEL=0, load() returns None
and the backend keeps its pure-torch path (same results; slower at long contexts, see
docs/performance.md).
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

from nanovllm.utils.default_model import cache_root

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_attention.c")
DISABLE_ENV = "NANOVLLM_CPU_KERNEL"
# -march=native: the library is built on, and cached for, the machine that runs it (the CPU's
# flags are part of its file name).
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]

_kernel = None
_tried = False


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return os.uname().machine


def library_path() -> Path:
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode() + _cpu_signature().encode())
    return cache_root() / "kernels" / f"cpu_attention-{key.hexdigest()[:16]}.so"


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
        result = subprocess.run([compiler, *CFLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True,
                                text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load():
    """The kernel's ctypes function, built on first use; None where it cannot be had (logged once)."""
    global _kernel, _tried
    if _tried:
        return _kernel
    _tried = True
    if os.environ.get(DISABLE_ENV, "1").lower() in ("0", "false", "off", "no"):
        return None
    try:
        path = library_path()
        if not path.is_file():
            build(path)
        fn = ctypes.CDLL(str(path)).paged_decode_attention_f32
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("CPU attention kernel unavailable, using the torch path: %s", e)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float, i64,
                   ctypes.c_int]
    fn.restype = ctypes.c_int
    _kernel = fn
    return fn


def paged_decode_attention(kernel, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
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
    failed = kernel(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                    context_lens.data_ptr(), out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim,
                    block_size, block_tables.shape[1], max_context, scale, kv_heads_per_item, threads)
    if failed:
        raise MemoryError("CPU attention kernel could not allocate its score buffers")
    return out
