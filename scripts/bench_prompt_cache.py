"""Time to first token behind a long shared prefix on a CPU, and what the KV offloading tier saves.

    python scripts/bench_prompt_cache.py [--prefix 8192] [--question 64] [--file q8_0] [--skip-llamacpp]
                                         [--skip-server] [--sessions 8 --turns 10 --context 6144
                                          --cache-sessions 3 [--tier-off-turns N]]

Model: bench.py's random-weight Qwen3-0.6B-shaped checkpoint as llama-quantize's --file (both engines
load that file). Each request: the same --prefix random token ids (an agent's preamble), then a
--question of its own (random ids); one token asked (max_tokens 1: the answer's time is its first
token's).

Server rows (`nanovllm serve --kv-offloading-dir`): cold; a second question (the prefix warm in the
engine's RAM cache); the server stopped (SIGTERM), started again (its start-up timed apart), and a
third question (the prefix read from the directory). llama-server on the same file and prompts (-c,
-t, -np 1, flash attention): cold; a second question (its own prompt cache); POST
/slots/0?action=save, the server restarted with the same --slot-save-path, POST
/slots/0?action=restore, then the third question: the restore call counts toward its first token.
Both engines' caches are mapped at start-up (llama.cpp clears its cache; ours --kvcache-prefault).

--sessions: an agent workload through one engine (LLM, offline): SESSIONS sessions, each with its own
--context random tokens, take --turns turns in a round (session 1 turn 1, session 2 turn 1, ...); a
turn appends 32 tokens (the tool's or the user's message) and generates 16, which join the context. The
engine's cache holds --cache-sessions sessions' tokens, so each session's prefix is evicted before its
next turn: with the tier on, the prefix is read back; off, it is prefilled again. Prefix-hit rate =
cached prompt tokens / prompt tokens. --tier-off-turns runs fewer turns with the tier off (each of its
turns costs a whole prefill).

Threads: the machine's cores (run with nothing else heavy, without OMP_WAIT_POLICY=PASSIVE).
"""
import argparse
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

TURN_TOKENS, TURN_ANSWER = 32, 16


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefix", type=int, default=8192)
    p.add_argument("--question", type=int, default=64)
    p.add_argument("--file", default="q8_0", help="llama-quantize preset of the file both engines load")
    p.add_argument("--skip-llamacpp", action="store_true")
    p.add_argument("--skip-server", action="store_true", help="only --sessions")
    p.add_argument("--sessions", type=int, default=0, help="agent sessions (0: no session workload)")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--tier-off-turns", type=int, default=None, help="turns with the tier off (default --turns)")
    p.add_argument("--context", type=int, default=6144)
    p.add_argument("--cache-sessions", type=int, default=3, help="sessions' tokens the engine's cache holds")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, url: str, timeout: float = 600) -> float:
    """Seconds until url/health answers 200."""
    import httpx
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}); see its log")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.perf_counter() - start
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the server did not come up")


def timed_post(url: str, body: dict) -> tuple[float, dict]:
    import httpx
    start = time.perf_counter()
    response = httpx.post(url, json=body, timeout=3600)
    seconds = time.perf_counter() - start
    if response.status_code != 200:
        raise RuntimeError(f"{url}: {response.status_code} {response.text[:300]}")
    return seconds, response.json()


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def our_server_rows(gguf: Path, prompts: list[list[int]], max_len: int, work: Path) -> list[tuple]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "nanovllm.cli", "serve", str(gguf), "--port", str(port), "--served-model-name", "m",
           "--max-model-len", str(max_len), "--max-num-seqs", "1", "--log-level", "warning", "--kvcache-prefault",
           "--kv-offloading-dir", str(work / "tier"), "--kv-offloading-dir-size", "8"]

    def body(i: int) -> dict:
        return {"model": "m", "prompt": prompts[i], "max_tokens": 1, "temperature": 0}
    log = open(work / "ours.log", "ab")
    rows = []
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        wait_ready(proc, url)
        cold, out = timed_post(url + "/v1/completions", body(0))
        rows.append(("nano-vLLM", "cold", cold, out["usage"]["prompt_tokens_details"]["cached_tokens"]))
        warm, out = timed_post(url + "/v1/completions", body(1))
        rows.append(("nano-vLLM", "a second question (the prefix warm in RAM)", warm,
                     out["usage"]["prompt_tokens_details"]["cached_tokens"]))
        time.sleep(2)  # the tier's writes are asynchronous; a restart finds those done
    finally:
        stop(proc)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        ready = wait_ready(proc, url)
        after, out = timed_post(url + "/v1/completions", body(2))
        rows.append(("nano-vLLM", f"after a restart: a third question, the prefix from the tier's directory "
                     f"(start-up {ready:.1f} s apart)",
                     after, out["usage"]["prompt_tokens_details"]["cached_tokens"]))
    finally:
        stop(proc)
    return rows


