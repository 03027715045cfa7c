"""scripts/bench_llamacpp.py's pure parts: parsing llama-bench / llama-batched-bench output (samples
trimmed from a real run of llama.cpp 0c1e570 on the default model), the table and the error path."""
import importlib.util
import os
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_llamacpp.py"

# llama-bench -p 128 -n 64 -t 2 -o json (stdout), fields trimmed.
LLAMA_BENCH_JSON = """[
  {
    "build_commit": "0c1e570", "model_type": "llama 256M all F32", "n_threads": 2,
    "type_k": "f16", "type_v": "f16", "flash_attn": -1,
    "n_prompt": 128, "n_gen": 0, "n_depth": 0,
    "avg_ns": 1825004627, "stddev_ns": 3891631978, "avg_ts": 251.932724, "stddev_ts": 424.868185,
    "samples_ns": [ 3123955122, 2511990831, 1403975224, 1958516179, 126581027 ],
    "samples_ts": [ 40.9737, 50.9556, 91.1697, 65.3556, 1011.21 ]
  },
  {
    "build_commit": "0c1e570", "model_type": "llama 256M all F32", "n_threads": 2,
    "type_k": "f16", "type_v": "f16", "flash_attn": -1,
    "n_prompt": 0, "n_gen": 64, "n_depth": 0,
    "avg_ns": 730995743, "stddev_ns": 77439643, "avg_ts": 88.311676, "stddev_ts": 8.979086,
    "samples_ts": [ 76.3006, 81.5597, 97.2086, 91.6932, 94.7963 ]
  }
]
"""

# llama-batched-bench ... -npp 64 -ntg 64 -npl 1,8 -t 2 --output-format jsonl (stdout), verbatim rows.
BATCHED_BENCH_JSONL = """
{"n_kv_max": 2048, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 64, "tg": 64, "pl": 1, "n_kv": 128, "t_pp": 0.073640, "speed_pp": 869.092957, "t_tg": 0.670418, "speed_tg": 95.462830, "t": 0.744058, "speed": 172.029602}
{"n_kv_max": 2048, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 64, "tg": 64, "pl": 8, "n_kv": 1024, "t_pp": 0.500760, "speed_pp": 1022.445862, "t_tg": 1.749952, "speed_tg": 292.579468, "t": 2.250712, "speed": 454.967163}
"""


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_llamacpp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_llama_bench_rates_by_test_kind(bench):
    rates = bench.parse_llama_bench(LLAMA_BENCH_JSON)
    # Decode: tokens over the mean time of the repetitions (not llama-bench's noisier mean of rates);
    # prefill: over the median repetition's time (the third slowest of five: 65.3556 tok/s).
    assert rates["prefill"] == pytest.approx(128 / (1958516179 * 1e-9)) == pytest.approx(65.3556, rel=1e-5)
    assert rates["decode"] == pytest.approx(64 / 0.730995743)
    assert [r["n_prompt"] for r in rates["rows"]] == [128, 0]
    # Text before the array (a stray log line) does not break parsing.
    assert bench.parse_llama_bench("load_backend: CPU\n" + LLAMA_BENCH_JSON) == rates


def test_batched_bench_rows_by_batch_size(bench):
    rows = bench.parse_batched_bench("main: n_kv_max = 2048\n" + BATCHED_BENCH_JSONL)
    assert sorted(rows) == [1, 8]
    for pl, row in rows.items():
        # speed_tg is sequences x decode steps / decode time, the definition our figures use.
        assert row["speed_tg"] == pytest.approx(pl * row["tg"] / row["t_tg"], rel=1e-5)
    assert rows[8]["speed_tg"] == 292.579468


