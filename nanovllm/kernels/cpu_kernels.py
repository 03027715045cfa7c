"""The CPU kernels in C, built once with the system C compiler into the nanovllm cache and loaded
with ctypes: paged decode attention (TorchBackend.decode, fp32 caches on CPU), linear layers over a
few rows in the formats of its weight-type table (cpu_kernels.c), and the decode step of a
Llama-family model (cpu_decode.c, driven by executor/cpu_decode.py). The structures both sides lay
out are declared here and in cpu_kernels.h; load() checks the library's ABI version and their sizes.

Without a C compiler, or when the build fails, or with NANOVLLM_CPU_KERNEL=0, load() returns None
and the callers keep their torch paths (same results, slower:
docs/performance.md, "Cliffs: what turns a fast path off").
"""
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

# The structures both sides lay out and the ABI check live in cpu_structs.py; named here too.
from nanovllm.kernels.cpu_structs import (ABI_VERSION, MOE_ACTIVATIONS, STRUCTS, DecoderLayer,  # noqa: F401
                                          DecoderModel, DecodeStep, DeltaNetLayer, Linear, MoeExperts, check_abi)
from nanovllm.utils.cache import cache_root
from nanovllm.utils.cpu_info import cpu_flags_line

logger = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(name) for name in ("cpu_kernels.c", "cpu_attention.c", "cpu_kv_formats.c",
                                                      "cpu_prefill_attention.c", "cpu_decode.c", "cpu_quant.c", "cpu_moe.c", "cpu_deltanet.c",
                                                      "cpu_lora.c")]
