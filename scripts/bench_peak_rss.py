"""Peak memory of loading a GGUF file and generating 64 tokens after a 64-token prompt at a
2048-token context, ours against llama.cpp's on the same file: each engine in a process of its own
under `/usr/bin/time -v` (its "Maximum resident set size"), one after the other.

    python scripts/bench_peak_rss.py FILE.gguf [FILE.gguf ...] [--threads 2] [--context 2048]

llama.cpp runs as llama-batched-bench -c CONTEXT -npp 64 -ntg 64 -npl 1 (its f16 KV cache of the
whole context, cleared at start-up, is in its figure); ours as `LLM(file, max_model_len=CONTEXT,
max_num_seqs=1)` and one greedy request of 64 tokens (our cache's pages count as they are touched).
llama.cpp is the build scripts/llamacpp_build.py caches (bench_llamacpp.py builds it once).
"""
import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

OURS = """
import sys
from nanovllm import LLM, SamplingParams
llm = LLM(sys.argv[1], max_model_len=int(sys.argv[2]), max_num_seqs=1)
prompt = [[(7 * i) % 1000 + 100 for i in range(64)]]
out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
assert len(out[0]["token_ids"]) == 64
print("weights held", llm.llm_engine.model_runner.weight_bytes)
"""


def peak_mib(cmd: list[str], env: dict) -> float:
    """The command's maximum resident set (MiB) by /usr/bin/time -v; RuntimeError if it fails."""
    out = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, env=env, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed ({out.returncode}): {out.stderr[-2000:]}")
    return int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", out.stderr).group(1)) / 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--context", type=int, default=2048)
    args = p.parse_args()
    if not os.path.exists("/usr/bin/time"):
        raise SystemExit("needs /usr/bin/time (apt install time)")
    import llamacpp_build
    sys.path.insert(0, str(ROOT))
    from nanovllm.utils.cache import cache_root
    bins = llamacpp_build.build_llamacpp(cache_root(), jobs=os.cpu_count())
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    lib_env = {**env, "LD_LIBRARY_PATH": str(Path(bins["llama-batched-bench"]).parent)}
    print("| file | llama.cpp peak MiB | ours peak MiB | ours / llama.cpp |\n|---|---|---|---|")
    for f in args.files:
        theirs = peak_mib([str(bins["llama-batched-bench"]), "-m", f, "-c", str(args.context), "-npp", "64",
                           "-ntg", "64", "-npl", "1", "-t", str(args.threads)], lib_env)
        ours = peak_mib([sys.executable, "-c", OURS, f, str(args.context)],
                        {**env, "OMP_NUM_THREADS": str(args.threads)})
        print(f"| {os.path.basename(f)} | {theirs:.0f} | {ours:.0f} | {ours / theirs:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