def test_table_rows_and_ratios(bench):
    results = {"threads": 2,
               "f32": {"decode": {1: 100.0, 8: 400.0}, "prefill": 1000.0},
               "f16": {"decode": {1: 50.0, 8: 200.0}, "prefill": None},
               "ours": {"decode": {1: 80.0, 8: 500.0}, "prefill": 250.0,
                        "rss": {"after load": 485.4, "after the largest batch": 700.6}},
               "ours_bf16": {"decode": {1: 60.0, 8: 300.0}, "prefill": 200.0}}
    lines = bench.table("m", results, [1, 8]).splitlines()
    assert lines[2] == ("| engine | decode @1 | decode @8 | prefill 128 | RSS MiB after load | "
                        "RSS MiB after the largest batch |")
    assert "| llama.cpp F32 | 100.0 | 400.0 | 1000.0 | - | - |" in lines
    assert "| llama.cpp F16 | 50.0 | 200.0 | - | - | - |" in lines
    assert "| nano-vLLM fp32 | 80.0 | 500.0 | 250.0 | 485 | 701 |" in lines
    assert "| nano-vLLM bf16 weights | 60.0 | 300.0 | 200.0 | - | - |" in lines
    # llama.cpp's row, then ours at the same width
    assert lines.index("| nano-vLLM fp32 | 80.0 | 500.0 | 250.0 | 485 | 701 |") == \
        lines.index("| llama.cpp F32 | 100.0 | 400.0 | 1000.0 | - | - |") + 1
    # Each of our rows against llama.cpp at the same weight width, and only that.
    assert "| nano-vLLM fp32 / llama.cpp F32 | 0.80x | 1.25x | 0.25x |" in lines
    assert "| nano-vLLM bf16 weights / llama.cpp F16 | 1.20x | 1.50x | - |" in lines
    assert sum("x |" in line for line in lines) == 2
    assert not any("Q8_0" in line for line in lines)  # no row for an engine that did not run



def test_failed_step_names_itself_and_its_log(bench, tmp_path):
    log = tmp_path / "logs" / "step.log"
    cmd = [sys.executable, "-c", "print('compiler said no'); raise SystemExit(3)"]
    with pytest.raises(bench.BuildError) as e:
        bench.llamacpp_build.run_step("cmake build of llama.cpp", cmd, log)
    message = str(e.value)
    assert message.startswith("cmake build of llama.cpp failed (exit code 3)")
    assert str(log) in message and "compiler said no" in message


def test_build_failure_exits_2_with_one_error_line(bench, monkeypatch, capsys):
    def fail(*args, **kwargs):
        raise bench.BuildError("cmake configure of llama.cpp failed (exit code 1); last lines of /x.log:\nboom")

    monkeypatch.setattr(bench.llamacpp_build, "build_llamacpp", fail)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # restored after the test
    monkeypatch.setattr(sys, "argv", ["bench_llamacpp.py", "--models", "default"])
    with pytest.raises(SystemExit) as e:
        bench.main()
    assert e.value.code == 2
    assert "error: cmake configure of llama.cpp failed" in capsys.readouterr().err
    assert "OMP_WAIT_POLICY" not in os.environ  # the benchmark runs without it


def test_our_timing_counts_prefill_and_decode_steps_apart(bench, qwen3_gqa):
    # Against the engine's real step(): 3 prompts of 5 tokens, 1 + 4 tokens each -> the prefill
    # computes 15 prompt tokens, then 4 decode steps of 3 rows (hand count).
    from nanovllm import LLM
    llm = LLM(qwen3_gqa, kvcache_block_size=16, max_model_len=64, cpu_kvcache_bytes=1 << 22)
    try:
        t = bench.time_batch(llm, [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15]], max_tokens=5)
    finally:
        llm.exit()
    assert (t["prefill_tokens"], t["decode_tokens"]) == (15, 12)
    assert t["prefill_s"] > 0 and t["decode_s"] > 0


def test_rounds_keep_each_engines_best_figure(bench):
    results = {}
    for point, rate in [(("decode", 1), 80.0), (("decode", 8), 500.0), (("prefill", 128), 250.0),
                        (("decode", 1), 90.0), (("decode", 8), 450.0), (("prefill", 128), 240.0)]:
        bench.keep_best(results, "ours", point, rate)
    assert results["ours"]["decode"] == {1: 90.0, 8: 500.0} and results["ours"]["prefill"] == 250.0
    assert results["ours"]["samples"] == {"decode 1": [80.0, 90.0], "decode 8": [500.0, 450.0],
                                          "prefill 128": [250.0, 240.0]}
    assert "| nano-vLLM fp32 | 90.0 | 500.0 | 250.0 |" in bench.table("m", {"threads": 2, **results}, [1, 8])