# The headers the sources include (cpu_kernels.h; the per-instruction-set bodies of cpu_quant.c).
HEADERS = sorted(Path(__file__).parent.glob("*.h"))
DISABLE_ENV = "NANOVLLM_CPU_KERNEL"
# -march=native by default: the library is built on, and cached for, the machine that runs it (the
# CPU's flags are part of its file name). NANOVLLM_CPU_MARCH=x86-64-v3 builds the AVX2 + FMA path
# on a machine with more (AVX-512), to measure what AVX2-only machines run.
MARCH_ENV = "NANOVLLM_CPU_MARCH"
BASE_CFLAGS = ["-O3", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


def cflags() -> list[str]:
    march = os.environ.get(MARCH_ENV, "native")
    if not march.replace("-", "").replace("_", "").isalnum():
        raise RuntimeError(f"{MARCH_ENV}={march!r} is not a -march value")
    return [*BASE_CFLAGS, f"-march={march}"]

_kernels = None
_tried = False
_compile_seconds = 0.0


def library_path() -> Path:
    cpu = cpu_flags_line() or os.uname().machine
    text = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    key = hashlib.sha256(text + " ".join(cflags()).encode() + cpu.encode())
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
        result = subprocess.run([compiler, *cflags(), *map(str, SOURCES), "-o", tmp, "-lm"], capture_output=True,
                                text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build_once(path: Path) -> None:
    """Build the library at path unless another process (a TP worker, a second engine) did while
    this one waited: one build per cache key, under a lock file beside it."""
    import fcntl
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if path.is_file():
            return
        logger.warning("compiling the CPU C kernels for this machine, once (about 10-30 s); later starts load "
                       "them from %s", path.parent)
        global _compile_seconds
        start = time.perf_counter()
        build(path)
        _compile_seconds = time.perf_counter() - start


def compile_seconds() -> float:
    """How long this process spent compiling the kernels (0.0 where it loaded a cached build)."""
    return _compile_seconds


# The one-call decode step's batch limit where some layer's weights are read by torch (a layer or
# format without a C view): up to here its dispatch costs more than the other layers' per-layer
# path saves (docs/performance.md, "The C decode step").
MAX_ROWS = 16
# Methods whose weights only the C kernels read (block formats, dense fp32 / bf16): every row count
# (dense: kernels/cpu_kernels.c, gemm_rows from GEMM_MIN_ROWS rows; docs/performance.md, "Weights held once").
ALL_ROWS = 1 << 30

c_int64, c_float, c_void_p = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class CpuKernels:
    """The library's functions, typed for ctypes."""

    def __init__(self, lib: ctypes.CDLL):
        check_abi(lib)
        i64, ptr, cint = c_int64, c_void_p, ctypes.c_int
        self.lib = lib

        def typed(name: str, restype, *argtypes):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, list(argtypes)
            return fn
        self.decode_attention = typed("paged_decode_attention", cint, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64,
                                      i64, i64, i64, i64, c_float, i64, c_float, ptr, cint)
        self.prefill_attention_q8 = typed("paged_prefill_attention_q8", cint, ptr, ptr, ptr, ptr, i64, ptr, ptr, i64,
                                          ptr, i64, i64, i64, i64, c_float, cint)
        self.kv_row_bytes = typed("kv_row_bytes", i64, i64, i64)
        self.kv_store_rows = typed("kv_store_rows", cint, i64, ptr, i64, ptr, i64, ptr, i64, ptr, ptr, i64, i64, cint)
        self.linear = typed("linear_f32", cint, ptr, ptr, ptr, ptr, i64, cint)
        self.weight_type_index = typed("weight_type_index", i64, ctypes.c_char_p)
        self.rows_to_f32 = typed("linear_rows_to_f32", cint, ptr, ptr, i64, ptr, cint)
        self.quant_simd = typed("quant_simd", i64)
        self.quantize_row_matches_reference = typed("quantize_row_matches_reference", i64, ptr, i64, i64, cint)
        self.repack_x8 = typed("repack_x8", i64, ctypes.c_char_p, ptr, i64, i64, ptr)
        self.linear_is_valid = typed("linear_is_valid", cint, ptr)
        self.set_quant_grid = typed("set_quant_grid", i64, ctypes.c_char_p, ptr, i64, i64)
        self.read_bytes = typed("read_bytes", i64, ptr, i64)
        self.weight_type_grid = typed("weight_type_grid", ctypes.c_char_p, ctypes.c_char_p)
        self.weight_type_ready = typed("weight_type_ready", i64, ctypes.c_char_p)
        self.decode_check_model = typed("decode_check_model", i64, ptr)
        self.decode_layers = typed("decode_layers", cint, ptr, ptr, ptr, i64, i64, ptr, ptr, cint, ptr, ptr, cint)
        self.lora_matrix_is_valid = typed("lora_matrix_is_valid", cint, ptr)
        self.lora_apply = typed("lora_apply", cint, ptr, ptr, i64, i64, ptr, ptr, ptr, i64, cint)
        self.decode_add_rms_norm = typed("decode_add_rms_norm", None, ptr, ptr, ptr, cint, ptr, i64, ptr, cint)
        self.decode_attention_layer = typed("decode_attention_layer", cint, ptr, i64, ptr, ptr, ptr, cint)
        self.rope_store_layer = typed("rope_store_layer", None, ptr, i64, ptr, ptr, ptr, i64, cint)
        self.decode_silu_mul = typed("decode_silu_mul", None, ptr, i64, i64, ptr, cint)
        self.moe_is_valid = typed("moe_is_valid", cint, ptr)
        self.moe_experts = typed("moe_experts_f32", cint, ptr, ptr, i64, ptr, ptr, cint)
        self.deltanet_decode = typed("deltanet_decode", cint, ptr, ptr, i64, i64, ptr, c_float, ptr, ptr, cint)
        self.mamba2_decode = typed("mamba2_decode", cint, ptr, ptr, i64, i64, ptr, c_float, ptr, ptr, cint)

    def weight_type(self, name: str) -> int:
        """The type code of a row of the C weight-type table (an i-quant's grid installed first)."""
        code = self.weight_type_index(name.encode())
        if code < 0:
            raise ValueError(f"the C kernels have no weight type {name!r}")
        if not self.weight_type_ready(name.encode()):
            self.install_grid(self.weight_type_grid(name.encode()).decode())
        return code

    def install_grid(self, grid: str) -> None:
        """The i-quant grid `grid` (iq2_xxs, ..., iq1_s: the gguf package's class of that name) into
        the C kernels: its rows of 4 or 8 small integers, as gguf.quants decodes them."""
        try:
            import gguf.quants
        except ImportError as e:
            raise ValueError(f"{grid} weights need the gguf package for their grid: pip install 'nanovllm[gguf]'") from e
        cls = getattr(gguf.quants, grid.upper())
        cls.init_grid()
        values = np.ascontiguousarray(cls.grid.reshape(cls.grid_shape)).astype(np.int8)
        if not np.array_equal(values, cls.grid.reshape(cls.grid_shape)):
            raise ValueError(f"the gguf package's {grid} grid is not small integers")
        if self.set_quant_grid(grid.encode(), values.ctypes.data, *values.shape):
            raise ValueError(f"the C kernels take no {grid} grid of shape {values.shape}")


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
            build_once(path)
        _kernels = CpuKernels(ctypes.CDLL(str(path)))
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
        logger.warning("CPU C kernels unavailable, using the torch paths: %s", e)
        return None
    return _kernels


def linear_struct(kernels: CpuKernels, view, bias: torch.Tensor | None = None) -> Linear:
    """The C description of a weight view (layers/quantization/base.py, CWeightView, with the views
    chained after it), checked against the C table's layout for its type (linear_is_valid). NOTE:
    it points into the views' tensors, which the layer keeps alive; the chained descriptions are
    kept alive by the returned one (its `chain`), not by a copy of it (a ctypes field assignment
    copies the structure only): whoever copies it keeps the original."""
    outputs = view.outputs
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous() or bias.numel() != outputs):
        raise ValueError(f"the C kernels take a dense fp32 bias of {outputs}, got {bias.dtype} {tuple(bias.shape)}")
    parts, offset = [], 0
    while view is not None:
        if not view.data.is_contiguous() or view.data.numel() * view.data.element_size() != view.n * view.row_bytes:
            raise ValueError(f"a {view.type_name} view's data is not {view.n} contiguous rows of {view.row_bytes} "
                             "bytes")
        part_bias = None if bias is None else bias.data_ptr() + 4 * offset
        parts.append(Linear(view.data.data_ptr(), part_bias, None if view.scales is None else view.scales.data_ptr(),
                            view.n, view.k, kernels.weight_type(view.type_name), view.row_bytes, None,
                            view.input_planes))
        offset += view.n
        view = view.next
    for first, second in zip(parts, parts[1:]):
        first.next = ctypes.addressof(second)
    linear = parts[0]
    linear.chain = parts  # keeps the chained structures alive
    if not kernels.linear_is_valid(ctypes.byref(linear)):  # the C table's own block layout for each type
        shapes = ", ".join(f"{p.n} x {p.k} {p.type}" for p in parts)
        raise ValueError(f"weights {shapes} (type codes) do not match their rows' byte layout")
    return linear


# Rows per group of the interleaved layouts (cpu_quant.c, repack_x8).
INTERLEAVE = 8


def interleaved(kernels: CpuKernels, type_name: str, data: torch.Tensor, k: int,
                in_place: bool = False) -> tuple[str, torch.Tensor] | None:
    """data (uint8 [n, row bytes] of a block format) repacked into the format's 8-row interleaved
    layout (same bytes; the kernels multiply 8 rows at once from it), as (its type name, the new
    tensor, or data itself repacked in_place: the matrix is never held twice); None when the
    format has no such layout or n is not a multiple of 8."""
    name = f"{type_name}x{INTERLEAVE}"
    n = data.shape[0]
    if n % INTERLEAVE or kernels.weight_type_index(name.encode()) < 0:
        return None
    if in_place and not data.is_contiguous():
        raise ValueError("an in-place repack needs contiguous rows")
    src = data.contiguous()
    out = src if in_place else torch.empty_like(src)
    if kernels.repack_x8(type_name.encode(), src.data_ptr(), n, k, out.data_ptr()):
        raise ValueError(f"cannot interleave a {n} x {k} {type_name} matrix")
    return name, out


def linear_outputs(weight: Linear) -> int:
    """The outputs of a description from linear_struct (its chain included)."""
    return sum(part.n for part in getattr(weight, "chain", [weight]))


def linear(kernels: CpuKernels, weight: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, k] (fp32) @ W^T (+ bias, fp32) -> [rows, n] fp32, W described by linear_struct."""
    x = x.contiguous()
    assert x.dtype == torch.float32 and (bias is None or bias.dtype == torch.float32)
    y = torch.empty(x.shape[0], linear_outputs(weight), dtype=torch.float32)
    failed = kernels.linear(ctypes.byref(weight), None if bias is None else bias.data_ptr(), x.data_ptr(),
                            y.data_ptr(), x.shape[0], torch.get_num_threads())
    if failed == 2:
        raise MemoryError(f"the C linear kernel could not allocate the quantized copy of {x.shape[0]} input rows")
    if failed:
        raise ValueError("the C linear kernel refused its weight description")
    return y


def rows_to_f32(kernels: CpuKernels, weight: Linear, ids: torch.Tensor) -> torch.Tensor:
    """Rows ids of W (an embedding table in any format of the C table) as fp32 [len(ids), k]."""
    ids = ids.to(torch.int64).contiguous().reshape(-1)
    out = torch.empty(ids.numel(), weight.k, dtype=torch.float32)
    if kernels.rows_to_f32(ctypes.byref(weight), ids.data_ptr(), ids.numel(), out.data_ptr(),
                           torch.get_num_threads()):
        raise ValueError(f"token ids outside [0, {weight.n}) or a table the C kernels cannot read")
    return out


def paged_decode_attention(kernels: CpuKernels, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           kv_type: int, block_tables: torch.Tensor, context_lens: torch.Tensor, max_context: int,
                           scale: float, window: int | None = None, softcap: float | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [num_seqs, num_heads, head_dim] (fp32) over caches in the C KV format kv_type -> the
    attention output, shaped like q; with a window, each query over its sequence's last `window`
    tokens; with softcap, the scaled scores capped by softcap * tanh(s / softcap); sinks [num_heads]:
    a logit per head in the softmax's denominator."""
    q = q.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    context_lens = context_lens.to(torch.int32).contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.dtype == torch.float32
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    sinks = None if sinks is None else sinks.detach().to(torch.float32).contiguous()
    # The work items (whole sequences, KV-head chunks or token chunks) are the C side's choice.
    failed = kernels.decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), kv_type, block_tables.data_ptr(),
        context_lens.data_ptr(), out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, block_size,
        block_tables.shape[1], max_context, scale, window or 0, softcap or 0.0,
        None if sinks is None else sinks.data_ptr(), torch.get_num_threads())
    if failed:
        raise MemoryError("CPU attention kernel could not allocate its score buffers")
    return out


