"""Soak an OpenAI-compatible nano-vLLM server: many requests of random sizes, `n`, sampling options and
streaming, a share of them dropped by the client at a random point, then a report: answers by
status, dropped and failed requests, what the server still holds (running, waiting, KV use, from
/metrics), its RSS before and after, and whether a fixed greedy request still gives the same text.

    python scripts/soak.py [--url URL --model NAME] [--requests 500] [--concurrency 16] [--seed 0]

Without --url it starts `nanovllm serve --kvcache-prefault` on the default model (127.0.0.1, a free
port) and stops it after; a server of your own should prefault its KV cache too, or its RSS grows
as blocks are first used. Exit status 0 when nothing was lost (every answer a 200 or a dropped stream, the server back
to 0 running / 0 waiting / KV 0, the fixed text unchanged, RSS within 15%), else 1.
tests/server/test_soak.py runs the same soak, short, against an in-process server.
"""
import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import time
from collections import Counter

WORDS = ("the quick brown fox jumps over a lazy dog while seven small birds sing about rivers mountains "
         "and the long road home").split()
FIXED = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}
RSS_SLACK = 0.15


def random_request(rng: random.Random, model: str) -> tuple[dict, int | None]:
    """(a /v1/completions body, the chunk after which the client hangs up, or None)."""
    body = {"model": model, "prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 120))),
            "max_tokens": rng.randint(1, 64), "n": rng.choice((1, 1, 1, 2, 3)),
            "temperature": rng.choice((0.0, 0.7, 1.0)), "seed": rng.randrange(1 << 30)}
    if rng.random() < 0.3:
        body["top_p"] = rng.choice((0.5, 0.9))
    if rng.random() < 0.3:
        body["top_k"] = rng.choice((1, 5, 50))
    if rng.random() < 0.2:
        body["ignore_eos"] = True
    body["stream"] = rng.random() < 0.7
    drop = rng.randint(0, 8) if body["stream"] and rng.random() < 0.4 else None
    return body, drop


async def one(client, url: str, body: dict, drop: int | None, tally: Counter) -> None:
    try:
        if not body["stream"]:
            r = await client.post(url + "/v1/completions", json=body)
            tally[f"status {r.status_code}"] += 1
            return
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            tally[f"status {r.status_code}"] += 1
            chunks = 0
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"error"' in line:
                    tally["stream error events"] += 1
                chunks += line.startswith("data: ")
                if drop is not None and chunks > drop:
                    tally["dropped by the client"] += 1
                    return  # leaving the block closes the connection mid-stream
    except Exception as e:  # noqa: BLE001 - a transport failure is a finding, reported
        tally[f"client error {type(e).__name__}"] += 1


async def soak(url: str, model: str, requests: int, concurrency: int, seed: int) -> Counter:
    """Run the requests, at most concurrency at once; the tally of what came back."""
    import httpx

    rng = random.Random(seed)
    tally: Counter = Counter()
    work = [random_request(rng, model) for _ in range(requests)]
    gate = asyncio.Semaphore(concurrency)

    async def gated(body, drop):
        async with gate:
            await one(client, url, body, drop, tally)
    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(*(gated(body, drop) for body, drop in work))
    return tally


def gauges(url: str) -> dict[str, float]:
    import httpx
    wanted = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in wanted:
            out[name] = float(line.rsplit(" ", 1)[1])
    return out


def settled_gauges(url: str, timeout_s: float = 30.0) -> dict[str, float]:
    """/metrics' gauges once nothing runs or waits (aborts reach the engine a moment after a hang-up)."""
    deadline = time.monotonic() + timeout_s
    while True:
        g = gauges(url)
        if (g.get("vllm:num_requests_running", 1) == 0 and g.get("vllm:num_requests_waiting", 1) == 0
                and g.get("vllm:kv_cache_usage_perc", 1) == 0) or time.monotonic() > deadline:
            return g
        time.sleep(0.1)


def fixed_text(url: str, model: str) -> str:
    import httpx
    r = httpx.post(url + "/v1/completions", json={"model": model, **FIXED}, timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run(url: str, model: str, requests: int, concurrency: int, seed: int, pid: int) -> dict:
    """The whole soak with its before / after checks; the report (its "lost" list empty when nothing was)."""
    before_text = fixed_text(url, model)
    # Warm-up (half as many requests): the RSS baseline is taken with the buffers a soak grows to.
    asyncio.run(soak(url, model, max(2 * concurrency, requests // 2), concurrency, seed + 1))
    settled_gauges(url)
    rss_before = rss_mib(pid)
    start = time.perf_counter()
    tally = asyncio.run(soak(url, model, requests, concurrency, seed))
    took = time.perf_counter() - start
    after = settled_gauges(url)
    rss_after = rss_mib(pid)
    after_text = fixed_text(url, model)
    lost = [f"{k}: {v}" for k, v in tally.items() if k.startswith("client error") or
            (k.startswith("status") and k != "status 200") or k == "stream error events"]
    lost += [f"{k} = {v} after the soak" for k, v in after.items() if v != 0]
    if after_text != before_text:
        lost.append(f"the fixed request's text changed: {before_text!r} -> {after_text!r}")
    if not rss_after <= rss_before * (1 + RSS_SLACK):
        lost.append(f"RSS grew {rss_before:.0f} -> {rss_after:.0f} MiB (over {RSS_SLACK:.0%})")
    return {"requests": requests, "concurrency": concurrency, "seconds": round(took, 1), "tally": dict(tally),
            "gauges_after": after, "rss_mib": [round(rss_before, 1), round(rss_after, 1)], "lost": lost}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url")
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--pid", type=int, help="the server's pid for its RSS (default: the one this script starts)")
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    proc = None
    if args.url is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        # NOTE: --kvcache-prefault: the KV cache's pages are mapped at start; otherwise the RSS grows
        # by itself as the block allocator reaches blocks never used before, up to the whole cache.
        proc = subprocess.Popen([sys.executable, "-m", "nanovllm.cli", "serve", "--port", str(port), "--kvcache-prefault",
                                 "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        args.url, args.pid = f"http://127.0.0.1:{port}", proc.pid
        import httpx
        for _ in range(600):
            try:
                if httpx.get(args.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None:
                print("the server did not start", file=sys.stderr)
                return 1
            time.sleep(0.5)
    if args.pid is None:
        p.error("--pid is needed with --url (the server's RSS is part of the report)")
    try:
        report = run(args.url, args.model, args.requests, args.concurrency, args.seed, args.pid)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    print(json.dumps(report, indent=2))
    return 1 if report["lost"] else 0


if __name__ == "__main__":
    sys.exit(main())
