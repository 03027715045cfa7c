"""Side-by-side CPU benchmark: llama.cpp (llama-bench, llama-batched-bench on F32 / F16 / Q8_0 GGUFs of
the same checkpoint) and nano-vLLM on the same shapes, fp32 weights and bf16 weights (fp32 activations,
as llama.cpp runs its F16 files); one markdown table per model, with ours fp32 / F32 and ours bf16 / F16.

    python scripts/bench_llamacpp.py [--models default,qwen3,qwen3-moe,gpt-oss] [--batches 1,8,32,64] [--threads N]
                                     [--rounds N] [--json FILE] [--skip-llamacpp | --skip-ours]
                                     [--forks llama.cpp,ik_llama.cpp]

--forks ik_llama.cpp adds ik_llama.cpp (the fastest CPU fork; built from the ik-llama-cpp-python sdist,
run with -rtr and its defaults otherwise) on the quantized files, a third row per file.

Shapes: random 64-token prompts, greedy decoding, 64 decode steps per sequence, at each batch size
(llama-batched-bench -npp 64 -ntg 64 -npl B; llama.cpp's batch-1 decode is llama-bench -n 64), and a
batch-1 prefill of 128 tokens (llama-bench -p 128 -r 5; ours 5 prefills too: a prefill takes a fraction of a
second, one of them moved 1.5x with the machine's other load; each engine's median of the 5). Decode tok/s = sequences x decode steps / decode
time; prefill tok/s = prompt tokens / prefill time. Our steps are whole engine steps (scheduling and
greedy sampling included); llama.cpp's time llama_decode. Both use --threads (default: every core).
Both engines' KV caches are mapped before the timed runs (llama.cpp clears its cache at start-up; ours
runs with kvcache_prefault). Each figure is measured --rounds times, llama.cpp's and ours alternating
figure by figure (seconds apart, so both see the same memory bandwidth), and each engine's best is
reported; every sample goes to --json.
llama.cpp is built once into the nanovllm cache (see scripts/llamacpp_build.py) and the GGUFs are
converted once. Benchmarks run without OMP_WAIT_POLICY=PASSIVE: this script unsets it (sleeping
OpenMP threads wake late between ops; the llama.cpp build uses OpenMP too). Each engine keeps its
own OpenMP default: ours the short spin nanovllm sets (GOMP_SPINCOUNT=3000, utils/threads.py),
llama.cpp libgomp's own (its commands get the environment without ours).
"""
import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import llamacpp_build  # noqa: E402
from llamacpp_build import BuildError  # noqa: E402

PROMPT_LEN, DECODE_STEPS, PREFILL_LEN = 64, 64, 128
PREFILL_REPS = 5  # prefills timed per figure, both engines; the figure is their median
QUANTS = ("f32", "f16", "q8_0", "q4_0", "q4_k_m")
# The other llama-quantize presets (K-quants and i-quants; not among the defaults).
MORE_QUANTS = tuple(p for p in llamacpp_build.PRESETS if p not in QUANTS)
# mxfp4: a GPT-OSS checkpoint's file as llama.cpp's converter writes it (--outtype q8_0): the MXFP4
# experts as shipped, the other matrices Q8_0 (the gpt-oss model's row; not among the defaults).
FORMATS = QUANTS + MORE_QUANTS + ("mxfp4",)
LABELS = {"f32": "llama.cpp F32", "f16": "llama.cpp F16", "q8_0": "llama.cpp Q8_0", "q4_0": "llama.cpp Q4_0",
          "q4_k_m": "llama.cpp Q4_K_M", "mxfp4": "llama.cpp MXFP4 experts + Q8_0", "ours": "nano-vLLM fp32",
          "ours_bf16": "nano-vLLM bf16 weights", "ours_q8_0": "nano-vLLM Q8_0", "ours_q4_0": "nano-vLLM Q4_0",
          "ours_q4_k_m": "nano-vLLM Q4_K_M", "ours_mxfp4": "nano-vLLM MXFP4 experts + Q8_0"}