def llama_server_rows(server: Path, gguf: Path, prompts: list[list[int]], max_len: int, work: Path) -> list[tuple]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    slots = work / "slots"
    slots.mkdir(exist_ok=True)
    threads = str(os.cpu_count())
    cmd = [str(server), "-m", str(gguf), "-c", str(max_len), "-t", threads, "-tb", threads, "-np", "1",
           "--port", str(port), "--slot-save-path", str(slots), "-fa", "on", "--no-webui"]

    def body(i: int) -> dict:
        return {"prompt": prompts[i], "n_predict": 1, "temperature": 0, "cache_prompt": True}
    log = open(work / "llama-server.log", "ab")
    rows = []
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(proc, url)
        cold, out = timed_post(url + "/completion", body(0))
        rows.append(("llama-server", "cold", cold, out.get("timings", {}).get("cache_n", "")))
        warm, out = timed_post(url + "/completion", body(1))
        rows.append(("llama-server", "a second question (its prompt cache)", warm,
                     out.get("timings", {}).get("cache_n", "")))
        save, _ = timed_post(url + "/slots/0?action=save", {"filename": "prefix.bin"})
        rows.append(("llama-server", "POST /slots/0?action=save", save, ""))
    finally:
        stop(proc)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        ready = wait_ready(proc, url)
        restore, _ = timed_post(url + "/slots/0?action=restore", {"filename": "prefix.bin"})
        after, out = timed_post(url + "/completion", body(2))
        rows.append(("llama-server", f"after a restart: restore {restore:.2f} s + a third question "
                     f"(start-up {ready:.1f} s apart)", restore + after, out.get("timings", {}).get("cache_n", "")))
    finally:
        stop(proc)
    return rows


def sessions_row(gguf: Path, args, tier: bool, turns: int, work: Path) -> tuple:
    from nanovllm import LLM, SamplingParams
    from nanovllm.loader.checkpoint import Checkpoint
    hf = Checkpoint(str(gguf)).hf_config
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    token_bytes = hf.num_hidden_layers * 2 * hf.num_key_value_heads * head_dim * 2  # f16 K and V
    session_len = args.context + args.turns * (TURN_TOKENS + TURN_ANSWER) + 16
    options = dict(max_model_len=session_len + 64, max_num_seqs=1,
                   cpu_kvcache_bytes=args.cache_sessions * session_len * token_bytes)
    if tier:
        shutil.rmtree(work / "sessions-tier", ignore_errors=True)
        options.update(kv_offloading_dir=str(work / "sessions-tier"), kv_offloading_dir_size=64)
    rng = random.Random(args.seed + 1)
    contexts = [[rng.randrange(1000, 100000) for _ in range(args.context)] for _ in range(args.sessions)]
    params = SamplingParams(temperature=0, max_tokens=TURN_ANSWER, ignore_eos=True)
    llm = LLM(str(gguf), **options)
    prompt_tokens = cached = 0
    start = time.perf_counter()
    for _ in range(turns):
        for context in contexts:
            context += [rng.randrange(1000, 100000) for _ in range(TURN_TOKENS)]
            deltas = list(llm.generate_stream([context], params))  # the deltas carry the cached count
            prompt_tokens += len(context)
            cached += deltas[-1].num_cached_tokens
            context += [token for delta in deltas for token in delta.token_ids]
    total = time.perf_counter() - start
    llm.llm_engine.exit()
    return ("on" if tier else "off", turns, prompt_tokens, cached / prompt_tokens, total)


def main() -> None:
    os.environ.pop("OMP_WAIT_POLICY", None)
    args = parse_args()
    import llamacpp_build
    import bench
    from nanovllm.utils.cache import cache_root
    path = bench.random_qwen3_checkpoint()
    bins = llamacpp_build.build_llamacpp(cache_root())
    source = llamacpp_build.convert_to_gguf(cache_root(), path, Path(path).name, "f32")
    gguf = llamacpp_build.quantize_gguf(cache_root(), bins, source, args.file)
    rng = random.Random(args.seed)
    prefix = [rng.randrange(1000, 100000) for _ in range(args.prefix)]
    prompts = [prefix + [rng.randrange(1000, 100000) for _ in range(args.question)] for _ in range(3)]
    max_len = args.prefix + args.question + 64
    work = Path(tempfile.mkdtemp(prefix="bench-prompt-cache-"))
    print(f"model {gguf.name}; prompt {args.prefix} + {args.question} tokens; {os.cpu_count()} threads; "
          f"logs and files in {work}", flush=True)
    if not args.skip_server:
        rows = our_server_rows(gguf, prompts, max_len, work)
        if not args.skip_llamacpp:
            rows += llama_server_rows(bins["llama-server"], gguf, prompts, max_len, work)
        print("\n| engine | request | time to first token (s) | prompt tokens cached |\n|---|---|---|---|")
        for engine, what, seconds, cached in rows:
            print(f"| {engine} | {what} | {seconds:.2f} | {cached} |", flush=True)
    if args.sessions:
        print(f"\n{args.sessions} sessions of {args.context} tokens, {TURN_TOKENS} in and {TURN_ANSWER} out a "
              f"turn; the cache holds {args.cache_sessions} sessions\n\n"
              "| tier | turns | prompt tokens | prefix-hit rate | total (s) | per turn (s) |\n|---|---|---|---|---|---|")
        for tier, turns in ((True, args.turns), (False, args.tier_off_turns or args.turns)):
            name, turns, tokens, rate, total = sessions_row(gguf, args, tier, turns, work)
            print(f"| {name} | {turns} | {tokens} | {rate:.1%} | {total:.0f} | {total / (turns * args.sessions):.1f} |",
                  flush=True)
    for big in ("tier", "sessions-tier", "slots"):  # the caches both engines wrote: ~1 GB; the logs stay
        shutil.rmtree(work / big, ignore_errors=True)


if __name__ == "__main__":
    main()