def stub_files(bench, monkeypatch, tmp_path) -> None:
    """The model folder and the GGUF files as names in tmp_path (m-<format>.gguf): nothing converted;
    the bandwidth view's inputs: 100 MB a token, a read bandwidth of 20 GB/s."""
    monkeypatch.setattr(bench.llamacpp_build, "convert_to_gguf",
                        lambda cache, path, name, quant: tmp_path / f"m-{quant}.gguf")
    monkeypatch.setattr(bench.llamacpp_build, "quantize_gguf",
                        lambda cache, bins, source, preset: tmp_path / f"m-{preset}.gguf")
    monkeypatch.setattr(bench, "model_folder", lambda name: str(tmp_path / "model"))
    monkeypatch.setattr(bench, "per_token_bytes", lambda llm: 100e6)
    monkeypatch.setattr(bench, "measured_read_bandwidth", lambda threads: 20e9)


def test_engines_alternate_figure_by_figure(bench, monkeypatch, tmp_path, capsys):
    """main() with both engines stubbed: for each weight width, every figure's --rounds measurements
    alternate llama.cpp and ours (ours on one engine per width, closed after), Q8_0 runs alone, and
    the table holds each engine's best."""
    calls = []
    rates = iter(range(1, 1000))
    builds = []
    monkeypatch.setattr(bench.llamacpp_build, "build_llamacpp",
                        lambda cache, jobs, isa, fork="llama.cpp": builds.append(isa) or {"fake": tmp_path})
    stub_files(bench, monkeypatch, tmp_path)

    def llamacpp_point(bins, gguf, point, threads, logs, raw, fork="llama.cpp"):
        calls.append((gguf.stem.split("-")[1], point))
        return float(next(rates)), 100.0

    class Engine:
        def __init__(self, name):
            self.name, self.closed = name, False

        def exit(self):
            self.closed = True
            calls.append((self.name, "exit"))

    engines = []

    def start_ours(path, batches, threads, dtype, input_bits):
        # the dense rows load the folder in their dtype, the quantized ones llama-quantize's file
        engines.append(Engine(dtype if path.endswith("model") else Path(path).stem))
        return engines[-1]

    def ours_point(llm, point, rng, raw):
        calls.append((llm.name, point))
        return float(next(rates))
    monkeypatch.setattr(bench, "llamacpp_point", llamacpp_point)
    monkeypatch.setattr(bench, "start_ours", start_ours)
    monkeypatch.setattr(bench, "ours_point", ours_point)
    monkeypatch.setattr(sys, "argv", ["bench_llamacpp.py", "--models", "default", "--batches", "1,8",
                                      "--rounds", "2", "--json", str(tmp_path / "out.json")])
    bench.main()
    points = [("decode", 1), ("decode", 8), ("prefill", 128)]
    expected = []
    ours = {"f32": "float32", "f16": "bfloat16", "q8_0": "m-q8_0", "q4_0": "m-q4_0", "q4_k_m": "m-q4_k_m"}
    for quant, name in ours.items():
        for point in points:
            for _ in range(2):
                expected.append((quant, point))
                expected.append((name, point))
        expected.append((name, "exit"))
    assert calls == expected
    assert [e.name for e in engines] == list(ours.values()) and all(e.closed for e in engines)
    # Rates were handed out 1, 2, 3, ... in call order: the best of each is its second round's.
    out = capsys.readouterr().out
    assert "| llama.cpp F32 | 3.0 | 7.0 | 11.0 | 100 | 100 |" in out and "| nano-vLLM fp32 | 4.0 | 8.0 | 12.0 |" in out
    assert "| nano-vLLM fp32 / llama.cpp F32 | 1.33x | 1.14x | 1.09x |" in out
    # Round by round the pairs are (1, 2), (3, 4), ...: the median of 2/1 and 4/3, of 6/5 and 8/7, ...
    assert "| nano-vLLM fp32 / llama.cpp F32, median of the rounds' pairs | 1.67x | 1.17x | 1.10x |" in out
    import json
    saved = json.loads((tmp_path / "out.json").read_text())["models"]["default"]
    assert saved["ours"]["samples"]["decode 1"] == [2.0, 4.0]