def paged_prefill_attention_q8(kernels: CpuKernels, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, q_lens: list[int], k_lens: list[int],
                               scale: float) -> torch.Tensor:
    """q [num_tokens, num_heads, head_dim] fp32 (each sequence's q_lens[i] new tokens in turn) over
    int8 (q8_0) caches holding all k_lens[i] tokens of each sequence, causal -> the attention output,
    shaped like q (kernels/cpu_prefill_attention.c)."""
    q = q.contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.dtype == torch.float32
    num_heads, head_dim = q.shape[1:]
    _, block_size, num_kv_heads, _ = k_cache.shape
    block_tables = block_tables.to(torch.int32).contiguous()
    q_lens_t, k_lens_t = (torch.tensor(x, dtype=torch.int32) for x in (q_lens, k_lens))
    out = torch.empty_like(q)
    failed = kernels.prefill_attention_q8(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
        q_lens_t.data_ptr(), k_lens_t.data_ptr(), len(q_lens), out.data_ptr(), num_heads, num_kv_heads, head_dim,
        block_size, scale, torch.get_num_threads())
    if failed == 2:
        raise ValueError(f"the int8 prefill kernel takes head_dim a multiple of 32 up to 512, got {head_dim}")
    if failed:
        raise MemoryError("CPU prefill attention kernel could not allocate its buffers")
    return out


