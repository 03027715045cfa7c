"""The machine's read floor: the C kernels' read kernel (kernels/cpu_kernels.c, read_bytes) over
1 GiB with N threads, best of 10, against a torch sum over the same bytes. What a one-sequence
decode step can at best read its weights at; bench_llamacpp.py measures it in the same run as the
engines.

    python scripts/read_bandwidth.py [--threads 2]                    # the native build
    NANOVLLM_CPU_MARCH=x86-64-v3 python scripts/read_bandwidth.py     # the AVX2 build (256-bit loads)
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--gib", type=float, default=1.0)
    args = p.parse_args()
    import torch

    from nanovllm.kernels import cpu_kernels
    from nanovllm.utils.efficiency import _best_time, c_read_bandwidth
    torch.set_num_threads(args.threads)
    kernels = cpu_kernels.load()
    if kernels is None:
        raise SystemExit("no C kernels on this machine")
    size = int(args.gib * (1 << 30)) // 256 * 256
    c = c_read_bandwidth(kernels, size)
    src = torch.ones(size // 4)
    t = _best_time(lambda: src.sum(), lambda: None, 10)
    build = os.environ.get(cpu_kernels.MARCH_ENV, "native")
    print(f"read kernel ({build} build), {args.threads} threads, {size / 2**30:.2f} GiB, best of 10: "
          f"{c / 1e9:.1f} GB/s; torch sum: {size / t / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