def test_isa_choice_reaches_both_engines(bench, monkeypatch, tmp_path):
    """--isa avx2 builds llama.cpp for AVX2, our kernels for x86-64-v3 and holds torch's own kernels
    to AVX2 (set before any engine starts: with torch already imported the script starts again
    with them); native keeps -march=native; an unknown instruction set is a build error."""
    real_build = bench.llamacpp_build.build_llamacpp
    builds = []
    monkeypatch.setattr(bench.llamacpp_build, "build_llamacpp",
                        lambda cache, jobs, isa, fork="llama.cpp": builds.append(isa) or {"fake": tmp_path})
    monkeypatch.setattr(bench.llamacpp_build, "convert_to_gguf", lambda cache, path, name, quant: None)
    monkeypatch.setattr(bench, "model_folder", lambda name: str(tmp_path / "model"))
    marches = []
    monkeypatch.setattr(bench, "start_ours", lambda *a: marches.append(os.environ.get("NANOVLLM_CPU_MARCH"))
                        or (_ for _ in ()).throw(KeyboardInterrupt))
    restarts = []  # torch is imported here: a real run would start again, this one goes on
    monkeypatch.setattr(bench.llamacpp_build.os, "execv", lambda exe, argv: restarts.append(argv[1:]))
    names = bench.llamacpp_build.OUR_ISA_ENV["avx2"]
    for name in names:  # restored after the test, whatever main() sets
        monkeypatch.setenv(name, "")
    for isa, march in (("native", None), ("avx2", "x86-64-v3")):
        for name in names:
            os.environ.pop(name, None)
        argv = ["bench_llamacpp.py", "--models", "default", "--isa", isa, "--json", str(tmp_path / f"{isa}.json")]
        monkeypatch.setattr(sys, "argv", argv)
        with pytest.raises(KeyboardInterrupt):
            bench.main()
        assert builds[-1] == isa and marches[-1] == march
        assert restarts == ([argv] if isa == "avx2" else [])
        if isa == "avx2":
            assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2" and os.environ["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"
            assert os.environ["ATEN_CPU_CAPABILITY"] == "avx2"
        import json
        report = json.loads((tmp_path / f"{isa}.json").read_text())
        assert report["isa"] == isa and report["our_march"] == (march or "native")
    with pytest.raises(bench.BuildError, match="no llama.cpp build for instruction set 'avx1'"):
        real_build(tmp_path, isa="avx1")
    assert set(bench.llamacpp_build.ISA_FLAGS) == {"native", "avx2"}
    assert "-mno-amx-int8" in " ".join(bench.llamacpp_build.ISA_FLAGS["native"])


def test_a_crashing_llamacpp_format_is_reported_and_the_rest_still_runs(bench, monkeypatch, tmp_path, capsys):
    """A llama.cpp run that fails (e.g. a kernel the VM traps) ends that format's figures only: the
    error is printed and saved, the other formats and our engine are still measured."""
    monkeypatch.setattr(bench.llamacpp_build, "build_llamacpp", lambda cache, jobs, isa, fork="llama.cpp": {"fake": tmp_path})
    stub_files(bench, monkeypatch, tmp_path)
    tried = []

    def llamacpp_point(bins, gguf, point, threads, logs, raw, fork="llama.cpp"):
        quant = gguf.stem.split("-")[1]
        tried.append(quant)
        if quant == "f16":
            raise bench.BuildError("llama-batched-bench on m-f16.gguf failed (exit code -11)")
        return 10.0, 100.0

    class Engine:
        def exit(self):
            pass
    monkeypatch.setattr(bench, "llamacpp_point", llamacpp_point)
    monkeypatch.setattr(bench, "start_ours", lambda *a: Engine())
    monkeypatch.setattr(bench, "ours_point", lambda llm, point, rng, raw: 20.0)
    monkeypatch.setattr(sys, "argv", ["bench_llamacpp.py", "--models", "default", "--batches", "1,8",
                                      "--rounds", "2", "--json", str(tmp_path / "out.json")])
    bench.main()
    assert tried.count("f16") == 1 and tried.count("f32") == tried.count("q8_0") == 6
    captured = capsys.readouterr()
    assert "failed (exit code -11)" in captured.err and "no more llama.cpp F16 figures" in captured.err
    assert "| llama.cpp F32 | 10.0 | 10.0 | 10.0 | 100 | 100 |" in captured.out
    assert "| nano-vLLM bf16 weights | 20.0 | 20.0 | 20.0 |" in captured.out
    import json
    saved = json.loads((tmp_path / "out.json").read_text())["models"]["default"]
    assert "exit code -11" in saved["failed"]["f16"]


