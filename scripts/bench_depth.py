"""Decode behind long prompts, one sequence, per KV cache format: a random prompt of P tokens
(prefill timed), then --decode steps (decode timed), for each depth P and kv_cache_dtype; and, with
--attention, the decode attention kernel alone at the same depths (one layer's call, the model's
head shape, blocks scattered over a cache four times the context, the caches evicted before each
call as a step's weights evict them; the median call).

    python scripts/bench_depth.py [--model M] [--quantization q4_0] [--depths 64,2048,8192]
                                  [--kv-cache-dtypes float32,float16,bfloat16,int8] [--decode 32]
                                  [--max-num-batched-tokens N]
                                  [--attention | --attention-only [--against CHECKOUT]]
                                  [--llamacpp [--forks llama.cpp,ik_llama.cpp] --file q4_0|q8_0 --isa native|avx2
                                   [--resumable [--llamacpp-depths D]]]

Default model: bench.py's random-weight Qwen3-0.6B-shaped checkpoint. One engine per format (a
cache mapped up front, kvcache_prefault), prompts past its max_num_batched_tokens prefilled in chunks
as a user's are (all of them timed as the prefill); each depth runs once per format, so repeat the command to
see the machine's noise. Peak RSS is printed per format. Run without OMP_WAIT_POLICY=PASSIVE.

--resumable is for prefills longer than a sitting (llama.cpp over a q8_0 cache at 32768 tokens: over
5 hours of 2 cores here): llama.cpp runs first, through scripts/llamacpp_depth.c (batched-bench's measurement, its
prompt's cache saved every 512 tokens); stopped in its prefill, the same command goes on from the last
save. Its prefill speed is then over the tokens of the last run only; decode is timed as always. A save
of the first D tokens of a longer prompt is a D-token prompt's (the same random tokens from the start):
copied to D's name, it gives llama.cpp's decode at D (--llamacpp-depths D) while the longer one goes on.
"""
import argparse
import os
import random
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def parse_args() -> argparse.Namespace:
    from nanovllm.layers.backends.kv_formats import NAMES
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF folder or .gguf file (default: bench.py's random Qwen3-0.6B shape)")
    p.add_argument("--quantization", default="q4_0", help="weights quantized at load (default: %(default)s; "
                   "'none' keeps the checkpoint's)")
    p.add_argument("--depths", default="64,2048,8192", help="prompt lengths, comma-separated")
    p.add_argument("--kv-cache-dtypes", default="float32,float16,bfloat16,int8")
    p.add_argument("--decode", type=int, default=32, help="decode steps timed behind each prompt")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="prefill chunk (tokens per step); default: the engine's own (chunked prefill past it, as a "
                        "user gets), 0: each prompt in one chunk")
    p.add_argument("--attention", action="store_true", help="also time the decode attention kernel alone")
    p.add_argument("--attention-only", action="store_true", help="only the decode attention kernel alone (no engine)")
    p.add_argument("--against", metavar="CHECKOUT",
                   help="with --attention(-only): also time another checkout's kernels (e.g. a `git worktree` of an "
                        "earlier commit), its calls and ours alternating")
    p.add_argument("--llamacpp", action="store_true",
                   help="also run llama.cpp (llama-batched-bench -npp P -ntg DECODE -npl 1, flash attention on) with "
                        "its nearest cache (-ctk/-ctv: f16 for auto / float16, q8_0 for int8), both engines on "
                        "llama-quantize's file of the checkpoint (--file); llama.cpp built once (scripts/llamacpp_build.py)")
    p.add_argument("--forks", default="llama.cpp",
                   help="with --llamacpp: which to run, comma-separated: llama.cpp, ik_llama.cpp (its "
                        "llama-batched-bench, same flags plus -rtr, its run-time repacking; built once from the "
                        "ik-llama-cpp-python sdist) (default: %(default)s)")
    p.add_argument("--file", default="q4_0", choices=["q8_0", "q4_0", "q4_k_m"], help="with --llamacpp (default: %(default)s)")
    p.add_argument("--resumable", action="store_true",
                   help="with --llamacpp: llama.cpp's prefill saved as it goes and resumed by the next run "
                        "(scripts/llamacpp_depth.c); llama.cpp runs before ours")
    p.add_argument("--llamacpp-depths", default=None,
                   help="with --resumable: llama.cpp's depths when not --depths (e.g. the deepest its saved "
                        "prefill has reached, beside ours at the full depth)")
    p.add_argument("--isa", default="native", choices=["native", "avx2"],
                   help="instruction sets of both engines (avx2: what AVX2-only machines run; default: %(default)s)")
    args = p.parse_args()
    args.depths = [int(d) for d in args.depths.split(",")]
    args.llamacpp_depths = [int(d) for d in args.llamacpp_depths.split(",")] if args.llamacpp_depths else args.depths
    if args.llamacpp_depths != args.depths and not args.resumable:
        p.error("--llamacpp-depths goes with --resumable")
    args.kv_cache_dtypes = args.kv_cache_dtypes.split(",")
    args.forks = args.forks.split(",")
    if any(f not in ("llama.cpp", "ik_llama.cpp") for f in args.forks):
        p.error(f"--forks takes llama.cpp and ik_llama.cpp, got {args.forks}")
    bad = [n for n in args.kv_cache_dtypes if n not in NAMES]
    if bad:
        p.error(f"--kv-cache-dtypes: {bad} not in {list(NAMES)}")
    return args