def store_kv(kernels: CpuKernels, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             kv_type: int, slot_mapping: torch.Tensor) -> None:
    """k, v [num_tokens, num_kv_heads, head_dim] fp32 (rows contiguous, tokens strided) into their
    slots of the caches, stored in the C KV format kv_type; slot -1 is skipped."""
    num_tokens, num_kv_heads, head_dim = k.shape
    k = k if k.stride(2) == 1 and k.stride(1) == head_dim else k.contiguous()
    v = v if v.stride(2) == 1 and v.stride(1) == head_dim else v.contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    assert k.dtype == v.dtype == torch.float32 and k_cache.is_contiguous() and v_cache.is_contiguous()
    if kernels.kv_store_rows(kv_type, k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slots.data_ptr(),
                             num_tokens, k_cache.data_ptr(), v_cache.data_ptr(), num_kv_heads, head_dim,
                             torch.get_num_threads()):
        raise ValueError(f"KV format {kv_type} cannot store rows of head_dim {head_dim}")


def moe_experts_struct(kernels: CpuKernels, gate_up: list, down: list, top_k: int, renormalize: bool,
                       router=None, shared: tuple | None = None, biases: tuple | None = None,
                       activation: tuple = ("silu", 0.0, 0.0), grouped=None,
                       correction_bias: torch.Tensor | None = None) -> MoeExperts:
    """The C description of a layer's experts from their weight views (one per expert: gate_up
    [2I, H], down [H, I]), optionally with the router's view and the shared expert's (gate_up,
    down, gate) views, checked by moe_is_valid. biases: (gate_up [E, 2I], down [E, H]) fp32, or
    None; activation: (name in MOE_ACTIVATIONS, alpha, limit); grouped: the layer's moe_ops.GroupedTopK
    (None: the softmax router) with its correction_bias [E] fp32. NOTE: it points into the views'
    tensors and the biases, which the layer keeps alive; the per-expert descriptions are kept alive
    by the returned structure."""
    up_bias, down_bias = biases if biases is not None else (None, None)
    ups = [linear_struct(kernels, view, None if up_bias is None else up_bias[e]) for e, view in enumerate(gate_up)]
    downs = [linear_struct(kernels, view, None if down_bias is None else down_bias[e]) for e, view in enumerate(down)]
    ups_array, downs_array = (Linear * len(ups))(*ups), (Linear * len(downs))(*downs)
    extra = [linear_struct(kernels, view) for view in ([router] if router is not None else []) + list(shared or ())]
    moe = MoeExperts(ctypes.cast(ups_array, ctypes.POINTER(Linear)), ctypes.cast(downs_array, ctypes.POINTER(Linear)),
                     len(ups), top_k, int(renormalize), down[0].outputs, down[0].k,
                     extra[0] if router is not None else Linear(),
                     *(extra[-3:] if shared else [Linear()] * 3),
                     MOE_ACTIVATIONS[activation[0]], activation[1], activation[2])
    if grouped is not None:
        moe.n_group, moe.topk_group, moe.routed_scale = grouped.n_group, grouped.topk_group, grouped.scale
        moe.correction_bias = correction_bias.data_ptr()
    moe.keep = (ups, downs, ups_array, downs_array, extra)
    if not kernels.moe_is_valid(ctypes.byref(moe)):
        raise ValueError(f"the experts' weights ({len(ups)} x [{gate_up[0].outputs}, {gate_up[0].k}] and "
                         f"[{down[0].outputs}, {down[0].k}]) do not form a valid C description")
    return moe


def moe_experts(kernels: CpuKernels, moe: MoeExperts, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
    """The routed experts of x [rows, hidden] (fp32) under router_logits [rows, num_experts] -> [rows, hidden]."""
    x = x.contiguous()
    logits = router_logits.float().contiguous()
    out = torch.empty(x.shape[0], moe.hidden, dtype=torch.float32)
    failed = kernels.moe_experts(ctypes.byref(moe), x.data_ptr(), x.shape[0], logits.data_ptr(), out.data_ptr(),
                                 torch.get_num_threads())
    if failed:
        raise MemoryError("the C experts kernel could not allocate its scratch") if failed == 1 else \
            ValueError("the C experts kernel refused its description")
    return out
