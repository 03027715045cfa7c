"""Speculative decoding on real text, the default model: decode speed with speculation off, with
n-gram lookup and with a draft model, at one sequence and at 8, and llama.cpp's own speculation
(llama-lookup, llama-speculative) on the same files and requests.

    python scripts/bench_speculative.py [--max-tokens 256] [--k 4] [--batch 1,8] [--skip-llamacpp]
                                        [--isa native|avx2] [--json FILE]

Files (both engines read the same two): the target is the default model (SmolLM2-135M-Instruct) as
llama.cpp's own converter writes it from the default model's folder, F16 (--target f16, the
default) or Q8_0 (--target q8_0, through llama-quantize); the draft is the model's shipped Q4_1
file (a lower-bit file of the same model, the one LLM.default() runs on a CPU).

Requests, each in the model's chat template:
  (a) copy-heavy: "rewrite this with the typos fixed" over paragraphs of tests/data/english.txt
      (typos put in by a seeded hand rule), and "add a docstring to this function" over functions
      of Python's standard library as installed on this machine;
  (b) open questions.
Greedy decoding, up to --max-tokens tokens per request (the model's end of turn ends it earlier).

Our three engines (off, ngram, draft) are built side by side and take turns: request by request
at one sequence, round by round (--rounds, the best kept) at 8. One sequence: each request alone;
decode tok/s = tokens after the first / time from the first
token to the last (prefill excluded, as llama.cpp's tools report it); the figure per engine is
the tokens of all requests over their summed decode time. 8 sequences: the set's requests in one
generate() call (8 at once), output tok/s over its wall time (prefill included: the same for
every method). Our greedy outputs with speculation are checked token-identical to those without.
llama.cpp's tools decode one sequence at a time; their "decoded N tokens in S seconds" is taken
as is. Run without OMP_WAIT_POLICY=PASSIVE (this script unsets it), nothing else heavy running.
"""
import argparse
import inspect
import json
import os
import random
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
os.environ.pop("OMP_WAIT_POLICY", None)

import llamacpp_build  # noqa: E402

STDLIB_FUNCTIONS = ("textwrap.dedent", "colorsys.rgb_to_hls", "ftplib.parse227", "difflib.get_close_matches")
QUESTIONS = ("Why is the sky blue?", "Explain how a bicycle stays upright when it moves.",
             "What are three good habits for learning a new language?", "Write a short poem about the sea.",
             "How does a refrigerator keep food cold?", "What should I pack for a weekend hiking trip?",
             "Why do we have seasons on Earth?", "Give me some ideas for a rainy afternoon at home.")


def with_typos(text: str, rng: random.Random, rate: float = 0.06) -> str:
    """Swap two neighbouring letters in about `rate` of the words (longer than three letters)."""
    words = text.split(" ")
    for i, w in enumerate(words):
        if len(w) > 3 and w.isalpha() and rng.random() < rate * 4:
            j = rng.randrange(1, len(w) - 2)
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


def stdlib_source(name: str) -> str:
    import importlib
    module, func = name.rsplit(".", 1)
    source = inspect.getsource(getattr(importlib.import_module(module), func))
    # Drop the existing docstring: the request is to write one.
    return re.sub(r'(\):\n)(\s+)(?:"""|\'\'\')(?:.|\n)*?(?:"""|\'\'\')\n', r"\1", source, count=1)


def requests() -> dict[str, list[str]]:
    rng = random.Random(0)
    paragraphs = [p.strip() for p in (ROOT / "tests" / "data" / "english.txt").read_text().split("\n\n") if p.strip()]
    paragraphs = [" ".join(p.split(" ")[:90]) for p in paragraphs][:4]
    copy = [f"Rewrite this paragraph with the typos fixed. Reply with the paragraph only.\n\n{with_typos(p, rng)}"
            for p in paragraphs]
    copy += [f"Add a docstring to this Python function. Reply with the whole function.\n\n```python\n"
             f"{stdlib_source(name)}```" for name in STDLIB_FUNCTIONS]
    return {"copy-heavy (a)": copy, "open questions (b)": list(QUESTIONS)}


def current_rss_gib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 2**20