def test_ik_llama_cpp_is_a_third_row_on_the_quantized_files(bench, monkeypatch, tmp_path, capsys):
    """--forks llama.cpp,ik_llama.cpp: on a quantized file the three engines alternate figure by
    figure (ik built as its own fork); the dense rows stay llama.cpp against ours; the table has
    ik's row and our ratio to it."""
    calls, builds = [], []
    monkeypatch.setattr(bench.llamacpp_build, "build_llamacpp",
                        lambda cache, jobs, isa, fork="llama.cpp": builds.append(fork) or {"fake": tmp_path})
    stub_files(bench, monkeypatch, tmp_path)

    def llamacpp_point(bins, gguf, point, threads, logs, raw, fork="llama.cpp"):
        calls.append((fork, gguf.stem.split("-")[1], point))
        return (20.0 if fork == "llama.cpp" else 25.0), 100.0

    class Engine:
        def exit(self):
            pass
    monkeypatch.setattr(bench, "llamacpp_point", llamacpp_point)
    monkeypatch.setattr(bench, "start_ours", lambda *a: Engine())
    monkeypatch.setattr(bench, "ours_point", lambda llm, point, rng, raw: calls.append(("ours", point)) or 30.0)
    monkeypatch.setattr(sys, "argv", ["bench_llamacpp.py", "--models", "default", "--batches", "1", "--rounds", "1",
                                      "--formats", "f32,q4_0", "--forks", "llama.cpp,ik_llama.cpp"])
    bench.main()
    assert builds == ["llama.cpp", "ik_llama.cpp"]  # each fork built once
    points = [("decode", 1), ("prefill", 128)]
    expected = [c for p in points for c in (("llama.cpp", "f32", p), ("ours", p))]
    expected += [c for p in points for c in (("llama.cpp", "q4_0", p), ("ik_llama.cpp", "q4_0", p), ("ours", p))]
    assert calls == expected
    out = capsys.readouterr().out
    assert "| ik_llama.cpp Q4_0 (-rtr) | 25.0 | 25.0 |" in out
    assert "| nano-vLLM Q4_0 / ik_llama.cpp Q4_0 (-rtr) | 1.20x | 1.20x |" in out
    assert "| nano-vLLM Q4_0 / llama.cpp Q4_0 | 1.50x | 1.50x |" in out
    # 100 MB a token at 20 GB/s: a floor of 200 tok/s, of which each engine's one-sequence decode is a share
    assert ("Bandwidth view, nano-vLLM Q4_0: 100 MB read per token at one sequence, read bandwidth 20.0 GB/s in "
            "the same run: floor 200.0 tok/s; decode @1 as a share of it: llama.cpp Q4_0 10%, "
            "ik_llama.cpp Q4_0 (-rtr) 12%, nano-vLLM Q4_0 15%") in out