# Each of our rows against the llama.cpp row at the same weight width (the same file for the
# quantized ones).
RATIOS = {"ours": "f32", "ours_bf16": "f16", "ours_q8_0": "q8_0", "ours_q4_0": "q4_0", "ours_q4_k_m": "q4_k_m",
          "ours_mxfp4": "mxfp4"}
for _preset in MORE_QUANTS:
    LABELS[_preset] = f"llama.cpp {llamacpp_build.PRESETS[_preset]}"
    LABELS[f"ours_{_preset}"] = f"nano-vLLM {llamacpp_build.PRESETS[_preset]}"
    RATIOS[f"ours_{_preset}"] = _preset
# The dense rows load the HF folder; the quantized rows the very file llama-quantize wrote.
OUR_DTYPES = {"ours": "float32", "ours_bf16": "bfloat16"}
FILE_ROWS = tuple(llamacpp_build.PRESETS)
RSS_COLUMNS = ("after load", "after the largest batch")
# The --models names of bench.py's random checkpoints, each its builder there (built once, cached).
RANDOM_BUILDERS = {"qwen3": "random_qwen3_checkpoint", "qwen3-moe": "random_qwen3_moe_checkpoint",
                 "gpt-oss": "random_gpt_oss_mxfp4_checkpoint", "qwen3.5": "random_qwen3_5_checkpoint",
                 "smollm3": "random_smollm3_checkpoint", "glm4.5": "random_glm4_moe_checkpoint",
                 "lfm2": "random_lfm2_checkpoint", "lfm2-moe": "random_lfm2_moe_checkpoint",
                 "granite4h": "random_granite_hybrid_checkpoint", "falcon-h1": "random_falcon_h1_checkpoint"}
MODELS = ("default", *RANDOM_BUILDERS)


def model_folder(name: str) -> str:
    """The HF folder of one of the --models names."""
    if name == "default":
        from nanovllm.utils.default_model import default_model_path
        return default_model_path()
    if name not in RANDOM_BUILDERS:
        raise ValueError(f"--models takes {', '.join(MODELS)}, got {name!r}")
    import bench  # the repo root's bench.py owns the random checkpoints
    return getattr(bench, RANDOM_BUILDERS[name])()


# ---- llama.cpp ----------------------------------------------------------------------------------
def parse_llama_bench(stdout: str) -> dict:
    """llama-bench -o json: {"prefill": pp tok/s, "decode": tg tok/s, "rows": its rows}. A rate is
    tokens / mean time over the repetitions (total tokens / total time, as ours), not its avg_ts; prefill
    is tokens / the median repetition's time (ours: the median of as many prefills)."""
    rows = json.loads(stdout[stdout.index("["):])
    out = {"rows": rows}
    for row in rows:
        if row["n_gen"] == 0:
            out["prefill"] = row["n_prompt"] / (statistics.median(row.get("samples_ns") or [row["avg_ns"]]) * 1e-9)
        elif row["n_prompt"] == 0:
            out["decode"] = row["n_gen"] / (row["avg_ns"] * 1e-9)
    return out


def parse_batched_bench(stdout: str) -> dict[int, dict]:
    """llama-batched-bench --output-format jsonl: its rows keyed by batch size (pl)."""
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return {int(row["pl"]): row for row in rows}