def run_ours(target: str, draft: str, prompts: dict[str, list[list[int]]], args) -> dict:
    """Per method, per request set: one-sequence decode tok/s, 8-sequence tok/s, outputs, metrics.
    The three engines live side by side and take turns request by request (one sequence) and
    round by round (8 sequences), so the machine's drift over minutes falls on all of them alike."""
    from nanovllm import LLM, SamplingParams
    methods = {"off": None,
               "ngram": {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4,
                         "prompt_lookup_min": 2},
               "draft": {"method": "draft_model", "model": draft, "num_speculative_tokens": args.k}}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    engines, results = {}, {}
    for method, spec in methods.items():
        before = current_rss_gib()
        engines[method] = LLM(target, max_model_len=2048, max_num_seqs=max(args.batch), speculative_config=spec,
                              kvcache_prefault=True)
        engines[method].generate([prompts["copy-heavy (a)"][0]], SamplingParams(temperature=0, max_tokens=8),
                                 use_tqdm=False)
        results[method] = {"rss_added_gib": current_rss_gib() - before}

    def spec_counts(llm) -> dict | None:
        return llm.llm_engine.speculator.metrics.as_dict() if llm.llm_engine.speculator else None

    for name, ps in prompts.items():
        rows = {method: results[method].setdefault(name, {}) for method in methods}
        counts = {method: [0, 0, 0, 0] for method in methods}  # drafted, accepted, emitted, verifications

        def run(method, fn):
            llm = engines[method]
            before = spec_counts(llm)
            value = fn(llm)
            after = spec_counts(llm)
            if after is not None:
                for i, key in enumerate(("num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens", "num_drafts")):
                    counts[method][i] += after[key] - before[key]
            return value

        def one(llm, p):
            times, ids = [], []
            for delta in llm.generate_stream([p], params):
                times.append(time.perf_counter())
                ids += delta.token_ids
            return ids, times[-1] - times[0]

        def eight(llm):
            start = time.perf_counter()
            out = llm.generate(ps[:8], params, use_tqdm=False)
            return [o["token_ids"] for o in out], time.perf_counter() - start

        if 1 in args.batch:
            totals = {method: [0, 0.0, []] for method in methods}
            for p in ps:
                for method in methods:
                    ids, seconds = run(method, lambda llm: one(llm, p))
                    totals[method][0] += len(ids) - 1
                    totals[method][1] += seconds
                    totals[method][2].append(ids)
            for method, (tokens, seconds, outputs) in totals.items():
                rows[method].update(batch1_tok_s=tokens / seconds, outputs=outputs)
        if 8 in args.batch:
            for _ in range(args.rounds):
                for method in methods:
                    outputs, seconds = run(method, eight)
                    speed = sum(map(len, outputs)) / seconds
                    rows[method]["batch8_tok_s"] = max(speed, rows[method].get("batch8_tok_s", 0.0))
                    rows[method]["outputs8"] = outputs
        for method in methods:
            drafted, accepted, emitted, verifications = counts[method]
            if engines[method].llm_engine.speculator:
                rows[method]["acceptance"] = accepted / drafted if drafted else 0.0
                rows[method]["emitted_per_verification"] = emitted / verifications if verifications else 0.0
            print(f"ours {method:6} {name:20} " + " ".join(
                f"{k}={v:.3f}" for k, v in rows[method].items() if isinstance(v, float)), flush=True)
    for method, llm in engines.items():
        if llm.llm_engine.speculator:
            print(f"  {method}: " + llm.llm_engine.speculator.metrics.summary(), flush=True)
        llm.exit()
    return results


SPEED = re.compile(r"decoded\s+(\d+)\s+tokens in\s+([\d.]+)\s+seconds")
ACCEPT = re.compile(r"accept\s*=\s*([\d.]+)%")