def engine_rows(args, path: str) -> None:
    from nanovllm import LLM, SamplingParams
    rng = random.Random(0)
    longest = max(args.depths) + args.decode + 16
    quantization = None if args.quantization == "none" else args.quantization
    chunk = {} if args.max_num_batched_tokens is None else {"max_num_batched_tokens": args.max_num_batched_tokens or longest}
    for name in args.kv_cache_dtypes:
        with LLM(path, quantization=quantization, kv_cache_dtype=name, max_model_len=longest, max_num_seqs=1,
                 enable_prefix_caching=False, kvcache_prefault=True, **chunk) as llm:
            vocab = llm.config.hf_config.vocab_size
            for depth in args.depths:
                prompt = [rng.randrange(100, vocab - 100) for _ in range(depth)]
                llm.llm_engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=args.decode + 1, ignore_eos=True))
                start, steps = time.perf_counter(), 1
                while llm.llm_engine.step().num_output_tokens == 0:  # the prefill's chunks, the last one's token
                    steps += 1
                prefilled = time.perf_counter()
                while not llm.llm_engine.is_finished():
                    llm.llm_engine.step()
                done = time.perf_counter()
                print(f"| ours {name} | {depth} | {depth / (prefilled - start):.1f} | {args.decode / (done - prefilled):.2f} |",
                      flush=True)
                if steps > 1:
                    print(f"(prefill of {depth} tokens in {steps} chunks)", flush=True)
        print(f"peak RSS after {name}: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB",
              flush=True)


LLAMA_KV = {"float32": "f32", "auto": "f16", "float16": "f16", "bfloat16": "bf16", "int8": "q8_0"}