def llamacpp_point(bins: dict[str, Path], gguf: Path, point: tuple[str, int], threads: int, logs: Path,
                   raw: list, fork: str = "llama.cpp") -> tuple[float, float]:
    """One figure of llama.cpp (or ik_llama.cpp: with -rtr, its run-time repacking, its defaults
    otherwise) on one GGUF (tok/s) and the run's peak RSS (MiB): ("decode", 1) from llama-bench -n 64
    (the figure llama.cpp users quote), ("decode", B) from llama-batched-bench -npl B, ("prefill", N)
    from llama-bench -p N; one repetition each (after llama-bench's own warm-up run). Its raw rows
    go to raw."""
    kind, n = point
    ik = fork == "ik_llama.cpp"
    stem = f"{gguf.stem}-{kind}{n}{'-ik' if ik else ''}"
    if kind == "decode" and n > 1:
        out = logs / f"batched-bench-{stem}.jsonl"
        cmd = [str(bins["llama-batched-bench"]), "-m", str(gguf), "-c", str(n * (PROMPT_LEN + DECODE_STEPS)),
               "-b", "2048", "-ub", "512", "-npp", str(PROMPT_LEN), "-ntg", str(DECODE_STEPS), "-npl", str(n),
               "-t", str(threads), *(["-rtr"] if ik else ["--output-format", "jsonl"])]
        try:
            rss = llamacpp_build.run_step(f"{fork} llama-batched-bench on {gguf.name}", cmd,
                                          logs / f"batched-bench-{stem}.log", stdout=out)
            log = logs / f"batched-bench-{stem}.log"
        except BuildError:
            if not ik:
                raise
            # ik_llama.cpp 0.1.5's flash attention (on by default) aborts on some shapes (GGML_ASSERT(S > 0)
            # in iqk_fa_templates.h with SmolLM2's 64-wide heads): its run without it
            print(f"note: {fork} llama-batched-bench aborted with flash attention on {gguf.name}; rerun with -fa 0",
                  file=sys.stderr)
            log = logs / f"batched-bench-{stem}-nofa.log"
            rss = llamacpp_build.run_step(f"{fork} llama-batched-bench -fa 0 on {gguf.name}", cmd + ["-fa", "0"],
                                          log, stdout=out)
            raw.append({"note": "flash attention off (aborted with it on)"})
        if ik:  # (its batched-bench prints a markdown table only, to either stream)
            from bench_depth import table_rows
            row = table_rows(out.read_text() + log.read_text())[-1]
        else:
            row = parse_batched_bench(out.read_text())[n]
        raw.append({**row, "peak_rss_mib": rss})
        return row["speed_tg"], rss
    prompt, gen = (n, 0) if kind == "prefill" else (0, DECODE_STEPS)
    out = logs / f"bench-{stem}.json"
    rss = llamacpp_build.run_step(f"{fork} llama-bench on {gguf.name}",
                            [str(bins["llama-bench"]), "-m", str(gguf), "-p", str(prompt), "-n", str(gen),
                             "-r", str(PREFILL_REPS if kind == "prefill" else 1), "-t", str(threads), "-o", "json",
                             *(["-rtr", "1"] if ik else [])],
                            logs / f"bench-{stem}.log", stdout=out)
    parsed = parse_llama_bench(out.read_text())
    raw.extend({**row, "peak_rss_mib": rss} for row in parsed["rows"])
    return parsed[kind], rss


