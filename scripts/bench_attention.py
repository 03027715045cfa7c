"""Time the Triton paged-attention kernels against the torch backend (decode and prefill).

    python scripts/bench_attention.py                     # CUDA: batch 1/32/256 x context 512/4096
    TRITON_INTERPRET=1 python scripts/bench_attention.py --device cpu --batches 1 --contexts 48 \
        --num-heads 4 --num-kv-heads 2 --head-dim 32 --block-size 16 --dtype float32   # smoke run

Every sequence of a row has the same context; the KV blocks are shuffled through the cache.
"""
import argparse
import time

import torch

from nanovllm.kernels.attention_tuning import choose_num_splits
from nanovllm.kernels.triton_attention import paged_decode_attention, paged_prefill_attention
from nanovllm.layers.backends.torch_backend import TorchBackend, TorchMetadata

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def time_ms(fn, device: torch.device) -> float:
    if device.type == "cuda":
        import triton.testing
        return triton.testing.do_bench(fn, warmup=10, rep=50)
    fn()  # compile / warm the interpreter
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def make_cache(args, num_seqs: int, context: int, device: torch.device):
    num_blocks_per_seq = -(-context // args.block_size)
    num_blocks = num_seqs * num_blocks_per_seq
    shape = (num_blocks, args.block_size, args.num_kv_heads, args.head_dim)
    dtype = DTYPES[args.dtype]
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    block_tables = torch.randperm(num_blocks, device=device).view(num_seqs, -1).to(torch.int32)
    return k_cache, v_cache, block_tables


def bench_decode(args, num_seqs: int, context: int, device: torch.device) -> str:
    k_cache, v_cache, block_tables = make_cache(args, num_seqs, context, device)
    q = torch.randn(num_seqs, args.num_heads, args.head_dim, dtype=k_cache.dtype, device=device)
    context_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=device)
    scale = args.head_dim ** -0.5
    meta = TorchMetadata(block_tables=block_tables, context_lens=context_lens, max_seqlen_k=context)
    def triton_fn():
        return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, context)

    def torch_fn():
        return TorchBackend().decode(q, k_cache, v_cache, meta, scale)

    diff = (triton_fn().float() - torch_fn().float()).abs().max().item()
    t_triton, t_torch = time_ms(triton_fn, device), time_ms(torch_fn, device)
    kv_bytes = 2 * num_seqs * context * args.num_kv_heads * args.head_dim * k_cache.element_size()
    splits = choose_num_splits(num_seqs, args.num_kv_heads, context, device)
    return (f"decode  {num_seqs:6d} {context:8d} {t_triton:10.3f} {t_torch:10.3f} {t_torch / t_triton:8.2f}x "
            f"{kv_bytes / t_triton / 1e6:8.0f} {splits:6d} {diff:9.2e}")


def bench_prefill(args, num_seqs: int, context: int, device: torch.device) -> str:
    """Whole-prompt prefill of `context` new tokens per sequence, the last quarter after a cached prefix."""
    k_cache, v_cache, block_tables = make_cache(args, num_seqs, context, device)
    q_len = max(1, context // 4) if args.prefix else context
    dtype, scale = k_cache.dtype, args.head_dim ** -0.5
    num_tokens = num_seqs * q_len
    q = torch.randn(num_tokens, args.num_heads, args.head_dim, dtype=dtype, device=device)
    # New tokens' K/V are those the cache holds at their positions (Attention stores before attending).
    pos = torch.arange(context - q_len, context, device=device)
    rows = (block_tables.long()[:, pos // args.block_size] * args.block_size + pos % args.block_size).flatten()
    k = k_cache.flatten(0, 1)[rows]
    v = v_cache.flatten(0, 1)[rows]
    cu_q = torch.arange(0, num_seqs + 1, device=device, dtype=torch.int32) * q_len
    cu_k = torch.arange(0, num_seqs + 1, device=device, dtype=torch.int32) * context
    tables = block_tables if args.prefix else None
    meta = TorchMetadata(seqlens_q=[q_len] * num_seqs, seqlens_k=[context] * num_seqs, block_tables=tables)
    def triton_fn():
        return paged_prefill_attention(q, k, v, k_cache, v_cache, cu_q, cu_k, q_len, scale, tables)

    def torch_fn():
        return TorchBackend().prefill(q, k, v, k_cache, v_cache, meta, scale)

    diff = (triton_fn().float() - torch_fn().float()).abs().max().item()
    t_triton, t_torch = time_ms(triton_fn, device), time_ms(torch_fn, device)
    # Causal FLOPs: 2 matmuls of 2*d each over the visible (query, key) pairs.
    pairs = num_seqs * (q_len * (context - q_len) + q_len * (q_len + 1) / 2)
    tflops = 4 * pairs * args.head_dim * args.num_heads / (t_triton * 1e-3) / 1e12
    return (f"prefill {num_seqs:6d} {context:8d} {t_triton:10.3f} {t_torch:10.3f} {t_torch / t_triton:8.2f}x "
            f"{tflops:8.1f}T {'-':>6} {diff:9.2e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    p.add_argument("--prefill-batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--prefix", action="store_true", help="prefill only the last quarter after a cached prefix")
    args = p.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    print(f"heads {args.num_heads}/{args.num_kv_heads} head_dim {args.head_dim} block {args.block_size} "
          f"{args.dtype} on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}")
    print(f"{'kind':7s} {'batch':>6s} {'context':>8s} {'triton ms':>10s} {'torch ms':>10s} {'speedup':>9s} "
          f"{'GB/s|TF':>9s} {'splits':>6s} {'max diff':>9s}")
    for context in args.contexts:
        for num_seqs in args.batches:
            print(bench_decode(args, num_seqs, context, device), flush=True)
    for context in args.contexts:
        for num_seqs in args.prefill_batches:
            print(bench_prefill(args, num_seqs, context, device), flush=True)


if __name__ == "__main__":
    main()
