"""How the OpenMP wait setting holds up when the cores are shared: seconds to generate 32 tokens for
one prompt (greedy, ignore_eos, after a warm-up), on an idle machine, beside one busy loop per core,
and beside a second engine decoding without pause, for each wait setting in one run.

    python scripts/bench_threads.py [--model DIR_OR_GGUF] [--repeats N] [--tokens N] [--spins 1000,...]

Settings: libgomp's own default (GOMP_SPINCOUNT=300000, what it does with neither variable set),
OMP_WAIT_POLICY=PASSIVE, and the engine's default (nothing set: nanovllm/utils/threads.py). Every
measurement is a fresh process; the competing processes start first and run until it ends.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

SETTINGS = {"libgomp default": {"GOMP_SPINCOUNT": "300000"},
            "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
            "engine default": {}}
LOADS = ("idle", "busy loop per core", "second engine")

ENGINE = r"""
import sys, time
from nanovllm import LLM, SamplingParams
model, tokens, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = LLM.default() if model == "default" else LLM(model)
sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
llm.generate(["Warm up"], sp, use_tqdm=False)
if repeats == 0:  # the competing engine: decode until killed
    print("ready", flush=True)
    while True:
        llm.generate(["The quick brown fox"], sp, use_tqdm=False)
for _ in range(repeats):
    t = time.perf_counter()
    llm.generate(["The capital of France is"], sp, use_tqdm=False)
    print(f"{time.perf_counter() - t:.4f}", flush=True)
"""


def environment(setting: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(setting)
    return env


def start_load(load: str, env: dict[str, str], model: str, tokens: int) -> list[subprocess.Popen]:
    if load == "busy loop per core":
        return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count())]
    if load == "second engine":
        proc = subprocess.Popen([sys.executable, "-c", ENGINE, model, str(tokens), "0"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the competing engine did not start")
        return [proc]
    return []


def measure(setting: dict[str, str], load: str, model: str, tokens: int, repeats: int) -> list[float]:
    env = environment(setting)
    others = start_load(load, env, model, tokens)
    try:
        time.sleep(1)
        out = subprocess.run([sys.executable, "-c", ENGINE, model, str(tokens), str(repeats)], env=env,
                             capture_output=True, text=True, check=True).stdout
        return [float(x) for x in out.split()]
    finally:
        for p in others:
            p.kill()
            p.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--spins", default="", help="comma-separated GOMP_SPINCOUNT values to add as settings")
    args = p.parse_args()
    settings = dict(SETTINGS)
    for spins in filter(None, args.spins.split(",")):
        settings[f"GOMP_SPINCOUNT={spins}"] = {"GOMP_SPINCOUNT": spins}
    print(f"{args.tokens} tokens, one prompt, {os.cpu_count()} cores; median (max) seconds of {args.repeats}\n")
    print("| setting | " + " | ".join(LOADS) + " |")
    print("|---|" + "---|" * len(LOADS))
    for name, setting in settings.items():
        cells = []
        for load in LOADS:
            times = measure(setting, load, args.model, args.tokens, args.repeats)
            cells.append(f"{statistics.median(times):.2f} ({max(times):.2f})")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