def table_rows(text: str) -> list[dict]:
    """The result rows of llama-batched-bench's markdown table (ik_llama.cpp prints no JSON):
    | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[0].isdigit():
            rows.append({"pp": int(cells[0]), "speed_pp": float(cells[5]), "speed_tg": float(cells[7])})
    return rows


def llamacpp_rows(args, gguf: Path, fork: str = "llama.cpp") -> None:
    """llama-batched-bench of fork at every depth, per KV cache type nearest to ours (one run each)."""
    import json

    import llamacpp_build
    from nanovllm.utils.cache import cache_root
    bins = llamacpp_build.build_llamacpp(cache_root(), isa=args.isa, fork=fork)
    logs = llamacpp_build.work_dir(cache_root(), fork) / "logs"
    ik = fork == "ik_llama.cpp"
    for name in args.kv_cache_dtypes:
        kv = LLAMA_KV.get(name)
        if kv is None:
            continue
        out, log = logs / f"depth-{gguf.stem}-{kv}.out", logs / f"depth-{gguf.stem}-{kv}.log"
        rss = llamacpp_build.run_step(
            f"{fork} llama-batched-bench on {gguf.name}",
            [str(bins["llama-batched-bench"]), "-m", str(gguf), "-c", str(max(args.depths) + args.decode + 16),
             "-b", "2048", "-ub", "512", "-npp", ",".join(map(str, args.depths)), "-ntg", str(args.decode),
             "-npl", "1", "-fa", "on", "-ctk", kv, "-ctv", kv, "-t", str(os.cpu_count()),
             *(["-rtr"] if ik else ["--output-format", "jsonl"])],
            log, stdout=out, cwd=logs)
        text = out.read_text()
        rows = table_rows(text + log.read_text()) if ik else [
            json.loads(line) for line in text.splitlines() if line.startswith("{")]
        for row in rows:
            print(f"| {fork} {kv} | {row['pp']} | {row['speed_pp']:.1f} | {row['speed_tg']:.2f} |", flush=True)
        print(f"peak RSS of {fork} {kv}: {rss / 1024:.2f} GiB", flush=True)


def depth_tool(bins: dict[str, Path], fork: str = "llama.cpp") -> Path:
    """scripts/llamacpp_depth.c compiled against fork's build (its headers, its libllama), once per source."""
    import hashlib

    import llamacpp_build
    from nanovllm.utils.cache import cache_root
    source = ROOT / "scripts" / "llamacpp_depth.c"
    lib = bins["llama-batched-bench"].parent
    tool = lib / f"llamacpp-depth-{hashlib.sha256(source.read_bytes()).hexdigest()[:10]}"
    if not tool.is_file():
        llama = llamacpp_build.fetch_source(cache_root(), fork)
        llamacpp_build.run_step(
            "compile of llamacpp_depth.c",
            [os.environ.get("CC", "cc"), "-O2", "-I", str(llama / "include"), "-I", str(llama / "ggml" / "include"),
             str(source), "-L", str(lib), "-lllama", "-lggml", "-lggml-base", f"-Wl,-rpath,{lib}", "-o", str(tool)],
            llamacpp_build.work_dir(cache_root(), fork) / "logs" / "compile-llamacpp-depth.log")
    return tool


def resumable_rows(args, gguf: Path, fork: str = "llama.cpp") -> None:
    """llama.cpp at every depth through llamacpp_depth.c, its prompt's cache saved under depth-state/ as
    it prefills and loaded by the next run of the same file, cache type and depth."""
    import json

    import llamacpp_build
    from nanovllm.utils.cache import cache_root
    bins = llamacpp_build.build_llamacpp(cache_root(), isa=args.isa, fork=fork)
    tool = depth_tool(bins, fork)
    work = llamacpp_build.work_dir(cache_root(), fork)
    states = work / "depth-state"
    states.mkdir(parents=True, exist_ok=True)
    for name in args.kv_cache_dtypes:
        kv = LLAMA_KV.get(name)
        if kv not in ("f16", "q8_0"):
            continue
        for depth in args.llamacpp_depths:
            stem = f"{gguf.stem}-{args.isa}-{kv}-{depth}"
            out, log = work / "logs" / f"depth-{stem}.out", work / "logs" / f"depth-{stem}.log"
            rss = llamacpp_build.run_step(
                f"{fork} llamacpp_depth on {gguf.name} ({kv}, {depth} tokens; progress in {log})",
                [str(tool), str(gguf), str(depth), str(args.decode), kv, str(os.cpu_count()),
                 str(states / f"{stem}.state")], log, stdout=out)
            row = json.loads(out.read_text().strip().splitlines()[-1])
            prefill = f"{row['speed_pp']:.1f}"
            if row["resumed_from"] >= depth:
                prefill = "- (the whole prompt from a save)"
            elif row["resumed_from"]:
                prefill += f" (resumed at {row['resumed_from']})"
            print(f"| {fork} {kv} | {depth} | {prefill} | {row['speed_tg']:.2f} |", flush=True)
            print(f"peak RSS of {fork} {kv}: {rss / 1024:.2f} GiB", flush=True)


def other_kernels(checkout: str):
    """The C kernels as another checkout of the project builds them (its sources, this machine's
    flags), loaded beside ours: the same calls timed alternately, so the machine's drift falls on both."""
    import ctypes
    import subprocess

    from nanovllm.kernels import cpu_kernels
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from nanovllm.kernels import cpu_kernels as c; "
            "assert c.load() is not None; print(c.library_path())")
    out = subprocess.run([sys.executable, "-c", code, checkout], capture_output=True, text=True, check=True)
    return cpu_kernels.CpuKernels(ctypes.CDLL(out.stdout.strip().splitlines()[-1]))


