"""Compile the Triton attention kernels ahead of time for a CUDA architecture (no GPU needed: Triton
ships ptxas) and report registers, spills and shared memory of every tile configuration the
launchers use, over caches in the activations' dtype and in fp8, and the KV store writing fp8. Exits 1 if a build fails, spills registers or needs more shared memory than the GPU has.

    python scripts/check_triton_build.py [--arch 90] [--quick]
"""
import argparse
import os
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter's stand-ins

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler import compile as triton_compile  # noqa: E402

import torch  # noqa: E402
from nanovllm.kernels import attention_tuning as tuning, store_kvcache, triton_attention as ta  # noqa: E402

SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}  # opt-in bytes per block
DTYPES = {"bf16": (torch.bfloat16, tl.bfloat16), "fp16": (torch.float16, tl.float16),
          "fp32": (torch.float32, tl.float32)}
INT_POINTERS = ("block_tables_ptr", "cu_q_ptr", "cu_k_ptr", "context_lens_ptr", "slot_mapping_ptr")
CACHE_POINTERS = ("k_cache_ptr", "v_cache_ptr")
FP8 = {"e4m3": ("fp8e4nv", torch.float8_e4m3fn), "e5m2": ("fp8e5", torch.float8_e5m2)}


def signature(fn, dtype: str, constexprs: dict, cache: str | None = None) -> dict:
    """cache: the KV cache pointers' element type when not dtype (fp8, or u8 for the store's view)."""
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in INT_POINTERS:
            sig[name] = "*i32"
        elif name in CACHE_POINTERS and cache:
            sig[name] = f"*{cache}"
        elif name.startswith("part_"):
            sig[name] = "*fp32"
        elif name.endswith("_ptr"):
            sig[name] = f"*{dtype}"
        else:
            sig[name] = "fp32" if name == "qk_scale" else "i32"
    return sig


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) from cuobjdump; stack > 0 means spilled registers."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    fields = dict(item.split(":") for line in out.splitlines() if "REG:" in line for item in line.split()
                  if ":" in item and item.split(":")[1].isdigit())
    return int(fields["REG"]), int(fields["STACK"]) + int(fields.get("LOCAL", 0))


def configs(quick: bool, arch: int):
    """(label, kernel, dtype, cache type, constexprs, num_warps, num_stages) for each build the
    launchers make."""
    dtypes = ("bf16",) if quick else ("bf16", "fp16", "fp32")
    head_dims = (128,) if quick else (64, 128, 256)
    caches = (None, "e4m3") if quick else (None, "e4m3", "e5m2")
    for dtype in dtypes:
        torch_dtype, tl_dtype = DTYPES[dtype]
        precision = "ieee" if dtype == "fp32" else "tf32"
        for head_dim in head_dims:
            block_d = ta._block_d(head_dim)
            for cache in caches:
                name, cache_dtype = FP8.get(cache, (None, torch_dtype))
                fp8 = dict(KV_FP8=cache is not None, **store_kvcache.fp8_constants(cache_dtype))
                kv = f" kv {cache}" if cache else ""
                m, n, warps, stages = tuning.prefill_tiles(block_d, torch_dtype, is_hopper=arch >= 90)
                for has_prefix in (True,) if quick else (True, False):
                    consts = dict(GROUP=4, HEAD_DIM=head_dim, BLOCK_SIZE=256, BLOCK_M=m, BLOCK_N=n, BLOCK_D=block_d,
                                  HAS_PREFIX=has_prefix, DIAG_SPLIT=dtype != "fp32", PRECISION=precision,
                                  DOT_DTYPE=tl_dtype, **fp8)
                    label = f"prefill {dtype} d{head_dim} prefix={has_prefix}{kv}"
                    yield label, ta._prefill_kernel, dtype, name, consts, warps, stages
                n, warps, stages = tuning.decode_tiles(block_d, torch_dtype)
                for splits in (8,) if quick else (1, 8):
                    consts = dict(GROUP=4, HEAD_DIM=head_dim, BLOCK_SIZE=16, BLOCK_G=16, BLOCK_D=block_d, BLOCK_N=n,
                                  NUM_SPLITS=splits, PRECISION=precision, DOT_DTYPE=tl_dtype, KV_FP8=fp8["KV_FP8"])
                    yield (f"decode  {dtype} d{head_dim} splits={splits}{kv}", ta._decode_kernel, dtype, name, consts,
                           warps, stages)
                if cache:
                    row = 8 * head_dim
                    consts = dict(ROW_SIZE=row, BLOCK=triton.next_power_of_2(row), FP8=True,
                                  **store_kvcache.fp8_constants(cache_dtype))
                    yield (f"store   {dtype} d{head_dim}{kv}", store_kvcache._store_kvcache_kernel, dtype, "u8", consts,
                           4, 2)
            consts = dict(HEAD_DIM=head_dim, NUM_SPLITS=8, BLOCK_S=8, BLOCK_D=block_d)
            yield f"reduce  {dtype} d{head_dim}", ta._decode_reduce_kernel, dtype, None, consts, 4, 2


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80 or 90")
    p.add_argument("--quick", action="store_true", help="only the bf16, head_dim 128 builds")
    args = p.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    limit = SHARED_LIMIT.get(args.arch, 101376)
    failures = 0
    for label, kernel, dtype, cache, consts, warps, stages in configs(args.quick, args.arch):
        source = ASTSource(kernel, signature(kernel, dtype, consts, cache), constexprs=consts)
        try:
            compiled = triton_compile(source, target=target, options=dict(num_warps=warps, num_stages=stages))
        except Exception as e:  # report every failing build, not just the first
            print(f"{label:36s} BUILD FAILED: {e}")
            failures += 1
            continue
        regs, spill = resource_usage(compiled.asm["cubin"])
        shared = compiled.metadata.shared
        ok = spill == 0 and shared <= limit
        failures += not ok
        print(f"{label:36s} warps {warps} stages {stages}  regs {regs:3d}  spill {spill:4d} B  "
              f"shared {shared:6d} B  {'ok' if ok else 'FAIL'}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