# ---- nano-vLLM ----------------------------------------------------------------------------------
def time_batch(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    """Add every prompt, then step to the end, timing prefill steps and decode steps apart."""
    from nanovllm import SamplingParams
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
    for prompt in prompts:
        llm.llm_engine.add_request(prompt, params)
    t = {"prefill_s": 0.0, "prefill_tokens": 0, "decode_s": 0.0, "decode_tokens": 0}
    while not llm.llm_engine.is_finished():
        start = time.perf_counter()
        num_tokens = llm.llm_engine.step().num_tokens  # > 0: a prefill step, < 0: a decode step of that many rows
        elapsed = time.perf_counter() - start
        phase = "prefill" if num_tokens > 0 else "decode"
        t[f"{phase}_s"] += elapsed
        t[f"{phase}_tokens"] += abs(num_tokens)
    return t


def rss_mib() -> float:
    """This process's resident set now (MiB)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def start_ours(path: str, batches: list[int], threads: int, dtype: str, input_bits: int | str):
    """Our engine for every point of one weight width (it stays loaded while llama.cpp runs)."""
    import torch
    from nanovllm import LLM
    torch.set_num_threads(threads)
    # NOTE: kvcache_prefault: llama.cpp clears its KV cache when it creates its context, so no
    # timed step of its writes to a fresh page; ours maps its (benchmark-sized) cache up front too.
    return LLM(path, device="cpu", dtype=dtype, max_num_seqs=max(batches),
               max_model_len=PROMPT_LEN + DECODE_STEPS + PREFILL_LEN, kvcache_prefault=True,
               cpu_input_bits=input_bits)


def per_token_bytes(llm) -> int:
    """What one decode step at one sequence reads in our engine (weights as held, the top_k
    experts, the KV cache at the middle of the benchmark's decode): the bandwidth view's bytes."""
    from nanovllm.utils.efficiency import decode_bytes_per_token
    runner = llm.llm_engine.model_runner
    return decode_bytes_per_token(runner.model, runner.kv_token_bytes(), PROMPT_LEN + DECODE_STEPS // 2)


def measured_read_bandwidth(threads: int) -> float:
    """Bytes/s of reading 1 GiB with `threads` threads by the C read kernel, best of 10, in this
    process (the floor's denominator; scripts/read_bandwidth.py measures it alone)."""
    import torch

    from nanovllm.kernels import cpu_kernels
    from nanovllm.utils.efficiency import c_read_bandwidth, read_bandwidth
    torch.set_num_threads(threads)
    kernels = cpu_kernels.load()
    return read_bandwidth(torch.device("cpu")) if kernels is None else c_read_bandwidth(kernels)


def ours_point(llm, point: tuple[str, int], rng: random.Random, raw: list) -> float:
    """One figure of our engine (tok/s) on the shape of llamacpp_point's, after a warm-up at that
    shape; every prompt is fresh random tokens (no prefix hits). Its step timings go to raw."""
    kind, n = point

    def prompts(count: int, length: int) -> list[list[int]]:
        return [[rng.randrange(llm.llm_engine.vocab_size) for _ in range(length)] for _ in range(count)]
    if kind == "prefill":
        time_batch(llm, prompts(1, n), max_tokens=1)  # warm-up
        runs = [time_batch(llm, prompts(1, n), max_tokens=1) for _ in range(PREFILL_REPS)]
        raw.extend(runs)
        return n / statistics.median(t["prefill_s"] for t in runs)
    time_batch(llm, prompts(n, PROMPT_LEN), max_tokens=3)  # warm-up at this shape
    # NOTE: prefill samples the first token, so max_tokens = 1 + the decode steps.
    t = time_batch(llm, prompts(n, PROMPT_LEN), max_tokens=1 + DECODE_STEPS)
    assert t["decode_tokens"] == n * DECODE_STEPS, t
    raw.append(t)
    return t["decode_tokens"] / t["decode_s"]


def sources(cache: Path, bins, name: str, path: str, quant: str) -> tuple[Path | None, str, str]:
    """(llama.cpp's GGUF, what ours loads, our dtype) of one row: llama-quantize's file from the F32
    conversion for the quantized rows (both engines load it), the conversion against our HF folder
    for f32 / f16."""
    stem = f"{name}-{Path(path).name}"
    if quant == "mxfp4":  # the converter keeps a GPT-OSS checkpoint's MXFP4 experts as they are
        gguf = llamacpp_build.convert_to_gguf(cache, path, stem, "q8_0")
        return gguf, str(gguf), "float32"
    if quant in FILE_ROWS:
        gguf = llamacpp_build.quantize_gguf(cache, bins, llamacpp_build.convert_to_gguf(cache, path, stem, "f32"),
                                            quant)
        return gguf, str(gguf), "float32"
    ours = next(key for key, ref in RATIOS.items() if ref == quant)
    gguf = llamacpp_build.convert_to_gguf(cache, path, stem, quant) if bins is not None else None
    return gguf, path, OUR_DTYPES[ours]


def perplexity_table(cache: Path, bins, name: str, path: str, args, results: dict) -> str:
    """Perplexity over tests/data/english.txt, scored as llama-perplexity scores it (-c 128), by
    llama-perplexity and by ours on the same weights (the same file for the quantized rows)."""
    import perplexity as ppl
    from nanovllm import LLM
    text = ROOT / "tests" / "data" / "english.txt"
    out = results.setdefault("perplexity", {})
    lines = [f"### {name}: perplexity of {text.name} (-c {ppl.N_CTX}, second half of each chunk)", "",
             "| weights | llama-perplexity | nano-vLLM | ours / theirs |", "|---|---|---|---|"]
    for quant in args.formats:
        gguf, our_source, our_dtype = sources(cache, bins, name, path, quant)
        theirs = None
        if gguf is not None and not args.skip_llamacpp:
            log = llamacpp_build.work_dir(cache) / "logs" / f"perplexity-{gguf.stem}.log"
            llamacpp_build.run_step(f"llama-perplexity on {gguf.name}",
                                    [str(bins["llama-perplexity"]), "-m", str(gguf), "-f", str(text), "-c",
                                     str(ppl.N_CTX), "-b", str(ppl.N_CTX), "-t", str(args.threads)], log)
            theirs = ppl.parse_llama_perplexity(log.read_text(errors="replace"))
        ours = None
        if not args.skip_ours:
            with LLM(our_source, device="cpu", dtype=our_dtype, max_num_seqs=16, max_model_len=2 * ppl.N_CTX,
                     cpu_input_bits=args.input_bits) as llm:
                ours = ppl.our_perplexity(llm, ppl.chunks_of(llm.tokenizer, text.read_text()))
        out[quant] = {"llama_perplexity": theirs, "ours": ours}
        ratio = f"{ours / theirs:.4f}" if ours and theirs else "-"
        cells = ["-" if v is None else f"{v:.4f}" for v in (theirs, ours)]
        lines.append(f"| {LABELS[quant].removeprefix('llama.cpp ')} | {cells[0]} | {cells[1]} | {ratio} |")
    return "\n".join(lines)


# ---- the table ----------------------------------------------------------------------------------
def point_key(point: tuple[str, int]) -> str:
    """The name a figure's samples are kept under: "decode 8", "prefill 128"."""
    kind, n = point
    return f"{kind} {n}"


def paired_median(ours: dict, ref: dict, point: str) -> float | None:
    """The median over the rounds of ours / ref at one point, each round's two samples measured
    seconds apart (None without samples of both)."""
    a, b = ours.get("samples", {}).get(point, []), ref.get("samples", {}).get(point, [])
    if not a or len(a) != len(b):
        return None
    return statistics.median(x / y for x, y in zip(a, b))


def table(name: str, results: dict, batches: list[int]) -> str:
    """One markdown table: a row per engine (each figure its best round), then our/their ratios at
    the same weight width: of the best figures, and the median of the rounds' pairs."""
    cols = [f"decode @{b}" for b in batches] + [f"prefill {PREFILL_LEN}"]
    points = [point_key(("decode", b)) for b in batches] + [point_key(("prefill", PREFILL_LEN))]

    def values(r: dict) -> list:
        return [r["decode"].get(b) for b in batches] + [r.get("prefill")]

    def row(label: str, vals: list, fmt: str, extra: list | None = None) -> str:
        cells = ["-" if v is None else fmt.format(v) for v in vals]
        cells += ["-" if v is None else f"{v:.0f}" for v in (extra or [])]
        return f"| {label} | " + " | ".join(cells) + " |"
    rss_cols = [f"RSS MiB {c}" for c in RSS_COLUMNS]
    inputs = {8: ", our block kernels' inputs in int8", 14: ", our block kernels' inputs in 14 bits"}.get(
        results.get("cpu_input_bits"), "")
    lines = [f"### {name} (tok/s, {results['threads']} threads{inputs})", "",
             "| engine | " + " | ".join(cols + rss_cols) + " |", "|---" * (len(cols) + len(rss_cols) + 1) + "|"]
    ours_of = {ref: o for o, ref in RATIOS.items()}
    keys = [k for f in FORMATS for k in (f, fork_key("ik_llama.cpp", f), ours_of[f])]
    rows = {k: values(results[k]) for k in keys if k in results}
    for key, vals in rows.items():
        rss = results[key].get("rss", {})
        lines.append(row(label(key), vals, "{:.1f}", [rss.get(c) for c in RSS_COLUMNS]))
    for ours, ref in RATIOS.items():
        for ref_key in (ref, fork_key("ik_llama.cpp", ref)):
            if ours in rows and ref_key in rows:
                ratio = [None if a is None or b is None else a / b for a, b in zip(rows[ours], rows[ref_key])]
                lines.append(row(f"{LABELS[ours]} / {label(ref_key)}", ratio, "{:.2f}x"))
                medians = [paired_median(results[ours], results[ref_key], point) for point in points]
                if any(m is not None for m in medians):
                    lines.append(row(f"{LABELS[ours]} / {label(ref_key)}, median of the rounds' pairs", medians,
                                     "{:.2f}x"))
    for ours, view in (results.get("floor", {}).items() if batches[0] == 1 else ()):
        # every engine on the same file reads about the same bytes (the KV cache in 16 bits in each)
        floor = view["read_bandwidth"] / view["bytes_per_token"]
        engines = [k for k in (RATIOS[ours], fork_key("ik_llama.cpp", RATIOS[ours]), ours) if k in rows]
        shares = ", ".join(f"{label(k)} {rows[k][0] / floor:.0%}" for k in engines if rows[k][0] is not None)
        lines.append(f"\nBandwidth view, {LABELS[ours]}: {view['bytes_per_token'] / 1e6:.0f} MB read per token at one "
                     f"sequence, read bandwidth {view['read_bandwidth'] / 1e9:.1f} GB/s in the same run: floor "
                     f"{floor:.1f} tok/s; decode @{batches[0]} as a share of it: {shares}\n")
    return "\n".join(lines)


def fork_key(fork: str, quant: str) -> str:
    """The results key of a llama.cpp fork's row on one format ("q4_0", "ik_q4_0")."""
    return quant if fork == "llama.cpp" else f"ik_{quant}"


def label(key: str) -> str:
    """A row's name in the tables."""
    if key.startswith("ik_"):
        return f"ik_llama.cpp {LABELS[key[3:]].removeprefix('llama.cpp ')} (-rtr)"
    return LABELS[key]


def keep_rss(results: dict, key: str, column: str, mib: float) -> None:
    """results[key]["rss"][column]: the largest RSS seen for that column (MiB)."""
    rss = results.setdefault(key, {"decode": {}, "prefill": None, "samples": {}}).setdefault("rss", {})
    rss[column] = max(rss.get(column, mib), mib)


def keep_best(results: dict, key: str, point: tuple[str, int], rate: float) -> None:
    """results[key]: each point's best rate over the rounds so far (decode by batch size, prefill);
    every rate is kept in results[key]["samples"]."""
    best = results.setdefault(key, {"decode": {}, "prefill": None, "samples": {}})
    kind, n = point
    best["samples"].setdefault(point_key(point), []).append(rate)
    if kind == "prefill":
        best["prefill"] = rate if best["prefill"] is None else max(best["prefill"], rate)
    else:
        best["decode"][n] = max(best["decode"].get(n, rate), rate)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="default,qwen3",
                   help="comma-separated: default (SmolLM2-135M), qwen3 (random, Qwen3-0.6B's shape), qwen3-moe "
                   "(random Qwen3-MoE: 24 layers, 64 experts, 8 active, 1.5B parameters), gpt-oss (random "
                   "GPT-OSS shape in MXFP4: 24 layers, 32 experts, 4 active, hidden 1024; with --formats mxfp4), qwen3.5 "
                   "(random, Qwen3.5-0.8B's hybrid shape: 18 Gated DeltaNet and 6 full-attention layers), smollm3 (random, "
                   "SmolLM3's NoPE layers at Qwen3-0.6B's size), glm4.5 (random, GLM-4.5-Air's kind at qwen3-moe's size), "
                   "lfm2 (random, LFM2-700M's shape), lfm2-moe (random, LFM2-8B-A1B's kind, smaller), granite4h "
                   "(random, Granite-4.0-H-350M's kind), falcon-h1 (random, Falcon-H1-0.5B's shape)")
    p.add_argument("--batches", default="1,8,32,64", help="decode batch sizes, comma-separated")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    p.add_argument("--threads", type=int, default=cores, help="default: every core")
    p.add_argument("--rounds", type=int, default=3, help="measure every figure this many times, alternating the "
                   "engines, and report each one's best (default: 3)")
    p.add_argument("--json", help="save every figure and llama.cpp's raw rows to this file")
    p.add_argument("--isa", default="native", choices=sorted(llamacpp_build.ISA_FLAGS),
                   help="instruction set of both engines' kernels: native (llama.cpp without AMX, ours "
                   "-march=native) or avx2 (llama.cpp AVX2 + FMA; ours: C kernels for x86-64-v3 and "
                   "torch's ATen / oneDNN / MKL held to AVX2, llamacpp_build.OUR_ISA_ENV)")
    p.add_argument("--formats", default=",".join(QUANTS),
                   help=f"comma-separated rows: {', '.join(FORMATS)} (default: {', '.join(QUANTS)}); f32 / f16: llama.cpp's "
                   "conversions against ours on the HF folder (fp32, bf16 weights); the quantized ones: "
                   "llama-quantize's file from the F32 conversion, loaded by both engines; mxfp4 (gpt-oss): "
                   "the converter's file of the MXFP4 checkpoint, experts as shipped and the rest Q8_0")
    p.add_argument("--input-bits", type=lambda s: int(s) if s.isdigit() else s, default="auto", choices=("auto", 8, 14),
                   help="our block-format kernels' input rounding per group (LLM(cpu_input_bits=)): auto (the "
                   "default: int8 where that is within 40 dB of the group, 14-bit elsewhere), 14 (two int8 planes "
                   "everywhere) or 8 (llama.cpp's int8 inputs everywhere)")
    p.add_argument("--perplexity", action="store_true",
                   help="also score tests/data/english.txt with llama-perplexity and with ours, each row's weights")
    p.add_argument("--depths", help="instead: decode behind long prompts, one sequence (scripts/bench_depth.py "
                   "--llamacpp, llama.cpp and ik_llama.cpp: these prompt lengths, our auto and int8 KV caches against f16 and q8_0, "
                   "the first quantized --formats file, --isa)")
    p.add_argument("--forks", default="llama.cpp",
                   help="comma-separated: llama.cpp, ik_llama.cpp (the CPU-speed fork, built once from the "
                   "ik-llama-cpp-python sdist; run with -rtr, its run-time repacking, on the quantized files)")
    skip = p.add_mutually_exclusive_group()
    skip.add_argument("--skip-llamacpp", action="store_true", help="run only nano-vLLM")
    skip.add_argument("--skip-ours", action="store_true", help="run only llama.cpp")
    args = p.parse_args()
    try:
        args.batches = sorted({int(b) for b in args.batches.split(",")})
    except ValueError:
        p.error(f"--batches takes comma-separated integers, got {args.batches!r}")
    if args.batches[0] < 1 or args.threads < 1 or args.rounds < 1:
        p.error(f"--batches, --threads and --rounds must be >= 1, got {args.batches}, {args.threads} and "
                f"{args.rounds}")
    args.formats = args.formats.split(",")
    for f in args.formats:
        if f not in FORMATS:
            p.error(f"--formats takes {', '.join(FORMATS)}, got {f!r}")
    args.forks = args.forks.split(",")
    if any(f not in llamacpp_build.FORKS for f in args.forks):
        p.error(f"--forks takes {', '.join(llamacpp_build.FORKS)}, got {args.forks}")
    args.models = args.models.split(",")
    for m in args.models:
        if m not in MODELS:
            p.error(f"--models takes {', '.join(MODELS)}, got {m!r}")
    return args


def main() -> None:
    # NOTE: before the first torch import (OpenMP reads it once); llama.cpp inherits the change.
    if os.environ.pop("OMP_WAIT_POLICY", None) is not None:
        print("note: OMP_WAIT_POLICY unset: benchmarks run without it", file=sys.stderr)
    args = parse_args()
    if args.depths:  # the depth table has its own script; this is its door from here
        file = next((f for f in args.formats if f in llamacpp_build.PRESETS), "q4_0")
        os.execv(sys.executable, [sys.executable, str(ROOT / "scripts" / "bench_depth.py"), "--llamacpp", "--forks", "llama.cpp,ik_llama.cpp",
                                  "--depths", args.depths, "--kv-cache-dtypes", "auto,int8", "--file", file,
                                  "--isa", args.isa])
    llamacpp_build.use_isa(args.isa)  # before torch starts and our kernels are built or loaded
    from nanovllm.kernels.cpu_kernels import MARCH_ENV
    from nanovllm.utils.default_model import cache_root
    cache = cache_root()
    report = {"threads": args.threads, "batches": args.batches, "llama_cpp_python": llamacpp_build.VERSION,
              "isa": args.isa, "our_march": os.environ.get(MARCH_ENV, "native"), "cpu_input_bits": args.input_bits,
              "our_env": {k: os.environ.get(k) for k in llamacpp_build.OUR_ISA_ENV["avx2"]}, "models": {}}
    try:
        # NOTE: built even with --skip-llamacpp when a quantized row runs: llama-quantize writes its file.
        need_build = not args.skip_llamacpp or any(q in FILE_ROWS for q in args.formats)
        bins = llamacpp_build.build_llamacpp(cache, jobs=os.cpu_count(), isa=args.isa) if need_build else None
        fork_bins = {fork: bins if fork == "llama.cpp" else
                     llamacpp_build.build_llamacpp(cache, jobs=os.cpu_count(), isa=args.isa, fork=fork)
                     for fork in (args.forks if not args.skip_llamacpp else [])}
        for name in args.models:
            path = model_folder(name)
            results = report["models"][name] = {"path": path, "threads": args.threads, "cpu_input_bits": args.input_bits}
            # NOTE: every figure is measured --rounds times, alternating llama.cpp and ours point by
            # point, and each engine's best counts: this VM's memory bandwidth drifts by a third over
            # minutes, and batch-1 decode follows it.
            points = [("decode", b) for b in args.batches] + [("prefill", PREFILL_LEN)]
            raw = results.setdefault("raw", {})
            for quant in args.formats:
                ours = None if args.skip_ours else next(key for key, ref in RATIOS.items() if ref == quant)
                gguf, our_source, our_dtype = sources(cache, bins, name, path, quant)
                if args.skip_llamacpp:
                    gguf_run = None
                else:
                    gguf_run = gguf
                if gguf_run is None and ours is None:
                    continue
                # every fork on the quantized files (ik_llama.cpp only there: the files of its users)
                runs = {fork: gguf_run for fork in args.forks if fork == "llama.cpp" or quant in FILE_ROWS}
                engines = [label(fork_key(fork, quant)) for fork, g in runs.items() if g is not None]
                engines += [LABELS[ours]] if ours is not None else []
                print(f"{' vs '.join(engines)}: {our_source if ours else gguf} ...", flush=True)
                llm = start_ours(our_source, args.batches, args.threads, our_dtype, args.input_bits) if ours else None
                if llm is not None:
                    keep_rss(results, ours, RSS_COLUMNS[0], rss_mib())
                    # the bandwidth view: bytes per token and the read bandwidth, measured now, beside the figures
                    results["floor"] = {**results.get("floor", {}), ours: {
                        "bytes_per_token": per_token_bytes(llm), "read_bandwidth": measured_read_bandwidth(args.threads)}}
                rng = random.Random(0)
                try:
                    for point in points:
                        for _ in range(args.rounds):
                            for fork, fork_gguf in runs.items():
                                if fork_gguf is None:
                                    continue
                                key = fork_key(fork, quant)
                                try:
                                    rate, rss = llamacpp_point(fork_bins[fork], fork_gguf, point, args.threads,
                                                               llamacpp_build.work_dir(cache, fork) / "logs",
                                                               raw.setdefault(key, []), fork)
                                    keep_best(results, key, point, rate)
                                    if point == ("decode", args.batches[0]):
                                        keep_rss(results, key, RSS_COLUMNS[0], rss)
                                    if point == ("decode", args.batches[-1]):
                                        keep_rss(results, key, RSS_COLUMNS[1], rss)
                                except BuildError as e:  # a crashed run: this format's other figures are skipped
                                    print(f"error: {e}\n(no more {label(key)} figures)", file=sys.stderr)
                                    results.setdefault("failed", {})[key] = str(e)
                                    runs[fork] = None
                            if llm is not None:
                                keep_best(results, ours, point, ours_point(llm, point, rng, raw.setdefault(ours, [])))
                                if point == ("decode", args.batches[-1]):
                                    keep_rss(results, ours, RSS_COLUMNS[1], rss_mib())
                finally:
                    if llm is not None:
                        llm.exit()
                        del llm
                        gc.collect()
            print("\n" + table(f"{name}: {Path(path).name}", results, args.batches) + "\n", flush=True)
            if args.perplexity:
                print(perplexity_table(cache, bins, name, path, args, results) + "\n", flush=True)
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