def attention_rows(args, heads: int, kv_heads: int, head_dim: int) -> None:
    import torch

    from nanovllm.kernels import cpu_kernels
    from nanovllm.layers.backends.kv_formats import kv_format
    from nanovllm.platforms import CpuPlatform
    builds = {"this checkout": cpu_kernels.load()}
    if args.against:
        builds[args.against] = other_kernels(args.against)

    def cache_like(rows: torch.Tensor) -> torch.Tensor:  # in the engine's KV cache memory (huge pages)
        return CpuPlatform().allocate_kv_cache(tuple(rows.shape), rows.dtype, torch.device("cpu")).copy_(rows)

    block = 16
    q = torch.randn(1, heads, head_dim)
    evict = torch.empty(64 * 2**20 // 4)  # twice a last-level cache of 32 MiB
    for name in args.kv_cache_dtypes:
        fmt = kv_format("float16" if name == "auto" else name)
        for depth in args.depths:
            blocks = -(-depth // block)
            table = torch.randperm(4 * blocks)[:blocks].to(torch.int32)[None]
            k, v = (cache_like(fmt.quantize(torch.randn(4 * blocks, block, kv_heads, head_dim))) for _ in "kv")
            lens = torch.tensor([depth], dtype=torch.int32)
            times = {build: [] for build in builds}
            for build, kernels in builds.items():
                for _ in range(3):
                    cpu_kernels.paged_decode_attention(kernels, q, k, v, fmt.c_type, table, lens, depth, 0.1)
            for _ in range(max(9, 20000 // depth)):
                for build, kernels in builds.items():  # alternately, call by call
                    evict.add_(1.0)  # as a decode step's weights do between two layers' attention: K/V from memory
                    start = time.perf_counter()
                    cpu_kernels.paged_decode_attention(kernels, q, k, v, fmt.c_type, table, lens, depth, 0.1)
                    times[build].append(time.perf_counter() - start)
            for build, samples in times.items():
                ms = sorted(samples)[len(samples) // 2] * 1e3
                gbs = 2 * depth * kv_heads * fmt.row_bytes(head_dim) / (ms / 1e3) / 1e9
                label = f" ({build})" if args.against else ""
                print(f"| {name}{label} | {depth} | {ms:.3f} ms | {gbs:.1f} GB/s |", flush=True)


def main() -> None:
    os.environ.pop("OMP_WAIT_POLICY", None)
    args = parse_args()
    sys.path.insert(0, str(ROOT / "scripts"))
    import llamacpp_build
    llamacpp_build.use_isa(args.isa)  # our side's instruction sets (it starts this script again where needed)
    import bench
    path = args.model or bench.random_qwen3_checkpoint()
    if args.llamacpp:
        from nanovllm.utils.cache import cache_root
        bins = llamacpp_build.build_llamacpp(cache_root(), isa=args.isa)
        source = llamacpp_build.convert_to_gguf(cache_root(), path, Path(path).name, "f32")
        path = str(llamacpp_build.quantize_gguf(cache_root(), bins, source, args.file))
        args.quantization = "none"  # the file's own blocks, as llama.cpp reads them
    print(f"model {path}, {args.isa} build", flush=True)
    if not args.attention_only:
        print("| engine / kv_cache_dtype | prompt tokens | prefill tok/s | decode tok/s |\n|---|---|---|---|", flush=True)
        if args.llamacpp and args.resumable and "llama.cpp" in args.forks:
            resumable_rows(args, Path(path))
        engine_rows(args, path)
    if args.llamacpp and not args.attention_only:
        for fork in args.forks:
            if not (args.resumable and fork == "llama.cpp"):
                llamacpp_rows(args, Path(path), fork)
    if args.attention or args.attention_only:
        from nanovllm.loader.checkpoint import Checkpoint
        hf = Checkpoint(path).hf_config
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        print("\n| kv_cache_dtype | context | decode attention per layer | KV read |\n|---|---|---|---|", flush=True)
        attention_rows(args, hf.num_attention_heads, hf.num_key_value_heads, head_dim)


if __name__ == "__main__":
    main()
