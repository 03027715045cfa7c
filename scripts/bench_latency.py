"""Latency under load: time to first token (TTFT) and inter-token latency (ITL) percentiles of
streamed completions at rising concurrency, each level run twice: alone, and with one client in
the mix that keeps sending a slow-to-prepare request (a prompt of --slow-mb MB, refused once
tokenized: over max_model_len) for the whole level.

    python scripts/bench_latency.py [--url URL --model NAME] [--concurrency 1,4,16] [--requests 4]
                                    [--max-tokens 64] [--slow-mb 7]

Without --url it starts `nanovllm serve` on the default model (127.0.0.1, a free port). Each of C
clients sends --requests streamed requests one after another (a random 64-word prompt, ignore_eos,
--max-tokens tokens, greedy); TTFT is request sent -> first chunk, ITL every gap between chunks
after it. Prints one markdown table (milliseconds; tok/s = generated tokens / the level's time).
"""
import argparse
import asyncio
import random
import socket
import statistics
import subprocess
import sys
import time

WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing about rivers".split()


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


async def level(url: str, model: str, clients: int, requests: int, max_tokens: int, slow_mb: float | None,
                seed: int) -> dict:
    import httpx
    rng = random.Random(seed)
    ttft, itl, tokens = [], [], 0
    done = asyncio.Event()

    async def client(http):
        nonlocal tokens
        for _ in range(requests):
            body = {"model": model, "prompt": " ".join(rng.choice(WORDS) for _ in range(64)), "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            sent = time.perf_counter()
            last = None
            async with http.stream("POST", url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    now = time.perf_counter()
                    if last is None:
                        ttft.append(now - sent)
                    else:
                        itl.append(now - last)
                    last = now
                    tokens += 1

    async def slow(http):
        body = {"model": model, "prompt": "fox " * int(slow_mb * 2**20 / 4), "max_tokens": 1}
        while not done.is_set():
            await http.post(url + "/v1/completions", json=body)  # a 400 once tokenized

    async with httpx.AsyncClient(timeout=600) as http:
        start = time.perf_counter()
        background = asyncio.create_task(slow(http)) if slow_mb else None
        await asyncio.gather(*(client(http) for _ in range(clients)))
        took = time.perf_counter() - start
        done.set()
        if background is not None:
            await background
    ms = [1e3 * v for v in ttft], [1e3 * v for v in itl]
    return {"ttft": [pct(ms[0], q) for q in (50, 90, 99)], "itl": [pct(ms[1], q) for q in (50, 90, 99)],
            "tok_s": tokens / took}


def start_server() -> tuple[subprocess.Popen, str]:
    import httpx
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "nanovllm.cli", "serve", "--port", str(port), "--kvcache-prefault",
                             "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    raise SystemExit("the server did not start")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url")
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--requests", type=int, default=4, help="streamed requests per client and level")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--slow-mb", type=float, default=7.0)
    args = p.parse_args()
    proc = None
    if args.url is None:
        proc, args.url = start_server()
    try:
        print("| clients | slow request in the mix | TTFT p50 / p90 / p99 (ms) | ITL p50 / p90 / p99 (ms) | tok/s |")
        print("|---|---|---|---|---|")
        for c in (int(x) for x in args.concurrency.split(",")):
            for slow in (None, args.slow_mb):
                r = asyncio.run(level(args.url, args.model, c, args.requests, args.max_tokens, slow, seed=c))
                mix = f"{slow:g} MB prompt" if slow else "none"
                print(f"| {c} | {mix} | {' / '.join(f'{v:.0f}' for v in r['ttft'])} | "
                      f"{' / '.join(f'{v:.1f}' for v in r['itl'])} | {r['tok_s']:.1f} |", flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