def run_llamacpp(bins: dict, target: Path, draft: Path, texts: dict[str, list[str]], args) -> dict:
    """llama-lookup (n-gram from the context) and llama-speculative (draft model), greedy, one
    request at a time; the tools' own decode figures summed over each set."""
    from nanovllm.utils.cache import cache_root
    logs = llamacpp_build.work_dir(cache_root()) / "logs"
    threads = str(os.cpu_count())
    common = ["-n", str(args.max_tokens), "--temp", "0", "-t", threads, "-c", "2048", "-fa", "on"]
    tools = {"ngram (llama-lookup)": [str(bins["llama-lookup"]), "-m", str(target), "--spec-draft-n-max", str(args.k)],
             "draft (llama-speculative)": [str(bins["llama-speculative"]), "-m", str(target), "-md", str(draft),
                                           "--spec-draft-n-max", str(args.k), "--spec-draft-n-min", "0", "-td", threads]}
    results: dict = {}
    for tool, cmd in tools.items():
        for name, prompts in texts.items():
            tokens, seconds, accepts = 0, 0.0, []
            for i, prompt in enumerate(prompts):
                log = logs / f"spec-{tool.split()[0]}-{name[:4]}-{i}.log"
                llamacpp_build.run_step(f"{tool} on request {i}", [*cmd, *common, "-p", prompt], log, cwd=logs)
                text = log.read_text(errors="replace")
                found = SPEED.findall(text)
                if not found:
                    raise llamacpp_build.BuildError(f"{tool}: no 'decoded N tokens in S seconds' in {log}")
                n, s = found[-1]
                tokens, seconds = tokens + int(n), seconds + float(s)
                accepts += [float(a) for a in ACCEPT.findall(text)[-1:]]
            results.setdefault(tool, {})[name] = {"batch1_tok_s": tokens / seconds,
                                                  "acceptance": sum(accepts) / len(accepts) / 100 if accepts else None}
            print(f"{tool:26} {name:20} {results[tool][name]}", flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens (llama.cpp: --draft-max)")
    p.add_argument("--batch", default="1,8", help="1, 8 or both")
    p.add_argument("--target", default="f16", choices=["f16", "q8_0"], help="the target's file (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="8-sequence runs per engine, the best kept (default: %(default)s)")
    p.add_argument("--skip-llamacpp", action="store_true")
    p.add_argument("--isa", default="native", choices=["native", "avx2"])
    p.add_argument("--json", help="write every figure (and our outputs) here")
    args = p.parse_args()
    args.batch = [int(b) for b in args.batch.split(",")]
    llamacpp_build.use_isa(args.isa)

    from nanovllm.utils.cache import cache_root
    from nanovllm.utils.default_model import default_model, default_model_path
    from nanovllm.loader.checkpoint import Checkpoint
    cache = cache_root()
    bins = llamacpp_build.build_llamacpp(cache, isa=args.isa)
    folder = default_model_path()
    if args.target == "f16":
        target = llamacpp_build.convert_to_gguf(cache, folder, "SmolLM2-135M-Instruct", "f16")
    else:
        f32 = llamacpp_build.convert_to_gguf(cache, folder, "SmolLM2-135M-Instruct", "f32")
        target = llamacpp_build.quantize_gguf(cache, bins, f32, "q8_0")
    draft = Path(default_model())
    print(f"target {target}\ndraft  {draft}", flush=True)

    tokenizer = Checkpoint(str(target)).load_tokenizer()
    texts = {name: [tokenizer.apply_chat_template([{"role": "user", "content": r}], add_generation_prompt=True,
                                                  tokenize=False) for r in rs]
             for name, rs in requests().items()}
    prompts = {name: [tokenizer.encode(t, add_special_tokens=False) for t in ts] for name, ts in texts.items()}
    for name, ps in prompts.items():
        print(f"{name}: {len(ps)} requests, prompts of {min(map(len, ps))}-{max(map(len, ps))} tokens", flush=True)

    ours = run_ours(str(target), str(draft), prompts, args)
    theirs = {} if args.skip_llamacpp else run_llamacpp(bins, target, draft, texts, args)

    for method in ("ngram", "draft"):
        for name in prompts:
            for key in ("outputs", "outputs8"):
                if key in ours["off"][name] and ours[method][name][key] != ours["off"][name][key]:
                    print(f"WARNING: {method} {name} {key} differ from speculation off", flush=True)
    print(f"\ntarget {target.name}, draft {draft.name}; {args.isa} build, {os.cpu_count()} threads, "
          f"up to {args.max_tokens} tokens, k={args.k}\n")
    print("| engine / method | set | 1 seq decode tok/s | x off | 8 seqs tok/s | x off | acceptance |")
    print("|---|---|---|---|---|---|---|")
    for method, rows in ours.items():
        for name in prompts:
            row, off = rows[name], ours["off"][name]
            one = row.get("batch1_tok_s")
            eight = row.get("batch8_tok_s")
            acc = row.get("acceptance")
            print(f"| ours {method} | {name} | {one or 0:.1f} | {(one or 0) / off.get('batch1_tok_s', 1):.2f} | "
                  f"{eight or 0:.1f} | {(eight or 0) / off.get('batch8_tok_s', 1):.2f} | "
                  f"{'' if acc is None else f'{100 * acc:.0f}%'} |")
    for tool, rows in theirs.items():
        for name in prompts:
            row = rows[name]
            acc = row["acceptance"]
            print(f"| llama.cpp {tool} | {name} | {row['batch1_tok_s']:.1f} | | | | "
                  f"{'' if acc is None else f'{100 * acc:.0f}%'} |")
    print("\nRSS each engine added (GiB): " + ", ".join(f"{m} {rows['rss_added_gib']:.2f}" for m, rows in ours.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"ours": ours, "llama.cpp": theirs, "args": vars(args)}, indent=1))


if __name__ == "__main__":
    main()
