"""scripts/bench_depth.py end to end on a tiny checkpoint: a row per format and depth, prompts of
the depths asked for (counted by the engine's own prefill), and the decode attention table."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_rows_per_format_and_depth(qwen3_gqa):
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_depth.py"), "--model", qwen3_gqa,
                          "--quantization", "none", "--depths", "16,40", "--decode", "3",
                          "--kv-cache-dtypes", "float32,int8", "--attention"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    engine = re.findall(r"^\| ours (\S+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \|$", out.stdout, re.M)
    assert [(name, int(depth)) for name, depth, _, _ in engine] == [
        ("float32", 16), ("float32", 40), ("int8", 16), ("int8", 40)]
    assert all(float(prefill) > 0 and float(decode) > 0 for _, _, prefill, decode in engine)
    kernel = re.findall(r"^\| (\S+) \| (\d+) \| ([\d.]+) ms \| ([\d.]+) GB/s \|$", out.stdout, re.M)
    assert [(name, int(depth)) for name, depth, _, _ in kernel] == [
        ("float32", 16), ("float32", 40), ("int8", 16), ("int8", 40)]
    assert "peak RSS after int8" in out.stdout


def test_long_prompts_prefill_in_chunks(qwen3_gqa):
    """--max-num-batched-tokens below a depth: that prompt is prefilled over several steps (as the
    engine's default chunk does past 8192 tokens on a CPU), all of them timed as its prefill."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_depth.py"), "--model", qwen3_gqa,
                          "--quantization", "none", "--depths", "12,40", "--decode", "3", "--kv-cache-dtypes", "int8",
                          "--max-num-batched-tokens", "16"], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = re.findall(r"^\| ours int8 \| (\d+) \|", out.stdout, re.M)
    assert rows == ["12", "40"]
    assert re.findall(r"^\(prefill of (\d+) tokens in (\d+) chunks\)$", out.stdout, re.M) == [("40", "3")]


def test_attention_only_against_another_checkout(qwen3_gqa):
    """--attention-only runs no engine; --against times another checkout's kernels (here this one
    again) beside ours, a row each per format and depth."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_depth.py"), "--model", qwen3_gqa,
                          "--depths", "40", "--kv-cache-dtypes", "float16,int8", "--attention-only",
                          "--against", str(ROOT)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| ours " not in out.stdout
    kernel = re.findall(r"^\| (\S+) \((.+)\) \| (\d+) \| ([\d.]+) ms \|", out.stdout, re.M)
    assert [(name, build, int(depth)) for name, build, depth, _ in kernel] == [
        ("float16", "this checkout", 40), ("float16", str(ROOT), 40), ("int8", "this checkout", 40),
        ("int8", str(ROOT), 40)]


def test_an_unknown_format_is_refused():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_depth.py"), "--kv-cache-dtypes", "int4"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2 and "--kv-cache-dtypes: ['int4'] not in" in out.stderr


# ik_llama.cpp's llama-batched-bench prints only this table (a real run: the Q4_0 file, 2 threads, -rtr),
# amid its log lines.
IK_BATCHED_BENCH = """main: n_kv_max = 600, n_batch = 2048, n_ubatch = 512, flash_attn = 1, is_pp_shared = 0
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   512 |      8 |    1 |    520 |    3.271 |   156.51 |    0.215 |    37.28 |    3.486 |   149.17 |
|  2048 |      8 |    1 |   2056 |   14.902 |   137.43 |    0.301 |    26.58 |   15.203 |   135.24 |
llama_print_timings:        load time =     612.38 ms
"""


def test_ik_table_rows_are_read():
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_depth
    assert bench_depth.table_rows(IK_BATCHED_BENCH) == [
        {"pp": 512, "speed_pp": 156.51, "speed_tg": 37.28}, {"pp": 2048, "speed_pp": 137.43, "speed_tg": 26.58}]
    assert bench_depth.table_rows("| PP | TG |\nno table here") == []
