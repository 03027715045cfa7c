"""Pre-quantized checkpoints against the block formats they are held as: the default model quantized
by llm-compressor (W8A16, W4A16: compressed-tensors folders) run by nano-vLLM, beside llama.cpp's
Q8_0 / Q4_0 of the same weights (llama-quantize's files from the F32 conversion) run by llama.cpp
and by nano-vLLM. Same shapes and method as scripts/bench_llamacpp.py (whose helpers this uses):
decode tok/s at each batch size (64-token prompts, 64 greedy steps), batch-1 prefill of 128 tokens,
every figure measured --rounds times with the engines alternating, each engine's best reported.

    python scripts/bench_prequantized.py [--batches 1,8] [--rounds 2] [--threads N] [--isa native|avx2]
        [--input-bits auto|14|8] [--json F]

SmolLM2-135M's 576 inputs are not whole groups of 128 (the presets' group size), so the schemes are
W8A16 / W4A16 with groups of 64 (symmetric int8 / int4); ours holds them as Q8_0 / Q4_0 blocks. The
presets keep lm_head (the tied embedding) dense, which llama-quantize quantizes: the "F32
embedding" rows are llama-quantize's file with --token-embedding-type f32, the same bytes per token
as that folder. The "int8 head" rows are llm-compressor's folders with lm_head quantized to int8
too (W8A16: no ignore list; W4A16: a second config group naming lm_head; llm-compressor unties the
head, the embedding stays dense), the same bytes per token as llama-quantize's own files, which
hold the tied head as Q8_0 in both. RSS: what loading each of our engines added (they share one process), and
llama.cpp's process.
"""
import argparse
import gc
import json
import os
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_llamacpp as bl  # noqa: E402
import llamacpp_build  # noqa: E402

# block format -> (label, the llm-compressor scheme held as it, its variant with an int8 lm_head:
# llama-quantize's Q8_0 and Q4_0 files of this model both hold the tied head as Q8_0)
SCHEMES = {"q8_0": ("W8A16", "int8-sym-group64", "+head"), "q4_0": ("W4A16", "int4-sym-group64", "+head8")}


def llmcompressor_folder(cache: Path, src: str, scheme: str) -> str:
    """src quantized by llm-compressor with scheme, once, in the cache."""
    out = cache / "prequantized" / Path(src).name
    if not (out / scheme / "config.json").is_file():
        python = subprocess.run(["bash", str(ROOT / "scripts" / "llmcompressor_env.sh")], check=True,
                                capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable})
        subprocess.run([python.stdout.strip().splitlines()[-1], str(ROOT / "scripts" / "llmcompressor_quantize.py"),
                        "quantize", src, str(out), scheme], check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return str(out / scheme)


def main() -> None:
    if os.environ.pop("OMP_WAIT_POLICY", None) is not None:
        print("note: OMP_WAIT_POLICY unset: benchmarks run without it", file=sys.stderr)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--isa", default="native", choices=sorted(llamacpp_build.ISA_FLAGS))
    p.add_argument("--input-bits", type=lambda s: int(s) if s.isdigit() else s, default="auto",
                   choices=("auto", 8, 14),
                   help="our engines' cpu_input_bits (every row): auto (per group), 14 or 8")
    p.add_argument("--json")
    args = p.parse_args()
    batches = sorted({int(b) for b in args.batches.split(",")})
    llamacpp_build.use_isa(args.isa)  # before torch starts and our kernels are built or loaded
    from nanovllm.kernels.cpu_kernels import MARCH_ENV
    from nanovllm.utils.cpu_memory import release_freed_memory
    from nanovllm.utils.default_model import cache_root
    cache = cache_root()
    bins = llamacpp_build.build_llamacpp(cache, jobs=os.cpu_count(), isa=args.isa)
    path = bl.model_folder("default")
    points = [("decode", b) for b in batches] + [("prefill", bl.PREFILL_LEN)]
    results = {"threads": args.threads, "isa": args.isa, "our_march": os.environ.get(MARCH_ENV, "native"),
               "cpu_input_bits": args.input_bits}
    raw: dict = {}
    lines = [f"### default model: pre-quantized vs GGUF (tok/s, {args.threads} threads, {args.isa}, "
             f"cpu_input_bits={args.input_bits})", "",
             "| engine | " + " | ".join(bl.point_key(pt) for pt in points) + " | RSS MiB of the loaded model |",
             "|---" * (len(points) + 2) + "|"]
    for quant, (label, scheme, with_head) in SCHEMES.items():
        gguf, _, _ = bl.sources(cache, bins, "default", path, quant)
        f32 = llamacpp_build.convert_to_gguf(cache, path, f"default-{Path(path).name}", "f32")
        # the same file with the tied embedding / LM head left F32, as the llm-compressor folder keeps lm_head dense
        dense_head = llamacpp_build.quantize_gguf(cache, bins, f32, quant, embedding_type="f32")
        folder = llmcompressor_folder(cache, path, scheme)
        head_folder = llmcompressor_folder(cache, path, scheme + with_head)  # lm_head quantized too, int8
        name = quant.upper()
        rows = {f"llama.cpp {name}": (gguf, None), f"ours {name}": (gguf, str(gguf)),
                f"ours {name}, F32 embedding": (dense_head, str(dense_head)), f"ours {label}": (None, folder),
                f"ours {label}, int8 head": (None, head_folder)}
        engines = {}
        for key, (_, source) in rows.items():  # one at a time: each one's RSS is what its loading added
            gc.collect()
            release_freed_memory()  # what the engines before this one freed, returned first
            before = bl.rss_mib()
            engines[key] = bl.start_ours(source, batches, args.threads, "float32", args.input_bits) if source else None
            if source:
                results.setdefault(key, {"decode": {}, "prefill": None, "samples": {}})["rss"] = \
                    {bl.RSS_COLUMNS[0]: bl.rss_mib() - before}
        rng = random.Random(0)
        try:
            for point in points:
                for _ in range(args.rounds):
                    for key, llm in engines.items():
                        if llm is None:
                            rate, rss = bl.llamacpp_point(bins, rows[key][0], point, args.threads,
                                                          llamacpp_build.work_dir(cache) / "logs",
                                                          raw.setdefault(key, []))
                            bl.keep_rss(results, key, bl.RSS_COLUMNS[0], rss)
                        else:
                            rate = bl.ours_point(llm, point, rng, raw.setdefault(key, []))
                        bl.keep_best(results, key, point, rate)
        finally:
            for llm in engines.values():
                if llm is not None:
                    llm.exit()
            engines.clear()
            gc.collect()

        def figures(key: str) -> list:
            r = results[key]
            return [r["decode"].get(n) if kind == "decode" else r["prefill"] for kind, n in points]
        for key in rows:
            rss = results[key].get("rss", {}).get(bl.RSS_COLUMNS[0])
            lines.append(f"| {key} | " + " | ".join(f"{v:.1f}" for v in figures(key)) + f" | {rss:.0f} |")
        for num, den in ((f"ours {label}", f"ours {name}, F32 embedding"), (f"ours {label}", f"ours {name}"),
                         (f"ours {label}, int8 head", f"ours {name}"),
                         (f"ours {label}, int8 head", f"llama.cpp {name}")):
            ratio = [a / b for a, b in zip(figures(num), figures(den))]
            lines.append(f"| {num} / {den} | " + " | ".join(f"{v:.2f}x" for v in ratio) + " | |")
    print("\n" + "\n".join(lines) + "\n", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "raw": raw}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
