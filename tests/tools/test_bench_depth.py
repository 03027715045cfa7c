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


def test_resumable_rows_pass_a_state_per_file_type_and_depth(tmp_path, monkeypatch, capsys):
    """--resumable: llamacpp_depth gets a state file named by the GGUF, the instruction set, the cache type
    and the depth (so a stopped run is resumed only by the same measurement), and its JSON line becomes
    the row, a resumed prefill marked as such (and none timed where the save held the whole prompt); formats llama.cpp has no same-size cache for are skipped."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import argparse
    import json

    import bench_depth
    import llamacpp_build
    calls = []

    def fake_run(step, cmd, log, stdout=None, cwd=None):
        calls.append(cmd)
        tool, gguf, depth, decode, kv, threads, state = cmd
        stdout.parent.mkdir(parents=True, exist_ok=True)
        stdout.write_text("noise\n" + json.dumps({"pp": int(depth), "resumed_from": 512 if kv == "q8_0" else int(depth),
                                                  "speed_pp": 12.5, "speed_tg": 3.25}) + "\n")
        return 2048.0

    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path))
    monkeypatch.setattr(llamacpp_build, "build_llamacpp", lambda cache, isa, fork: {
        "llama-batched-bench": tmp_path / "bin" / "llama-batched-bench"})
    monkeypatch.setattr(bench_depth, "depth_tool", lambda bins, fork="llama.cpp": tmp_path / "bin" / "tool")
    monkeypatch.setattr(llamacpp_build, "run_step", fake_run)
    args = argparse.Namespace(kv_cache_dtypes=["auto", "float32", "int8"], depths=[64], llamacpp_depths=[2048, 32768],
                              decode=16, isa="avx2")
    bench_depth.resumable_rows(args, Path("/models/m-lq-q4_0.gguf"))
    states = [Path(cmd[-1]).name for cmd in calls]
    assert states == ["m-lq-q4_0-avx2-f16-2048.state", "m-lq-q4_0-avx2-f16-32768.state",
                      "m-lq-q4_0-avx2-q8_0-2048.state", "m-lq-q4_0-avx2-q8_0-32768.state"]
    assert [cmd[2:5] for cmd in calls] == [["2048", "16", "f16"], ["32768", "16", "f16"], ["2048", "16", "q8_0"],
                                           ["32768", "16", "q8_0"]]
    rows = re.findall(r"^\| llama\.cpp (\S+) \| (\d+) \| (.+) \| ([\d.]+) \|$", capsys.readouterr().out, re.M)
    assert rows == [("f16", "2048", "- (the whole prompt from a save)", "3.25"),
                    ("f16", "32768", "- (the whole prompt from a save)", "3.25"),
                    ("q8_0", "2048", "12.5 (resumed at 512)", "3.25"), ("q8_0", "32768", "12.5 (resumed at 512)", "3.25")]