def test_ik_batched_bench_reruns_without_flash_attention(bench, monkeypatch, tmp_path, capsys):
    """ik_llama.cpp's llama-batched-bench aborting with flash attention (its default): the figure is
    its -fa 0 run, read from the markdown table it prints, and the run says so."""
    commands = []

    def run_step(step, cmd, log, stdout=None, cwd=None):
        commands.append(cmd)
        if "-fa" not in cmd:
            raise bench.BuildError(f"{step} failed (exit code -6)")
        log.write_text("|    64 |     64 |    8 |   1024 |    1.131 |   452.72 |    2.084 |   245.69 |    3.215 |   318.52 |\n")
        stdout.write_text("")
        return 123.0
    monkeypatch.setattr(bench.llamacpp_build, "run_step", run_step)
    raw = []
    rate, rss = bench.llamacpp_point({"llama-batched-bench": tmp_path / "bb"}, tmp_path / "m.gguf", ("decode", 8), 2,
                                     tmp_path, raw, "ik_llama.cpp")
    assert (rate, rss) == (245.69, 123.0)
    assert "-rtr" in commands[0] and commands[1][-2:] == ["-fa", "0"]
    assert "rerun with -fa 0" in capsys.readouterr().err
    assert raw[0] == {"note": "flash attention off (aborted with it on)"}


def test_build_info_script_the_ik_sdist_leaves_out(bench, tmp_path):
    # The written script is run by cmake, as the fork's build runs it, and fills in the template.
    import shutil
    import subprocess
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("no cmake on PATH")
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "build-info.cpp.in").write_text('char const *LLAMA_COMMIT = "@BUILD_COMMIT@";\n')
    bench.llamacpp_build.complete_build_info(tmp_path, "ik-llama-cpp-python-0.1.5")
    script = tmp_path / "common" / "cmake" / "build-info-gen-cpp.cmake"
    subprocess.run([cmake, "-DCMAKE_C_COMPILER_ID=GNU", "-P", str(script)], cwd=tmp_path, check=True)
    assert (tmp_path / "common" / "build-info.cpp").read_text() == \
        'char const *LLAMA_COMMIT = "ik-llama-cpp-python-0.1.5";\n'
    before = script.read_text()
    bench.llamacpp_build.complete_build_info(tmp_path, "other")  # a script already there is kept
    assert script.read_text() == before


def test_depths_hand_over_to_the_depth_script(bench, monkeypatch):
    calls = []
    monkeypatch.setattr(bench.os, "execv", lambda exe, argv: calls.append(argv[1:]) or sys.exit(0))
    monkeypatch.setattr(sys, "argv", ["bench_llamacpp.py", "--depths", "2048,8192", "--formats", "f32,q8_0",
                                      "--isa", "avx2"])
    with pytest.raises(SystemExit):
        bench.main()
    (argv,) = calls
    assert Path(argv[0]).name == "bench_depth.py"
    assert argv[1:] == ["--llamacpp", "--forks", "llama.cpp,ik_llama.cpp", "--depths", "2048,8192", "--kv-cache-dtypes", "auto,int8",
                        "--file", "q8_0", "--isa", "avx2"]


def test_decode_bytes_per_token_is_the_hand_count(tmp_path):
    """The bandwidth view's bytes at one sequence: every linear matrix once as held (fp32 here), the
    tied embedding once as the LM head, and the KV cache of the context (K and V, 16 bits)."""
    from helpers import make_qwen3
    from nanovllm import LLM
    from nanovllm.utils.efficiency import decode_bytes_per_token
    path = make_qwen3(str(tmp_path / "m"), tie_word_embeddings=True)
    with LLM(path, dtype="float32", kv_cache_dtype="float16", cpu_kvcache_bytes=8 << 20) as llm:
        c = llm.config.hf_config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        per_layer = (q + 2 * kv) * c.hidden_size + c.hidden_size * q + 3 * c.intermediate_size * c.hidden_size
        weights = 4 * (c.num_hidden_layers * per_layer + c.vocab_size * c.hidden_size)
        cache = c.num_hidden_layers * 2 * kv * 2  # K and V of one token, every layer, float16
        runner = llm.llm_engine.model_runner
        assert runner.kv_token_bytes() == cache
        assert decode_bytes_per_token(runner.model, runner.kv_token_bytes(), 100) == weights + 100 * cache
